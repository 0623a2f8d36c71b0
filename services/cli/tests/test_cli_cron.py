"""`conveyor cron ...` against a real `conveyor dev` process (gRPC over a socket), whose
scheduler fires the entries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conveyor_cli.main import cli
from conveyor_testkit.polling import wait_until_blocking

from tests.e2e.harness import dev_server


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with dev_server(tmp_path_factory.mktemp("dev-cron") / "dev.log") as address:
        yield address


def run(*args: str, target: str | None = None) -> click.testing.Result:
    argv = list(args) + (["--target", target] if target else [])
    return CliRunner().invoke(cli, argv, catch_exceptions=False)


def test_set_get_list_pause_resume_trigger_delete(target: str) -> None:
    made = run(
        "cron",
        "set",
        "cli-nightly",
        "--schedule",
        "30 2 * * *",
        "--timezone",
        "Europe/Berlin",
        "--type",
        "report.build",
        "--payload",
        '{"kind": "daily"}',
        "--queue",
        "cli-cron-reports",
        "--misfire",
        "skip",
        "--header",
        "tenant=acme",
        "--max-retry",
        "2",
        "--json",
        target=target,
    )
    assert made.exit_code == 0, made.output
    entry = json.loads(made.output)
    assert entry["name"] == "cli-nightly"
    assert entry["schedule"] == "30 2 * * *"
    assert entry["timezone"] == "Europe/Berlin"
    assert entry["misfire"] == "skip"
    assert entry["task"]["payload"] == {"kind": "daily"}
    assert entry["task"]["queue"] == "cli-cron-reports"
    assert entry["task"]["headers"] == {"tenant": "acme"}
    assert entry["next_run_at"]

    shown = run("cron", "get", "cli-nightly", target=target)
    assert shown.exit_code == 0, shown.output
    for text in (
        "cli-nightly",
        "30 2 * * *",
        "Europe/Berlin",
        "report.build",
        "skip",
        "tenant=acme",
    ):
        assert text in shown.output

    listed = run("cron", "list", target=target)
    assert listed.exit_code == 0, listed.output
    assert "schedule" in listed.output
    [row] = json.loads(run("cron", "list", "--json", target=target).output)
    assert (row["name"], row["task"]["queue"]) == ("cli-nightly", "cli-cron-reports")

    paused = run("cron", "pause", "cli-nightly", target=target)
    assert paused.exit_code == 0, paused.output
    assert json.loads(run("cron", "get", "cli-nightly", "--json", target=target).output)["paused"]
    assert "paused" in run("cron", "get", "cli-nightly", target=target).output

    triggered = run("cron", "trigger", "cli-nightly", "--json", target=target)
    assert triggered.exit_code == 0, triggered.output
    task = json.loads(triggered.output)
    assert task["queue"] == "cli-cron-reports"
    assert task["headers"]["conveyor-cron-slot"] == "manual"

    resumed = run("cron", "resume", "cli-nightly", target=target)
    assert resumed.exit_code == 0, resumed.output
    assert "next 20" in resumed.output

    deleted = run("cron", "delete", "cli-nightly", target=target)
    assert deleted.exit_code == 0, deleted.output
    missing = run("cron", "get", "cli-nightly", target=target)
    assert missing.exit_code == 1
    assert "no cron entry named 'cli-nightly'" in missing.output


def test_bad_entries_get_one_clear_line(target: str) -> None:
    never = run(
        "cron", "set", "cli-never", "--schedule", "0 0 31 2 *", "--type", "t", target=target
    )
    assert never.exit_code == 1
    assert "never fires" in never.output
    zone = run(
        "cron",
        "set",
        "cli-zone",
        "--schedule",
        "@daily",
        "--type",
        "t",
        "--timezone",
        "X/Y",
        target=target,
    )
    assert zone.exit_code == 1
    assert "unknown time zone" in zone.output
    payload = run(
        "cron",
        "set",
        "cli-p",
        "--schedule",
        "@daily",
        "--type",
        "t",
        "--payload",
        "{",
        target=target,
    )
    assert payload.exit_code == 2
    assert "payload is not JSON" in payload.output


def test_apply_a_file_twice_and_watch_it_fire(target: str, tmp_path: Path) -> None:
    file = tmp_path / "cron.toml"
    file.write_text(
        """
[[cron]]
name = "cli-ticker"
schedule = "@every 1s"
type = "tick"
queue = "cli-cron-ticks"
payload = { n = 1 }

[[cron]]
name = "cli-daily"
schedule = "@daily"
type = "cleanup"
timezone = "Asia/Tokyo"
misfire = "skip"
""",
        encoding="utf-8",
    )
    applied = run("cron", "apply", str(file), "--json", target=target)
    assert applied.exit_code == 0, applied.output
    entries = json.loads(applied.output)
    assert [e["name"] for e in entries] == ["cli-ticker", "cli-daily"]
    again = json.loads(run("cron", "apply", str(file), "--json", target=target).output)
    assert again[1]["next_run_at"] == entries[1]["next_run_at"]

    def fired() -> bool:
        listed = run("task", "list", "--queue", "cli-cron-ticks", "--json", target=target)
        return len(json.loads(listed.output)["tasks"]) >= 2

    wait_until_blocking(fired, within=60, message="the ticker fired twice")
    shown = json.loads(run("cron", "get", "cli-ticker", "--json", target=target).output)
    assert shown["last_run_at"]
    assert run("cron", "pause", "cli-ticker", target=target).exit_code == 0

    as_json = tmp_path / "cron.json"
    as_json.write_text(json.dumps([{"name": "cli-j", "schedule": "@hourly", "type": "t"}]))
    assert run("cron", "apply", str(as_json), target=target).exit_code == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "cli-b", "schedule": "@hourly", "type": "t", "x": 1}]))
    refused = run("cron", "apply", str(bad), target=target)
    assert refused.exit_code == 1
    assert "unknown keys x" in refused.output
