"""The README quickstart, exactly as a newcomer runs it: `scripts/run`, then the example
worker and producer from `examples/`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conveyor_runtime.embedded_nats import free_port
from conveyor_testkit.polling import wait_until_blocking

from tests.e2e.harness import POLL_INTERVAL, dev_server, port_open

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.nats
def test_quickstart_runs_start_to_finish(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "CONVEYOR_TARGET": f"127.0.0.1:{port}", "PYTHONUNBUFFERED": "1"}
    dev_log = (tmp_path / "dev.log").open("wb")
    dev = subprocess.Popen(
        ["bash", "scripts/run", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=dev_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    worker = None
    try:
        wait_until_blocking(
            lambda: port_open(port) or dev.poll() is not None,
            within=120,
            interval=POLL_INTERVAL,
            message="dev server",
        )
        assert dev.poll() is None, (tmp_path / "dev.log").read_text()
        # The banner comes once every service has started (the port opens with the api).
        wait_until_blocking(
            lambda: "AUTH IS OFF" in (tmp_path / "dev.log").read_text() or dev.poll() is not None,
            within=60,
            interval=POLL_INTERVAL,
            message="dev banner",
        )
        banner = (tmp_path / "dev.log").read_text()
        assert "AUTH IS OFF" in banner, banner
        nats_port = int(re.search(r"nats://127\.0\.0\.1:(\d+)", banner).group(1))  # type: ignore[union-attr]

        with (tmp_path / "worker.log").open("wb") as worker_log:
            worker = subprocess.Popen(
                [sys.executable, "examples/worker.py"],
                cwd=ROOT,
                env=env,
                stdout=worker_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        producer = subprocess.run(
            [sys.executable, "examples/producer.py"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert producer.returncode == 0, producer.stdout + producer.stderr
        assert "8 of 8 tasks completed" in producer.stdout
        assert "result={'delivered_to': 'user0@example.com'}" in producer.stdout

        # The cron example: its entries are stored, and the scheduler fires the demo one.
        declared = subprocess.run(
            [sys.executable, "examples/cron.py"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert declared.returncode == 0, declared.stdout + declared.stderr
        assert "demo-report" in declared.stdout

        def cron_listed() -> str:
            return subprocess.run(
                [sys.executable, "-m", "conveyor_cli", "cron", "list", "--json"],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout

        wait_until_blocking(
            lambda: '"last_run_at": "' in cron_listed(),
            within=60,
            interval=1.0,
            message="the demo cron entry fired",
        )

        # The groups example: the groups wait, and `conveyor group stats` shows them; the
        # full one (max size) reaches the worker's batch handler as one digest.
        grouped = subprocess.run(
            [sys.executable, "examples/groups.py"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert grouped.returncode == 0, grouped.stdout + grouped.stderr
        stats = subprocess.run(
            [sys.executable, "-m", "conveyor_cli", "group", "stats", "digests", "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stats.returncode == 0, stats.stdout + stats.stderr
        assert '"user:grace"' in stats.stdout, stats.stdout
        assert '"user:linus"' in stats.stdout, stats.stdout
        wait_until_blocking(
            lambda: "digest for user:ada: 5 events" in (tmp_path / "worker.log").read_text(),
            within=60,
            interval=POLL_INTERVAL,
            message="the full group reached the batch handler",
        )

        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        assert "email to user0@example.com" in (tmp_path / "worker.log").read_text()
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        os.killpg(dev.pid, signal.SIGINT)
        try:
            code = dev.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(dev.pid, signal.SIGKILL)
            raise
        dev_log.close()
    log = (tmp_path / "dev.log").read_text()
    # Ctrl-C: a clean exit, or the conventional 130 from the `uv run` wrapper.
    assert code in (0, 130), log
    assert "service.stopped name=dev" in log, log
    assert not port_open(nats_port), "the embedded nats-server outlived conveyor dev"
    assert not port_open(port)


@pytest.mark.nats
@pytest.mark.parametrize("broken", [False, True], ids=["as-is", "a-source-fails"])
def test_the_pipeline_example_runs(tmp_path: Path, broken: bool) -> None:
    with dev_server(tmp_path / "dev.log") as target:
        env = {**os.environ, "CONVEYOR_TARGET": target, "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "examples/pipeline.py", *(["--break"] if broken else [])]
        run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = {line.split()[0]: line for line in run.stdout.splitlines() if line.strip()}
    assert "completed" in lines["merge"]
    if broken:
        assert "archived" in run.stdout.splitlines()[1]  # fetch b
        assert "'sources': 1" in lines["merge"]
        assert "daily: 2 rows from 1 sources" in lines["publish"]
    else:
        assert "'sources': 2" in lines["merge"]
        assert "daily: 3 rows from 2 sources" in lines["publish"]
    assert "completed" in lines["audit"]
