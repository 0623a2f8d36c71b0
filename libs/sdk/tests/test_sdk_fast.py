"""The producer's bulk paths make exactly what the plain ones make: the frozen-dataclass
constructor, the codec's shortcuts for an empty object, and reading stored tasks back."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta

import pytest
from conveyor import JsonCodec, TaskState
from conveyor._clients.task_wire import task_from_wire
from conveyor._types import EnqueueResult, TaskInfo, TaskOptions
from conveyor._wire_time import timestamp_to_wire
from conveyor_protos.construct import constructor
from conveyor_protos.v1 import task_pb2 as pb

NOW = datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)


def test_the_constructor_makes_what_init_makes() -> None:
    values: dict[str, object] = {f.name: None for f in dataclasses.fields(TaskInfo)}
    values.update(id="x", queue="q", type="t", state=TaskState.PENDING, headers={}, retried=0)
    values.update(options=TaskOptions(), max_retry=3, created_at=NOW)
    built = constructor(TaskInfo)(**values)
    assert type(built) is TaskInfo
    assert built == TaskInfo(**values)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.id = "y"  # type: ignore[misc]
    assert constructor(EnqueueResult)(task=built, created=True) == EnqueueResult(built, True)
    with pytest.raises(TypeError):
        constructor(TaskOptions)  # validates in __post_init__: not for this constructor


@pytest.mark.parametrize("value", [{}, [], {"a": [1, {}]}, "", 0, None, [{}]])
def test_json_codec_matches_the_json_module(value: object) -> None:
    codec = JsonCodec()
    data = codec.encode(value)
    assert data == json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    decoded = codec.decode(data)
    assert decoded == value
    if isinstance(value, dict):
        assert decoded is not value
        assert codec.decode(b"{}") is not codec.decode(b"{}")  # each caller its own


def test_task_from_wire_reads_every_field_and_shares_no_mutable_value() -> None:
    message = pb.Task(
        id="01HZY0000000000000000000AA",
        queue="q",
        type="t",
        payload=b"{}",
        headers={"k": "v"},
        state=pb.TASK_STATE_RETRY,
        max_retry=4,
        retried=1,
        progress=b"[1]",
        last_error="boom",
    )
    message.options.max_retry = 4
    for name, at in (
        ("created_at", NOW),
        ("updated_at", NOW),
        ("started_at", NOW + timedelta(seconds=1)),
        ("next_process_at", NOW + timedelta(minutes=1)),
    ):
        getattr(message, name).CopyFrom(timestamp_to_wire(at))
    codec = JsonCodec()
    first, second = task_from_wire(message, codec), task_from_wire(message, codec)
    assert first == second
    assert first.payload == {}
    assert first.payload is not second.payload
    assert first.headers is not second.headers
    assert (first.created_at, first.updated_at) == (NOW, NOW)
    assert first.started_at == NOW + timedelta(seconds=1)
    assert first.next_process_at == NOW + timedelta(minutes=1)
    assert first.completed_at is None
    assert first.lease_expires_at is None
    assert (first.progress, first.result, first.last_error) == ([1], None, "boom")
    assert first.state is TaskState.RETRY
