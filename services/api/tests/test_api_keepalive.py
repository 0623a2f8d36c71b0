"""The server's Ping keepalive: an idle session gets a Ping at least every
``ping_interval``, stamped with the injected clock."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from conveyor_api.session import FrameWriter
from conveyor_protos.v1 import service_pb2

STAMP = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


class _Stream:
    """A stream context that records what is written (a real object, not a mock)."""

    def __init__(self) -> None:
        self.frames: list[service_pb2.ServerFrame] = []
        self.written = asyncio.Event()

    async def write(self, frame: service_pb2.ServerFrame) -> None:
        self.frames.append(frame)
        self.written.set()

    def kinds(self) -> list[str | None]:
        return [f.WhichOneof("frame") for f in self.frames]


async def _until(cond: Any, stream: _Stream, within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while not cond():
            stream.written.clear()
            await stream.written.wait()


async def test_an_idle_session_gets_pings_stamped_with_the_clock() -> None:
    stream = _Stream()
    writer = FrameWriter(stream, ping_interval=0.02, now=lambda: STAMP)  # type: ignore[arg-type]
    try:
        await _until(lambda: stream.kinds().count("ping") >= 2, stream)
    finally:
        writer.task.cancel()
    assert set(stream.kinds()) == {"ping"}
    assert stream.frames[0].ping.sent_at.ToDatetime(tzinfo=UTC) == STAMP


async def test_no_ping_without_an_interval() -> None:
    stream = _Stream()
    writer = FrameWriter(stream)  # type: ignore[arg-type]
    try:
        writer.cancel("t", "l", "why")
        await _until(lambda: len(stream.frames) >= 1, stream)
    finally:
        writer.task.cancel()
    assert stream.kinds() == ["cancel"]
