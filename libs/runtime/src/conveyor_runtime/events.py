"""Publish the broker's lifecycle events to ``<prefix>.events.<queue>.<state>``.

The broker calls its event sink inside its commit path, so the sink must never block:
:class:`EventPublisher` only appends to a bounded buffer, and a background task turns
the buffer into NATS publishes. Events are hints for watchers (WatchEvents, the
dashboard); when the buffer overflows the oldest events are dropped and counted.

Events cost every process CPU per task, so by default they are published on demand:
an :class:`EventGate` attaches the publisher to the broker only while someone has
announced on ``<prefix>.watch`` within :data:`WATCH_TTL` seconds. A watcher announces
itself before it reads and every :data:`WATCH_REANNOUNCE` seconds while it reads
(:meth:`conveyor_runtime.bus.Bus.publish_watch`); the api's WatchEvents does. Events
that happen in a process before the first announcement reaches it are not published (the
stream is live, not a log).

Each message carries a run of consecutive events of one queue and state (see
:func:`~conveyor_runtime.wire.encode_events`): a broker call's rows share both, so a
batch of a hundred acks costs one publish, not a hundred, and watchers still see every
event in the order this process emitted them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque

from conveyor_broker.interface import Broker
from conveyor_broker.types import TaskEvent
from nats.aio.subscription import Subscription

from conveyor_runtime.bus import Bus
from conveyor_runtime.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: Seconds an announcement keeps a process publishing events.
WATCH_TTL = 15.0
#: Seconds between a watcher's announcements (well inside WATCH_TTL).
WATCH_REANNOUNCE = 5.0

#: Most events in one message (about 100 bytes each: far below NATS's 1 MB default).
MAX_EVENTS_PER_MESSAGE = 1000


class EventPublisher:
    """A broker EventSink (call it with a TaskEvent) that publishes to NATS in the background.

    Call it from the event loop's thread; calls from other threads are handed over to it.
    """

    def __init__(self, bus: Bus, *, max_buffered: int = 100_000) -> None:
        if max_buffered < 1:
            raise ValueError("max_buffered must be >= 1")
        self._bus = bus
        self._buffer: deque[TaskEvent] = deque()
        self._max = max_buffered
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self.dropped = 0
        #: Events published, and the messages that carried them.
        self.published = 0
        self.messages = 0

    def __call__(self, event: TaskEvent) -> None:
        """Queue ``event`` for publishing. Never blocks, never raises."""
        if self._loop is not None and threading.get_ident() != self._thread:
            self._loop.call_soon_threadsafe(self._append, event)
            return
        self._append(event)

    def _append(self, event: TaskEvent) -> None:
        if len(self._buffer) >= self._max:
            self._buffer.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                logger.warning("events.dropped total=%d", self.dropped)
        self._buffer.append(event)
        self._wakeup.set()

    @property
    def backlog(self) -> int:
        """Events queued and not yet published."""
        return len(self._buffer)

    async def start(self) -> None:
        """Start publishing from a background task."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.get_ident()
            self._task = asyncio.create_task(self._run(), name="event-publisher")

    async def stop(self, *, flush_within: float = 2.0) -> None:
        """Publish what is buffered (for up to ``flush_within`` seconds), then stop."""
        if self._task is None:
            return
        task, self._task = self._task, None
        await cancel_and_wait([task])
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._publish_all(), flush_within)
        self._loop = None

    async def _publish_all(self) -> None:
        buffer = self._buffer
        while buffer:
            first = buffer[0]
            key = (first.queue, first.state)
            run = 1
            while (
                run < len(buffer)
                and run < MAX_EVENTS_PER_MESSAGE
                and (buffer[run].queue, buffer[run].state) == key
            ):
                run += 1
            events = [buffer.popleft() for _ in range(run)]
            try:
                await self._bus.publish_events(events)
            except BaseException:
                buffer.extendleft(reversed(events))  # retried on the next pass
                raise
            self.published += run
            self.messages += 1

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            try:
                await self._publish_all()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # NATS is down or the connection is closing: keep the buffer, retry later.
                logger.warning("events.publish_failed backlog=%d error=%r", self.backlog, exc)
                await asyncio.sleep(0.5)
                self._wakeup.set()


class EventGate:
    """Attaches ``publisher`` to ``broker`` while someone watches events.

    Each announcement (:meth:`conveyor_runtime.bus.Bus.publish_watch`) keeps the sink
    attached for ``ttl`` seconds more; without announcements the broker has no sink, and
    builds no events at all.
    """

    def __init__(
        self,
        broker: Broker,
        publisher: EventPublisher,
        bus: Bus,
        *,
        ttl: float = WATCH_TTL,
    ) -> None:
        self._broker = broker
        self._publisher = publisher
        self._bus = bus
        self._ttl = ttl
        self._sub: Subscription | None = None
        self._expiry: asyncio.TimerHandle | None = None

    @property
    def open(self) -> bool:
        """True while the broker's events are being published."""
        return self._expiry is not None

    async def start(self) -> None:
        """Listen for announcements."""
        if self._sub is None:
            self._sub = await self._bus.subscribe_watch(self.keep_open)

    def keep_open(self) -> None:
        """Publish events for ``ttl`` seconds from now (also for in-process watchers)."""
        loop = asyncio.get_running_loop()
        if self._expiry is None:
            self._broker.set_event_sink(self._publisher)
            logger.info("events.publishing reason=watched")
        else:
            self._expiry.cancel()
        self._expiry = loop.call_later(self._ttl, self._close)

    def _close(self) -> None:
        self._expiry = None
        self._broker.set_event_sink(None)
        logger.info("events.paused reason=unwatched")

    async def stop(self) -> None:
        """Stop listening and detach the sink."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._broker.set_event_sink(None)
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
