"""The history behind the dashboard's charts: a background sampler of every queue, and
the in-memory ring of its samples over the last hour.

The api keeps no history (its stats are counts as of now), so the REST process takes one:
every ``interval`` seconds (``CONVEYOR_SAMPLE_INTERVAL``) :class:`QueueSampler` asks the
api, with the process's own token (``CONVEYOR_TOKEN``; a read-only one suffices), for every
queue's counts (ListQueues, page by page) and, for each queue with pending tasks, its
first pending task (ListTasks, limit 1), and :class:`QueueHistory` keeps each queue's
samples of the last ``window`` seconds: a ring, whose older samples fall out. It samples
whether or not a dashboard is open, so a tab opened later shows the hour before it.

From consecutive samples the charts draw, per queue:

- **throughput**: tasks completed per minute between two samples (the change of the
  ``completed`` count; a count that went down, as retention purges ended tasks, counts as
  none), and the tasks archived (failed for good) alike;
- **latency**: how long the queue's oldest pending task (the first by id, the oldest
  enqueued) had waited at the sample since it became pending; 0 with nothing pending.

Memory only: a restarted REST process starts with an empty history, and each REST
replica keeps its own. Time comes from an injected wall clock (``clock``), so the tests
drive it without sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from conveyor_protos.v1 import service_pb2 as pb
from conveyor_protos.v1 import task_pb2 as task_pb

from conveyor_rest.periodic import Periodic

logger = logging.getLogger(__name__)

#: How far back the history goes, in seconds.
HOUR = 3600.0
#: Seconds between samples when the settings give none.
DEFAULT_INTERVAL = 10.0
#: Most queues the history keeps (the first by name: one ListQueues page).
MAX_QUEUES = 1000
#: Most queues whose latency one sample measures (those with the most pending first):
#: one ListTasks each. The others get no latency (None) in that sample.
LATENCY_PROBES = 200
#: ListTasks calls of one sample in flight at once.
PROBE_CONCURRENCY = 8

#: Seconds since the epoch, now (``time.time``; the tests give a fake one).
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Sample:
    """One queue as one sample saw it."""

    #: When (seconds since the epoch).
    at: float
    #: Its counts of completed and archived tasks (they only grow, but for purges).
    completed: int
    archived: int
    #: Its pending and running tasks.
    pending: int
    active: int
    #: Seconds its oldest pending task had waited (0: none pending; None: not measured).
    latency: float | None


@dataclass(frozen=True, slots=True)
class Point:
    """A sample and what changed since the queue's previous one (None for its first)."""

    sample: Sample
    #: Tasks completed, and archived, between the two samples.
    completed: int | None
    failed: int | None
    #: ``completed`` per minute of the time between them.
    per_minute: float | None


class QueueHistory:
    """Each queue's samples of the last ``window`` seconds, oldest first, for at most
    ``max_queues`` queues: a ring per queue (``window / interval`` samples, plus room for
    a late one) from which the samples older than the newest round minus ``window`` are
    dropped at each :meth:`record`, and a queue with none left is forgotten.
    ``interval`` is the sampler's (0: there is none)."""

    def __init__(
        self,
        *,
        window: float = HOUR,
        interval: float = DEFAULT_INTERVAL,
        max_queues: int = MAX_QUEUES,
    ) -> None:
        if window <= 0:
            raise ValueError("window must be > 0")
        self.window = window
        #: How often the sampler records (0: no sampler; the history stays empty).
        self.interval = interval
        self.max_queues = max_queues
        self._keep = int(window / (interval if interval > 0 else DEFAULT_INTERVAL)) + 2
        self._rings: dict[str, deque[Sample]] = {}
        #: When the last round was recorded (None: never).
        self.last_at: float | None = None

    def record(self, at: float, samples: Mapping[str, Sample]) -> None:
        """Add one round of samples taken at ``at`` (queue -> its sample), then drop
        what is older than ``at - window``."""
        for queue, sample in samples.items():
            ring = self._rings.get(queue)
            if ring is None:
                if len(self._rings) >= self.max_queues:
                    continue
                ring = self._rings[queue] = deque(maxlen=self._keep)
            ring.append(sample)
        horizon = at - self.window
        for queue in list(self._rings):
            ring = self._rings[queue]
            while ring and ring[0].at < horizon:
                ring.popleft()
            if not ring:
                del self._rings[queue]
        self.last_at = at

    def queues(self) -> list[str]:
        """The queues that have samples, by name."""
        return sorted(self._rings)

    def samples(self, queue: str) -> list[Sample]:
        """``queue``'s samples, oldest first (empty: none in the window)."""
        return list(self._rings.get(queue, ()))

    def points(self, queue: str) -> list[Point]:
        """``queue``'s samples with the changes between consecutive ones."""
        out: list[Point] = []
        before: Sample | None = None
        for sample in self._rings.get(queue, ()):
            if before is None:
                out.append(Point(sample, None, None, None))
            else:
                done = max(0, sample.completed - before.completed)
                failed = max(0, sample.archived - before.archived)
                elapsed = sample.at - before.at
                rate = done * 60.0 / elapsed if elapsed > 0 else None
                out.append(Point(sample, done, failed, rate))
            before = sample
        return out


def _seconds(stamp: Any) -> float:
    return float(stamp.seconds) + float(stamp.nanos) / 1e9


def waited(task: task_pb.Task, now: float) -> float:
    """How long ``task`` (a pending one) has waited at ``now``: since it last changed
    state (became pending), else since it was created; never less than 0."""
    if task.HasField("updated_at"):
        since = _seconds(task.updated_at)
    elif task.HasField("created_at"):
        since = _seconds(task.created_at)
    else:
        return 0.0
    return max(0.0, now - since)


class QueueSampler(Periodic):
    """Samples every queue into ``history`` every ``interval`` seconds, in a background
    task (:meth:`start`, :meth:`stop`); :meth:`sample` takes one round now.

    ``admin`` gives an AdminService stub; ``token`` is the bearer secret of the calls
    (None: none, for an api without auth); ``clock`` is the wall clock of the samples."""

    name = "conveyor-rest-sampler"

    def __init__(
        self,
        admin: Callable[[], Any],
        history: QueueHistory,
        *,
        interval: float = DEFAULT_INTERVAL,
        token: str | None = None,
        clock: Clock = time.time,
        timeout: float = 10.0,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        super().__init__(interval)
        self._admin = admin
        self.history = history
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._clock = clock
        self._timeout = timeout
        #: The gRPC status of the last failed round, until a round succeeds (for logs).
        self._failing: grpc.StatusCode | None = None

    async def sample(self) -> bool:
        """Take one round now: every queue's counts, the latency of those with pending
        tasks, recorded at the clock's time. False (and a log line when the failure is
        new) when the api refused or did not answer; nothing is recorded then."""
        try:
            stats = await self._queues()
            at = self._clock()
            latencies = await self._latencies(stats, at)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code != self._failing:
                hint = (
                    " (set CONVEYOR_TOKEN to a read-only token: the charts need one)"
                    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
                    else ""
                )
                logger.warning(
                    "rest.sample_failed code=%s details=%s%s", code.name, exc.details(), hint
                )
                self._failing = code
            return False
        if self._failing is not None:
            logger.info("rest.sample_recovered")
            self._failing = None
        self.history.record(
            at,
            {
                q.queue: Sample(
                    at=at,
                    completed=int(q.counts.get("completed", 0)),
                    archived=int(q.counts.get("archived", 0)),
                    pending=int(q.counts.get("pending", 0)),
                    active=int(q.counts.get("active", 0)),
                    latency=latencies.get(q.queue, 0.0 if not q.counts.get("pending") else None),
                )
                for q in stats
            },
        )
        return True

    async def _queues(self) -> list[pb.QueueStats]:
        """Every queue's stats, page by page, up to the history's ``max_queues``."""
        admin = self._admin()
        found: list[pb.QueueStats] = []
        cursor = ""
        while len(found) < self.history.max_queues:
            limit = min(1000, self.history.max_queues - len(found))
            page = await admin.ListQueues(
                pb.ListQueuesRequest(limit=limit, cursor=cursor),
                metadata=self._metadata,
                timeout=self._timeout,
            )
            found.extend(page.queues)
            cursor = page.next_cursor
            if not cursor:
                break
        return found

    async def _latencies(self, stats: list[pb.QueueStats], at: float) -> dict[str, float]:
        """The latency of the queues with pending tasks (the most pending first, at most
        LATENCY_PROBES of them; one whose probe fails is left out: not measured)."""
        waiting = sorted(
            (q for q in stats if q.counts.get("pending", 0) > 0),
            key=lambda q: (-q.counts.get("pending", 0), q.queue),
        )[:LATENCY_PROBES]
        admin = self._admin()
        gate = asyncio.Semaphore(PROBE_CONCURRENCY)
        found: dict[str, float] = {}

        async def probe(queue: str) -> None:
            request = pb.ListTasksRequest(
                queue=queue, state=task_pb.TASK_STATE_PENDING, limit=1, omit_payloads=True
            )
            async with gate:
                try:
                    page = await admin.ListTasks(
                        request, metadata=self._metadata, timeout=self._timeout
                    )
                except grpc.aio.AioRpcError as exc:
                    # This queue's latency goes unmeasured this round; the counts stand.
                    logger.debug("rest.latency_probe_failed queue=%s code=%s", queue, exc.code())
                    return
            found[queue] = waited(page.tasks[0], at) if page.tasks else 0.0

        await asyncio.gather(*(probe(q.queue) for q in waiting))
        return found

    async def round(self) -> None:
        """A round: :meth:`sample`."""
        await self.sample()
