"""TLS on the api's port, in process: the SDK's blocking and asyncio clients over TLS and
mutual TLS, a renewed certificate served without a restart, a half-written renewal
ignored, and the SDK's TLS arguments and messages."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conveyor import (
    AdminClient,
    AsyncAdminClient,
    AsyncClient,
    Client,
    InvalidArgument,
    Unavailable,
)
from conveyor._channel import endpoint
from conveyor._errors import transport_hint
from conveyor.webhooks import AsyncCallbacks
from conveyor_api import ApiServer
from conveyor_api import tls as api_tls
from conveyor_testkit.certs import CertAuthority, Issued
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import MakeApi

pytestmark = pytest.mark.nats


@dataclass(frozen=True)
class Pki:
    folder: Path
    ca: CertAuthority
    ca_file: str
    client: Issued

    def write(self, name: str, data: bytes) -> str:
        path = self.folder / name
        path.write_bytes(data)
        return str(path)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = CertAuthority("api test CA")
    folder = tmp_path
    (folder / "ca.pem").write_bytes(ca.cert_pem)
    server = ca.issue("api", hosts=["localhost", "127.0.0.1"])
    (folder / "server.pem").write_bytes(server.cert)
    (folder / "server.key").write_bytes(server.key)
    return Pki(folder, ca, str(folder / "ca.pem"), ca.issue("client", server=False, client=True))


async def tls_api(make_api: MakeApi, pki: Pki, *, mutual: bool = False) -> ApiServer:
    return await make_api(
        tls_cert=str(pki.folder / "server.pem"),
        tls_key=str(pki.folder / "server.key"),
        tls_client_ca=pki.ca_file if mutual else None,
    )


async def test_every_client_works_over_tls(make_api: MakeApi, pki: Pki) -> None:
    api = await tls_api(make_api, pki)
    target = f"https://localhost:{api.port}"
    async with AsyncClient(target, tls_ca=pki.ca_file) as client:
        assert client.tls
        task = await client.enqueue("t", {"a": 1}, queue="q")
    async with AsyncAdminClient(target, tls_ca=pki.ca.cert_pem) as admin:
        assert (await admin.get_task(task.id)).payload == {"a": 1}

    def blocking() -> None:
        # tls=True with a plain host:port, the CA as a path-like.
        with Client(f"127.0.0.1:{api.port}", tls=True, tls_ca=Path(pki.ca_file)) as sync:
            assert sync.get_task(task.id).id == task.id
        with AdminClient(target, tls_ca=pki.ca_file) as admin:
            assert [q.name for q in admin.list_queues().queues] == ["q"]

    await asyncio.to_thread(blocking)
    async with AsyncCallbacks(target, tls_ca=pki.ca_file) as callbacks:
        assert callbacks.tls


async def test_mutual_tls_needs_a_client_certificate(make_api: MakeApi, pki: Pki) -> None:
    api = await tls_api(make_api, pki, mutual=True)
    target = f"https://127.0.0.1:{api.port}"
    cert, key = pki.write("client.pem", pki.client.cert), pki.write("client.key", pki.client.key)
    async with AsyncClient(target, tls_ca=pki.ca_file, tls_cert=cert, tls_key=key) as client:
        await client.enqueue("t", queue="q")
    async with AsyncClient(target, tls_ca=pki.ca_file, timeout=5) as anonymous:
        with pytest.raises(Unavailable, match="requires a client certificate"):
            await anonymous.enqueue("t", queue="q")


async def test_a_renewed_certificate_is_served_without_a_restart(
    make_api: MakeApi, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_tls, "RELOAD_CHECK_INTERVAL", 0.0)
    api = await tls_api(make_api, pki)
    target = f"https://127.0.0.1:{api.port}"
    renewed_ca = CertAuthority("renewed CA")
    renewed = renewed_ca.issue("api", hosts=["127.0.0.1"])
    renewed_ca_file = pki.write("renewed-ca.pem", renewed_ca.cert_pem)

    async def answers(ca: str) -> bool:
        async with AsyncClient(target, tls_ca=ca, timeout=5) as client:
            try:
                await client.enqueue("t", queue="q")
            except Unavailable:
                return False
            return True

    assert await answers(pki.ca_file)
    # Half a renewal (a new certificate, the old key): ignored, the old pair still served.
    pki.write("server.pem.new", renewed.cert)
    os.replace(pki.folder / "server.pem.new", pki.folder / "server.pem")
    assert await answers(pki.ca_file)
    # The key follows: the new pair is served to the next connection.
    pki.write("server.key.new", renewed.key)
    os.replace(pki.folder / "server.key.new", pki.folder / "server.key")
    await wait_until(lambda: answers(renewed_ca_file), within=10, message="renewed certificate")
    assert not await answers(pki.ca_file)


async def test_unusable_files_fail_the_start_with_their_names(make_api: MakeApi, pki: Pki) -> None:
    other = pki.ca.issue("other")
    shutil.copy(pki.folder / "server.pem", pki.folder / "mismatch.pem")
    key = pki.write("other.key", other.key)
    with pytest.raises(ValueError, match="TLS files unusable"):
        await make_api(tls_cert=str(pki.folder / "mismatch.pem"), tls_key=key)


def test_sdk_tls_arguments(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(CertAuthority().cert_pem)
    assert endpoint("https://api:50051") == endpoint("api:50051", tls=True)
    assert endpoint("https://api:50051/").address == "api:50051"
    assert not endpoint("api:50051").tls
    assert not endpoint("http://api:50051").tls
    assert endpoint("api:50051", tls_ca=str(ca)).tls  # a TLS file selects TLS
    assert endpoint("api:50051", tls_ca=ca.read_bytes()).root_certificates == ca.read_bytes()
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: endpoint("http://api:1", tls=True), "plaintext"),
        (lambda: endpoint("https://api:1", tls=False), "tls=False"),
        (lambda: endpoint("api:1", tls=False, tls_ca=str(ca)), "tls=False"),
        (lambda: endpoint("api:1", tls_cert=str(ca)), "go together"),
        (lambda: endpoint("api:1", tls_ca="/no/such/ca.pem"), "tls_ca: cannot read"),
        (lambda: endpoint("https://api:1/path"), "has a path"),
    ]
    for bad, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            bad()
    with pytest.raises(InvalidArgument, match="tls_ca: cannot read"):
        AsyncClient("api:1", tls_ca="/no/such/ca.pem")


def test_transport_hints_name_the_side_to_change() -> None:
    closed = (
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1.2.3.4:1: Socket closed"
    )
    assert "if it speaks TLS" in (transport_hint(closed, tls=False) or "")
    assert "client certificate" in (transport_hint(closed, tls=True) or "")
    wrong = "Ssl handshake failed: SSL_ERROR_SSL: error:100000f7:SSL routines:WRONG_VERSION_NUMBER"
    assert "does not speak TLS" in (transport_hint(wrong, tls=True) or "")
    untrusted = "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: certificate has expired: OK"
    assert "(certificate has expired)" in (transport_hint(untrusted, tls=True) or "")
    assert transport_hint("Connection refused", tls=True) is None
