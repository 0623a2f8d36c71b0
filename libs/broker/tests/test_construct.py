"""conveyor_protos.construct: the bulk constructor makes what ``__init__`` makes."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from conveyor_broker.types import EnqueueResult, NewTask, OnFailure, Task, TaskState
from conveyor_protos.construct import constructor

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _task(**overrides: object) -> dict[str, object]:
    values: dict[str, object] = {
        "id": "01HZY0000000000000000000AA",
        "queue": "q",
        "type": "t",
        "payload": b"p",
        "headers": {"a": "b"},
        "state": TaskState.PENDING,
        "max_retry": 3,
        "retried": 0,
        "timeout": timedelta(seconds=5),
        "deadline": None,
        "process_at": None,
        "expires_at": None,
        "retention": None,
        "unique_key": "k",
        "unique_until": None,
        "group": None,
        "depends_on": ("01HZY0000000000000000000AB",),
        "on_failure": OnFailure.CONTINUE,
        "concurrency_key": None,
        "available_at": NOW,
        "lease_id": None,
        "lease_expires_at": None,
        "progress": None,
        "result": None,
        "last_error": None,
        "created_at": NOW,
        "updated_at": NOW,
        "started_at": None,
        "completed_at": None,
    }
    values.update(overrides)
    return values


def test_the_constructed_object_is_the_one_init_makes() -> None:
    make = constructor(Task)
    values = _task()
    built, expected = make(**values), Task(**values)  # type: ignore[arg-type]
    assert type(built) is Task
    assert built == expected
    assert repr(built) == repr(expected)
    assert built.holder is None  # a default left out
    assert make(**values, holder="h") == dataclasses.replace(expected, holder="h")
    assert pickle.loads(pickle.dumps(built)) == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.queue = "other"  # type: ignore[misc]
    result = constructor(EnqueueResult)(task=built, created=True)
    assert result == EnqueueResult(expected, True)
    new = constructor(NewTask)(
        **{f.name: getattr(NewTask("q", "t"), f.name) for f in dataclasses.fields(NewTask)}
    )
    assert new == NewTask("q", "t")


def test_missing_arguments_and_unsuitable_classes_are_refused() -> None:
    make = constructor(Task)
    values = _task()
    del values["queue"]
    with pytest.raises(TypeError, match="queue"):
        make(**values)

    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            if self.a < 0:
                raise ValueError

    for cls in (NoSlots, Checked):
        with pytest.raises(TypeError):
            constructor(cls)


def test_a_default_factory_field_must_be_given() -> None:
    @dataclass(frozen=True, slots=True)
    class WithFactory:
        a: int
        items: list[int] = field(default_factory=list)

    make = constructor(WithFactory)
    assert make(a=1, items=[2]) == WithFactory(1, [2])
    with pytest.raises(TypeError, match="items"):
        make(a=1)
