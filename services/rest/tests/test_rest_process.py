"""The REST process's own settings and links: RestSettings' fail-closed checks, the REST
server (real uvicorn, in this loop) reaching a real api over mutual TLS and serving
HTTPS itself, its health file, and ``python -m conveyor_rest``'s exit codes."""

from __future__ import annotations

import ssl
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conveyor_api import ApiServer
from conveyor_broker import FakeClock
from conveyor_rest.__main__ import main
from conveyor_rest.health import HealthBeat
from conveyor_rest.link import ApiTarget
from conveyor_rest.serve import start_rest
from conveyor_runtime.health import is_fresh
from conveyor_runtime.nats_connect import connect_nats
from conveyor_runtime.settings import ApiSettings, RestSettings
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.certs import CertAuthority
from conveyor_testkit.webhooks import WEBHOOK_KEY, FakeDns
from pydantic import ValidationError

ADMIN = "rest-admin-secret-0123456789"


@dataclass(frozen=True)
class Pki:
    """A CA and the files issued by it: the api's, the REST port's, a client's."""

    ca: str
    files: dict[str, str]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = CertAuthority("rest test CA")
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    files = {}
    for name, issued in (
        ("api", ca.issue("api", hosts=["localhost", "127.0.0.1"])),
        ("rest", ca.issue("rest", hosts=["localhost", "127.0.0.1"])),
        ("client", ca.issue("client", server=False, client=True)),
    ):
        (tmp_path / f"{name}.pem").write_bytes(issued.cert)
        (tmp_path / f"{name}.key").write_bytes(issued.key)
        files[f"{name}.pem"] = str(tmp_path / f"{name}.pem")
        files[f"{name}.key"] = str(tmp_path / f"{name}.key")
    return Pki(str(tmp_path / "ca.pem"), files)


# ------------------------------------------------------------------- settings


def test_rest_settings_fail_closed(pki: Pki) -> None:
    # Loopback: plaintext is fine (nothing leaves the machine).
    assert RestSettings.from_args([]).target == "127.0.0.1:50051"
    for argv, says in (
        (["--target", "api:50051"], "the api at api without TLS"),
        (["--rest-host", "0.0.0.0"], "plain HTTP on 0.0.0.0"),
        (["--target", "http://api:50051", "--tls-ca", pki.ca], "TLS files are set"),
        (["--target", "https://api:50051/v1"], "has a path"),
        (["--tls-ca", "/no/such/ca.pem"], "cannot read /no/such/ca.pem"),
        (["--tls-client-cert", pki.files["client.pem"]], "go together"),
        (["--rest-tls-cert", pki.files["rest.pem"]], "go together"),
    ):
        with pytest.raises(ValidationError, match=says):
            RestSettings.from_args(argv)
    settings = RestSettings.from_args(
        [
            "--target",
            "https://api:50051",
            "--tls-ca",
            pki.ca,
            "--rest-host",
            "0.0.0.0",
            "--rest-tls-cert",
            pki.files["rest.pem"],
            "--rest-tls-key",
            pki.files["rest.key"],
        ]
    )
    target = ApiTarget.from_settings(settings)
    assert (target.address, target.tls) == ("api:50051", True)
    # Knowingly in clear; a bare host:port with a CA is TLS, as for the CLI and the SDK.
    assert RestSettings.from_args(["--target", "api:1", "--allow-plaintext"]).allow_plaintext
    assert ApiTarget.from_settings(RestSettings.from_args(["--tls-ca", pki.ca])).tls


def test_invalid_settings_exit_2_without_echoing_a_secret(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--target", "api:50051", "--token", "a-secret-value-0123456789"]) == 2
    err = capsys.readouterr().err
    assert "conveyor-rest: invalid settings" in err
    assert "a-secret-value" not in err


# ------------------------------------------------------------ against an api


@pytest.fixture
async def tls_api(nats_url: str, pki: Pki) -> AsyncIterator[ApiServer]:
    """An api on mutual TLS with an admin token."""
    clock = FakeClock()
    broker = CountingBroker(clock)
    nc = await connect_nats(nats_url, name="rest-process-test")
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "nats_url": nats_url,
        "subject_prefix": f"t{uuid.uuid4().hex[:12]}",
        "broker": "memory",
        "register_tick": 60.0,
        "webhook_secret_key": WEBHOOK_KEY,
        "auth_tokens": [f"ops:admin:{ADMIN}"],
        "tls_cert": pki.files["api.pem"],
        "tls_key": pki.files["api.key"],
        "tls_client_ca": pki.ca,
    }
    server = ApiServer(ApiSettings(**options), broker, nc, clock, resolve=FakeDns({}).lookup)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=1.0)
        await nc.close()
        await broker.close()


@pytest.mark.nats
async def test_rest_reaches_a_mutual_tls_api_and_serves_https(
    tls_api: ApiServer, pki: Pki, tmp_path: Path
) -> None:
    settings = RestSettings.from_args(
        [
            "--target",
            f"https://localhost:{tls_api.port}",
            "--tls-ca",
            pki.ca,
            "--tls-client-cert",
            pki.files["client.pem"],
            "--tls-client-key",
            pki.files["client.key"],
        ]
    )
    rest = await start_rest(
        ApiTarget.from_settings(settings),
        "127.0.0.1",
        0,
        sample_interval=0,
        ssl={"ssl_certfile": pki.files["rest.pem"], "ssl_keyfile": pki.files["rest.key"]},
    )
    health = tmp_path / "rest.health"
    beat = HealthBeat(str(health), rest.link.admin, token=ADMIN)
    try:
        assert rest.url.startswith("https://127.0.0.1:")
        admin = {"authorization": f"Bearer {ADMIN}"}
        trust = ssl.create_default_context(cafile=pki.ca)
        async with httpx.AsyncClient(base_url=rest.url, verify=trust, timeout=10) as client:
            made = await client.post("/v1/tasks", json={"type": "t", "queue": "tls"}, headers=admin)
            assert made.status_code == 200, made.text
            me = (await client.get("/v1/whoami", headers=admin)).json()
            assert (me["role"], me["token_name"], me["auth_enabled"]) == ("admin", "ops", True)
            page = await client.get("/ui", headers=admin)
            assert "not sampled" in page.text
        # The api answers: the health file is written.
        assert await beat.check()
        assert is_fresh(str(health), 10.0)
        health.unlink()
        # The api gone: no answer, no health file.
        await tls_api.stop(grace=0.5)
        assert not await beat.check()
        assert not health.exists()
    finally:
        await rest.stop()


@pytest.mark.nats
async def test_a_refusal_is_still_an_answer(tls_api: ApiServer, pki: Pki, tmp_path: Path) -> None:
    """Without a token (or with a bad one) the api refuses, which shows it is up."""
    target = ApiTarget.from_settings(
        RestSettings.from_args(
            [
                "--target",
                f"https://localhost:{tls_api.port}",
                "--tls-ca",
                pki.ca,
                "--tls-client-cert",
                pki.files["client.pem"],
                "--tls-client-key",
                pki.files["client.key"],
            ]
        )
    )
    rest = await start_rest(target, "127.0.0.1", 0, sample_interval=0)
    try:
        beat = HealthBeat(str(tmp_path / "h"), rest.link.admin)
        assert await beat.check()
    finally:
        await rest.stop()
