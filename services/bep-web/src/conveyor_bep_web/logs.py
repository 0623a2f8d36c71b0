"""A build's log, read back from its segments as a byte stream.

The ingest stores the log (progress output and console output, scrubbed) as zstd
segments, each with the byte offset of its first byte in the whole log
(``bep.log_segments``). Reading from byte ``offset`` starts at the segment holding it,
drops the bytes before it, and goes on in offset order, a page of segments per query so
that no connection is held while the client reads. The stream ends at the log's end as
committed when each page was read: a build still running gets its further log by asking
again from the offset it reached.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from conveyor_bep.writer import decompress

from conveyor_bep_web import queries

#: Segments read per query.
PAGE = 64


async def log_bytes(
    pool: Any, projects: list[int] | None, invocation_id: str, offset: int = 0
) -> AsyncIterator[bytes]:
    """The log of ``invocation_id`` from byte ``offset`` on, one chunk per segment."""
    position = offset
    while True:
        async with pool.acquire() as conn:
            rows = await conn.fetch(queries.LOG_SEGMENTS, projects, invocation_id, position, PAGE)
        for row in rows:
            start = row["byte_offset"]
            if start > position:
                # A hole: a segment past the one expected (never written by the ingest,
                # whose offsets are contiguous). Stop rather than splice.
                return
            data = decompress(row["data"])
            chunk = data[position - start :]
            position = start + len(data)
            if chunk:
                yield chunk
        if len(rows) < PAGE:
            return
