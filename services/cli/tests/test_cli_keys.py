"""``conveyor keys``: a new key, the key status, and a rotation that is killed (kill -9,
a real process) midway and run again to completion."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest
from click.testing import CliRunner
from conveyor_broker import SystemClock, TaskListParams
from conveyor_broker.encrypted import EncryptedBroker
from conveyor_broker.keyring import Keyring, generate_key
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_broker.postgres.rotation import DEFAULT_BATCH, key_status
from conveyor_broker.types import NewTask
from conveyor_cli import keys as keys_module
from conveyor_cli.main import cli
from conveyor_testkit.polling import wait_until

OLD = generate_key("old")
NEW = generate_key("new")
ROTATING = f"{OLD},*{NEW}"
TASKS = 3000


def test_a_new_key_parses() -> None:
    made = CliRunner().invoke(cli, ["keys", "new", "--id", "k7"])
    assert made.exit_code == 0, made.output
    assert Keyring.parse(made.output.strip()).primary == "k7"
    bad = CliRunner().invoke(cli, ["keys", "new", "--id", "no spaces"])
    assert bad.exit_code != 0
    assert "invalid key id" in bad.output


def test_the_cli_batch_default_is_the_library_one() -> None:
    assert keys_module.DEFAULT_BATCH == DEFAULT_BATCH


def test_rotate_without_keys_is_a_clear_error(fresh_pg_dsn: str) -> None:
    done = CliRunner().invoke(
        cli, ["keys", "rotate", "--dsn", fresh_pg_dsn], env={"CONVEYOR_ENCRYPTION_KEYS": ""}
    )
    assert done.exit_code == 1
    assert "no encryption keys: set CONVEYOR_ENCRYPTION_KEYS" in done.output


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


async def _fill(dsn: str) -> dict[str, bytes]:
    await migrate(dsn)
    store = await PostgresBroker.connect(dsn, SystemClock(), max_size=2)
    try:
        old = EncryptedBroker(store, Keyring.parse(OLD))
        payloads: dict[str, bytes] = {}
        for start in range(0, TASKS, 1000):
            batch = [
                NewTask("q", "t", payload=b"payload %d" % i, headers={"h": f"v{i}"})
                for i in range(start, start + 1000)
            ]
            for result in await old.enqueue_batch(batch):
                payloads[result.task.id] = result.task.payload
        return payloads
    finally:
        await store.close()


async def _under(dsn: str) -> dict[str | None, int]:
    conn = await asyncpg.connect(dsn)
    try:
        return (await key_status(conn)).task_values()
    finally:
        await conn.close()


async def _others_gone(dsn: str) -> bool:
    """No other session is left on the database (a killed client's backend ends after
    whatever commit it had received)."""
    conn = await asyncpg.connect(dsn)
    try:
        others = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    finally:
        await conn.close()
    return int(others) == 0


@pytest.mark.postgres
async def test_a_rotation_killed_midway_resumes_to_completion(
    fresh_pg_dsn: str, tmp_path: Path
) -> None:
    payloads = await _fill(fresh_pg_dsn)
    assert await _under(fresh_pg_dsn) == {"old": 2 * TASKS}  # payload and header value

    env = {
        **os.environ,
        "CONVEYOR_DSN": fresh_pg_dsn,
        "CONVEYOR_ENCRYPTION_KEYS": ROTATING,
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "conveyor_cli", "keys", "rotate", "--batch-size", "50"]
    log = tmp_path / "first.log"
    first = _start([*command, "--pause", "0.05"], env, log)
    try:
        # Midway: some batches committed, most not.
        async def some_done() -> bool:
            return (await _under(fresh_pg_dsn)).get("new", 0) >= 200 or first.poll() is not None

        await wait_until(some_done, within=120, interval=0.05, message="rotation under way")
        assert first.poll() is None, f"the rotation finished before the kill:\n{log.read_text()}"
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    await wait_until(lambda: _others_gone(fresh_pg_dsn), within=30, message="killed session gone")
    midway = await _under(fresh_pg_dsn)
    assert 0 < midway.get("new", 0) < 2 * TASKS
    assert midway["old"] + midway["new"] == 2 * TASKS  # every value under one key or the other

    # Run again: it goes on from there to the end.
    second = await asyncio.to_thread(
        subprocess.run, command, env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stdout + second.stderr
    left = midway["old"]
    assert (
        f"re-encrypted {left} values in {left // 2} tasks and 0 cron templates under key 'new'"
        in second.stdout
    )
    assert "re-encrypting under new" in second.stderr  # the progress bar
    assert f"{left // 2}/{left // 2}" in second.stderr
    assert await _under(fresh_pg_dsn) == {"new": 2 * TASKS}

    # Every task reads as it was written, with the new key alone.
    store = await PostgresBroker.connect(fresh_pg_dsn, SystemClock(), max_size=2)
    try:
        reader = EncryptedBroker(store, Keyring.parse(NEW))
        read: dict[str, bytes] = {}
        cursor: str | None = None
        while True:
            page = await reader.list_tasks(TaskListParams(limit=1000, cursor=cursor))
            read.update((task.id, task.payload) for task in page.tasks)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    finally:
        await store.close()
    assert read == payloads

    # The status says so, and that the old key can go.
    status = await asyncio.to_thread(
        CliRunner().invoke,
        cli,
        ["keys", "status", "--dsn", fresh_pg_dsn, "--json"],
        env={"CONVEYOR_ENCRYPTION_KEYS": ROTATING},
    )
    assert status.exit_code == 0, status.output
    rows = {row["key"]: row for row in json.loads(status.output)["keys"]}
    assert rows["new"]["task_values"] == 2 * TASKS
    assert rows["new"]["configured"] == "primary"
    assert rows["old"]["task_values"] == 0
    text = await asyncio.to_thread(
        CliRunner().invoke,
        cli,
        ["keys", "status", "--dsn", fresh_pg_dsn],
        env={"CONVEYOR_ENCRYPTION_KEYS": ROTATING},
    )
    assert "key 'old': no task value uses it; it can be dropped" in text.output
    for material in (OLD.partition(":")[2], NEW.partition(":")[2]):
        assert material not in second.stdout + second.stderr + log.read_text() + text.output
