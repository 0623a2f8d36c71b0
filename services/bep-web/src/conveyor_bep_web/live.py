"""Live updates as Server-Sent Events: a build's page and a project's build list.

The ingest publishes a digest on NATS after each commit that touched a build
(:mod:`conveyor_bep.live`). A digest is only a trigger here: whatever arrives within one
``interval`` (``CONVEYOR_BEP_WEB_DIGEST_INTERVAL``, 0.25 s) is coalesced into one SSE
event, which carries the rows as freshly re-read from Postgres. A lost digest therefore
delays an update and never corrupts one, and a safety poll of the build's
``updated_at``/``last_event_seq`` (every :data:`SAFETY_POLL` seconds) heals a lost final
digest. Without a NATS connection the same poll runs every :data:`POLL` second instead.

A build's stream: one ``build`` event at connect, one after each change (at most one per
interval), then ``end`` once the build is finished. A project's stream: ``ready`` at
connect, then ``builds`` events with the list rows of the builds that changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from conveyor_bep.live import build_subject, project_subject

from conveyor_bep_web import queries
from conveyor_bep_web.reads import build_summary, builds_by_id

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient
    from nats.aio.msg import Msg

logger = logging.getLogger(__name__)

#: Seconds between two polls of Postgres without NATS.
POLL = 1.0
#: Seconds between two polls with NATS (only a lost digest makes one matter).
SAFETY_POLL = 5.0
#: Seconds of silence after which a comment keeps proxies from closing the stream.
KEEPALIVE = 15.0
#: Builds remembered per project stream to send only rows that moved.
REMEMBERED = 10_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def sse(event: str, data: Any, *, event_id: int | None = None) -> bytes:
    """One Server-Sent Event: ``event``, optional ``id`` and ``data`` as one JSON line."""
    head = f"event: {event}\n"
    if event_id is not None:
        head += f"id: {event_id}\n"
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Changed:
    """What woke a stream: an event, and the invocation ids digests named."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.ids: set[str] = set()

    def mark(self, invocation_id: str | None = None) -> None:
        """Something changed (for ``invocation_id``, when known)."""
        if invocation_id:
            self.ids.add(invocation_id)
        self.event.set()

    def take(self) -> set[str]:
        """The ids named since the last take; clears the event."""
        self.event.clear()
        ids, self.ids = self.ids, set()
        return ids

    async def wait(self) -> AsyncIterator[bytes]:
        """Until something changed, yielding a keepalive comment every
        :data:`KEEPALIVE` seconds of silence."""
        while not self.event.is_set():
            try:
                await asyncio.wait_for(self.event.wait(), KEEPALIVE)
            except TimeoutError:
                yield b": keepalive\n\n"


async def _subscribe(nc: NatsClient | None, subject: str, changed: Changed) -> Any:
    if nc is None:
        return None

    async def on_digest(msg: Msg) -> None:
        try:
            invocation_id = json.loads(msg.data).get("invocation_id")
        except (ValueError, AttributeError):
            invocation_id = None
        changed.mark(invocation_id if isinstance(invocation_id, str) else None)

    return await nc.subscribe(subject, cb=on_digest)


async def _unsubscribe(sub: Any) -> None:
    if sub is not None:
        with contextlib.suppress(Exception):  # a closed connection has no subscriptions
            await sub.unsubscribe()


async def _poll(every: float, check: Callable[[], Awaitable[bool]], changed: Changed) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            if await check():
                changed.mark()
        except Exception as exc:  # Postgres away: the next poll tries again
            logger.warning("bep_web.live.poll_failed error=%s", exc)


async def _pace(last_sent: float, interval: float) -> None:
    """Wait until ``interval`` seconds have passed since ``last_sent`` (monotonic)."""
    delay = last_sent + interval - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def build_events(
    pool: Any,
    nc: NatsClient | None,
    *,
    prefix: str,
    projects: list[int] | None,
    project_id: int,
    invocation_id: str,
    interval: float,
) -> AsyncIterator[bytes]:
    """The SSE stream of one build's page (see the module)."""
    changed = Changed()
    # Subscribe before the first read: a digest of a commit after that read is not lost.
    sub = await _subscribe(nc, build_subject(prefix, project_id, invocation_id), changed)
    seen: list[Any] = [None]

    async def moved() -> bool:
        async with pool.acquire() as conn:
            row = await conn.fetchrow(queries.BUILD_PROGRESS, projects, invocation_id)
        state = None if row is None else tuple(row.values())
        if state != seen[0]:
            seen[0] = state
            return True
        return False

    await moved()
    poller = asyncio.create_task(_poll(POLL if nc is None else SAFETY_POLL, moved, changed))
    try:
        while True:
            changed.take()
            async with pool.acquire() as conn:
                summary = await build_summary(conn, projects, invocation_id)
            if summary is None:  # deleted (retention) while watched
                yield sse("gone", {"invocation_id": invocation_id})
                return
            summary["sent_at"] = time.time()
            yield sse("build", summary, event_id=summary["counters"]["last_event_seq"])
            last_sent = time.monotonic()
            if summary["finished"]:
                yield sse("end", {"invocation_id": invocation_id, "status": summary["status"]})
                return
            async for keepalive in changed.wait():
                yield keepalive
            await _pace(last_sent, interval)
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        await _unsubscribe(sub)


async def project_events(
    pool: Any,
    nc: NatsClient | None,
    *,
    prefix: str,
    projects: list[int] | None,
    project_id: int,
    interval: float,
) -> AsyncIterator[bytes]:
    """The SSE stream of a project's build list (see the module)."""
    changed = Changed()
    sub = await _subscribe(nc, project_subject(prefix, project_id), changed)
    async with pool.acquire() as conn:
        since = await conn.fetchval(queries.PROJECT_UPDATED_AT, projects, project_id)
    cursor: list[Any] = [since]

    async def moved() -> bool:
        # The overlap covers commits whose now() is earlier than one already seen;
        # rows that did not move are dropped below.
        floor = cursor[0] - timedelta(seconds=2) if cursor[0] is not None else _EPOCH
        async with pool.acquire() as conn:
            rows = await conn.fetch(queries.BUILDS_UPDATED_SINCE, projects, project_id, floor)
            newest = await conn.fetchval(queries.PROJECT_UPDATED_AT, projects, project_id)
        for row in rows:
            changed.ids.add(row["invocation_id"])
        if newest is not None:
            cursor[0] = newest
        return bool(rows)

    poller = asyncio.create_task(_poll(POLL, moved, changed)) if nc is None else None
    sent: dict[str, tuple[Any, ...]] = {}
    try:
        yield sse("ready", {"project_id": project_id})
        last_sent = time.monotonic()
        while True:
            async for keepalive in changed.wait():
                yield keepalive
            await _pace(last_sent, interval)
            ids = changed.take()
            if not ids:
                continue
            async with pool.acquire() as conn:
                rows = await builds_by_id(conn, projects, project_id, sorted(ids))
            fresh = []
            for row in rows:
                state = (row["last_event_seq"], row["updated_at"], row["status"])
                if sent.get(row["invocation_id"]) != state:
                    sent[row["invocation_id"]] = state
                    fresh.append(row)
            if len(sent) > REMEMBERED:
                sent.clear()
            if fresh:
                yield sse("builds", {"builds": fresh, "sent_at": time.time()})
                last_sent = time.monotonic()
    finally:
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        await _unsubscribe(sub)
