"""`conveyor token new|check`: making api tokens and checking what an api would load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conveyor_cli.main import cli
from conveyor_runtime.tokens import Role, digest, load_tokens


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("CONVEYOR_AUTH_TOKENS", raising=False)
    monkeypatch.delenv("CONVEYOR_AUTH_TOKENS_FILE", raising=False)
    return CliRunner()


@pytest.mark.parametrize(
    "role", ["admin", "producer", "worker", "worker=emails+reports", "read-only"]
)
def test_new_prints_a_valid_entry_with_a_fresh_secret(runner: CliRunner, role: str) -> None:
    first = runner.invoke(cli, ["token", "new", "ci", "--role", role])
    second = runner.invoke(cli, ["token", "new", "ci", "--role", role])
    assert first.exit_code == 0, first.output
    [token] = load_tokens([first.output.strip()])
    assert token.name == "ci"
    assert token.role_text == role
    secret = first.output.strip().split(":", 2)[2]
    assert len(secret) >= 40
    assert token.secret_digest == digest(secret)
    assert first.output != second.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ci", "--role", "root"], "unknown role"),
        (["ci", "--role", "producer=q"], "only the worker role takes a list of queues"),
        (["bad name", "--role", "admin"], "the name must be"),
    ],
)
def test_new_refuses_a_bad_name_or_role(runner: CliRunner, args: list[str], message: str) -> None:
    result = runner.invoke(cli, ["token", "new", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_check_lists_names_and_roles_never_secrets(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokens"
    path.write_text("# tokens\nmail:worker=emails:mail-secret-0123456789\n")
    monkeypatch.setenv("CONVEYOR_AUTH_TOKENS", "ops:admin:ops-secret-0123456789")
    listed = runner.invoke(cli, ["token", "check", "--file", str(path)])
    assert listed.exit_code == 0, listed.output
    assert listed.output.splitlines() == ["ops   admin", "mail  worker=emails"]
    monkeypatch.setenv("CONVEYOR_AUTH_TOKENS_FILE", str(path))
    as_json = runner.invoke(cli, ["token", "check", "--json"])
    assert json.loads(as_json.output) == [
        {"name": "ops", "role": str(Role.ADMIN)},
        {"name": "mail", "role": "worker=emails"},
    ]
    assert "secret" not in listed.output + as_json.output


def test_check_fails_on_a_bad_entry_without_showing_it(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("ops:admin:ops-secret-0123456789\nlegacy-bare-token-0123456789\n")
    result = runner.invoke(cli, ["token", "check", "--file", str(path)])
    assert result.exit_code == 1
    assert f"tokens file {str(path)!r} line 2 is a bare token" in result.output
    assert "legacy-bare-token-0123456789" not in result.output
    empty = runner.invoke(cli, ["token", "check"])
    assert empty.exit_code == 1
    assert "no tokens" in empty.output
