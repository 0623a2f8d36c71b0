"""The ingest: one asyncio worker per build stream, ordering, batching and acks.

``PublishBuildToolEventStream`` carries one invocation's events, numbered from 1. The
worker of a stream (:class:`InvocationStream`) reads where the invocation stands in
Postgres (``last_event_seq``), then for each event:

* below the expected number: a resend of an event already committed: acknowledged at once;
* above it: a gap, refused with FAILED_PRECONDITION (Bazel does not retry that);
* the expected one: scrubbed (:mod:`conveyor_bep.scrub`), normalized
  (:mod:`conveyor_bep.normalize`) and appended to the open batch.

A batch closes after ``batch_window`` seconds, ``batch_events`` events or ``batch_bytes``
bytes, or at once when it carries the end-of-stream marker, and goes to the writer shard
of its invocation (:mod:`conveyor_bep.writer`). Acks are written in order and only after
the batch's commit. When more than the project's ``max_unacked`` events wait for their
ack, the worker stops reading (backpressure: gRPC flow control then slows Bazel down).
A batch fenced out by another writer ends the stream with UNAVAILABLE, which Bazel retries
against whatever node answers; it resumes from its first unacknowledged event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from conveyor_runtime.decoding import Undecodable
from google.protobuf import empty_pb2

from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_bep.bazel.google.devtools.build.v1 import (
    build_events_pb2,
    publish_build_event_pb2,
    publish_build_event_pb2_grpc,
)
from conveyor_bep.keys import KeyCache, Project
from conveyor_bep.normalize import console_text, normalize
from conveyor_bep.scrub import mask_bytes, may_hold_secret, scrub_message, scrub_text
from conveyor_bep.writer import Batch, FencedOut, WriterShard

logger = logging.getLogger(__name__)

#: A stream's requests as the handler gets them: an undecodable one is a marker
#: (conveyor_runtime.decoding), which ends the stream with INVALID_ARGUMENT.
Requests = AsyncIterator[publish_build_event_pb2.PublishBuildToolEventStreamRequest | Undecodable]

_BAZEL_EVENT_TYPE = "type.googleapis.com/" + bes.BuildEvent.DESCRIPTOR.full_name


@dataclass(frozen=True, slots=True)
class IngestLimits:
    """How batches close and how far a stream may run ahead of its acks."""

    batch_window: float = 0.05
    batch_events: int = 500
    batch_bytes: int = 256 * 1024


class StreamError(Exception):
    """Ends the stream with ``code``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Shards:
    """The writer shards, chosen by hashing the invocation id."""

    def __init__(self, shards: list[WriterShard]) -> None:
        if not shards:
            raise ValueError("at least one writer shard")
        self.shards = shards

    def for_batch(self, batch: Batch) -> WriterShard:
        return self.shards[batch.shard_key() % len(self.shards)]


def scrub_ordered_event(
    ordered: publish_build_event_pb2.OrderedBuildEvent,
) -> tuple[bes.BuildEvent | None, str]:
    """Scrub ``ordered`` in place; return its Bazel event (None for a BES-level event)
    and the console text it carries."""
    event = ordered.event
    kind = event.WhichOneof("event")
    console = ""
    bazel: bes.BuildEvent | None = None
    if kind == "bazel_event" and event.bazel_event.type_url == _BAZEL_EVENT_TYPE:
        bazel = bes.BuildEvent()
        raw = event.bazel_event.value
        bazel.ParseFromString(raw)
        if may_hold_secret(raw):
            scrub_message(bazel)
            event.bazel_event.value = mask_bytes(bazel.SerializeToString())
    elif kind == "console_output":
        output = event.console_output
        if output.WhichOneof("output") == "text_output":
            output.text_output = scrub_text(output.text_output)
            console = console_text(output.text_output)
        elif output.WhichOneof("output") == "binary_output":
            text = scrub_text(output.binary_output.decode(errors="replace"))
            output.text_output = text
            console = console_text(text)
    else:
        scrub_message(event)
    return bazel, console


class InvocationStream:
    """The worker of one ``PublishBuildToolEventStream`` call."""

    def __init__(
        self,
        project: Project,
        pool: Any,
        shards: Shards,
        limits: IngestLimits,
    ) -> None:
        self.project = project
        self._pool = pool
        self._shards = shards
        self._limits = limits
        self._loop = asyncio.get_running_loop()
        self._acks: asyncio.Queue[tuple[asyncio.Future[None], int, int] | None] = asyncio.Queue()
        self._acked_through = 0
        self._acked = asyncio.Event()
        self._batch: Batch | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stream_id: build_events_pb2.StreamId | None = None
        self.invocation_id = ""
        self.build_id = ""
        self.expected = 1
        self._log_offset = 0
        self._line_offset = 0

    async def run(
        self,
        requests: Requests,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        reader = asyncio.ensure_future(self._read(requests))
        writer = asyncio.ensure_future(self._write_acks(context))
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
            await writer
        except FencedOut:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"invocation {self.invocation_id} was taken over by another writer; retry",
            )
        except StreamError as exc:
            await context.abort(exc.code, exc.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            # A database error that retrying one by one did not cure, say: Bazel retries
            # INTERNAL, and resumes from what is committed.
            logger.exception("bep.stream.failed invocation=%s", self.invocation_id)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"ingest of {self.invocation_id} failed; retry"
            )
        finally:
            for task in (reader, writer):
                task.cancel()
            for task in (reader, writer):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self._timer is not None:
                self._timer.cancel()

    async def _start(self, ordered: publish_build_event_pb2.OrderedBuildEvent) -> None:
        stream_id = ordered.stream_id
        if not stream_id.invocation_id:
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, "stream_id.invocation_id is empty")
        if len(stream_id.invocation_id) > 200:
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, "invocation_id is too long")
        self._stream_id = stream_id
        self.invocation_id = stream_id.invocation_id
        self.build_id = stream_id.build_id
        row = await self._pool.fetchrow(
            "SELECT project_id, last_event_seq, log_bytes, log_lines FROM bep.invocations"
            " WHERE invocation_id = $1",
            self.invocation_id,
        )
        if row is not None:
            if row["project_id"] != self.project.id:
                raise StreamError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"invocation {self.invocation_id} belongs to another project",
                )
            self.expected = int(row["last_event_seq"]) + 1
            self._acked_through = self.expected - 1
            self._log_offset = int(row["log_bytes"])
            self._line_offset = int(row["log_lines"])

    async def _read(
        self,
        requests: Requests,
    ) -> None:
        done = self._loop.create_future()
        done.set_result(None)
        async for request in requests:
            if isinstance(request, Undecodable):
                # What is committed stays acked; Bazel does not retry this.
                raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            ordered = request.ordered_build_event
            if self._stream_id is None:
                await self._start(ordered)
            elif ordered.stream_id.invocation_id != self.invocation_id:
                raise StreamError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "one stream carries one invocation: got "
                    f"{ordered.stream_id.invocation_id!r} after {self.invocation_id!r}",
                )
            seq = ordered.sequence_number
            if seq < 1:
                raise StreamError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"sequence_number {seq} is below 1"
                )
            if seq < self.expected:
                self._acks.put_nowait((done, seq, seq))
                continue
            if seq > self.expected:
                raise StreamError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"event {seq} arrived but {self.expected} was expected next",
                )
            self._accept(ordered)
            self.expected += 1
            while self.expected - 1 - self._acked_through > self.project.max_unacked:
                self._acked.clear()
                await self._acked.wait()
        self._close_batch()
        self._acks.put_nowait(None)

    def _accept(self, ordered: publish_build_event_pb2.OrderedBuildEvent) -> None:
        bazel, console = scrub_ordered_event(ordered)
        data = ordered.SerializeToString()
        if bazel is None:
            # A Bazel event's bytes were masked when it was repacked; the envelope around
            # it holds only ids, numbers and times.
            data = mask_bytes(data)
        batch = self._batch
        if batch is None:
            batch = self._batch = Batch(
                invocation_id=self.invocation_id,
                project_id=self.project.id,
                build_id=self.build_id,
                first_seq=ordered.sequence_number,
                log_offset=self._log_offset,
                line_offset=self._line_offset,
                stream=id(self),
            )
            self._timer = self._loop.call_later(self._limits.batch_window, self._close_batch)
        batch.last_seq = ordered.sequence_number
        batch.events.append(data)
        batch.size += len(data)
        if bazel is not None:
            normalize(bazel, ordered.sequence_number, batch.changes)
        if console:
            batch.changes.log.append(console)
        final = ordered.event.WhichOneof("event") == "component_stream_finished"
        if final:
            batch.final = True
        if (
            final
            or len(batch.events) >= self._limits.batch_events
            or batch.size >= self._limits.batch_bytes
        ):
            self._close_batch()

    def _close_batch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._batch = self._batch, None
        if batch is None:
            return
        text = batch.log_text
        self._log_offset += len(text)
        self._line_offset += text.count(b"\n")
        future = self._shards.for_batch(batch).submit(batch)
        # A stream that ended early never awaits its last futures: retrieve their errors.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._acks.put_nowait((future, batch.first_seq, batch.last_seq))

    async def _write_acks(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        while True:
            item = await self._acks.get()
            if item is None:
                return
            future, first, last = item
            await future
            for seq in range(first, last + 1):
                await context.write(
                    publish_build_event_pb2.PublishBuildToolEventStreamResponse(
                        stream_id=self._stream_id, sequence_number=seq
                    )
                )
            self._acked_through = max(self._acked_through, last)
            self._acked.set()


UNAUTHENTICATED_HINT = (
    "no valid API key: pass --remote_header=x-api-key=<key> (or, for a Bazel without "
    "BES headers, --project_id=<key>)"
)


async def _chain(
    first: publish_build_event_pb2.PublishBuildToolEventStreamRequest | Undecodable,
    rest: Requests,
) -> Requests:
    yield first
    async for item in rest:
        yield item


class PublishBuildEventService(publish_build_event_pb2_grpc.PublishBuildEventServicer):
    """The BES endpoint Bazel's ``--bes_backend`` talks to."""

    def __init__(
        self,
        pool: Any,
        shards: Shards,
        keys: KeyCache,
        header_project: Callable[[], Project | None],
        limits: IngestLimits | None = None,
    ) -> None:
        self._pool = pool
        self._shards = shards
        self._keys = keys
        self._header_project = header_project
        self._limits = limits or IngestLimits()
        self._streams: dict[int, int] = {}

    async def PublishBuildToolEventStream(
        self,
        request_iterator: Requests,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        project = self._header_project()
        if project is None:
            first = await anext(aiter(request_iterator), None)
            if first is None:
                return
            if isinstance(first, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, first.message)
            project = await self._keys.authenticate(first.project_id)
            if project is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_HINT)
            request_iterator = _chain(first, request_iterator)
        active = self._streams.get(project.id, 0)
        if active >= project.max_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"project {project.slug} has {active} streams open on this node "
                f"(its limit is {project.max_streams})",
            )
        self._streams[project.id] = active + 1
        try:
            stream = InvocationStream(project, self._pool, self._shards, self._limits)
            await stream.run(request_iterator, context)
        finally:
            self._streams[project.id] -= 1

    async def PublishLifecycleEvent(
        self,
        request: publish_build_event_pb2.PublishLifecycleEventRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> empty_pb2.Empty:
        project = self._header_project() or await self._keys.authenticate(request.project_id)
        if project is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_HINT)
        ordered = request.build_event
        invocation_id = ordered.stream_id.invocation_id
        event = ordered.event
        kind = event.WhichOneof("event")
        if not invocation_id or kind not in (
            "invocation_attempt_started",
            "invocation_attempt_finished",
        ):
            return empty_pb2.Empty()  # build-level lifecycle: nothing of ours to record
        when = (
            event.event_time.ToDatetime().replace(tzinfo=None)
            if event.HasField("event_time")
            else None
        )
        owner = await self._pool.fetchval(
            "INSERT INTO bep.invocations (invocation_id, project_id, build_id) VALUES"
            " ($1, $2, $3) ON CONFLICT (invocation_id) DO UPDATE SET updated_at ="
            " bep.invocations.updated_at RETURNING project_id",
            invocation_id,
            project.id,
            ordered.stream_id.build_id,
        )
        if owner != project.id:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"invocation {invocation_id} belongs to another project",
            )
        if kind == "invocation_attempt_started":
            await self._pool.execute(
                "UPDATE bep.invocations SET attempt_started_at = COALESCE(attempt_started_at,"
                " $2::timestamp AT TIME ZONE 'UTC', now()) WHERE invocation_id = $1",
                invocation_id,
                when,
            )
        else:
            status = event.invocation_attempt_finished.invocation_status
            await self._pool.execute(
                "UPDATE bep.invocations SET lifecycle_status = $2, attempt_finished_at ="
                " COALESCE($3::timestamp AT TIME ZONE 'UTC', now()) WHERE invocation_id = $1",
                invocation_id,
                status.Result.Name(status.result),
                when,
            )
        return empty_pb2.Empty()
