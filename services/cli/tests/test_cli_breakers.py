"""`conveyor breakers ...` against a real `conveyor dev` process (gRPC over a socket), and
how the open breakers print (in `breakers status` and `queue stats`) from a stand-in
admin client, since only failing workers open breakers on a real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any

import click
import pytest
from click.testing import CliRunner
from conveyor import Breaker, BreakerScope, BreakerState, QueueInfo, TaskState
from conveyor_cli import breakers, ops
from conveyor_cli.main import cli

from tests.e2e.harness import dev_server

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with dev_server(tmp_path_factory.mktemp("dev-breakers") / "dev.log") as address:
        yield address


def run(*args: str, target: str | None = None) -> click.testing.Result:
    argv = list(args) + (["--target", target] if target else [])
    return CliRunner(env={"COLUMNS": "200"}).invoke(cli, argv, catch_exceptions=False)


def test_set_list_delete(target: str) -> None:
    made = run(
        "breakers",
        "set",
        "cli-pay",
        "--failures",
        "5",
        "--window",
        "60",
        "--cooldown",
        "30",
        "--json",
        target=target,
    )
    assert made.exit_code == 0, made.output
    assert json.loads(made.output) == {
        "queue": "cli-pay",
        "pattern": "*",
        "failures": 5,
        "window": 60.0,
        "cooldown": 30.0,
        "scope": "worker",
    }
    charge = run(
        "breakers",
        "set",
        "cli-pay",
        "--failures",
        "2",
        "--window",
        "10",
        "--cooldown",
        "0.5",
        "--pattern",
        "pay.*",
        "--scope",
        "queue",
        target=target,
    )
    assert charge.exit_code == 0, charge.output
    assert (
        "breaker config cli-pay pay.* saved: 2 failures in 10s open it for 0.5s, scope queue"
        in charge.output
    )
    other = ("--failures", "1", "--window", "1", "--cooldown", "1")
    assert run("breakers", "set", "cli-other", *other, target=target).exit_code == 0

    listed = run("breakers", "list", target=target)
    assert listed.exit_code == 0, listed.output
    assert "type pattern" in listed.output
    assert "pay.*" in listed.output
    assert "cli-other" in listed.output
    rows = json.loads(run("breakers", "list", "--queue", "cli-pay", "--json", target=target).output)
    assert [(r["queue"], r["pattern"], r["failures"], r["scope"]) for r in rows] == [
        ("cli-pay", "*", 5, "worker"),
        ("cli-pay", "pay.*", 2, "queue"),
    ]

    assert json.loads(run("breakers", "status", "--json", target=target).output) == []
    assert "no circuit breaker is open" in run("breakers", "status", target=target).output

    gone = run("breakers", "delete", "cli-pay", "--pattern", "pay.*", target=target)
    assert gone.exit_code == 0, gone.output
    assert "breaker config cli-pay pay.* deleted" in gone.output
    for queue in ("cli-pay", "cli-other"):
        assert run("breakers", "delete", queue, "--json", target=target).exit_code == 0
    assert json.loads(run("breakers", "list", "--json", target=target).output) == []


def test_errors_are_one_line_and_non_zero(target: str) -> None:
    missing = run("breakers", "delete", "cli-none", "--pattern", "pay.*", target=target)
    assert missing.exit_code != 0
    assert "cli-none" in missing.output
    assert "pay.*" in missing.output
    good = ("--failures", "3", "--window", "60", "--cooldown", "30")
    assert run("breakers", "set", "cli-kept", *good, target=target).exit_code == 0
    for args, says in (
        (("a b", *good), "queue"),
        (("cli-kept", "--failures", "0", "--window", "60", "--cooldown", "30"), "failures"),
        (("cli-kept", "--failures", "3", "--window", "0.5", "--cooldown", "30"), "window"),
        (("cli-kept", "--failures", "3", "--window", "60", "--cooldown", "0.01"), "cooldown"),
        (("cli-kept", *good, "--pattern", "x" * 300), "pattern"),
    ):
        bad = run("breakers", "set", *args, target=target)
        assert bad.exit_code != 0, args
        assert says in bad.output, bad.output
        assert "Traceback" not in bad.output
    # A flag click checks itself: the scopes there are.
    scope = run("breakers", "set", "cli-kept", *good, "--scope", "everyone", target=target)
    assert scope.exit_code != 0
    assert "worker" in scope.output
    required = run("breakers", "set", "cli-kept", "--failures", "3", target=target)
    assert required.exit_code != 0
    assert "--window" in required.output
    # Nothing refused changed what is stored.
    rows = json.loads(
        run("breakers", "list", "--queue", "cli-kept", "--json", target=target).output
    )
    assert [(r["failures"], r["window"], r["cooldown"]) for r in rows] == [(3, 60.0, 30.0)]
    assert run("breakers", "delete", "cli-kept", target=target).exit_code == 0


OPEN = Breaker(
    queue="pay",
    type="pay.charge",
    scope=BreakerScope.WORKER,
    state=BreakerState.OPEN,
    opened_at=T0,
    until=T0 + timedelta(seconds=30),
    failures=5,
    gateway="gw-1",
    worker_id="worker-7",
)
HALF_OPEN = Breaker(
    queue="pay",
    type="pay.refund",
    scope=BreakerScope.QUEUE,
    state=BreakerState.HALF_OPEN,
    opened_at=T0,
    until=T0 + timedelta(seconds=90),
    failures=3,
)


class StandIn:
    """The few AdminClient calls these commands make, with open breakers."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, Any]] = []

    def __enter__(self) -> StandIn:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def list_breakers(self, queue: str | None = None) -> list[Breaker]:
        self.asked.append(("list_breakers", queue))
        return [OPEN, HALF_OPEN]

    def queue_stats(self, queue: str) -> QueueInfo:
        self.asked.append(("queue_stats", queue))
        breakers = [OPEN, HALF_OPEN] if queue == "pay" else []
        return QueueInfo(queue, False, {TaskState.PENDING: 4}, breakers)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandIn:
    admin = StandIn()
    for module in (breakers, ops):
        monkeypatch.setattr(module, "admin_client", lambda target, token: admin)
    return admin


def cells(line: str) -> list[str]:
    """The words of a table row, without rich's column rules."""
    return line.translate(str.maketrans("│┃", "  ")).split()


def test_status_shows_each_open_breaker(stand_in: StandIn) -> None:
    shown = run("breakers", "status", "--queue", "pay")
    assert shown.exit_code == 0, shown.output
    header = cells(shown.output.splitlines()[0])
    assert header == ["queue", "type", "scope", "worker", "state", "until", "failures"]
    charge = next(line for line in shown.output.splitlines() if "pay.charge" in line)
    until = ["2030-01-02", "03:04:35"]
    assert cells(charge) == ["pay", "pay.charge", "worker", "worker-7", "open", *until, "5"]
    refund = next(line for line in shown.output.splitlines() if "pay.refund" in line)
    until = ["2030-01-02", "03:05:35"]
    assert cells(refund) == ["pay", "pay.refund", "queue", "-", "half_open", *until, "3"]
    rows = json.loads(run("breakers", "status", "--json").output)
    assert rows[0] == {
        "queue": "pay",
        "type": "pay.charge",
        "scope": "worker",
        "state": "open",
        "opened_at": T0.isoformat(),
        "until": (T0 + timedelta(seconds=30)).isoformat(),
        "failures": 5,
        "gateway": "gw-1",
        "worker_id": "worker-7",
    }
    assert (rows[1]["gateway"], rows[1]["worker_id"], rows[1]["state"]) == (
        None,
        None,
        "half_open",
    )
    assert stand_in.asked == [("list_breakers", "pay"), ("list_breakers", None)]


def test_queue_stats_show_the_queues_breakers(stand_in: StandIn) -> None:
    shown = run("queue", "stats", "pay")
    assert shown.exit_code == 0, shown.output
    assert "circuit breakers" in shown.output
    assert "pay.charge" in shown.output
    assert "worker-7" in shown.output
    assert "half_open" in shown.output
    quiet = run("queue", "stats", "quiet")
    assert quiet.exit_code == 0, quiet.output
    assert "circuit breakers: none open" in quiet.output
    stats = json.loads(run("queue", "stats", "pay", "--json").output)
    assert stats["counts"] == {"pending": 4}
    assert [(b["type"], b["state"]) for b in stats["breakers"]] == [
        ("pay.charge", "open"),
        ("pay.refund", "half_open"),
    ]
