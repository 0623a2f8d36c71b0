"""Both SDKs pass one behavioural checklist (checklist.json), across languages.

- A Python producer enqueues every scenario; a TypeScript worker process
  (ts_worker.mjs, on the TypeScript SDK in sdks/typescript) runs them; Python reads the
  tasks back and checks them.
- The reverse: a TypeScript producer (ts_producer.mjs) enqueues the same checklist, a
  Python SDK worker process (py_worker.py) runs it; the TypeScript script checks what it
  reads back, and Python reads the same tasks back and checks them again.

Each direction runs against its own ``conveyor dev``. The TypeScript SDK is built first
(``npm ci`` and ``npm run build`` in sdks/typescript) when its build output is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from conveyor import Client, TaskInfo
from conveyor_testkit.polling import wait_until_blocking

from tests.e2e.harness import POLL_INTERVAL, dev_server

pytestmark = [pytest.mark.e2e, pytest.mark.nats]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TS_SDK = ROOT / "sdks" / "typescript"
CHECKLIST: dict[str, Any] = json.loads((HERE / "checklist.json").read_text())
SCENARIOS: list[dict[str, Any]] = CHECKLIST["scenarios"]
TERMINAL = {"completed", "archived", "canceled"}


def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.fail("the cross-language tests need Node.js 20+ (node on PATH)")
    return found


@pytest.fixture(scope="module")
def ts_sdk() -> Path:
    """The TypeScript SDK, built (npm ci and npm run build when its output is missing)."""
    node()
    npm = shutil.which("npm")
    if not (TS_SDK / "dist" / "index.js").exists() or not (TS_SDK / "dist" / "protos").exists():
        assert npm is not None, "npm is needed to build sdks/typescript"
        if not (TS_SDK / "node_modules").exists():
            subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=TS_SDK, check=True
            )
        subprocess.run([npm, "run", "build", "--silent"], cwd=TS_SDK, check=True)
    return TS_SDK


def mismatches(task: TaskInfo, expect: dict[str, Any]) -> list[str]:
    """What differs between a task read back and a scenario's expectations (the keys
    ``expect`` names only)."""
    actual: dict[str, Any] = {
        "state": task.state.value,
        "retried": task.retried,
        "result": task.result,
        "progress": task.progress,
        "last_error": task.last_error,
    }
    return [
        f"{key}: expected {wanted!r}, got {actual[key]!r}"
        for key, wanted in expect.items()
        if actual[key] != wanted or type(actual[key]) is not type(wanted)
    ]


def check_all(client: Client, ids: dict[str, str]) -> list[str]:
    """Wait until every task has ended, then the mismatches of all scenarios."""
    tasks: dict[str, TaskInfo] = {}

    def ended() -> bool:
        for name, task_id in ids.items():
            tasks[name] = client.get_task(task_id)
        return all(t.state.value in TERMINAL for t in tasks.values())

    wait_until_blocking(ended, within=60, interval=POLL_INTERVAL, message="the checklist's tasks")
    return [
        f"{scenario['name']}: {problem}"
        for scenario in SCENARIOS
        for problem in mismatches(tasks[scenario["name"]], scenario["expect"])
    ]


class Process:
    """A worker process with its output in a log file; stop() sends SIGTERM and returns
    the exit code."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out: IO[bytes] = log.open("wb")
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            raise
        finally:
            self._out.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    with dev_server(tmp_path / "dev.log") as target:
        yield target


def queue_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def test_the_checklist_is_well_formed() -> None:
    names = [s["name"] for s in SCENARIOS]
    assert len(names) == len(set(names))
    assert {s["type"] for s in SCENARIOS} - {"xl.nobody"} == set(CHECKLIST["behaviours"])
    for scenario in SCENARIOS:
        assert scenario["expect"]["state"] in TERMINAL, scenario["name"]


def test_python_producer_typescript_worker(ts_sdk: Path, server: str, tmp_path: Path) -> None:
    queue = queue_name("xl-ts")
    worker = Process(
        [node(), str(HERE / "ts_worker.mjs")],
        {"CONVEYOR_TARGET": server, "XL_QUEUE": queue},
        tmp_path / "ts_worker.log",
    )
    try:
        with Client(server) as client:
            ids: dict[str, str] = {}
            for scenario in SCENARIOS:
                options = scenario.get("options", {})
                timeout_ms = options.get("timeout_ms")
                info = client.enqueue(
                    scenario["type"],
                    scenario["payload"],
                    queue=queue,
                    max_retry=options.get("max_retry"),
                    timeout=None if timeout_ms is None else timeout_ms / 1000,
                    headers=options.get("headers"),
                )
                ids[scenario["name"]] = info.id
            failures = check_all(client, ids)
        assert failures == [], "\n".join(failures) + "\n--- ts worker:\n" + worker.output()
        assert "ready " in worker.output()
    finally:
        code = worker.stop()
    assert code == 0, worker.output()
    assert "stopped" in worker.output()


def test_typescript_producer_python_worker(ts_sdk: Path, server: str, tmp_path: Path) -> None:
    queue = queue_name("xl-py")
    worker = Process(
        [sys.executable, str(HERE / "py_worker.py"), server, queue],
        {},
        tmp_path / "py_worker.log",
    )
    try:
        started = time.monotonic()
        producer = subprocess.run(
            [node(), str(HERE / "ts_producer.mjs")],
            cwd=ROOT,
            env={**os.environ, "CONVEYOR_TARGET": server, "XL_QUEUE": queue},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert producer.stdout.strip(), producer.stderr + "\n--- py worker:\n" + worker.output()
        report = json.loads(producer.stdout.strip().splitlines()[-1])
        assert report["failures"] == [], (
            "\n".join(report["failures"]) + "\n--- py worker:\n" + worker.output()
        )
        assert producer.returncode == 0, producer.stdout + producer.stderr
        assert time.monotonic() - started < 60
        # Read back in Python too: the same checklist holds for what the TS producer stored.
        with Client(server) as client:
            failures = check_all(client, report["tasks"])
        assert failures == [], "\n".join(failures)
    finally:
        code = worker.stop()
    assert code == 0, worker.output()
