"""Prometheus metrics: every definition in one place, the label cap, the ``/metrics`` server.

Every service process exposes the default ``prometheus_client`` registry on
``CONVEYOR_METRICS_PORT`` (0, the default: no server) at ``http://<metrics_host>:<port>/metrics``;
:func:`conveyor_runtime.service.open_runtime` starts and stops it, so each service (and
``conveyor dev``, one process for all) gets one.

Instrumentation is cheap by rule: a counter increment per batch where the code already has
one, never a query per scrape. The only database reads are the maintenance process's:
the depth gauges (a small grouped query per served queue every ``depth_tick``) and the
oldest due task of each served queue (from the reaper's sweep of the due index, which it
makes anyway); the pool's size is read from asyncpg's own bookkeeping at scrape time, and
the type breakers' states from the gateways' memory (:func:`watch_type_breakers`).

**Label cap.** Queue, task-type and webhook worker names come from clients, so the label
values are bounded: each of :data:`QUEUE`, :data:`TYPE` and :data:`WORKER` keeps the first
:data:`LABEL_LIMIT` (200) distinct values it sees in a process and reports every later one
as ``"other"``.

**Per-task observations.** The two histograms observed once per task (run time, enqueue to
start) are :class:`FoldedHistogram`: their hot children (:class:`Observations`) only append
each value to a list, and fold the list into the prometheus_client child in bulk (sorted,
one increment per bucket hit) at every collect (a scrape) and every :data:`FOLD_AT`
values; what is exposed is the same Histogram, exactly as if each value had been observed.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from conveyor_broker.types import EnqueueResult
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

#: Distinct values one label keeps per process before it reports ``"other"``.
LABEL_LIMIT = 200
OTHER = "other"


class LabelCap:
    """Bounds one label's values: the first ``limit`` distinct values pass, every later
    one is :data:`OTHER`; the empty value is ``"none"``."""

    def __init__(self, limit: int = LABEL_LIMIT) -> None:
        self.limit = limit
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if not value:
            return "none"
        if value in self._kept:
            return value
        with self._lock:
            if value in self._kept:
                return value
            if len(self._kept) >= self.limit:
                return OTHER
            self._kept.add(value)
            return value

    def __len__(self) -> int:
        return len(self._kept)


#: The caps of the queue, task-type and webhook worker labels (one each per process).
QUEUE = LabelCap()
TYPE = LabelCap()
WORKER = LabelCap()


class Bound:
    """The label children of one metric by raw label values, capped once and kept: a hot
    path pays a dict lookup for its child instead of the caps and ``labels()`` (a lock)
    on every call. ``caps`` caps each label in turn (None: taken as it is). At most
    ``limit`` value tuples are kept (beyond the caps they all share ``other`` anyway);
    later ones are looked up each time. Only for metrics whose children are never
    removed (counters, histograms)."""

    def __init__(self, metric: Any, *caps: LabelCap | None, limit: int = 4 * LABEL_LIMIT) -> None:
        self._metric = metric
        # A FoldedHistogram's children are its Observations (what its hot paths observe).
        self._child = metric.observations if isinstance(metric, FoldedHistogram) else metric.labels
        self._caps = caps
        self._limit = limit
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        """The child of ``values`` (raw: the caps apply)."""
        child = self._children.get(values)
        if child is None:
            labels = [
                cap(value) if cap is not None else value
                for cap, value in zip(self._caps, values, strict=True)
            ]
            child = self._child(*labels)
            if len(self._children) < self._limit:
                self._children[values] = child
        return child


class Tally:
    """A gauge's value kept as a plain number by the one thread that changes it (the
    event loop) and read at scrape time: cheaper than a Gauge's locked ``inc`` on a path
    taken per task."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def add(self, n: int) -> None:
        """Change the value by ``n``."""
        self.value += n


#: Values an :class:`Observations` keeps before it folds them in on its own (a scrape folds
#: them all in before): a bound on its memory when nobody scrapes.
FOLD_AT = 512


class Observations:
    """The hot side of one :class:`FoldedHistogram` child: :meth:`observe` appends the value
    to a list (no lock: ``list.append`` is atomic, whatever thread calls it), and every
    collect, and every :data:`FOLD_AT` values, adds what is listed to the child in bulk:
    the values sorted, one locked increment per bucket they fall in and one for the sum,
    instead of a bucket search and two locked increments per value. The child's samples
    are then those of one ``observe`` per value (the sum up to float rounding: it is added
    a batch at a time). Values must not be NaN (durations never are)."""

    __slots__ = ("_bounds", "_child", "_lock", "_pending")

    def __init__(self, child: Histogram, lock: threading.Lock) -> None:
        self._child = child
        self._bounds: list[float] = child._upper_bounds
        self._pending: list[float] = []
        #: The histogram's: a collect reads no batch half folded in.
        self._lock = lock

    def observe(self, value: float) -> None:
        """Observe ``value`` (folded in at the next collect at the latest)."""
        pending = self._pending
        pending.append(value)
        if len(pending) >= FOLD_AT:
            self._fold_unless_collecting()

    def observe_many(self, values: Iterable[float]) -> None:
        """Observe each of ``values``."""
        pending = self._pending
        pending.extend(values)
        if len(pending) >= FOLD_AT:
            self._fold_unless_collecting()

    def _fold_unless_collecting(self) -> None:
        # A collect (another thread) holding the lock folds the list in itself: the hot
        # path never waits for a scrape.
        if self._lock.acquire(blocking=False):
            try:
                self._fold()
            finally:
                self._lock.release()

    def _fold(self) -> None:
        """Add the values listed so far to the child (the histogram's lock held)."""
        pending = self._pending
        n = len(pending)
        if not n:
            return
        # Values appended meanwhile (by another thread) go after the n taken: kept.
        values = pending[:n]
        del pending[:n]
        child = self._child
        child._sum.inc(sum(values))
        values.sort()
        counted = 0
        for bound, bucket in zip(self._bounds, child._buckets, strict=True):
            upto = bisect_right(values, bound, counted)
            if upto > counted:
                bucket.inc(upto - counted)
                counted = upto
                if counted == n:
                    break


class FoldedHistogram(Histogram):
    """A Histogram whose hot paths observe through :meth:`observations` (see
    :class:`Observations`); every collect (a scrape, ``get_sample_value``) folds what they
    listed in first. Its ``labels()`` children still observe one value at a time. Never
    ``remove()`` a child that has observations (a :class:`Bound` keeps them anyway)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._observations: dict[tuple[str, ...], Observations] = {}
        self._fold_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def observations(self, *labelvalues: str) -> Observations:
        """The hot side of the child of ``labelvalues`` (one per child, kept)."""
        found = self._observations.get(labelvalues)
        if found is None:
            with self._fold_lock:
                found = self._observations.get(labelvalues)
                if found is None:
                    found = Observations(self.labels(*labelvalues), self._fold_lock)
                    self._observations[labelvalues] = found
        return found

    def collect(self) -> Iterable[Metric]:
        with self._fold_lock:
            for observations in self._observations.values():
                observations._fold()
            return super().collect()


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)

# ----------------------------------------------------------------- task lifecycle

ENQUEUED = Counter(
    "conveyor_tasks_enqueued", "Tasks created by enqueue commits (api)", ["queue", "type"]
)
STARTED = Counter(
    "conveyor_tasks_started",
    "Tasks a gateway accepted from a dispatch offer (dispatcher: leased and delivered)",
    ["queue"],
)
COMPLETED = Counter(
    "conveyor_tasks_completed", "Attempts acked as completed (gateway)", ["queue", "type"]
)
FAILED = Counter(
    "conveyor_tasks_failed",
    "Attempts that failed (handler failure, skip-retry, oversized result, timeout); each "
    "is then retried or archived (gateway)",
    ["queue", "type"],
)
RETRIED = Counter(
    "conveyor_tasks_retried", "Failed attempts put back for a retry (gateway)", ["queue", "type"]
)
ARCHIVED = Counter(
    "conveyor_tasks_archived",
    "Tasks archived after a failure: retries used up, skip-retry, past the deadline (gateway)",
    ["queue", "type"],
)
ENQUEUE_TO_START = FoldedHistogram(
    "conveyor_enqueue_to_start_seconds",
    "Seconds from a task's enqueue (or its due time, when later) to its lease (dispatcher)",
    ["queue"],
    buckets=_LATENCY_BUCKETS,
)
RUN_TIME = FoldedHistogram(
    "conveyor_task_run_seconds",
    "Seconds from a gateway's accept of a delivery to the worker's Result (gateway)",
    ["queue"],
    buckets=_LATENCY_BUCKETS,
)
LEASES_HELD = Gauge(
    "conveyor_leases_held",
    "Deliveries the gateways of this process hold (in flight)",
)
#: What LEASES_HELD reports, changed per delivery held and let go (see :class:`Tally`).
HELD = Tally()
LEASES_HELD.set_function(lambda: HELD.value)
LEASES_EXPIRED = Counter(
    "conveyor_leases_expired", "Expired leases the reaper took back (maintenance)"
)

#: The hot paths' children of the task metrics, by raw queue (and type).
completed = Bound(COMPLETED, QUEUE, TYPE)
failed = Bound(FAILED, QUEUE, TYPE)
retried = Bound(RETRIED, QUEUE, TYPE)
archived = Bound(ARCHIVED, QUEUE, TYPE)
run_time = Bound(RUN_TIME, QUEUE)
enqueue_to_start = Bound(ENQUEUE_TO_START, QUEUE)

# ----------------------------------------------------------------------- dispatch

OFFERS = Counter(
    "conveyor_dispatch_offers", "Dispatch offers sent to gateways (dispatcher)", ["queue"]
)
OFFERED = Counter(
    "conveyor_dispatch_offered_tasks", "Tasks in dispatch offers (dispatcher)", ["queue"]
)
ACCEPTED = Counter(
    "conveyor_dispatch_accepted_tasks", "Offered tasks a gateway accepted (dispatcher)", ["queue"]
)
RELEASED = Counter(
    "conveyor_dispatch_released_tasks",
    "Leased tasks released unsent or refused by a gateway (dispatcher)",
    ["queue"],
)
CREDITS = Gauge(
    "conveyor_dispatch_credits",
    "Free slots the gateways announced for a queue this dispatcher owns (CreditBook total)",
    ["queue"],
)
#: The dispatcher's children of the dispatch metrics, by raw queue.
offers = Bound(OFFERS, QUEUE)
offered = Bound(OFFERED, QUEUE)
accepted = Bound(ACCEPTED, QUEUE)
started = Bound(STARTED, QUEUE)
released = Bound(RELEASED, QUEUE)
credits = Bound(CREDITS, QUEUE)
OWNERSHIP = Counter(
    "conveyor_ownership_changes",
    "Queue ownership changes of this dispatcher (event: claimed, lost, released)",
    ["event"],
)
LEADERSHIP = Counter(
    "conveyor_leader_changes",
    "Leader roles won and lost by this process (role: scheduler, reaper, resolver, "
    "storage: maintenance; webhook-manager: webhook)",
    ["role", "event"],
)

# ------------------------------------------------------------ breakers, webhooks

#: The values of the breaker state gauges.
BREAKER_CLOSED, BREAKER_HALF_OPEN, BREAKER_OPEN = 0, 1, 2

TYPE_BREAKER = Counter(
    "conveyor_type_breaker_transitions",
    "Circuit breakers per task type that this process's gateways opened and closed "
    "(event: opened, closed; a probe's failure opens it again)",
    ["queue", "type", "event"],
)
WEBHOOK_DELIVERIES = Counter(
    "conveyor_webhook_deliveries",
    "Webhook deliveries (HTTP requests) by registration and outcome: success, failure, "
    "skip_retry, release (the endpoint's answer), accepted (asynchronous), error (an "
    "answer that fails the attempt: 4xx, JSON-RPC error, invalid body), transport (no "
    "answer, a timeout or a 5xx: what the endpoint's breaker counts), canceled (aborted "
    "in flight: lease lost, a callback came first, a drain), mixed (an aggregation group's "
    "batch call whose members got different outcomes; a batch call counts once)",
    ["worker", "outcome"],
)
WEBHOOK_DELIVERY_SECONDS = Histogram(
    "conveyor_webhook_delivery_seconds",
    "Seconds from sending a webhook delivery to its endpoint's answer (or its failure)",
    ["worker"],
    buckets=_LATENCY_BUCKETS,
)
WEBHOOK_CALLBACKS = Counter(
    "conveyor_webhook_callbacks",
    "Webhook callbacks answered by the webhook leader (kind: heartbeat, result; status: "
    "ok, lease_lost, invalid)",
    ["worker", "kind", "status"],
)
WEBHOOK_BREAKER = Gauge(
    "conveyor_webhook_breaker_state",
    "State of a running webhook registration's endpoint breaker: 0 closed, 1 half-open, "
    "2 open (the webhook leader)",
    ["worker"],
)
WEBHOOK_BREAKER_TRANSITIONS = Counter(
    "conveyor_webhook_breaker_transitions",
    "Endpoint circuit breakers opened and closed (event: opened, closed)",
    ["worker", "event"],
)

# --------------------------------------------------------------- queue depth

QUEUE_DEPTH = Gauge(
    "conveyor_queue_depth",
    "Tasks per queue and state (the reaper leader of maintenance, every depth_tick)",
    ["queue", "state"],
)
QUEUE_OLDEST_DUE = Gauge(
    "conveyor_queue_oldest_due_seconds",
    "Seconds the oldest due task of a served queue has waited since it fell due; 0 when "
    "nothing is due (the reaper leader of maintenance, every reap_tick)",
    ["queue"],
)

# ------------------------------------------------------------------ links

NATS_RECONNECTS = Counter("conveyor_nats_reconnects", "NATS reconnections of this process")


#: The hot path's children of the enqueue counter, by raw queue and type.
enqueued = Bound(ENQUEUED, QUEUE, TYPE)


def record_enqueued(results: Iterable[EnqueueResult]) -> None:
    """Count the tasks ``results`` created (an existing id counts for nothing)."""
    # By queue, then type: nothing allocated per task (no key tuple).
    counts: dict[str, dict[str, int]] = {}
    for result in results:
        if result.created:
            task = result.task
            by_type = counts.get(task.queue)
            if by_type is None:
                by_type = counts[task.queue] = {}
            by_type[task.type] = by_type.get(task.type, 0) + 1
    for queue, by_type in counts.items():
        for type_, n in by_type.items():
            enqueued(queue, type_).inc(n)


# ----------------------------------------------------------- scrape-time reads


@dataclass(frozen=True, slots=True)
class _Source:
    service: str
    pool: Callable[[], tuple[int, int] | None]
    connected: Callable[[], bool]


_S = TypeVar("_S")


class _Sources(Generic[_S]):
    """What a collector reads at scrape time: sources added (and removed) by whoever
    owns them, from any thread."""

    def __init__(self) -> None:
        self._sources: dict[int, _S] = {}
        self._lock = threading.Lock()

    def add(self, source: _S) -> Callable[[], None]:
        """Read ``source`` from now on, until the returned function is called."""
        key = id(source)
        with self._lock:
            self._sources[key] = source

        def remove() -> None:
            with self._lock:
                self._sources.pop(key, None)

        return remove

    def snapshot(self) -> list[_S]:
        """The sources now."""
        with self._lock:
            return list(self._sources.values())


class _RuntimeCollector(_Sources[_Source], Collector):
    """The Postgres pool (size, free) and the NATS connection state of every runtime open
    in this process, read at scrape time (no query: asyncpg's and nats-py's own state)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sources = self.snapshot()
        size = GaugeMetricFamily(
            "conveyor_db_pool_size", "Connections in the Postgres pool", labels=["service"]
        )
        free = GaugeMetricFamily(
            "conveyor_db_pool_free", "Idle connections in the Postgres pool", labels=["service"]
        )
        connected = GaugeMetricFamily(
            "conveyor_nats_connected", "1 while connected to NATS", labels=["service"]
        )
        pools: dict[str, list[int]] = {}
        links: dict[str, int] = {}
        for source in sources:
            try:
                stats = source.pool()
                up = source.connected()
            except Exception:  # a closing client: report nothing for it
                continue
            if stats is not None:
                total = pools.setdefault(source.service, [0, 0])
                total[0] += stats[0]
                total[1] += stats[1]
            links[source.service] = min(links.get(source.service, 1), int(up))
        for service, (n, idle) in sorted(pools.items()):
            size.add_metric([service], n)
            free.add_metric([service], idle)
        for service, state in sorted(links.items()):
            connected.add_metric([service], state)
        yield size
        yield free
        yield connected


_COLLECTOR = _RuntimeCollector()
REGISTRY.register(_COLLECTOR)


def watch_runtime(service: str, broker: Any, nc: Any) -> Callable[[], None]:
    """Report ``broker``'s pool (when it has one: ``pool_stats()``) and ``nc``'s connection
    state under ``service`` until the returned function is called."""
    inner = getattr(broker, "inner", broker)  # an EncryptedBroker wraps the real one
    pool_stats = getattr(inner, "pool_stats", None)

    def pool() -> tuple[int, int] | None:
        return pool_stats() if pool_stats is not None else None

    return _COLLECTOR.add(_Source(service, pool, lambda: bool(nc.is_connected)))


#: What one gateway's type breakers are now: ``(queue, type, state)`` per breaker it has,
#: ``state`` one of BREAKER_CLOSED, BREAKER_HALF_OPEN and BREAKER_OPEN.
BreakerStates = Callable[[], Iterable[tuple[str, str, int]]]


class _TypeBreakerCollector(_Sources[BreakerStates], Collector):
    """The state of the circuit breakers per task type of every gateway in this process,
    read from their memory at scrape time (nothing is kept per change): the worst state
    per queue and type, and how many gateways hold it open or half-open."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sources = self.snapshot()
        worst: dict[tuple[str, str], int] = {}
        tripped: dict[tuple[str, str], int] = {}
        for states in sources:
            try:
                rows = list(states())
            except Exception:  # a gateway closing meanwhile: report nothing for it
                continue
            for queue, type_, state in rows:
                key = (QUEUE(queue), TYPE(type_))
                worst[key] = max(worst.get(key, BREAKER_CLOSED), state)
                tripped[key] = tripped.get(key, 0) + (state != BREAKER_CLOSED)
        state_family = GaugeMetricFamily(
            "conveyor_type_breaker_state",
            "Worst state of a task type's circuit breaker among this process's gateways: "
            "0 closed, 1 half-open, 2 open (a QUEUE-scope one is open in the process that "
            "opened it, for its cool-down)",
            labels=["queue", "type"],
        )
        open_family = GaugeMetricFamily(
            "conveyor_type_breakers_open",
            "Gateways of this process whose breaker of the type is open or half-open",
            labels=["queue", "type"],
        )
        for key in sorted(worst):
            state_family.add_metric(list(key), worst[key])
            open_family.add_metric(list(key), tripped[key])
        yield state_family
        yield open_family


_BREAKERS = _TypeBreakerCollector()
REGISTRY.register(_BREAKERS)


def watch_type_breakers(states: BreakerStates) -> Callable[[], None]:
    """Report the type breakers ``states`` lists (one gateway's) at every scrape, until the
    returned function is called. ``states`` runs on the scrape's thread: it must only
    read."""
    return _BREAKERS.add(states)


# ------------------------------------------------------------------ the server


class MetricsServer:
    """``/metrics`` over HTTP (prometheus_client's threaded server), stopped cleanly."""

    def __init__(self, host: str, port: int) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=REGISTRY)
        self.host = host
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(host: str, port: int) -> MetricsServer | None:
    """The metrics server on ``host:port`` (None when ``port`` is 0: metrics off)."""
    if port == 0:
        return None
    server = MetricsServer(host, port)
    logger.info("metrics.listening url=%s", server.url)
    return server
