"""Token roles through real processes: an api reading its tokens from a file, the
`conveyor` CLI presenting role tokens with --token and CONVEYOR_TOKEN, and SDK workers
with a queue-limited worker token."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conveyor_broker import TaskState
from conveyor_broker.postgres import PostgresBroker
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]


async def conveyor(
    *args: str, token: str | None = None, env_token: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the `conveyor` command in its own process (none of this test's CONVEYOR_*
    variables: only what the arguments say)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    if env_token is not None:
        env["CONVEYOR_TOKEN"] = env_token
    argv = [sys.executable, "-m", "conveyor_cli", *args]
    if token is not None:
        argv += ["--token", token]
    return await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, env=env, timeout=60
    )


async def new_token(name: str, role: str) -> tuple[str, str]:
    """`conveyor token new`: the entry for the tokens file, and the secret clients present."""
    made = await conveyor("token", "new", name, "--role", role)
    assert made.returncode == 0, made.stderr
    entry = made.stdout.strip()
    return entry, entry.split(":", 2)[2]


async def test_role_tokens_from_a_file_with_the_cli_and_workers(
    cluster: Cluster, tmp_path: Path, store: PostgresBroker
) -> None:
    made = {
        name: await new_token(name, role)
        for name, role in (
            ("ops", "admin"),
            ("ci", "producer"),
            ("dash", "read-only"),
            ("mailer", "worker=emails"),
        )
    }
    secret = {name: pair[1] for name, pair in made.items()}
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(
        "# the api's tokens\n" + "".join(f"{entry}\n" for entry, _ in made.values())
    )
    checked = await conveyor("token", "check", "--file", str(tokens_file))
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.split() == [
        "ops",
        "admin",
        "ci",
        "producer",
        "dash",
        "read-only",
        "mailer",
        "worker=emails",
    ]
    assert not any(s in checked.stdout for s in secret.values())

    api = await cluster.start_api({"CONVEYOR_AUTH_TOKENS_FILE": str(tokens_file)})
    cluster.start_dispatcher()
    cluster.start_maintenance()
    target = f"127.0.0.1:{api.port}"
    assert "auth.tokens ops=admin ci=producer dash=read-only mailer=worker=emails" in api.log()
    assert not any(s in api.log() for s in secret.values())

    # A producer enqueues (--token) ...
    enqueued = await conveyor(
        "enqueue",
        "e2e.echo",
        '{"n": 1}',
        "--queue",
        "emails",
        "--json",
        "--target",
        target,
        token=secret["ci"],
    )
    assert enqueued.returncode == 0, enqueued.stderr
    task_id = json.loads(enqueued.stdout)["id"]
    # ... and may not administer (CONVEYOR_TOKEN).
    denied = await conveyor("queue", "pause", "emails", "--target", target, env_token=secret["ci"])
    assert denied.returncode == 1
    assert "AdminService.PauseQueue needs role admin; token 'ci' has role producer" in (
        denied.stderr
    )

    # A worker limited to emails serves emails ...
    record = tmp_path / "record.txt"
    cluster.start_worker(
        target,
        queues={"emails": 1},
        concurrency=2,
        record=record,
        env={"CONVEYOR_TOKEN": secret["mailer"]},
    )

    async def completed() -> bool:
        return (await store.get_task(task_id)).state is TaskState.COMPLETED

    await wait_until(completed, within=60, message="the task completes", interval=POLL_INTERVAL)

    # ... and is refused another queue: the worker stops with the reason, it does not retry.
    refused = cluster.start_worker(
        target,
        queues={"emails": 1, "billing": 1},
        concurrency=1,
        record=tmp_path / "refused.txt",
        env={"CONVEYOR_TOKEN": secret["mailer"]},
    )
    await wait_until(
        lambda: not refused.alive(),
        within=60,
        message="the refused worker exits",
        interval=POLL_INTERVAL,
    )
    assert refused.popen is not None
    assert refused.popen.returncode != 0
    assert "may not serve queue 'billing'" in refused.log()
    assert "PermissionDenied" in refused.log()

    # read-only reads, and may not change anything.
    got = await conveyor("task", "get", task_id, "--json", "--target", target, token=secret["dash"])
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["state"] == "completed"
    listed = await conveyor("queue", "list", "--target", target, token=secret["dash"])
    assert listed.returncode == 0, listed.stderr
    refused_delete = await conveyor(
        "task", "cancel", task_id, "--target", target, token=secret["dash"]
    )
    assert refused_delete.returncode == 1
    assert "needs role admin; token 'dash' has role read-only" in refused_delete.stderr

    # admin may.
    paused = await conveyor("queue", "pause", "emails", "--target", target, token=secret["ops"])
    assert paused.returncode == 0, paused.stderr
    assert await store.queue_paused("emails")

    # No token, or the whole entry instead of its secret: unauthenticated.
    for token in (None, made["ops"][0]):
        anonymous = await conveyor("queue", "list", "--target", target, token=token)
        assert anonymous.returncode == 1
        assert "missing or invalid bearer token" in anonymous.stderr
