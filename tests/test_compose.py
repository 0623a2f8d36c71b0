"""compose.yaml cannot be run here (no Docker engine), so check what can go wrong in it:
every Conveyor command is a real CLI command, every CONVEYOR_* variable is a real setting
of the service it is given to, the health checks and ports line up, and the TLS wiring
holds: every file it mounts is one scripts/dev-certs writes, the services agree on their
TLS settings, the certificates name the hosts they are reached by, and deploy/nats.conf
with those files is a real TLS server that admits each service's key and no one else."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
import yaml
from click.testing import CliRunner
from conveyor_broker.validation import MAX_HEADER_LEN, MAX_HEADERS
from conveyor_cli.main import cli
from conveyor_runtime.cluster_key import ClusterAuth
from conveyor_runtime.embedded_nats import EmbeddedNats, find_nats_server, free_port
from conveyor_runtime.nats_connect import NatsConnectError, NatsSecurity, close_nats, connect_nats
from conveyor_runtime.ownership import TRANSPORT_ERRORS
from conveyor_runtime.settings import SERVICE_SETTINGS, ApiSettings, CommonSettings, RestSettings
from conveyor_runtime.tls import client_context
from conveyor_runtime.wire import DISPATCH_OVERHEAD
from conveyor_testkit.certs import BEP_NATS_USERS, NATS_CLUSTER_NODES, NATS_USERS, nkey_variable
from conveyor_testkit.polling import wait_until
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from nats import errors as nats_errors

ROOT = Path(__file__).resolve().parent.parent
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
CONVEYOR = {name: svc for name, svc in SERVICES.items() if svc.get("image") == "conveyor:dev"}
#: The Conveyor services that are only gRPC clients of the api (on neither NATS nor
#: Postgres): the REST admin API.
API_CLIENTS = {"rest"}
#: The build-event services (the ingest and its web UI): on NATS and Postgres, but not
#: of the task queue's cluster (no cluster key, nothing encrypted at rest).
BEP = {"bep", "bep-web"}
#: The Conveyor services on NATS and Postgres (migrate: Postgres only).
CLUSTER = {name: svc for name, svc in CONVEYOR.items() if name not in API_CLIENTS | BEP}


#: What the top of compose.yaml says to set for the nats-cluster profile.
CLUSTER_ENV = {
    "COMPOSE_PROFILES": "nats-cluster",
    "CONVEYOR_NATS_URL": "tls://nats-1:4222,tls://nats-2:4222,tls://nats-3:4222",
    "CONVEYOR_NATS_REPLICAS": "3",
}
NATS_NODES = {
    name: svc for name, svc in SERVICES.items() if "nats-cluster" in svc.get("profiles", [])
}


def interpolate(value: object, env: dict[str, str]) -> str:
    """``value`` as compose gives it to a container, with ``env`` as the operator's
    environment: ``${VAR:-default}``, ``${VAR:?message}`` (required) and ``${VAR}``."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op == ":-":
            return arg or ""
        if op == ":?":
            raise KeyError(f"{name} is required: {arg}")
        return ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, str(value))


def settings_for(command: list[str]) -> type[CommonSettings] | type[RestSettings]:
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
        "rest",
        "bep",
        "bep-web",
        "jaeger",
        "prometheus",
        "grafana",
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
    if name in API_CLIENTS:
        # It needs the api only, and the api a migrated database.
        assert service["depends_on"]["api"]["condition"] == "service_healthy"
    elif name == "bep-web":
        # It reads the schema the ingest applies at start.
        assert service["depends_on"]["bep"]["condition"] == "service_healthy"
    else:
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
    for name, service in CLUSTER.items():
        env = service["environment"]
        assert "@postgres:5432/" in env["CONVEYOR_DSN"], name
        if name != "migrate":
            assert interpolate(env["CONVEYOR_NATS_URL"], {}) == "tls://nats:4222", name
            assert interpolate(env["CONVEYOR_NATS_REPLICAS"], {}) == "1", name


def test_the_build_event_services_share_the_stack_over_tls() -> None:
    """The ingest and its web UI: Postgres and NATS as the task queue's services reach
    them (same TLS settings), each with a NATS user of its own, their ports published
    and health-checked, TLS on both; the ingest applies its own schema, the web UI's
    admin token comes from the operator's environment."""
    api = SERVICES["api"]["environment"]
    for name in sorted(BEP):
        env = SERVICES[name]["environment"]
        assert "@postgres:5432/" in env["CONVEYOR_DSN"], name
        for variable in (
            "CONVEYOR_NATS_URL",
            "CONVEYOR_NATS_TLS_CA",
            "CONVEYOR_DB_SSLMODE",
            "CONVEYOR_DB_SSLROOTCERT",
        ):
            assert env[variable] == api[variable], (name, variable)
        assert env["CONVEYOR_NATS_NKEY_SEED"] == f"/tls/{name}.nk"
        assert env["CONVEYOR_TLS_CERT"] == f"/tls/{name}.pem"
        assert env["CONVEYOR_TLS_KEY"] == f"/tls/{name}.key"
        port = env["CONVEYOR_PORT"]
        assert f"{port}:{port}" in SERVICES[name]["ports"]
        check = SERVICES[name]["healthcheck"]["test"]
        assert check[check.index("--port") + 1] == port
        assert env["CONVEYOR_HOST"] == "0.0.0.0"
    assert {Path(SERVICES[n]["environment"]["CONVEYOR_NATS_NKEY_SEED"]).stem for n in BEP} == set(
        BEP_NATS_USERS
    )
    assert SERVICES["bep"]["environment"]["CONVEYOR_AUTO_MIGRATE"] == "true"
    # The CAS sink's blobs: one volume, written by the ingest, read by the web UI.
    root = SERVICES["bep"]["environment"]["CONVEYOR_BEP_BLOB_ROOT"]
    assert SERVICES["bep-web"]["environment"]["CONVEYOR_BEP_BLOB_ROOT"] == root
    assert f"bepblobs:{root}" in SERVICES["bep"]["volumes"]
    assert f"bepblobs:{root}:ro" in SERVICES["bep-web"]["volumes"]
    assert "bepblobs" in COMPOSE["volumes"]
    assert root in (ROOT / "Dockerfile").read_text()  # made in the image, owned by its user
    token = SERVICES["bep-web"]["environment"]["CONVEYOR_BEP_WEB_ADMIN_TOKEN"]
    assert token == "${CONVEYOR_BEP_WEB_ADMIN_TOKEN:-}"


def test_the_rest_service_reaches_the_api_over_tls_and_serves_its_port() -> None:
    """The REST admin API: a client of the api's published gRPC port over TLS with the
    stack's CA, its dashboard port published and health-checked, its sampler's token
    the operator's from the environment (never one written in the file)."""
    rest = SERVICES["rest"]
    env = rest["environment"]
    target = urlsplit(env["CONVEYOR_TARGET"])
    assert (target.scheme, target.hostname) == ("https", "api")
    assert str(target.port) == SERVICES["api"]["environment"]["CONVEYOR_PORT"]
    assert env["CONVEYOR_TLS_CA"] == SERVICES["api"]["environment"]["CONVEYOR_NATS_TLS_CA"]
    port = env["CONVEYOR_REST_PORT"]
    assert f"{port}:{port}" in rest["ports"]
    check = rest["healthcheck"]["test"]
    assert check[check.index("--port") + 1] == port
    assert env["CONVEYOR_REST_HOST"] == "0.0.0.0"
    assert env["CONVEYOR_TOKEN"] == "${CONVEYOR_TOKEN:-}"
    assert float(env["CONVEYOR_SAMPLE_INTERVAL"]) > 0
    assert "CONVEYOR_ALLOW_PLAINTEXT" not in env


def test_webhook_endpoints_call_back_the_api() -> None:
    env = SERVICES["webhook"]["environment"]
    address = env["CONVEYOR_CALLBACK_ADDRESS"]
    assert address.startswith("https://"), "the api speaks TLS: endpoints must too"
    host, _, port = address.removeprefix("https://").rpartition(":")
    assert host == "api", "endpoints reach WebhookService on the api"
    assert port == SERVICES["api"]["environment"]["CONVEYOR_PORT"]


# ------------------------------------------------------------------------------ TLS

DEV_CERTS = ROOT / "scripts" / "dev_certs.py"
#: Where the containers see the folder scripts/dev-certs writes.
TLS_MOUNTS = {"/tls", "/etc/nats/tls"}


def _dev_certs_folder() -> str:
    """scripts/dev_certs.py's default output folder, relative to the repository."""
    spec = importlib.util.spec_from_file_location("dev_certs", DEV_CERTS)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(Path(module.DEFAULT_OUT).relative_to(ROOT))


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """A service's bind mounts: container path -> host path (relative, as written)."""
    mounts: dict[str, str] = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = source.removeprefix("./")
    return mounts


@pytest.fixture(scope="module")
def dev_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What scripts/dev-certs writes, in a folder of this module's own."""
    folder = tmp_path_factory.mktemp("tls")
    assert (
        subprocess.run(
            [sys.executable, str(DEV_CERTS), "--out", str(folder)], capture_output=True
        ).returncode
        == 0
    )
    return folder


def _tls_paths() -> list[tuple[str, str]]:
    """(where, container path) of every file under a TLS mount that compose.yaml or
    deploy/nats.conf names."""
    paths: list[tuple[str, str]] = []
    pattern = re.compile(r"(/(?:etc/nats/)?tls/[\w.-]+)")
    for name, service in SERVICES.items():
        texts = [str(v) for v in (service.get("environment") or {}).values()]
        texts += [str(part) for key in ("command", "entrypoint") for part in service.get(key) or []]
        paths += [(name, found) for text in texts for found in pattern.findall(text)]
    nats_conf = (ROOT / "deploy" / "nats.conf").read_text()
    paths += [("nats.conf", found) for found in pattern.findall(nats_conf)]
    cluster_conf = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    paths += [("nats-cluster.conf", found) for found in pattern.findall(cluster_conf)]
    [include] = re.findall(r'include\s+"([^"]+)"', nats_conf)
    paths.append(("nats.conf include", f"/etc/nats/{include}"))
    return paths


def test_compose_mounts_the_folder_dev_certs_writes() -> None:
    folder = _dev_certs_folder()
    for name in ("postgres", "nats", *NATS_NODES, *CONVEYOR):
        mounts = {t: s for t, s in _mounts(SERVICES[name]).items() if t in TLS_MOUNTS}
        assert list(mounts.values()) == [folder], f"{name} mounts {mounts}, not {folder}"
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert f"{folder}/" in ignored, "generated keys must never be committed"


def test_every_tls_file_compose_names_is_one_dev_certs_writes(dev_certs: Path) -> None:
    written = {p.name for p in dev_certs.iterdir()}
    paths = _tls_paths()
    assert len(paths) > 10
    for where, path in paths:
        if path == "/var/lib/postgresql/server.key":
            continue
        assert Path(path).name in written, f"{where} names {path}, which dev-certs does not write"
    named = {Path(path).name for _, path in paths}
    unused = written - named - {"client.pem", "client.key"}  # for clients, not the stack
    assert not unused, f"dev-certs writes files compose never uses: {sorted(unused)}"


def test_tls_settings_agree_across_services() -> None:
    services = {name: CLUSTER[name]["environment"] for name in CLUSTER if name != "migrate"}
    for variable in (
        "CONVEYOR_NATS_URL",
        "CONVEYOR_NATS_TLS_CA",
        "CONVEYOR_DB_SSLMODE",
        "CONVEYOR_DB_SSLROOTCERT",
    ):
        values = {name: env.get(variable) for name, env in services.items()}
        assert None not in values.values(), (variable, values)
        assert len(set(values.values())) == 1, (variable, values)
    migrate = CONVEYOR["migrate"]["environment"]
    api = SERVICES["api"]["environment"]
    for variable in ("CONVEYOR_DB_SSLMODE", "CONVEYOR_DB_SSLROOTCERT"):
        assert migrate[variable] == api[variable], variable
    assert api["CONVEYOR_DB_SSLMODE"] == "verify-full"
    assert interpolate(api["CONVEYOR_NATS_URL"], {}).startswith("tls://")
    # The api and the services trust one CA, the one that signed the servers' certificates.
    assert api["CONVEYOR_NATS_TLS_CA"] == api["CONVEYOR_DB_SSLROOTCERT"] == "/tls/ca.pem"
    assert api["CONVEYOR_TLS_CERT"]
    assert api["CONVEYOR_TLS_KEY"]
    # One NATS user per service, each with its own key, and exactly those in nats.conf.
    seeds = {name: env["CONVEYOR_NATS_NKEY_SEED"] for name, env in services.items()}
    assert len(set(seeds.values())) == len(seeds), seeds
    assert {Path(seed).stem for seed in seeds.values()} == set(NATS_USERS) == set(services)
    nats_conf = (ROOT / "deploy" / "nats.conf").read_text()
    users = re.findall(
        r"\{\s*nkey:\s*\$(\w+)_NKEY,\s*permissions:\s*\$(\w+)_PERMISSIONS", nats_conf
    )
    assert {f"{user}_NKEY" for user, _ in users} == {
        nkey_variable(u) for u in (*NATS_USERS, *BEP_NATS_USERS)
    }
    assert all(user == permissions for user, permissions in users), users
    # The services share one cluster key, the file dev-certs writes.
    keys = {env.get("CONVEYOR_CLUSTER_KEY_FILE") for env in services.values()}
    assert keys == {"/tls/cluster.key"}, keys
    # And one keyring for encryption at rest: a service without it would store in clear,
    # and could not read what the others stored.
    keyrings = {name: env.get("CONVEYOR_ENCRYPTION_KEYS_FILE") for name, env in services.items()}
    assert set(keyrings.values()) == {"/tls/encryption.key"}, keyrings
    # Postgres serves TLS with the same CA's certificate, and refuses anything else.
    command = " ".join(SERVICES["postgres"]["command"])
    assert "ssl=on" in command
    assert "ssl_cert_file=/tls/postgres.pem" in command
    hba = (ROOT / "deploy" / "postgres" / "pg_hba.conf").read_text()
    assert re.search(r"^hostnossl\s+all\s+all\s+all\s+reject$", hba, re.MULTILINE)


def _sans(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in san.get_values_for_type(x509.DNSName)} | {
        str(v) for v in san.get_values_for_type(x509.IPAddress)
    }


def test_certificates_name_the_hosts_services_connect_to(dev_certs: Path) -> None:
    env = SERVICES["api"]["environment"]
    nats_host = urlsplit(interpolate(env["CONVEYOR_NATS_URL"], {})).hostname
    pg_host = urlsplit(env["CONVEYOR_DSN"]).hostname
    callback = urlsplit(SERVICES["webhook"]["environment"]["CONVEYOR_CALLBACK_ADDRESS"])
    assert nats_host in _sans(dev_certs / "nats.pem")
    assert pg_host in _sans(dev_certs / "postgres.pem")
    assert {callback.hostname, "localhost"} <= _sans(dev_certs / "api.pem")
    rest = urlsplit(SERVICES["rest"]["environment"]["CONVEYOR_TARGET"])
    assert rest.hostname in _sans(dev_certs / "api.pem")
    assert {"rest", "localhost"} <= _sans(dev_certs / "rest.pem")
    # Bazel on the host reaches the ingest as localhost, browsers the web UI likewise.
    assert {"bep", "localhost"} <= _sans(dev_certs / "bep.pem")
    assert {"bep-web", "localhost"} <= _sans(dev_certs / "bep-web.pem")


#: What an operator puts in CONVEYOR_AUTH_TOKENS for `docker compose up` (compose requires it).
OPERATOR_TOKENS = "ops:admin:0123456789abcdef0123"


def _container_env(
    service: dict[str, Any], dev_certs: Path, operator: dict[str, str] | None = None
) -> dict[str, str]:
    """A service's environment as compose gives it, with the operator's environment
    ``operator`` (their tokens, which compose requires, in any case), and its /tls paths
    pointing into ``dev_certs``."""
    given = {"CONVEYOR_AUTH_TOKENS": OPERATOR_TOKENS, **(operator or {})}
    return {
        var: interpolate(value, given).replace("/tls/", f"{dev_certs}/")
        for var, value in (service.get("environment") or {}).items()
    }


@pytest.mark.parametrize("name", sorted(CONVEYOR))
def test_each_service_accepts_its_tls_settings(
    name: str, dev_certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fail-closed checks (no plaintext beyond loopback) pass with compose's settings,
    and every file they name exists once dev-certs ran."""
    monkeypatch.delenv("CONVEYOR_CLUSTER_KEY")  # the test run's: compose names a file
    for var, value in _container_env(CONVEYOR[name], dev_certs).items():
        monkeypatch.setenv(var, value)
    settings = settings_for(CONVEYOR[name]["command"])()
    assert not settings.allow_plaintext
    if name in BEP:
        # TLS on its own port; on NATS with its own key; no cluster key to seal with.
        assert isinstance(settings, CommonSettings)
        assert getattr(settings, "tls_cert", None)
        assert settings.nats_nkey_seed
        return
    if isinstance(settings, RestSettings):
        # The api over TLS, verified against the CA; HTTPS for the browsers.
        assert settings.target.startswith("https://")
        assert settings.tls_ca is not None
        assert settings.rest_tls_cert is not None
        return
    assert not settings.allow_unsigned
    if name != "migrate":
        assert ClusterAuth.from_settings(settings).signs
    if name != "migrate":
        keyring = settings.encryption_keyring()
        assert keyring is not None
        assert keyring.primary == "dev"
    if isinstance(settings, ApiSettings):
        assert settings.tls_cert
        assert settings.tls_key


def _compose_nats_config(dev_certs: Path, tmp_path: Path) -> tuple[Path, str]:
    """deploy/nats.conf with the dev-certs files where compose mounts them (moved under
    ``tmp_path``): the folder the server runs in, and the configuration's text."""
    etc = tmp_path / "etc-nats"
    etc.mkdir()
    (etc / "tls").symlink_to(dev_certs)
    text = (ROOT / "deploy" / "nats.conf").read_text().replace("/etc/nats/", f"{etc}/")
    return etc, text


def test_nats_conf_is_valid_with_the_dev_certs(dev_certs: Path, tmp_path: Path) -> None:
    etc, text = _compose_nats_config(dev_certs, tmp_path)
    config = etc / "conveyor.conf"
    config.write_text(text)
    checked = subprocess.run(
        [find_nats_server(), "-t", "-c", str(config)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr


def test_nats_carries_the_biggest_task_the_api_accepts() -> None:
    """A dispatch carries a task's payload and headers in one NATS message: the nats
    service reads deploy/nats.conf, whose max_payload leaves room for
    CONVEYOR_MAX_PAYLOAD's default plus every header allowed (the next test runs it)."""
    nats = SERVICES["nats"]
    command = nats["command"]
    path = command[command.index("-c") + 1]
    [mount] = [v for v in nats["volumes"] if v.endswith(f":{path}:ro")]
    source = ROOT / mount.split(":")[0]
    [line] = [ln for ln in source.read_text().splitlines() if ln.startswith("max_payload")]
    value = line.split(":", 1)[1].strip()
    assert value.endswith("MB")
    headers = MAX_HEADERS * MAX_HEADER_LEN * 4  # characters, at most 4 bytes each in UTF-8
    needed = ApiSettings.model_fields["max_payload"].default + headers + DISPATCH_OVERHEAD
    assert int(value[:-2]) * 1024 * 1024 >= needed


@pytest.mark.nats
async def test_compose_nats_admits_each_service_over_tls_and_no_one_else(
    dev_certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    etc, text = _compose_nats_config(dev_certs, tmp_path)
    # Run in ``etc``, so that the include resolves as it does in the container.
    with EmbeddedNats(store_dir=str(etc), config=text) as server:
        url = f"tls://127.0.0.1:{server.port}"  # the certificate names 127.0.0.1 as well as nats
        monkeypatch.delenv("CONVEYOR_CLUSTER_KEY")  # the test run's: compose names a file
        for name in ("api", "dispatcher", "maintenance", "webhook"):
            env = _container_env(SERVICES[name], dev_certs)
            for var, value in env.items():
                monkeypatch.setenv(var, value)
            monkeypatch.setenv("CONVEYOR_NATS_URL", url)
            settings = settings_for(SERVICES[name]["command"])()
            assert isinstance(settings, CommonSettings)
            nc = await connect_nats(url, name=name, security=NatsSecurity.from_settings(settings))
            try:
                await nc.publish("conveyor.test", b"hello")
                await nc.flush()
                assert nc.max_payload >= ApiSettings.model_fields["max_payload"].default
            finally:
                await close_nats(nc)
        ca = str(dev_certs / "ca.pem")
        with pytest.raises(NatsConnectError, match="Authorization Violation"):
            await connect_nats(
                url, name="intruder", security=NatsSecurity(tls=client_context(ca=ca))
            )
        with pytest.raises(NatsConnectError, match="not trusted"):
            await connect_nats(
                url,
                name="no-ca",
                security=NatsSecurity(
                    tls=client_context(ca=None), nkey_seed=str(dev_certs / "api.nk")
                ),
            )


# ----------------------------------------------------------- NATS permissions

#: What each service publishes and subscribes to (docs/architecture.md's subject table,
#: as the code does it), as probes: a concrete subject each pattern covers.
PROBES = {
    "wake": "conveyor.q.mail.wake",
    "register": "conveyor.q.mail.register",
    "done": "conveyor.q.mail.done",
    "control": "conveyor.q.mail.control",
    "owner": "conveyor.q.mail.owner",
    "dispatch": "conveyor.gw.gw-1.dispatch",
    "cancel": "conveyor.cancel",
    "promote": "conveyor.promote",
    "watch": "conveyor.watch",
    "roll call": "conveyor.rollcall",
    "holder beat": "conveyor.holder.beat",
    "dispatcher beat": "conveyor.dispatcher.beat",
    "callback": "conveyor.webhook.hooks.callback",
    "events": "conveyor.events.mail.completed",
    "resolve": "conveyor.resolve",
    "cluster nodes": "conveyor.cluster.nodes",
    "other": "conveyor.something-else",
    "owners kv": "$KV.conveyor_owners.mail",
    "leaders kv": "$KV.conveyor_leaders.scheduler",
    "owners stream delete": "$JS.API.STREAM.DELETE.KV_conveyor_owners",
    "leaders stream purge": "$JS.API.STREAM.PURGE.KV_conveyor_leaders",
    "inbox": "_INBOX.someone.1",
}
SUBSCRIBE_ONLY_PROBES = {"everything": "conveyor.>", "every dispatch": "conveyor.gw.*.dispatch"}
MAY_PUBLISH = {
    "api": {
        "wake",
        "register",
        "done",
        "control",
        "cancel",
        "promote",
        "watch",
        "holder beat",
        "callback",
        "events",
        "resolve",
        "cluster nodes",
    },
    "dispatcher": {"dispatch", "owner", "roll call", "dispatcher beat", "events", "owners kv"},
    "maintenance": {"wake", "events", "leaders kv", "resolve"},
    "webhook": {"wake", "register", "done", "events", "leaders kv", "resolve"},
}
MAY_SUBSCRIBE = {
    "api": {
        "dispatch",
        "every dispatch",
        "owner",
        "cancel",
        "watch",
        "roll call",
        "events",
        "inbox",
        "cluster nodes",
    },
    "dispatcher": {
        "wake",
        "register",
        "done",
        "control",
        "owner",
        "watch",
        "dispatcher beat",
        "inbox",
        "cluster nodes",
    },
    "maintenance": {
        "register",
        "promote",
        "watch",
        "holder beat",
        "inbox",
        "resolve",
        "cluster nodes",
    },
    "webhook": {
        "dispatch",
        "every dispatch",
        "owner",
        "cancel",
        "callback",
        "watch",
        "roll call",
        "inbox",
        "cluster nodes",
    },
}


class Errors:
    """The asynchronous errors of one connection (a permission violation is one)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def on_error(self, exc: Exception) -> None:
        self.seen.append(str(exc).lower())

    def reported(self, count: int) -> bool:
        return len(self.seen) >= count

    def violations(self, action: str, subject: str) -> int:
        needle = f'permissions violation for {action} to "{subject.lower()}"'
        return sum(needle in error for error in self.seen)


async def _connect_as(name: str, url: str, dev_certs: Path, errors: Errors) -> Any:
    security = NatsSecurity(
        tls=client_context(ca=str(dev_certs / "ca.pem")), nkey_seed=str(dev_certs / f"{name}.nk")
    )
    return await nats.connect(
        url.split(","),
        name=name,
        error_cb=errors.on_error,
        allow_reconnect=False,
        **security.connect_options(),
    )


async def _check_permissions(
    name: str,
    url: str,
    dev_certs: Path,
    probes: dict[str, str],
    subscribe_only: dict[str, str],
    may_publish: set[str],
    may_subscribe: set[str],
) -> None:
    """Connect as ``name``, publish to every probe and subscribe to every probe and
    subscribe-only probe; exactly those not in ``may_publish`` / ``may_subscribe`` are
    refused."""
    errors = Errors()
    nc = await _connect_as(name, url, dev_certs, errors)
    try:
        for subject in probes.values():
            await nc.publish(subject, b"probe")
        subscribed = {**probes, **subscribe_only}
        for subject in subscribed.values():
            await nc.subscribe(subject)
        await nc.flush()
        # A violation comes back as an asynchronous error, not always before the flush's
        # PONG: wait for as many as are due, then compare.
        denied_publish = {p for p in probes if p not in may_publish}
        denied_subscribe = {p for p in subscribed if p not in may_subscribe}
        due = len(denied_publish) + len(denied_subscribe)
        await wait_until(partial(errors.reported, due), within=10.0)
        refused_publish = {
            p for p, subject in probes.items() if errors.violations("publish", subject)
        }
        refused_subscribe = {
            p for p, subject in subscribed.items() if errors.violations("subscription", subject)
        }
        assert refused_publish == denied_publish, name
        assert refused_subscribe == denied_subscribe, name
        assert len(errors.seen) == due, errors.seen
    finally:
        await nc.close()


@pytest.mark.nats
async def test_each_service_user_may_use_exactly_its_own_subjects(
    dev_certs: Path, tmp_path: Path
) -> None:
    """deploy/nats.conf, run for real: each service's user publishes and subscribes to
    what the subject table gives it, and is refused everything else (forging a
    dispatch, a cancel, a registration or a callback, reading every dispatch, touching
    the other bucket or deleting one)."""
    etc, text = _compose_nats_config(dev_certs, tmp_path)
    with EmbeddedNats(store_dir=str(etc), config=text) as server:
        url = f"tls://127.0.0.1:{server.port}"
        for name in NATS_USERS:
            await _check_permissions(
                name,
                url,
                dev_certs,
                PROBES,
                SUBSCRIBE_ONLY_PROBES,
                MAY_PUBLISH[name],
                MAY_SUBSCRIBE[name],
            )
        # A client without a service's key cannot subscribe to conveyor.> (or anything
        # else): it is not let in at all.
        intruder = Errors()
        with pytest.raises(nats_errors.Error, match="Authorization Violation"):
            await nats.connect(
                url,
                tls=client_context(ca=str(dev_certs / "ca.pem")),
                error_cb=intruder.on_error,
                allow_reconnect=False,
            )


BEP_PROBES = {
    "live": "conveyor.bep.live.7.inv-1",
    "invalidate": "conveyor.bep.keys.invalidate",
    "bep other": "conveyor.bep.something-else",
    "dispatch": PROBES["dispatch"],
    "wake": PROBES["wake"],
    "cancel": PROBES["cancel"],
    "events": PROBES["events"],
    "owners kv": PROBES["owners kv"],
    "inbox": PROBES["inbox"],
}
BEP_MAY_PUBLISH = {"bep": {"live", "invalidate"}, "bep-web": {"invalidate"}}
BEP_MAY_SUBSCRIBE = {"bep": {"invalidate"}, "bep-web": {"live", "every live"}}


@pytest.mark.nats
async def test_the_build_event_users_may_use_only_the_bep_subjects(
    dev_certs: Path, tmp_path: Path
) -> None:
    """The ingest publishes live digests and hears revocations; the web UI hears the
    digests and publishes revocations; neither may touch the task queue's subjects."""
    etc, text = _compose_nats_config(dev_certs, tmp_path)
    with EmbeddedNats(store_dir=str(etc), config=text) as server:
        url = f"tls://127.0.0.1:{server.port}"
        for name in BEP_NATS_USERS:
            await _check_permissions(
                name,
                url,
                dev_certs,
                BEP_PROBES,
                {"every live": "conveyor.bep.live.>", "everything": "conveyor.>"},
                BEP_MAY_PUBLISH[name],
                BEP_MAY_SUBSCRIBE[name],
            )


@pytest.mark.nats
async def test_the_services_do_their_work_under_their_permissions(
    dev_certs: Path, tmp_path: Path
) -> None:
    """Request/reply (a dispatch from the dispatcher's user answered by the api's, a
    webhook callback from the api's answered by the webhook's) and the KV leases of each
    bucket work under the permissions; a user cannot open the other bucket."""
    from conveyor_protos.v1 import cluster_pb2, service_pb2
    from conveyor_runtime.bus import Bus
    from conveyor_runtime.ownership import KeyLease, LeaseKeeper, held_by, open_lease_bucket
    from conveyor_runtime.subjects import Subjects
    from conveyor_testkit.cluster_keys import cluster_auth

    etc, text = _compose_nats_config(dev_certs, tmp_path)
    subjects = Subjects()  # the default prefix, which nats.conf names
    with EmbeddedNats(store_dir=str(etc), config=text) as server:
        url = f"tls://127.0.0.1:{server.port}"
        errors = {name: Errors() for name in NATS_USERS}
        conns = {name: await _connect_as(name, url, dev_certs, errors[name]) for name in NATS_USERS}
        try:
            bus = {name: Bus(nc, subjects, cluster_auth()) for name, nc in conns.items()}
            await bus["api"].serve_dispatch(
                "gw-1", lambda r: cluster_pb2.DispatchReply(accepted=[t.id for t in r.tasks])
            )

            async def answer(cb: cluster_pb2.WebhookCallback) -> cluster_pb2.WebhookCallbackReply:
                return cluster_pb2.WebhookCallbackReply(message=cb.task_id)

            await bus["webhook"].serve_webhook_callbacks("hooks", answer)
            await conns["api"].flush()
            await conns["webhook"].flush()
            request = cluster_pb2.DispatchRequest(queue="mail")
            request.tasks.add(id="t1", queue="mail")
            reply = await bus["dispatcher"].dispatch("gw-1", request, within=5.0)
            assert list(reply.accepted) == ["t1"]
            callback = cluster_pb2.WebhookCallback(worker="hooks", task_id="t2")
            assert (await bus["api"].webhook_callback(callback, within=5.0)).message == "t2"
            # The cluster view: every service answers the api's NodesRequest.
            for name in NATS_USERS:
                await bus[name].serve_nodes(partial(service_pb2.ClusterNode, kind=name))
                await conns[name].flush()

            async def every_kind_answers() -> bool:
                nodes = await bus["api"].gather_nodes(within=0.5)
                return sorted(node.kind for node in nodes) == sorted(NATS_USERS)

            await wait_until(every_kind_answers, within=10.0, message="every kind answers")

            for name, bucket, key in (
                ("dispatcher", subjects.owners_bucket, "mail"),
                ("maintenance", subjects.leaders_bucket, "scheduler"),
                ("webhook", subjects.leaders_bucket, "webhook-manager"),
            ):
                kv = await open_lease_bucket(conns[name], bucket, 2.0)
                lease = KeyLease(kv, key, name)
                assert await lease.claim(), name
                assert await lease.refresh(), name
                await lease.release()
                assert (await lease.holder()) is None, name
            # A dispatcher reads the owners bucket whole to take over a dead one's queues.
            kv = await open_lease_bucket(conns["dispatcher"], subjects.owners_bucket, 2.0)
            dead = KeyLease(kv, "mail", "dead-dispatcher")
            assert await dead.claim()
            found = await held_by(kv, "dead-dispatcher")
            assert found == {"mail": dead.revision}
            assert await LeaseKeeper(kv, "me", 2.0, lambda key: None).take_over(
                "mail", found["mail"]
            )
            await conns["dispatcher"].flush()
            assert errors["dispatcher"].seen == []
            # The other bucket: not even a claim gets through (opening it does not fail:
            # a service starts while NATS cannot make its bucket yet).
            for name, bucket in (
                ("maintenance", subjects.owners_bucket),
                ("dispatcher", subjects.leaders_bucket),
            ):
                kv = await open_lease_bucket(conns[name], bucket, 2.0)
                with pytest.raises(TRANSPORT_ERRORS):
                    await KeyLease(kv, "stolen", name).claim()
            await wait_until(lambda: errors["maintenance"].seen != [], within=5.0)
            for name in ("api", "webhook"):
                assert errors[name].seen == [], (name, errors[name].seen)
        finally:
            for nc in conns.values():
                await nc.close()


# ---------------------------------------------------------- the nats-cluster profile


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_the_nats_cluster_profile_runs_three_nodes_routed_to_each_other() -> None:
    assert sorted(NATS_NODES) == ["nats-1", "nats-2", "nats-3"]
    assert set(NATS_CLUSTER_NODES) == set(NATS_NODES)
    cluster_conf = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    routes = set(re.findall(r"nats-route://([\w-]+):6222", cluster_conf))
    assert routes == set(NATS_NODES)
    assert re.search(r"listen:\s*0\.0\.0\.0:6222", cluster_conf)
    assert 'include "conveyor.conf"' in cluster_conf
    volumes = set()
    for name, node in NATS_NODES.items():
        command = node["command"]
        assert _flag(command, "--server_name") == name
        assert _flag(command, "-c") == "/etc/nats/cluster.conf"
        assert "-js" in command
        mounts = {v.split(":")[1]: v.split(":")[0] for v in node["volumes"]}
        assert mounts["/etc/nats/cluster.conf"] == "./deploy/nats-cluster.conf"
        assert mounts["/etc/nats/conveyor.conf"] == "./deploy/nats.conf"
        volumes.add(mounts[_flag(command, "-sd")])
        assert node["healthcheck"] == SERVICES["nats"]["healthcheck"]
        assert node["restart"] == "unless-stopped"
    assert len(volumes) == 3, "each node keeps its own store"
    assert volumes <= set(COMPOSE["volumes"])
    # Every other service runs in both set-ups.
    for name, service in SERVICES.items():
        if name not in NATS_NODES:
            assert "profiles" not in service, name


def test_the_services_point_at_every_node_with_three_replicas() -> None:
    """What the top of compose.yaml says to set reaches every service as a setting that
    names each node once, with a bucket replica on each."""
    text = (ROOT / "compose.yaml").read_text()
    for var, value in CLUSTER_ENV.items():
        assert f"{var}={value}" in text, var
    for name, service in CLUSTER.items():
        if name == "migrate":
            continue
        operator = {**CLUSTER_ENV, "CONVEYOR_AUTH_TOKENS": OPERATOR_TOKENS}
        env = {var: interpolate(v, operator) for var, v in service["environment"].items()}
        hosts = [urlsplit(url).hostname or "" for url in env["CONVEYOR_NATS_URL"].split(",")]
        assert sorted(hosts) == sorted(NATS_NODES), name
        assert all(url.startswith("tls://") for url in env["CONVEYOR_NATS_URL"].split(","))
        assert int(env["CONVEYOR_NATS_REPLICAS"]) == len(NATS_NODES), name


def test_certificates_name_the_cluster_nodes(dev_certs: Path) -> None:
    # The services reach any node by its name; the nodes route to each other.
    assert set(NATS_NODES) <= _sans(dev_certs / "nats.pem")
    assert set(NATS_NODES) <= _sans(dev_certs / "nats-route.pem")
    route = x509.load_pem_x509_certificate((dev_certs / "nats-route.pem").read_bytes())
    usage = route.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)


@pytest.mark.parametrize("name", sorted(n for n in CLUSTER if n != "migrate"))
def test_each_service_accepts_the_cluster_settings(
    name: str, dev_certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONVEYOR_CLUSTER_KEY")  # the test run's: compose names a file
    for var, value in _container_env(CONVEYOR[name], dev_certs, CLUSTER_ENV).items():
        monkeypatch.setenv(var, value)
    settings = settings_for(CONVEYOR[name]["command"])()
    assert isinstance(settings, CommonSettings)
    assert settings.nats_replicas == 3
    assert settings.nats_url == CLUSTER_ENV["CONVEYOR_NATS_URL"]


def _cluster_node_configs(dev_certs: Path, tmp_path: Path) -> list[tuple[Path, str, list[str]]]:
    """deploy/nats-cluster.conf for three local nodes, as compose runs them, each node
    name turned into a port of localhost: (folder, configuration, extra arguments) each."""
    route_ports = {name: free_port() for name in sorted(NATS_NODES)}
    nodes = []
    for name in sorted(NATS_NODES):
        (tmp_path / name).mkdir()
        etc, conveyor_conf = _compose_nats_config(dev_certs, tmp_path / name)
        (etc / "conveyor.conf").write_text(conveyor_conf)
        text = (ROOT / "deploy" / "nats-cluster.conf").read_text().replace("/etc/nats/", f"{etc}/")
        text = text.replace("0.0.0.0:6222", f"127.0.0.1:{route_ports[name]}")
        for other, port in route_ports.items():
            # A name, as in compose: a node takes a route only from a certificate that
            # names one of its routes' hosts (dev-certs names localhost too).
            text = text.replace(f"{other}:6222", f"localhost:{port}")
        command = NATS_NODES[name]["command"]
        nodes.append((etc, text, ["--server_name", _flag(command, "--server_name")]))
    return nodes


def test_nats_cluster_conf_is_valid_with_the_dev_certs(dev_certs: Path, tmp_path: Path) -> None:
    etc, text, _ = _cluster_node_configs(dev_certs, tmp_path)[0]
    config = etc / "cluster.conf"
    config.write_text(text)
    checked = subprocess.run(
        [find_nats_server(), "-t", "-c", str(config)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr


@pytest.mark.nats
async def test_the_nats_cluster_forms_and_holds_replicated_buckets(
    dev_certs: Path, tmp_path: Path
) -> None:
    """deploy/nats-cluster.conf run for real on three nodes with the dev certificates:
    the routes' mutual TLS holds, JetStream elects its leaders, and the dispatcher's user
    keeps leases in a bucket with a replica on every node."""
    from conveyor_runtime.ownership import KeyLease, open_lease_bucket
    from conveyor_runtime.subjects import Subjects

    subjects = Subjects()
    servers = []
    for path, text, args in _cluster_node_configs(dev_certs, tmp_path):
        servers.append(EmbeddedNats(store_dir=str(path), config=text, args=args))
    try:
        for server in servers:
            server.start()
        url = ",".join(f"tls://127.0.0.1:{server.port}" for server in servers)
        errors = Errors()
        nc = await _connect_as("dispatcher", url, dev_certs, errors)
        try:

            async def opened() -> Any:
                try:
                    kv = await open_lease_bucket(nc, subjects.owners_bucket, 5.0, replicas=3)
                    return await KeyLease(kv, "mail", "d1").claim()
                except TRANSPORT_ERRORS:
                    return False

            await wait_until(opened, within=60, interval=0.5, message="a bucket on 3 nodes")
            info = await nc.jetstream().stream_info(f"KV_{subjects.owners_bucket}")
            assert info.config.num_replicas == 3
            assert info.cluster is not None
            assert len(info.cluster.replicas or []) == 2  # and the leader
        finally:
            await nc.close()
    finally:
        for server in servers:
            server.stop()


def test_prometheus_scrapes_every_services_metrics_port() -> None:
    prometheus = SERVICES["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {
        (name, sd["port"])
        for job in config["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    for name in ("api", "dispatcher", "maintenance", "webhook"):
        port = int(SERVICES[name]["environment"]["CONVEYOR_METRICS_PORT"])
        assert (name, port) in targets, f"prometheus does not scrape {name} on {port}"


# -------------------------------------------------------------------------- Grafana

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD: dict[str, Any] = json.loads((GRAFANA / "dashboards" / "conveyor.json").read_text())


def _queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' and its variables'."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [var["definition"] for var in dashboard["templating"]["list"]]
    return exprs


def test_grafana_reads_prometheus_and_provisions_the_dashboard() -> None:
    grafana = SERVICES["grafana"]
    assert "prometheus" in grafana["depends_on"]
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == "deploy/grafana/provisioning"
    assert (ROOT / mounts["/var/lib/grafana/dashboards"] / "conveyor.json").exists()
    (datasource,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    url = urlsplit(datasource["url"])
    prometheus_port = SERVICES["prometheus"]["ports"][0].split(":")[-1]
    assert (url.hostname, str(url.port)) == ("prometheus", prometheus_port)
    # Every panel and variable uses the provisioned datasource.
    uses = {
        target["datasource"]["uid"]
        for panel in DASHBOARD["panels"]
        for target in panel.get("targets", [])
    } | {var["datasource"]["uid"] for var in DASHBOARD["templating"]["list"]}
    assert uses == {datasource["uid"]}
    (provider,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "conveyor.yml").read_text()
    )["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/var/lib/grafana/dashboards/conveyor.json"


def _known_series() -> set[str]:
    """The series names the services' metrics registry can expose."""
    from conveyor_runtime import metrics  # noqa: F401  (registers every metric)
    from prometheus_client import REGISTRY

    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_count", "_sum"),
        "gauge": ("",),
        "unknown": ("",),
    }
    return {
        family.name + suffix
        for family in REGISTRY.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


def test_every_dashboard_query_names_a_real_metric() -> None:
    known = _known_series()
    used = {name for expr in _queries(DASHBOARD) for name in re.findall(r"conveyor_\w+", expr)}
    assert used, "the dashboard queries nothing"
    assert used <= known, f"not metrics of the services: {sorted(used - known)}"
    # The panels the operator needs are there.
    for series in (
        "conveyor_tasks_enqueued_total",
        "conveyor_tasks_completed_total",
        "conveyor_queue_depth",
        "conveyor_queue_oldest_due_seconds",
        "conveyor_enqueue_to_start_seconds_bucket",
        "conveyor_task_run_seconds_bucket",
        "conveyor_tasks_failed_total",
        "conveyor_type_breaker_state",
        "conveyor_webhook_deliveries_total",
        "conveyor_webhook_breaker_state",
    ):
        assert series in used, f"no panel shows {series}"
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
