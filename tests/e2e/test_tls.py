"""TLS on the api's port, end to end through real processes: an api serving TLS (and
mutual TLS), a dispatcher, a maintenance and a webhook service process, an SDK worker
process, the SDK's producer and admin clients, a webhook endpoint's callbacks, and the
CLI; and what a client that does not match the server is told."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from conveyor import AsyncAdminClient, AsyncClient, TaskState, Unavailable
from conveyor.webhooks import AsyncCallbacks
from conveyor_runtime.embedded_nats import free_port
from conveyor_testkit.certs import CertAuthority
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import Endpoint, rpc

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster, conveyor_cli, port_open
from tests.e2e.lifecycle import wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]
#: A webhook signing secret (at least 32 bytes).
TLS_SECRET = "tls-hook-secret-0123456789abcdefg"


@dataclass(frozen=True)
class Certs:
    """PEM files: a CA, the api's certificate, a client certificate it signed, and a
    client certificate of another CA."""

    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str
    stranger_cert: str
    stranger_key: str
    stranger_ca: str


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    folder = tmp_path_factory.mktemp("certs")
    ca, stranger = CertAuthority("e2e CA"), CertAuthority("another CA")
    files = {
        "ca": ca.cert_pem,
        "stranger_ca": stranger.cert_pem,
    }
    server = ca.issue("api", hosts=["localhost", "127.0.0.1"])
    client = ca.issue("e2e-client", server=False, client=True)
    intruder = stranger.issue("intruder", server=False, client=True)
    files |= {"cert": server.cert, "key": server.key}
    files |= {"client_cert": client.cert, "client_key": client.key}
    files |= {"stranger_cert": intruder.cert, "stranger_key": intruder.key}
    for name, data in files.items():
        (folder / f"{name}.pem").write_bytes(data)
    return Certs(**{name: str(folder / f"{name}.pem") for name in files})


async def start_tls_stack(cluster: Cluster, certs: Certs, *, mutual: bool) -> tuple[str, int]:
    """api (TLS, ``mutual``: client certificates required), dispatcher, maintenance and a
    webhook service that sends the api's https:// address as the callback."""
    env = {"CONVEYOR_TLS_CERT": certs.cert, "CONVEYOR_TLS_KEY": certs.key}
    if mutual:
        env["CONVEYOR_TLS_CLIENT_CA"] = certs.ca
    cluster.settings_env["CONVEYOR_LEASE_TTL"] = "10"
    api = await cluster.start_api(env)
    assert api.port is not None
    target = f"https://127.0.0.1:{api.port}"
    cluster.start_dispatcher()
    cluster.start_maintenance()
    cluster.start_webhook({"CONVEYOR_CALLBACK_ADDRESS": target, "CONVEYOR_RECONCILE_TICK": "0.2"})
    await wait_until(
        lambda: f"tls={'mutual' if mutual else 'on'}" in api.log(),
        message="api tls line",
        within=30,
        interval=POLL_INTERVAL,
    )
    return target, api.port


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
async def test_a_session_over_tls_end_to_end(
    cluster: Cluster, certs: Certs, tmp_path: Path, mutual: bool
) -> None:
    target, port = await start_tls_stack(cluster, certs, mutual=mutual)
    cert, key = (certs.client_cert, certs.client_key) if mutual else (None, None)
    record = tmp_path / "record.txt"
    worker_tls = {"ca": certs.ca} | (
        {"cert": certs.client_cert, "key": certs.client_key} if mutual else {}
    )
    cluster.start_worker(target, queues={"tls": 1}, concurrency=4, record=record, tls=worker_tls)
    async with (
        AsyncClient(target, tls_ca=certs.ca, tls_cert=cert, tls_key=key) as client,
        AsyncAdminClient(target, tls_ca=certs.ca, tls_cert=cert, tls_key=key) as admin,
        Endpoint(answer=rpc("accepted")) as endpoint,
    ):
        # Producer -> api -> dispatcher -> the worker process, all over TLS to the api.
        task = await client.enqueue("e2e.echo", {"n": 1}, queue="tls")
        done = await wait_state(admin, task.id, TaskState.COMPLETED, within=30)
        assert done.result == {"n": 1}
        assert any(line[:2] == ["done", task.id] for line in read_record(record))
        assert {q.name for q in (await admin.list_queues()).queues} >= {"tls"}

        # A webhook delivery answered "accepted", finished through the callbacks.
        await admin.upsert_webhook_worker(
            "tls-hook", endpoint.url, {"hooks": 1}, secrets=[TLS_SECRET]
        )
        hooked = await client.enqueue("report.build", {"m": 1}, queue="hooks")
        await wait_until(
            lambda: len(endpoint.deliveries) == 1,
            message="webhook delivery",
            within=30,
            interval=POLL_INTERVAL,
        )
        params = endpoint.deliveries[0].call["params"]
        assert params["callback"] == target
        async with AsyncCallbacks(
            params["callback"], tls_ca=certs.ca, tls_cert=cert, tls_key=key
        ) as callbacks:
            assert await callbacks.heartbeat(params["lease_token"], progress={"p": 1})
            await callbacks.report_result(params["lease_token"], "success", result={"ok": 1})
        finished = await admin.get_task(hooked.id)
        assert finished.state is TaskState.COMPLETED
        assert finished.result == {"ok": 1}

    # The CLI, with its TLS flags (and plain host:port: the CA file alone selects TLS).
    cli_tls = ["--tls-ca", certs.ca]
    if mutual:
        cli_tls += ["--tls-cert", certs.client_cert, "--tls-key", certs.client_key]
    code, out, err = await conveyor_cli(
        "queue", "list", "--json", "--target", f"127.0.0.1:{port}", *cli_tls
    )
    assert code == 0, err
    assert '"tls"' in out

    # A plaintext client gets told the server may speak TLS.
    async with AsyncClient(f"127.0.0.1:{port}", timeout=5) as plain:
        with pytest.raises(Unavailable, match=r"if it speaks TLS, use an 'https://host:port'"):
            await plain.get_task(task.id)
    # A client that does not trust the api's CA is told so.
    async with AsyncClient(target, tls_ca=certs.stranger_ca, timeout=5) as untrusting:
        with pytest.raises(Unavailable, match="certificate is not trusted"):
            await untrusting.get_task(task.id)
    code, _, err = await conveyor_cli("queue", "list", "--target", target)
    assert code != 0
    assert "not trusted" in err, err


async def test_mutual_tls_refuses_a_client_without_a_certificate_of_its_ca(
    cluster: Cluster, certs: Certs
) -> None:
    target, _ = await start_tls_stack(cluster, certs, mutual=True)
    async with AsyncClient(target, tls_ca=certs.ca, timeout=5) as anonymous:
        with pytest.raises(Unavailable, match="pass tls_cert= and tls_key="):
            await anonymous.get_task("01J0000000000000000000000")
    async with AsyncClient(
        target,
        tls_ca=certs.ca,
        tls_cert=certs.stranger_cert,
        tls_key=certs.stranger_key,
        timeout=5,
    ) as stranger:
        with pytest.raises(Unavailable):
            await stranger.get_task("01J0000000000000000000000")
    async with AsyncAdminClient(
        target, tls_ca=certs.ca, tls_cert=certs.client_cert, tls_key=certs.client_key
    ) as admin:
        assert list((await admin.list_queues()).queues) == []


async def test_a_tls_client_of_a_plaintext_server_is_told_so(
    cluster: Cluster, certs: Certs
) -> None:
    api = await cluster.start_api()
    async with AsyncClient(f"https://127.0.0.1:{api.port}", tls_ca=certs.ca, timeout=5) as client:
        with pytest.raises(Unavailable, match="the server does not speak TLS"):
            await client.get_task("01J0000000000000000000000")


async def test_the_api_refuses_a_plaintext_port_beyond_loopback_unless_told(
    cluster: Cluster,
) -> None:
    port = free_port()
    refused = cluster.spawn(
        "api", ["-m", "conveyor_api"], {"CONVEYOR_HOST": "0.0.0.0", "CONVEYOR_PORT": str(port)}
    )
    await wait_until(
        lambda: not refused.alive(),
        message="api refusing to start",
        within=30,
        interval=POLL_INTERVAL,
    )
    assert refused.popen is not None
    assert refused.popen.returncode == 2
    assert "no TLS certificate for the gRPC port on 0.0.0.0" in refused.log()
    assert "CONVEYOR_ALLOW_PLAINTEXT=true" in refused.log()

    allowed = cluster.spawn(
        "api",
        ["-m", "conveyor_api"],
        {
            "CONVEYOR_HOST": "0.0.0.0",
            "CONVEYOR_PORT": str(port),
            "CONVEYOR_ALLOW_PLAINTEXT": "true",
        },
    )
    await wait_until(
        lambda: port_open(port) or not allowed.alive(),
        message="api port",
        within=30,
        interval=POLL_INTERVAL,
    )
    assert allowed.alive(), allowed.log()
    assert "tls.DISABLED" in allowed.log()
