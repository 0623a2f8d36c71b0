"""Prometheus metrics: every definition in one place, the label cap, the ``/metrics`` server.

Every service process exposes the default ``prometheus_client`` registry on
``CONVEYOR_METRICS_PORT`` (0, the default: no server) at ``http://<metrics_host>:<port>/metrics``;
:func:`conveyor_runtime.service.open_runtime` starts and stops it, so each service (and
``conveyor dev``, one process for all) gets one.

Instrumentation is cheap by rule: a counter increment per batch where the code already has
one, never a query per scrape. The only database reads are the maintenance process's depth
gauges (a small grouped query every few seconds, see ``conveyor_maintenance``) and the
pool's size, read from asyncpg's own bookkeeping at scrape time.

**Label cap.** Queue and task-type names come from clients, so the label values are
bounded: each of :data:`QUEUE` and :data:`TYPE` keeps the first :data:`LABEL_LIMIT` (200)
distinct values it sees in a process and reports every later one as ``"other"``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from conveyor_broker.types import EnqueueResult
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
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


#: The caps of the queue and task-type labels (one each per process).
QUEUE = LabelCap()
TYPE = LabelCap()

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
ENQUEUE_TO_START = Histogram(
    "conveyor_enqueue_to_start_seconds",
    "Seconds from a task's enqueue (or its due time, when later) to its lease (dispatcher)",
    ["queue"],
    buckets=_LATENCY_BUCKETS,
)
RUN_TIME = Histogram(
    "conveyor_task_run_seconds",
    "Seconds from a gateway's accept of a delivery to the worker's Result (gateway)",
    ["queue"],
    buckets=_LATENCY_BUCKETS,
)
LEASES_HELD = Gauge(
    "conveyor_leases_held",
    "Deliveries the gateways of this process hold (in flight)",
)
LEASES_EXPIRED = Counter(
    "conveyor_leases_expired", "Expired leases the reaper took back (maintenance)"
)

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
OWNERSHIP = Counter(
    "conveyor_ownership_changes",
    "Queue ownership changes of this dispatcher (event: claimed, lost, released)",
    ["event"],
)
LEADERSHIP = Counter(
    "conveyor_leader_changes",
    "Leader roles won and lost by this process (role: scheduler, reaper, ...)",
    ["role", "event"],
)

# ------------------------------------------------------------ breakers, webhooks

TYPE_BREAKER = Counter(
    "conveyor_type_breaker_transitions",
    "Circuit breakers per task type opened and closed (gateway)",
    ["queue", "type", "event"],
)
WEBHOOK_DELIVERIES = Counter(
    "conveyor_webhook_deliveries",
    "Webhook deliveries by outcome (ok, failure, transport, ...)",
    ["outcome"],
)
WEBHOOK_BREAKER = Gauge(
    "conveyor_webhook_breaker_open",
    "1 while an endpoint's circuit breaker is open or half-open, 0 when closed",
    ["endpoint"],
)

# --------------------------------------------------------------- queue depth

QUEUE_DEPTH = Gauge(
    "conveyor_queue_depth",
    "Tasks per queue and state (the reaper leader of maintenance, refreshed every 10 s)",
    ["queue", "state"],
)

# ------------------------------------------------------------------ links

NATS_RECONNECTS = Counter("conveyor_nats_reconnects", "NATS reconnections of this process")


def record_enqueued(results: Iterable[EnqueueResult]) -> None:
    """Count the tasks ``results`` created (an existing id counts for nothing)."""
    counts: dict[tuple[str, str], int] = {}
    for result in results:
        if result.created:
            key = (result.task.queue, result.task.type)
            counts[key] = counts.get(key, 0) + 1
    for (queue, type_), n in counts.items():
        ENQUEUED.labels(QUEUE(queue), TYPE(type_)).inc(n)


# ----------------------------------------------------------- scrape-time reads


@dataclass(frozen=True, slots=True)
class _Source:
    service: str
    pool: Callable[[], tuple[int, int] | None]
    connected: Callable[[], bool]


class _RuntimeCollector(Collector):
    """The Postgres pool (size, free) and the NATS connection state of every runtime open
    in this process, read at scrape time (no query: asyncpg's and nats-py's own state)."""

    def __init__(self) -> None:
        self._sources: dict[int, _Source] = {}
        self._lock = threading.Lock()

    def add(self, source: _Source) -> Callable[[], None]:
        key = id(source)
        with self._lock:
            self._sources[key] = source

        def remove() -> None:
            with self._lock:
                self._sources.pop(key, None)

        return remove

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            sources = list(self._sources.values())
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
