"""compose.yaml cannot be run here (no Docker engine), so check what can go wrong in it:
every Conveyor command is a real CLI command, every CONVEYOR_* variable is a real setting
of the service it is given to, and the health checks and ports line up."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from conveyor_broker.validation import MAX_HEADER_LEN, MAX_HEADERS
from conveyor_cli.main import cli
from conveyor_runtime.embedded_nats import find_nats_server
from conveyor_runtime.settings import SERVICE_SETTINGS, ApiSettings, CommonSettings
from conveyor_runtime.wire import DISPATCH_OVERHEAD

ROOT = Path(__file__).resolve().parent.parent
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
CONVEYOR = {name: svc for name, svc in SERVICES.items() if svc.get("image") == "conveyor:dev"}


def settings_for(command: list[str]) -> type[CommonSettings]:
    if command[0] == "serve":
        return SERVICE_SETTINGS[command[1]]
    return CommonSettings


def test_the_stack_has_every_part() -> None:
    assert {
        "postgres",
        "nats",
        "migrate",
        "api",
        "dispatcher",
        "maintenance",
        "webhook",
        "jaeger",
    } <= set(SERVICES)
    assert "-js" in SERVICES["nats"]["command"]
    assert (ROOT / "Dockerfile").exists()


@pytest.mark.parametrize("name", sorted(CONVEYOR))
def test_command_is_a_real_cli_command(name: str) -> None:
    command = CONVEYOR[name]["command"]
    result = CliRunner().invoke(cli, [*command, "--help"])
    assert result.exit_code == 0, (
        f"{name}: `conveyor {' '.join(command)}` is not a command:\n{result.output}"
    )


@pytest.mark.parametrize("name", sorted(CONVEYOR))
def test_every_variable_is_a_real_setting(name: str) -> None:
    service = CONVEYOR[name]
    fields = settings_for(service["command"]).model_fields
    env = service.get("environment", {})
    assert env, f"{name} has no environment"
    for var in env:
        assert var.startswith("CONVEYOR_"), f"{name}: {var} is not a Conveyor setting"
        assert var.removeprefix("CONVEYOR_").lower() in fields, f"{name}: {var} is not a setting"


@pytest.mark.parametrize("name", sorted(n for n in CONVEYOR if n != "migrate"))
def test_long_running_services_restart_and_have_health_checks(name: str) -> None:
    service = CONVEYOR[name]
    assert service["restart"] == "unless-stopped"
    check = service["healthcheck"]["test"]
    assert check[:3] == ["CMD", "conveyor", "health"]
    assert CliRunner().invoke(cli, [*check[2:], "--help"]).exit_code == 0
    health_file = check[check.index("--file") + 1]
    assert service["environment"]["CONVEYOR_HEALTH_FILE"] == health_file
    assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_api_port_is_published_and_checked() -> None:
    api = SERVICES["api"]
    port = api["environment"]["CONVEYOR_PORT"]
    assert f"{port}:{port}" in api["ports"]
    check = api["healthcheck"]["test"]
    assert check[check.index("--port") + 1] == port


def test_the_api_refuses_to_start_without_real_tokens() -> None:
    """No token ships in compose.yaml: the api's tokens come from the operator's
    environment, and compose's ``${VAR:?message}`` stops `docker compose up` when it is
    unset or empty, with a message saying what to set."""
    value = SERVICES["api"]["environment"]["CONVEYOR_AUTH_TOKENS"]
    required = re.fullmatch(r"\$\{CONVEYOR_AUTH_TOKENS:\?([^}$]+)\}", value)
    assert required, f"CONVEYOR_AUTH_TOKENS must be required from the environment: {value!r}"
    assert "name:role:secret" in required.group(1)
    assert "change-me" not in (ROOT / "compose.yaml").read_text()
    assert "CONVEYOR_ALLOW_UNAUTHENTICATED" not in SERVICES["api"]["environment"]


def test_services_export_traces_to_the_viewer() -> None:
    ports = SERVICES["jaeger"]["ports"]
    assert "4317:4317" in ports
    for name in ("api", "dispatcher", "maintenance", "webhook"):
        assert SERVICES[name]["environment"]["CONVEYOR_OTLP_ENDPOINT"] == "http://jaeger:4317"


def test_services_reach_postgres_and_nats_by_their_compose_names() -> None:
    for name, service in CONVEYOR.items():
        env = service["environment"]
        assert "@postgres:5432/" in env["CONVEYOR_DSN"], name
        if name != "migrate":
            assert env["CONVEYOR_NATS_URL"] == "nats://nats:4222", name


def test_webhook_endpoints_call_back_the_api() -> None:
    env = SERVICES["webhook"]["environment"]
    host, _, port = env["CONVEYOR_CALLBACK_ADDRESS"].rpartition(":")
    assert host == "api", "endpoints reach WebhookService on the api"
    assert port == SERVICES["api"]["environment"]["CONVEYOR_PORT"]


def test_nats_carries_the_biggest_task_the_api_accepts() -> None:
    """A dispatch carries a task's payload and headers in one NATS message: the nats
    service reads deploy/nats.conf, which nats-server accepts and whose max_payload
    leaves room for CONVEYOR_MAX_PAYLOAD's default plus every header allowed."""
    nats = SERVICES["nats"]
    command = nats["command"]
    path = command[command.index("-c") + 1]
    [mount] = [v for v in nats["volumes"] if v.endswith(f":{path}:ro")]
    source = ROOT / mount.split(":")[0]
    checked = subprocess.run(
        [find_nats_server(), "-t", "-c", str(source)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr
    [line] = [ln for ln in source.read_text().splitlines() if ln.startswith("max_payload")]
    value = line.split(":", 1)[1].strip()
    assert value.endswith("MB")
    headers = MAX_HEADERS * MAX_HEADER_LEN * 4  # characters, at most 4 bytes each in UTF-8
    needed = ApiSettings.model_fields["max_payload"].default + headers + DISPATCH_OVERHEAD
    assert int(value[:-2]) * 1024 * 1024 >= needed
