"""`conveyor limits ...` against a real `conveyor dev` process (gRPC over a socket)."""

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
    with dev_server(tmp_path_factory.mktemp("dev-limits") / "dev.log") as address:
        yield address


def run(*args: str, target: str | None = None) -> click.testing.Result:
    argv = list(args) + (["--target", target] if target else [])
    return CliRunner().invoke(cli, argv, catch_exceptions=False)


def test_rate_set_list_delete(target: str) -> None:
    made = run("limits", "rate", "set", "cli-calls", "50", "--burst", "5", "--json", target=target)
    assert made.exit_code == 0, made.output
    assert json.loads(made.output) == {"queue": "cli-calls", "per_second": 50.0, "burst": 5}
    plain = run("limits", "rate", "set", "cli-slow", "0.5", target=target)
    assert plain.exit_code == 0, plain.output
    assert "rate limit cli-slow saved: 0.5 a second, burst 1" in plain.output

    listed = run("limits", "rate", "list", target=target)
    assert listed.exit_code == 0, listed.output
    assert "cli-calls" in listed.output
    assert "per second" in listed.output
    rows = json.loads(run("limits", "rate", "list", "--json", target=target).output)
    assert [(r["queue"], r["per_second"], r["burst"]) for r in rows] == [
        ("cli-calls", 50.0, 5),
        ("cli-slow", 0.5, 1),
    ]

    gone = run("limits", "rate", "delete", "cli-calls", target=target)
    assert gone.exit_code == 0, gone.output
    assert "deleted" in gone.output
    assert run("limits", "rate", "delete", "cli-slow", target=target).exit_code == 0
    assert json.loads(run("limits", "rate", "list", "--json", target=target).output) == []


def test_rate_errors_are_one_line_and_non_zero(target: str) -> None:
    missing = run("limits", "rate", "delete", "cli-none", target=target)
    assert missing.exit_code != 0
    assert "cli-none" in missing.output
    bad = run("limits", "rate", "set", "a b", "5", target=target)
    assert bad.exit_code != 0
    assert "queue" in bad.output.lower()
    zero = run("limits", "rate", "set", "cli-calls", "0", target=target)
    assert zero.exit_code != 0
    assert "per_second" in zero.output
    burst = run("limits", "rate", "set", "cli-calls", "5", "--burst", "0", target=target)
    assert burst.exit_code != 0
    assert "burst" in burst.output


def test_concurrency_set_list_delete(target: str) -> None:
    made = run("limits", "concurrency", "set", "cli-keyed", "2", "--json", target=target)
    assert made.exit_code == 0, made.output
    assert json.loads(made.output) == {"queue": "cli-keyed", "per_key": 2, "pattern": "*"}
    vip = run("limits", "concurrency", "set", "cli-keyed", "5", "--pattern", "vip-*", target=target)
    assert vip.exit_code == 0, vip.output
    assert "concurrency limit cli-keyed vip-* saved: 5 at once per key" in vip.output
    assert run("limits", "concurrency", "set", "cli-other", "1", target=target).exit_code == 0

    listed = run("limits", "concurrency", "list", target=target)
    assert listed.exit_code == 0, listed.output
    assert "key pattern" in listed.output
    assert "vip-*" in listed.output
    rows = json.loads(
        run("limits", "concurrency", "list", "--queue", "cli-keyed", "--json", target=target).output
    )
    assert [(r["queue"], r["pattern"], r["per_key"]) for r in rows] == [
        ("cli-keyed", "*", 2),
        ("cli-keyed", "vip-*", 5),
    ]

    gone = run("limits", "concurrency", "delete", "cli-keyed", "--pattern", "vip-*", target=target)
    assert gone.exit_code == 0, gone.output
    assert "deleted" in gone.output
    for queue in ("cli-keyed", "cli-other"):
        assert run("limits", "concurrency", "delete", queue, target=target).exit_code == 0
    assert json.loads(run("limits", "concurrency", "list", "--json", target=target).output) == []


def test_concurrency_errors_are_one_line_and_non_zero(target: str) -> None:
    missing = run("limits", "concurrency", "delete", "cli-none", target=target)
    assert missing.exit_code != 0
    assert "cli-none" in missing.output
    zero = run("limits", "concurrency", "set", "cli-keyed", "0", target=target)
    assert zero.exit_code != 0
    assert "per_key" in zero.output
    pattern = run(
        "limits", "concurrency", "set", "cli-keyed", "1", "--pattern", "x" * 300, target=target
    )
    assert pattern.exit_code != 0
    assert "pattern" in pattern.output
