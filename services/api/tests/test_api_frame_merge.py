"""How accepted tasks become Dispatches frames: cut at a byte cap per offer, and merged
when several wait to be written together (pure logic)."""

from __future__ import annotations

from collections import deque

import pytest
from conveyor_api import session
from conveyor_api.session import DISPATCHES_MAX_BYTES, _next_frame, frame_chunks
from conveyor_protos.v1 import service_pb2, task_pb2


def dispatches(*ids: str, payload: bytes = b"") -> service_pb2.ServerFrame:
    tasks = [task_pb2.TaskEnvelope(id=i, lease_id=f"l-{i}", payload=payload) for i in ids]
    return service_pb2.ServerFrame(dispatches=service_pb2.Dispatches(tasks=tasks))


def cancel(task_id: str) -> service_pb2.ServerFrame:
    return service_pb2.ServerFrame(cancel=service_pb2.Cancel(task_id=task_id))


def drain(frames: deque[service_pb2.ServerFrame]) -> list[tuple[str | None, list[str]]]:
    out = []
    while frames:
        frame = _next_frame(frames)
        kind = frame.WhichOneof("frame")
        ids = [t.id for t in frame.dispatches.tasks] if kind == "dispatches" else []
        out.append((kind, ids or [frame.cancel.task_id]))
    return out


def test_adjacent_dispatches_become_one_frame_in_order() -> None:
    frames = deque([dispatches("a"), dispatches("b", "c"), cancel("x"), dispatches("d")])
    assert drain(frames) == [
        ("dispatches", ["a", "b", "c"]),
        ("cancel", ["x"]),
        ("dispatches", ["d"]),
    ]


def test_other_frames_are_never_merged_or_reordered() -> None:
    frames = deque([cancel("x"), cancel("y"), dispatches("a"), cancel("z")])
    assert drain(frames) == [
        ("cancel", ["x"]),
        ("cancel", ["y"]),
        ("dispatches", ["a"]),
        ("cancel", ["z"]),
    ]


def test_a_merged_frame_stays_under_the_byte_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    big = b"x" * 400
    frames = deque([dispatches(str(n), payload=big) for n in range(5)])
    monkeypatch.setattr(session, "MERGE_MAX_BYTES", 2 * frames[0].ByteSize() + 10)
    assert drain(frames) == [
        ("dispatches", ["0", "1"]),
        ("dispatches", ["2", "3"]),
        ("dispatches", ["4"]),
    ]


def test_an_offer_goes_out_in_frames_of_at_most_the_cap_or_one_task() -> None:
    envelopes = [
        task_pb2.TaskEnvelope(id=str(n), payload=b"x" * size)
        for n, size in enumerate([400_000, 400_000, 400_000, 1_500_000, 10])
    ]
    chunks = frame_chunks(envelopes)
    assert [[e.id for e in chunk] for chunk in chunks] == [["0", "1"], ["2"], ["3"], ["4"]]
    for chunk in chunks:
        if len(chunk) > 1:
            frame = service_pb2.Dispatches(tasks=chunk)
            assert frame.ByteSize() <= DISPATCHES_MAX_BYTES
