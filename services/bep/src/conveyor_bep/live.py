"""Live digests: after every commit, the ingest tells whoever watches a build what changed.

A digest is a small JSON object published (core NATS, fire and forget) on
``<prefix>.bep.live.<project_id>.<token>`` once per committed batch, where ``<token>`` is
:func:`invocation_token` of the invocation id. The web process subscribes to one build's
subject for its page (``<prefix>.bep.live.<project>.<token>``) or to a project's
(``<prefix>.bep.live.<project>.*``) for the build list, coalesces what arrives and sends
the browser at most one update every 250 ms. A digest says only what moved; the page
reads the rows themselves from Postgres, so a lost digest delays an update and never
corrupts one.

Fields: ``invocation_id``, ``project_id``, ``last_seq`` (the last committed event),
``events`` (in this commit), ``final`` (the stream's end was committed), ``status``
(when this commit set it), ``log_bytes`` / ``log_lines`` (the log's size after this
commit), and which tables it touched (``targets``, ``tests``, ``actions``: counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

    from conveyor_bep.writer import Batch

logger = logging.getLogger(__name__)

_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def invocation_token(invocation_id: str) -> str:
    """A NATS subject token for ``invocation_id``: the id itself when it is made of
    letters, digits, ``-`` and ``_`` (Bazel's UUIDs are), else ``h`` and the first 32 hex
    digits of its SHA-256."""
    if _SAFE.match(invocation_id):
        return invocation_id
    return "h" + hashlib.sha256(invocation_id.encode()).hexdigest()[:32]


def build_subject(prefix: str, project_id: int, invocation_id: str) -> str:
    """The subject one build's digests are published on."""
    return f"{prefix}.bep.live.{project_id}.{invocation_token(invocation_id)}"


def project_subject(prefix: str, project_id: int) -> str:
    """The wildcard subject of every build of a project."""
    return f"{prefix}.bep.live.{project_id}.*"


def digest(batch: Batch) -> dict[str, Any]:
    """What a committed ``batch`` tells a watcher."""
    changes = batch.changes
    log = batch.log_text
    return {
        "invocation_id": batch.invocation_id,
        "project_id": batch.project_id,
        "last_seq": batch.last_seq,
        "events": len(batch.events),
        "final": batch.final,
        "status": changes.invocation.set.get("status"),
        "log_bytes": batch.log_offset + len(log),
        "log_lines": batch.line_offset + log.count(b"\n"),
        "targets": len(changes.targets),
        "tests": len(changes.test_results),
        "actions": len(changes.actions),
    }


class LivePublisher:
    """Publishes the digests of committed batches (the writer shards' ``on_committed``).

    Publishing never waits on NATS inside the commit path: :meth:`committed` queues the
    digests and one task sends them; when the queue is full (NATS is slow or gone) the
    newest digests are dropped and counted, since the next one supersedes them anyway.
    """

    def __init__(self, nc: NatsClient, prefix: str, *, limit: int = 10_000) -> None:
        self._nc = nc
        self._prefix = prefix
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(limit)
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        self.dropped = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="bep-live")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def committed(self, batches: Sequence[Batch]) -> None:
        for batch in batches:
            subject = build_subject(self._prefix, batch.project_id, batch.invocation_id)
            try:
                self._queue.put_nowait((subject, json.dumps(digest(batch)).encode()))
            except asyncio.QueueFull:
                self.dropped += 1

    async def _run(self) -> None:
        while True:
            subject, data = await self._queue.get()
            try:
                await self._nc.publish(subject, data)
                self.published += 1
            except Exception as exc:  # a closed or reconnecting connection: drop it
                self.dropped += 1
                logger.debug("bep.live.publish_failed subject=%s error=%s", subject, exc)
