"""The committed protobuf code is what scripts/genproto.py generates from the .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current() -> None:
    spec = importlib.util.spec_from_file_location("genproto", ROOT / "scripts" / "genproto.py")
    assert spec is not None
    assert spec.loader is not None
    genproto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(genproto)
    generated = genproto.generate()
    committed = {p.name: p.read_text() for p in genproto.OUT.glob("*.py*")}
    stale = sorted(
        n for n in set(generated) | set(committed) if generated.get(n) != committed.get(n)
    )
    assert not stale, f"run scripts/genproto.py: stale generated files {stale}"


def test_every_task_state_is_in_the_wire_contract() -> None:
    from conveyor_broker import TaskState
    from conveyor_protos.v1 import task_pb2

    names = set(task_pb2.TaskState.keys())
    assert {f"TASK_STATE_{s.name}" for s in TaskState} <= names
