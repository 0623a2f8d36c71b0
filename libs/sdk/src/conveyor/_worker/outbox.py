"""Frames a worker session is about to write, coalesced.

Results that become ready at the same moment (in the same event-loop tick, or while the
previous write was still in flight) leave as one BatchResult frame; a lone Result leaves as
a plain Result frame. The answer to an aggregation group's BatchDispatch always leaves as
a BatchResult frame of its own, never cut nor joined with other Results. Progress updates
of one task collapse to the latest value.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from conveyor_protos.v1 import service_pb2 as svc

#: A BatchResult frame is cut before it grows past this many serialized bytes (a server
#: refuses messages over its receive limit, 4 MiB by default) ...
MAX_BATCH_BYTES = 1024 * 1024
#: ... or past this many results.
MAX_BATCH_RESULTS = 1000


def result_frames(
    results: Sequence[svc.Result],
    *,
    max_bytes: int = MAX_BATCH_BYTES,
    max_results: int = MAX_BATCH_RESULTS,
) -> list[svc.WorkerFrame]:
    """The frames carrying ``results``: one Result frame when there is a single result,
    otherwise BatchResult frames of at most ``max_results`` results and about
    ``max_bytes`` bytes each (a result bigger than that travels alone)."""
    if not results:
        return []
    if len(results) == 1:
        return [svc.WorkerFrame(result=results[0])]
    frames: list[svc.WorkerFrame] = []
    chunk: list[svc.Result] = []
    size = 0
    for result in results:
        n = result.ByteSize()
        if chunk and (size + n > max_bytes or len(chunk) >= max_results):
            frames.append(_frame(chunk))
            chunk, size = [], 0
        chunk.append(result)
        size += n
    frames.append(_frame(chunk))
    return frames


def _frame(chunk: list[svc.Result]) -> svc.WorkerFrame:
    if len(chunk) == 1:
        return svc.WorkerFrame(result=chunk[0])
    return svc.WorkerFrame(batch_result=svc.BatchResult(results=chunk))


class Outbox:
    """The frames waiting to be written on one session.

    Producers call the ``put_*`` methods (from the event loop thread); the session's
    writer waits with :meth:`wait`, takes everything with :meth:`drain` and writes it.
    """

    def __init__(self) -> None:
        self._progress: dict[tuple[str, str], bytes] = {}
        self._results: list[svc.Result] = []
        self._batches: list[svc.WorkerFrame] = []
        self._control: list[svc.WorkerFrame] = []
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called: nothing more will be queued."""
        return self._closed

    def close(self) -> None:
        """Queue nothing more; the writer half-closes the stream once it has written
        what is already queued."""
        self._closed = True
        self._ready.set()

    @property
    def pending(self) -> bool:
        """True when something waits to be written."""
        return bool(self._progress or self._results or self._batches or self._control)

    def put_result(self, result: svc.Result) -> None:
        """Queue one Result; it joins whatever else is ready when the writer wakes."""
        if self._closed:
            return
        self._results.append(result)
        self._wake()

    def put_batch(self, results: list[svc.Result]) -> None:
        """Queue the one BatchResult frame answering a BatchDispatch (``results``: a
        Result per member), as a frame of its own."""
        if self._closed:
            return
        self._batches.append(svc.WorkerFrame(batch_result=svc.BatchResult(results=results)))
        self._wake()

    def put_progress(self, task_id: str, lease_id: str, data: bytes) -> None:
        """Queue a Progress update, replacing an unsent one for the same delivery."""
        if self._closed:
            return
        self._progress.pop((task_id, lease_id), None)
        self._progress[(task_id, lease_id)] = data
        self._wake()

    def put_frame(self, frame: svc.WorkerFrame) -> None:
        """Queue a control frame (Heartbeat, Credit)."""
        if self._closed:
            return
        self._control.append(frame)
        self._wake()

    def _wake(self) -> None:
        self._ready.set()
        self._idle.clear()

    async def wait(self) -> None:
        """Return once something waits to be written."""
        await self._ready.wait()

    def drain(self) -> list[svc.WorkerFrame]:
        """Take every waiting frame, in write order: progress, results, the answers to
        batches, control."""
        frames = [
            svc.WorkerFrame(progress=svc.Progress(task_id=t, lease_id=lease, progress=data))
            for (t, lease), data in self._progress.items()
        ]
        frames += result_frames(self._results)
        frames += self._batches
        frames += self._control
        self._progress = {}
        self._results = []
        self._batches = []
        self._control = []
        self._ready.clear()
        if not frames:
            self._idle.set()
        return frames

    def written(self) -> None:
        """The writer finished writing the last drained frames."""
        if not self.pending:
            self._idle.set()

    async def flushed(self) -> None:
        """Return once everything queued so far has been written."""
        await self._idle.wait()
