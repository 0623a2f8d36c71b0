"""`conveyor webhook ...` against a real `conveyor dev` process (gRPC over a socket)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner
from conveyor_cli.main import cli
from conveyor_runtime.embedded_nats import free_port

from tests.e2e.harness import dev_server

SECRET_NEW = "cli-secret-new-1234-0123456789abcdef"
SECRET_OLD = "cli-secret-old-5678-0123456789abcdef"


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with dev_server(tmp_path_factory.mktemp("dev-webhooks") / "dev.log") as address:
        yield address


def run(*args: str, target: str | None = None) -> click.testing.Result:
    argv = list(args) + (["--target", target] if target else [])
    return CliRunner().invoke(
        cli, argv, catch_exceptions=False, env={"CONVEYOR_WEBHOOK_SECRETS": None}
    )


def no_secrets(output: str) -> None:
    assert SECRET_NEW not in output
    assert SECRET_OLD not in output


def test_set_get_list_pause_resume_delete(target: str) -> None:
    made = run(
        "webhook",
        "set",
        "cli-hook",
        "--url",
        "https://hooks.example.com/conveyor",
        "--queue",
        "cli-wh-a=3",
        "--queue",
        "cli-wh-b",
        "--concurrency",
        "5",
        "--timeout",
        "12.5",
        "--secret",
        SECRET_NEW,
        "--secret",
        SECRET_OLD,
        "--paused",
        "--json",
        target=target,
    )
    assert made.exit_code == 0, made.output
    no_secrets(made.output)
    worker = json.loads(made.output)
    assert worker["name"] == "cli-hook"
    assert worker["url"] == "https://hooks.example.com/conveyor"
    assert worker["queues"] == {"cli-wh-a": 3, "cli-wh-b": 1}
    assert (worker["concurrency"], worker["timeout"], worker["paused"]) == (5, 12.5, True)
    assert "secrets" not in worker
    assert worker["created_at"]

    shown = run("webhook", "get", "cli-hook", target=target)
    assert shown.exit_code == 0, shown.output
    no_secrets(shown.output)
    for text in ("cli-hook", "https://hooks.example.com/conveyor", "cli-wh-a=3,cli-wh-b=1"):
        assert text in shown.output
    assert "12.5s" in shown.output

    # Replace without secrets (kept server-side), active this time.
    again = run(
        "webhook",
        "set",
        "cli-hook",
        "--url",
        "https://other.example.com:8443/hook",
        "--queue",
        "cli-wh-a",
        target=target,
    )
    assert again.exit_code == 0, again.output
    assert (
        "webhook worker cli-hook saved (active) -> https://other.example.com:8443/hook"
        in again.output
    )

    table = run("webhook", "list", target=target)
    assert table.exit_code == 0, table.output
    no_secrets(table.output)
    assert "cli-hook" in table.output
    assert "url" in table.output

    assert "paused" in run("webhook", "pause", "cli-hook", target=target).output
    listed = json.loads(run("webhook", "list", "--json", target=target).output)
    [mine] = [w for w in listed if w["name"] == "cli-hook"]
    assert mine["paused"] is True
    assert (mine["concurrency"], mine["timeout"]) == (10, 30.0)
    assert "resumed" in run("webhook", "resume", "cli-hook", target=target).output
    got = json.loads(run("webhook", "get", "cli-hook", "--json", target=target).output)
    assert got["paused"] is False

    deleted = run("webhook", "delete", "cli-hook", "--json", target=target)
    assert json.loads(deleted.output) == {"webhook": "cli-hook", "deleted": True}
    gone = run("webhook", "get", "cli-hook", target=target)
    assert gone.exit_code == 1
    assert "cli-hook" not in [
        w["name"] for w in json.loads(run("webhook", "list", "--json", target=target).output)
    ]


def test_errors_are_one_clear_line_and_a_nonzero_exit(target: str) -> None:
    missing = run("webhook", "get", "cli-nobody", target=target)
    assert missing.exit_code == 1
    assert missing.output.startswith("Error:")
    assert "no webhook worker named 'cli-nobody'" in missing.output
    assert len(missing.output.strip().splitlines()) == 1
    for command in ("pause", "resume", "delete"):
        result = run("webhook", command, "cli-nobody", target=target)
        assert result.exit_code == 1
        assert "cli-nobody" in result.output

    bad_url = run("webhook", "set", "cli-bad", "--url", "ftp://x", "--queue", "q", target=target)
    assert bad_url.exit_code == 1
    assert bad_url.output.startswith("Error:")
    assert "invalid webhook url" in bad_url.output
    assert len(bad_url.output.strip().splitlines()) == 1

    bad_weight = run(
        "webhook",
        "set",
        "cli-bad",
        "--url",
        "https://a.example.com/",
        "--queue",
        "q=0",
        target=target,
    )
    assert bad_weight.exit_code == 1
    assert "weight" in bad_weight.output

    not_a_number = run(
        "webhook",
        "set",
        "cli-bad",
        "--url",
        "https://a.example.com/",
        "--queue",
        "q=lots",
        target=target,
    )
    assert not_a_number.exit_code == 2
    assert "the weight must be an integer" in not_a_number.output

    no_queue = run("webhook", "set", "cli-bad", "--url", "https://a.example.com/", target=target)
    assert no_queue.exit_code == 2
    assert "--queue" in no_queue.output

    names = [w["name"] for w in json.loads(run("webhook", "list", "--json", target=target).output)]
    assert "cli-bad" not in names

    down = run("webhook", "list", target=f"127.0.0.1:{free_port()}")
    assert down.exit_code == 1
    assert down.output.startswith("Error:")


def test_new_secret_prints_a_registrable_standard_secret(target: str) -> None:
    made = run("webhook", "new-secret")
    assert made.exit_code == 0, made.output
    secret = made.output.strip()
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret.removeprefix("whsec_"), validate=True)) == 32
    assert run("webhook", "new-secret").output.strip() != secret
    saved = run(
        "webhook",
        "set",
        "cli-fresh",
        "--url",
        "https://a.example.com/",
        "--queue",
        "cli-fresh",
        "--secret",
        secret,
        "--paused",
        target=target,
    )
    assert saved.exit_code == 0, saved.output
    assert secret not in saved.output
    assert run("webhook", "delete", "cli-fresh", target=target).exit_code == 0


def test_short_secrets_and_forbidden_urls_are_refused_loopback_allowed_in_dev(
    target: str,
) -> None:
    def set_(url: str, *secrets: str) -> click.testing.Result:
        args = ["webhook", "set", "cli-guarded", "--url", url, "--queue", "cli-g", "--paused"]
        for secret in secrets:
            args += ["--secret", secret]
        return run(*args, target=target)

    short = set_("https://a.example.com/", "k")
    assert short.exit_code == 1
    assert "at least 32 bytes" in short.output
    metadata = set_("http://169.254.169.254/latest/meta-data/", SECRET_NEW)
    assert metadata.exit_code == 1
    assert "link-local address" in metadata.output
    private = set_("http://10.0.0.1/hook", SECRET_NEW)
    assert "private address" in private.output
    names = [w["name"] for w in json.loads(run("webhook", "list", "--json", target=target).output)]
    assert "cli-guarded" not in names
    # `conveyor dev` allows endpoints on loopback (local development), by name too.
    for url in ("http://127.0.0.1:8080/hook", "http://localhost:8080/hook"):
        local = set_(url, SECRET_NEW)
        assert local.exit_code == 0, local.output
    assert run("webhook", "delete", "cli-guarded", target=target).exit_code == 0


def test_batch_types_are_set_shown_and_replaced(target: str) -> None:
    args = ("webhook", "set", "cli-batch", "--url", "https://a.example.com/", "--queue", "cli-b")
    made = run(
        *args,
        "--batch-type",
        "digest.send",
        "--batch-type",
        "report.build",
        "--batch-type",
        "digest.send",
        "--paused",
        "--json",
        target=target,
    )
    assert made.exit_code == 0, made.output
    assert json.loads(made.output)["batch_types"] == ["digest.send", "report.build"]
    shown = run("webhook", "get", "cli-batch", target=target)
    assert shown.exit_code == 0, shown.output
    assert "batch types" in shown.output
    assert "digest.send,report.build" in shown.output
    got = json.loads(run("webhook", "get", "cli-batch", "--json", target=target).output)
    assert got["batch_types"] == ["digest.send", "report.build"]
    listed = json.loads(run("webhook", "list", "--json", target=target).output)
    [mine] = [w for w in listed if w["name"] == "cli-batch"]
    assert mine["batch_types"] == ["digest.send", "report.build"]
    table = run("webhook", "list", target=target)
    assert table.exit_code == 0, table.output
    assert "cli-batch" in table.output
    assert "batch" in table.output  # the column (its header wraps in a narrow terminal)

    # Every field is replaced: a set without --batch-type clears them.
    cleared = run(*args, "--paused", "--json", target=target)
    assert cleared.exit_code == 0, cleared.output
    assert json.loads(cleared.output)["batch_types"] == []

    bad = run(*args, "--batch-type", "x" * 257, "--paused", target=target)
    assert bad.exit_code == 1
    assert bad.output.startswith("Error:")
    assert "invalid webhook batch type" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
    empty = run(*args, "--batch-type", "", "--paused", target=target)
    assert empty.exit_code == 1
    assert "invalid webhook batch type" in empty.output
    got = json.loads(run("webhook", "get", "cli-batch", "--json", target=target).output)
    assert got["batch_types"] == []
    assert run("webhook", "delete", "cli-batch", target=target).exit_code == 0
