"""The conveyor CLI against a real `conveyor dev` process (gRPC over a socket)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conveyor import Client
from conveyor_broker.postgres.migrations import load_migrations
from conveyor_cli.main import cli
from conveyor_runtime.embedded_nats import free_port
from conveyor_testkit.polling import wait_until_blocking

from tests.e2e.harness import dev_server


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with dev_server(tmp_path_factory.mktemp("dev") / "dev.log") as address:
        yield address


def run(*args: str, target: str | None = None) -> click.testing.Result:
    argv = list(args) + (["--target", target] if target else [])
    return CliRunner().invoke(cli, argv, catch_exceptions=False)


def all_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, command in group.commands.items():
        yield (*prefix, name)
        if isinstance(command, click.Group):
            yield from all_commands(command, (*prefix, name))


@pytest.mark.parametrize("path", list(all_commands(cli)), ids=" ".join)
def test_every_command_has_help(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "usage" in result.output.lower()


def test_enqueue_get_list_and_cancel(target: str) -> None:
    made = run(
        "enqueue",
        "report.build",
        '{"pages": 3}',
        "--queue",
        "cli-a",
        "--process-in",
        "3600",
        "--json",
        target=target,
    )
    assert made.exit_code == 0, made.output
    task = json.loads(made.output)
    assert task["state"] == "scheduled"
    assert task["payload"] == {"pages": 3}

    shown = run("task", "get", task["id"], target=target)
    assert shown.exit_code == 0
    assert task["id"] in shown.output
    assert "report.build" in shown.output

    listed = json.loads(run("task", "list", "--queue", "cli-a", "--json", target=target).output)
    assert [t["id"] for t in listed["tasks"]] == [task["id"]]
    # Payloads are left out of listings unless asked for.
    assert listed["tasks"][0]["payload"] is None
    argv = ("task", "list", "--queue", "cli-a", "--payloads", "--json")
    full = json.loads(run(*argv, target=target).output)
    assert full["tasks"][0]["payload"] == {"pages": 3}

    canceled = run("task", "cancel", task["id"], target=target)
    assert canceled.exit_code == 0
    assert "canceled" in canceled.output
    again = json.loads(run("task", "get", task["id"], "--json", target=target).output)
    assert again["state"] == "canceled"


def test_bulk_enqueue_from_a_file_with_pagination(target: str, tmp_path: Path) -> None:
    lines = [
        json.dumps(
            {"type": "bulk.item", "payload": {"i": i}, "queue": "cli-bulk", "process_in": 3600}
        )
        for i in range(1200)
    ]
    (tmp_path / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    result = run("enqueue", "--file", str(tmp_path / "tasks.jsonl"), target=target)
    assert result.exit_code == 0, result.output
    assert "enqueued 1200 task(s), 0 failed" in result.output

    seen: list[str] = []
    cursor: list[str] = []
    while True:
        page = json.loads(
            run(
                "task",
                "list",
                "--queue",
                "cli-bulk",
                "--limit",
                "500",
                *cursor,
                "--json",
                target=target,
            ).output
        )
        seen += [t["id"] for t in page["tasks"]]
        if not page["next_cursor"]:
            break
        cursor = ["--cursor", page["next_cursor"]]
    assert len(seen) == len(set(seen)) == 1200


def test_a_bad_line_in_a_file_stores_nothing(target: str, tmp_path: Path) -> None:
    good = json.dumps({"type": "x", "queue": "cli-bad"})
    (tmp_path / "bad.jsonl").write_text(f"{good}\n{good}\n{{not json\n")
    result = run("enqueue", "--file", str(tmp_path / "bad.jsonl"), target=target)
    assert result.exit_code == 1
    assert "line 3" in result.output
    stats = json.loads(run("queue", "stats", "cli-bad", "--json", target=target).output)
    assert sum(stats["counts"].values()) == 0


def test_queue_list_stats_pause_resume(target: str) -> None:
    assert (
        run("enqueue", "a.b", "--queue", "cli-q", "--process-in", "3600", target=target).exit_code
        == 0
    )
    assert run("queue", "pause", "cli-q", target=target).exit_code == 0
    stats = json.loads(run("queue", "stats", "cli-q", "--json", target=target).output)
    assert stats["paused"] is True
    assert stats["counts"]["scheduled"] == 1
    table = run("queue", "list", target=target)
    assert "cli-q" in table.output
    assert "yes" in table.output
    assert run("queue", "resume", "cli-q", target=target).exit_code == 0
    assert (
        json.loads(run("queue", "stats", "cli-q", "--json", target=target).output)["paused"]
        is False
    )


def test_errors_are_one_clear_line_and_a_nonzero_exit(target: str) -> None:
    missing = run("task", "get", "01ARZ3NDEKTSV4RRFFQ69G5FAV", target=target)
    assert missing.exit_code == 1
    assert missing.output.startswith("Error:")
    assert "not found" in missing.output
    assert len(missing.output.strip().splitlines()) == 1

    bad = run("enqueue", "x", "--queue", "no spaces allowed", target=target)
    assert bad.exit_code == 1
    assert "queue" in bad.output

    bad_json = run("enqueue", "x", "{oops", target=target)
    assert bad_json.exit_code == 2
    assert "payload is not JSON" in bad_json.output

    down = run("queue", "list", target=f"127.0.0.1:{free_port()}")
    assert down.exit_code == 1
    assert down.output.startswith("Error:")


def test_migrate_applies_then_reports_up_to_date(fresh_pg_dsn: str) -> None:
    first = CliRunner().invoke(cli, ["migrate", "--dsn", fresh_pg_dsn, "--json"])
    assert first.exit_code == 0, first.output
    every = [m.version for m in load_migrations()]
    assert every[:2] == [1, 2]  # the initial schema, then webhook registrations
    assert json.loads(first.output)["applied"] == every
    second = CliRunner().invoke(cli, ["migrate", "--dsn", fresh_pg_dsn])
    assert "up to date" in second.output


@pytest.mark.parametrize(
    ("service", "bad_flag"),
    [
        ("api", "--port=-1"),
        ("dispatcher", "--batch-max=0"),
        ("maintenance", "--reap-tick=0"),
        ("webhook", "--reconcile-tick=-1"),
    ],
)
def test_serve_with_invalid_settings_is_one_message_and_exit_2(service: str, bad_flag: str) -> None:
    done = subprocess.run(
        [str(Path(sys.executable).with_name("conveyor")), "serve", service, bad_flag],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"conveyor-{service}: invalid settings" in done.stderr
    assert "Traceback" not in done.stderr


def test_task_deps_shows_both_ways_and_run_now_overrides(target: str) -> None:
    with Client(target) as client:
        parent = client.enqueue("report.build", {}, queue="cli-deps", process_in=3600)
        child = client.enqueue("report.send", {}, queue="cli-deps", depends_on=[parent.id])
    assert child.state.value == "blocked"

    waits = json.loads(run("task", "deps", child.id, "--json", target=target).output)
    [edge] = waits["dependencies"]
    assert (edge["task_id"], edge["state"], edge["outcome"]) == (parent.id, "scheduled", "open")
    assert waits["dependents"] == []
    waited = json.loads(run("task", "deps", parent.id, "--json", target=target).output)
    assert [e["task_id"] for e in waited["dependents"]] == [child.id]

    # The parent fails for good (canceled): the child (BLOCK) waits for an operator.
    assert run("task", "cancel", parent.id, target=target).exit_code == 0

    def settled() -> bool:
        shown = json.loads(run("task", "deps", child.id, "--json", target=target).output)
        return bool(shown["dependencies"][0]["outcome"] == "failed")

    wait_until_blocking(settled, within=30, interval=0.1, message="the edge failed")
    table = run("task", "deps", child.id, target=target)
    assert table.exit_code == 0
    assert "waits for: 1" in table.output
    assert "failed" in table.output
    ran = run("task", "run-now", child.id, target=target)
    assert ran.exit_code == 0
    assert "pending" in ran.output
