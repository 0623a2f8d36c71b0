"""The CLI's TLS options: every operator command takes them, their variables are the
client's own (never the api's server certificate), and `conveyor migrate` takes the
services' Postgres TLS settings and refuses a plaintext link beyond the machine.
(The commands against a real TLS api: tests/e2e/test_tls.py.)"""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conveyor_cli.main import cli
from conveyor_cli.ops import connection_options, tls_options


def operator_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += operator_commands(command, (*prefix, name))
        elif any(p.name == "target" for p in command.params):
            found.append((*prefix, name))
    return found


@pytest.mark.parametrize("path", operator_commands(cli), ids=" ".join)
def test_every_operator_command_takes_the_tls_options(path: tuple[str, ...]) -> None:
    help_text = CliRunner().invoke(cli, [*path, "--help"], terminal_width=200).output
    for flag, variable in (
        ("--tls-ca", "CONVEYOR_TLS_CA"),
        ("--tls-cert", "CONVEYOR_TLS_CLIENT_CERT"),
        ("--tls-key", "CONVEYOR_TLS_CLIENT_KEY"),
    ):
        assert flag in help_text, path
        assert variable in help_text, path


def test_tls_options_come_from_flags_or_the_clients_variables(tmp_path: Path) -> None:
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "client.pem", "client.key"))
    for path in (ca, cert, key):
        path.write_text("pem")
    seen: list[dict[str, str]] = []

    def probe(target: str, token: str | None, as_json: bool) -> None:
        seen.append(tls_options())

    command = click.command()(connection_options(probe))
    runner = CliRunner()
    env = {
        "CONVEYOR_TLS_CA": str(ca),
        "CONVEYOR_TLS_CLIENT_CERT": str(cert),
        "CONVEYOR_TLS_CLIENT_KEY": str(key),
        # The api's own server certificate, set in its container: never presented.
        "CONVEYOR_TLS_CERT": "/srv/api.pem",
        "CONVEYOR_TLS_KEY": "/srv/api.key",
    }
    assert runner.invoke(command, [], env=env).exit_code == 0
    assert runner.invoke(command, ["--tls-ca", str(ca)], env={}).exit_code == 0
    assert seen == [
        {"tls_ca": str(ca), "tls_cert": str(cert), "tls_key": str(key)},
        {"tls_ca": str(ca)},
    ]
    missing = runner.invoke(command, ["--tls-ca", str(tmp_path / "nope.pem")])
    assert missing.exit_code == 2
    assert "does not exist" in missing.output


def test_migrate_refuses_plaintext_postgres_beyond_the_machine() -> None:
    result = CliRunner().invoke(cli, ["migrate", "--dsn", "postgresql://u@db.example.com/x"])
    assert result.exit_code == 1
    assert "Postgres at db.example.com with sslmode=prefer" in result.output
    assert "CONVEYOR_ALLOW_PLAINTEXT=true" in result.output
    assert "Traceback" not in result.output


@pytest.mark.postgres
def test_migrate_with_sslmode_require_against_a_server_without_ssl_is_a_clear_error() -> None:
    result = CliRunner().invoke(
        cli,
        [
            "migrate",
            "--dsn",
            "postgresql://postgres@127.0.0.1:5432/postgres",
            "--db-sslmode",
            "require",
        ],
    )
    if result.exit_code == 0:
        pytest.skip("the local PostgreSQL accepts TLS")
    assert "migration failed: cannot connect to Postgres at 127.0.0.1" in result.output
    assert "the server does not accept TLS" in result.output
