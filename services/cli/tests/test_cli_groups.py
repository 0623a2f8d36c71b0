"""`conveyor group ...` against a real `conveyor dev` process (gRPC over a socket)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner
from conveyor_cli.main import cli

from tests.e2e.harness import dev_server


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with dev_server(tmp_path_factory.mktemp("dev-groups") / "dev.log") as address:
        yield address


def run(*args: str, target: str | None = None) -> click.testing.Result:
    argv = list(args) + (["--target", target] if target else [])
    return CliRunner().invoke(cli, argv, catch_exceptions=False)


def test_set_list_stats_delete(target: str) -> None:
    made = run(
        "group",
        "set",
        "cli-digests",
        "--pattern",
        "user:*",
        "--max-size",
        "20",
        "--max-delay",
        "30",
        "--grace-period",
        "2.5",
        "--json",
        target=target,
    )
    assert made.exit_code == 0, made.output
    assert json.loads(made.output) == {
        "queue": "cli-digests",
        "pattern": "user:*",
        "max_size": 20,
        "max_delay": 30.0,
        "grace_period": 2.5,
    }
    plain = run("group", "set", "cli-digests", target=target)
    assert plain.exit_code == 0, plain.output
    assert "group config cli-digests * saved" in plain.output

    listed = run("group", "list", "--queue", "cli-digests", target=target)
    assert listed.exit_code == 0, listed.output
    assert "user:*" in listed.output
    assert "max delay" in listed.output
    rows = json.loads(run("group", "list", "--json", target=target).output)
    assert [(r["queue"], r["pattern"]) for r in rows] == [
        ("cli-digests", "*"),
        ("cli-digests", "user:*"),
    ]

    stats = run("group", "stats", "cli-digests", "--json", target=target)
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.output) == []
    assert "waiting" in run("group", "stats", target=target).output

    gone = run("group", "delete", "cli-digests", "--pattern", "user:*", target=target)
    assert gone.exit_code == 0, gone.output
    assert "deleted" in gone.output
    assert run("group", "delete", "cli-digests", target=target).exit_code == 0
    assert json.loads(run("group", "list", "--json", target=target).output) == []


def test_errors_are_one_line_and_non_zero(target: str) -> None:
    missing = run("group", "delete", "cli-digests", "--pattern", "nope*", target=target)
    assert missing.exit_code != 0
    assert "nope*" in missing.output
    bad = run("group", "set", "a b", target=target)
    assert bad.exit_code != 0
    assert "queue" in bad.output.lower()
    size = run("group", "set", "cli-digests", "--max-size", "0", target=target)
    assert size.exit_code != 0
    assert "max_size" in size.output
