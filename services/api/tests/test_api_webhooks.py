"""AdminService webhook registrations and WebhookService callbacks over a real gRPC socket,
with a stand-in webhook gateway answering on the real nats-server. Every test runs over
the memory broker and over Postgres (registrations and their secrets are stored there)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from conveyor_api import ApiServer
from conveyor_broker import Broker, FakeClock, WebhookWorker, WebhookWorkerSpec
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.testing.schemas import migrated_schema
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc
from conveyor_runtime.bus import Bus
from conveyor_runtime.webhook_auth import LeaseClaims, mint_lease_token
from conveyor_runtime.webhook_secrets import SecretKeyError, SecretKeyring, generate_key
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.stream import MakeApi
from conveyor_testkit.webhooks import KEYRING, FakeDns
from google.protobuf.duration_pb2 import Duration
from nats.aio.subscription import Subscription

TOKEN = "s3cret-token-of-the-tests"
SCHEMA = "conveyor_api_webhook_tests"
NAME = "hooky"
#: The Standard Webhooks form (whsec_ + base64 of 32 bytes), and a plain text of 32 bytes.
NEW_SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
OLD_SECRET = "old-secret-0123456789abcdefghijk"
OTHER_SECRET = "zzz-secret-0123456789abcdefghijk"
TASK_ID = "01HZZZZZZZZZZZZZZZZZZZZZZA"
LEASE_ID = "01HZZZZZZZZZZZZZZZZZZZZZZB"
Reply = cluster_pb2.WebhookCallbackReply


@pytest.fixture(scope="module")
def webhook_schema_dsn(pg_dsn: str) -> str:
    """A migrated schema of its own in the session's database."""
    return asyncio.run(migrated_schema(pg_dsn, SCHEMA))


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.postgres)])
def broker_dsn(request: pytest.FixtureRequest) -> str | None:
    """None for the memory broker, else the DSN of this module's Postgres schema."""
    if request.param == "memory":
        return None
    dsn: str = request.getfixturevalue("webhook_schema_dsn")
    return dsn


@pytest.fixture
async def broker(broker_dsn: str | None, clock: FakeClock) -> AsyncIterator[Broker]:
    """Overrides the api conftest's memory broker: memory, then Postgres (emptied)."""
    b: Broker
    if broker_dsn is None:
        b = CountingBroker(clock)
    else:
        conn = await asyncpg.connect(broker_dsn)
        try:
            await conn.execute("TRUNCATE conveyor_webhook_workers")
        finally:
            await conn.close()
        b = await PostgresBroker.connect(broker_dsn, clock, max_size=4)
    yield b
    await b.close()


async def expect_code(call: Any, request: Any, code: grpc.StatusCode, **kwargs: Any) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(request, **kwargs)
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


def wire_worker(
    name: str = NAME,
    *,
    url: str = "https://hooks.example.com/conveyor",
    queues: dict[str, int] | None = None,
    concurrency: int = 4,
    timeout: float | None = 12.5,
    paused: bool = False,
    secrets: tuple[str, ...] = (NEW_SECRET, OLD_SECRET),
    batch_types: tuple[str, ...] = (),
) -> service_pb2.WebhookWorker:
    message = service_pb2.WebhookWorker(
        name=name,
        url=url,
        queues=queues if queues is not None else {"wh-a": 2, "wh-b": 1},
        concurrency=concurrency,
        paused=paused,
        secrets=list(secrets),
        batch_types=list(batch_types),
    )
    if timeout is not None:
        message.timeout.FromTimedelta(timedelta(seconds=timeout))
    return message


def upsert(worker: service_pb2.WebhookWorker) -> service_pb2.UpsertWebhookWorkerRequest:
    return service_pb2.UpsertWebhookWorkerRequest(worker=worker)


async def stored_secrets(broker: Broker, name: str = NAME) -> tuple[str, ...]:
    """The secrets of registration ``name`` as stored (sealed under the test key: none
    shows in what the broker holds), opened."""
    stored = (await broker.get_webhook_worker(name)).secrets
    assert all(value.startswith("enc:v1:test:") for value in stored), stored
    for secret in (NEW_SECRET, OLD_SECRET, OTHER_SECRET):
        assert secret not in "".join(stored)
    return KEYRING.open_all(name, stored)


def assert_no_secrets(response: Any, *secrets: str) -> None:
    """Neither the decoded message nor its bytes carry any secret."""
    data = response.SerializeToString()
    for secret in secrets or (NEW_SECRET, OLD_SECRET):
        assert secret.encode() not in data
    workers = list(getattr(response, "workers", [])) or [response.worker]
    for worker in workers:
        assert list(worker.secrets) == []


# ----------------------------------------------------------- registrations


async def test_register_read_pause_resume_delete_without_ever_returning_secrets(
    admin: Any, broker: Broker, clock: FakeClock
) -> None:
    created_at = clock.now()
    made = await admin.UpsertWebhookWorker(upsert(wire_worker()))
    assert_no_secrets(made)
    worker = made.worker
    assert (worker.name, worker.url, dict(worker.queues)) == (
        NAME,
        "https://hooks.example.com/conveyor",
        {"wh-a": 2, "wh-b": 1},
    )
    assert (worker.concurrency, worker.timeout.ToTimedelta(), worker.paused) == (
        4,
        timedelta(seconds=12.5),
        False,
    )
    assert worker.created_at.ToDatetime(tzinfo=UTC) == created_at
    assert worker.updated_at.ToDatetime(tzinfo=UTC) == created_at
    assert await stored_secrets(broker) == (NEW_SECRET, OLD_SECRET)

    got = await admin.GetWebhookWorker(service_pb2.GetWebhookWorkerRequest(name=NAME))
    assert_no_secrets(got)
    assert got.worker == worker

    # An edit without secrets keeps the stored ones and bumps updated_at only.
    clock.advance(timedelta(minutes=5))
    edited = await admin.UpsertWebhookWorker(upsert(wire_worker(concurrency=9, secrets=())))
    assert_no_secrets(edited)
    assert edited.worker.concurrency == 9
    assert edited.worker.created_at.ToDatetime(tzinfo=UTC) == created_at
    assert edited.worker.updated_at.ToDatetime(tzinfo=UTC) == clock.now()
    assert await stored_secrets(broker) == (NEW_SECRET, OLD_SECRET)

    await admin.UpsertWebhookWorker(upsert(wire_worker("another", secrets=(OTHER_SECRET,))))
    listed = await admin.ListWebhookWorkers(service_pb2.ListWebhookWorkersRequest())
    assert_no_secrets(listed, NEW_SECRET, OLD_SECRET, OTHER_SECRET)
    assert [w.name for w in listed.workers] == ["another", NAME]

    await admin.SetWebhookWorkerPaused(
        service_pb2.SetWebhookWorkerPausedRequest(name=NAME, paused=True)
    )
    assert (await broker.get_webhook_worker(NAME)).paused
    got = await admin.GetWebhookWorker(service_pb2.GetWebhookWorkerRequest(name=NAME))
    assert got.worker.paused
    await admin.SetWebhookWorkerPaused(
        service_pb2.SetWebhookWorkerPausedRequest(name=NAME, paused=False)
    )
    assert not (await broker.get_webhook_worker(NAME)).paused

    await admin.DeleteWebhookWorker(service_pb2.DeleteWebhookWorkerRequest(name=NAME))
    assert [w.name for w in await broker.list_webhook_workers()] == ["another"]
    await expect_code(
        admin.GetWebhookWorker,
        service_pb2.GetWebhookWorkerRequest(name=NAME),
        grpc.StatusCode.NOT_FOUND,
    )


async def test_unset_concurrency_and_timeout_take_the_defaults(admin: Any) -> None:
    made = await admin.UpsertWebhookWorker(upsert(wire_worker(concurrency=0, timeout=None)))
    assert made.worker.concurrency == 10
    assert made.worker.timeout.ToTimedelta() == timedelta(seconds=30)


async def test_batch_types_round_trip_once_each_and_an_upsert_replaces_them(
    admin: Any, broker: Broker
) -> None:
    made = await admin.UpsertWebhookWorker(
        upsert(wire_worker(batch_types=("digest.send", "report.build", "digest.send")))
    )
    assert list(made.worker.batch_types) == ["digest.send", "report.build"]
    assert (await broker.get_webhook_worker(NAME)).batch_types == ("digest.send", "report.build")
    got = await admin.GetWebhookWorker(service_pb2.GetWebhookWorkerRequest(name=NAME))
    assert got.worker == made.worker
    listed = await admin.ListWebhookWorkers(service_pb2.ListWebhookWorkersRequest())
    assert [list(w.batch_types) for w in listed.workers] == [["digest.send", "report.build"]]
    # An upsert without them clears them (every field but the secrets is replaced).
    edited = await admin.UpsertWebhookWorker(upsert(wire_worker(secrets=())))
    assert list(edited.worker.batch_types) == []
    assert (await broker.get_webhook_worker(NAME)).batch_types == ()


BAD_WORKERS: dict[str, Callable[[], service_pb2.WebhookWorker]] = {
    "empty-name": lambda: wire_worker(""),
    "bad-name": lambda: wire_worker("no spaces"),
    "no-url": lambda: wire_worker(url=""),
    "ftp-url": lambda: wire_worker(url="ftp://hooks.example.com/x"),
    "url-without-host": lambda: wire_worker(url="https:///path"),
    "no-queues": lambda: wire_worker(queues={}),
    "bad-queue": lambda: wire_worker(queues={"no spaces": 1}),
    "zero-weight": lambda: wire_worker(queues={"wh-a": 0}),
    "huge-weight": lambda: wire_worker(queues={"wh-a": 1001}),
    "negative-concurrency": lambda: wire_worker(concurrency=-1),
    "huge-concurrency": lambda: wire_worker(concurrency=10_001),
    "zero-timeout": lambda: wire_worker(timeout=0),
    "negative-timeout": lambda: wire_worker(timeout=-1),
    "timeout-over-an-hour": lambda: wire_worker(timeout=3601),
    "empty-secret": lambda: wire_worker(secrets=(NEW_SECRET, "")),
    "too-many-secrets": lambda: wire_worker(secrets=tuple(f"{i:032}" for i in range(11))),
    "secret-too-long": lambda: wire_worker(secrets=("x" * 513,)),
    "one-character-secret": lambda: wire_worker(secrets=("k",)),
    "31-byte-secret": lambda: wire_worker(secrets=(NEW_SECRET, "x" * 31)),
    "short-whsec-secret": lambda: wire_worker(
        secrets=("whsec_" + base64.b64encode(b"k" * 31).decode(),)
    ),
    "whsec-not-base64": lambda: wire_worker(secrets=("whsec_" + "!" * 44,)),
    "control-in-secret": lambda: wire_worker(secrets=("x" * 40 + "\n",)),
    "loopback-url": lambda: wire_worker(url="http://127.0.0.1:5432/"),
    "private-url": lambda: wire_worker(url="http://10.0.0.1/hook"),
    "metadata-url": lambda: wire_worker(url="http://169.254.169.254/latest/meta-data/"),
    "ipv6-loopback-url": lambda: wire_worker(url="http://[::1]:8080/hook"),
    "ipv4-mapped-loopback-url": lambda: wire_worker(url="https://[::ffff:127.0.0.1]/hook"),
    "unspecified-url": lambda: wire_worker(url="http://0.0.0.0:9/"),
    "name-resolving-to-loopback": lambda: wire_worker(url="https://loopback.test/hook"),
    "name-resolving-to-private-among-public": lambda: wire_worker(url="https://mixed.test/"),
    "empty-batch-type": lambda: wire_worker(batch_types=("digest.send", "")),
    "batch-type-too-long": lambda: wire_worker(batch_types=("t" * 257,)),
    "control-in-batch-type": lambda: wire_worker(batch_types=("digest\tsend",)),
    "too-many-batch-types": lambda: wire_worker(batch_types=tuple(f"t{i}" for i in range(101))),
}
#: What names resolve to in these tests (any other name does not resolve).
DNS = {
    "loopback.test": [["127.0.0.1"]],
    "mixed.test": [["93.184.216.34", "10.1.2.3"]],
    "public.test": [["93.184.216.34"]],
    "private.test": [["10.2.0.9"]],
}


@pytest.fixture
async def api(make_api: MakeApi) -> ApiServer:
    """A server with the default test settings, whose registrations see :data:`DNS`."""
    return await make_api(resolve=FakeDns(DNS).lookup)


@pytest.mark.parametrize("case", sorted(BAD_WORKERS))
async def test_bad_registrations_are_invalid_argument_and_change_nothing(
    admin: Any, broker: Broker, clock: FakeClock, case: str
) -> None:
    stored = await broker.upsert_webhook_worker(
        WebhookWorkerSpec(name=NAME, url="https://a.example.com/", queues={"q": 1}, secrets=("k",))
    )
    before = await broker.list_webhook_workers()
    clock.advance(timedelta(seconds=1))
    bad = BAD_WORKERS[case]()
    details = await expect_code(
        admin.UpsertWebhookWorker, upsert(bad), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert details
    # No message quotes a secret (long enough to tell).
    for secret in bad.secrets:
        assert len(secret) < 8 or secret not in details
    assert await broker.list_webhook_workers() == before
    assert await broker.get_webhook_worker(NAME) == stored


async def test_refusals_say_why(admin: Any) -> None:
    async def details(worker: service_pb2.WebhookWorker) -> str:
        code = grpc.StatusCode.INVALID_ARGUMENT
        return await expect_code(admin.UpsertWebhookWorker, upsert(worker), code)

    loopback = await details(wire_worker(url="http://127.0.0.1:5432/"))
    assert "points at a loopback address" in loopback
    assert "CONVEYOR_WEBHOOK_ALLOW_NETWORKS" in loopback
    metadata = await details(wire_worker(url="http://169.254.169.254/"))
    assert "link-local" in metadata
    mapped = await details(wire_worker(url="http://[::ffff:127.0.0.1]/"))
    assert "a loopback address in an IPv6 form" in mapped
    resolved = await details(wire_worker(url="https://loopback.test/hook"))
    assert "host 'loopback.test' resolves to a loopback address" in resolved
    short = await details(wire_worker(secrets=("k",)))
    assert "at least 32 bytes" in short
    assert "this one has 1" in short


async def test_the_system_resolvers_localhost_is_refused(make_api: MakeApi) -> None:
    from conveyor_runtime.webhook_urls import system_resolve

    api = await make_api(resolve=system_resolve)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stub: Any = service_pb2_grpc.AdminServiceStub
        details = await expect_code(
            stub(channel).UpsertWebhookWorker,
            upsert(wire_worker(url="http://localhost:8080/hook")),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
    assert "host 'localhost' resolves to a loopback address" in details


async def test_public_names_and_unresolvable_ones_are_accepted(admin: Any, broker: Broker) -> None:
    for url in ("https://public.test/hook", "https://not-yet-in-dns.test/hook"):
        made = await admin.UpsertWebhookWorker(upsert(wire_worker(url=url)))
        assert made.worker.url == url


async def test_the_allow_list_lets_its_networks_through_and_no_more(
    make_api: MakeApi, broker: Broker
) -> None:
    api = await make_api(
        webhook_allow_networks="10.1.0.0/16,127.0.0.1/32", resolve=FakeDns(DNS).lookup
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stub: Any = service_pb2_grpc.AdminServiceStub
        admin = stub(channel)
        for url in ("http://10.1.200.3/hook", "http://127.0.0.1:8080/", "https://loopback.test/"):
            made = await admin.UpsertWebhookWorker(upsert(wire_worker(url=url)))
            assert made.worker.url == url
        # (mixed.test's private address, 10.1.2.3, is in the allowed network.)
        for url in ("http://10.2.0.1/", "http://127.0.0.2/", "https://private.test/"):
            await expect_code(
                admin.UpsertWebhookWorker,
                upsert(wire_worker(url=url)),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
    assert (await broker.get_webhook_worker(NAME)).url == "https://loopback.test/"


async def test_without_a_secret_key_secrets_are_refused_and_nothing_is_stored(
    make_api: MakeApi, broker: Broker
) -> None:
    api = await make_api(webhook_secret_key=None)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stub: Any = service_pb2_grpc.AdminServiceStub
        admin = stub(channel)
        details = await expect_code(
            admin.UpsertWebhookWorker, upsert(wire_worker()), grpc.StatusCode.FAILED_PRECONDITION
        )
        assert "CONVEYOR_WEBHOOK_SECRET_KEY" in details
        assert await broker.list_webhook_workers() == []
        # A registration without secrets needs no key (nothing to seal).
        await admin.UpsertWebhookWorker(upsert(wire_worker(secrets=())))
    assert (await broker.get_webhook_worker(NAME)).secrets == ()


async def test_secrets_are_sealed_in_the_database_under_the_registrations_name(
    admin: Any, broker: Broker, broker_dsn: str | None
) -> None:
    await admin.UpsertWebhookWorker(upsert(wire_worker()))
    await admin.UpsertWebhookWorker(upsert(wire_worker("another", secrets=(NEW_SECRET,))))
    if broker_dsn is not None:
        # What a database dump holds: the raw column.
        conn = await asyncpg.connect(broker_dsn)
        try:
            rows = await conn.fetch("SELECT name, secrets FROM conveyor_webhook_workers")
        finally:
            await conn.close()
        raw = {row["name"]: list(row["secrets"]) for row in rows}
    else:
        raw = {w.name: list(w.secrets) for w in await broker.list_webhook_workers()}
    assert set(raw) == {NAME, "another"}
    dump = repr(raw)
    for secret in (NEW_SECRET, OLD_SECRET, NEW_SECRET.removeprefix("whsec_")):
        assert secret not in dump
    assert all(value.startswith("enc:v1:test:") for values in raw.values() for value in values)
    # The same secret sealed twice (another nonce) looks different.
    assert raw[NAME][0] != raw["another"][0]
    # A value moved to another registration does not open there.
    with pytest.raises(SecretKeyError, match="does not decrypt with key 'test'"):
        KEYRING.open("another", raw[NAME][1])
    assert KEYRING.open_all(NAME, raw[NAME]) == (NEW_SECRET, OLD_SECRET)


async def test_a_missing_worker_message_is_invalid_argument(admin: Any) -> None:
    details = await expect_code(
        admin.UpsertWebhookWorker,
        service_pb2.UpsertWebhookWorkerRequest(),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "worker is required" in details


async def test_unknown_and_malformed_names(admin: Any, broker: Broker) -> None:
    calls: list[tuple[Any, Callable[[str], Any]]] = [
        (admin.GetWebhookWorker, lambda n: service_pb2.GetWebhookWorkerRequest(name=n)),
        (
            admin.SetWebhookWorkerPaused,
            lambda n: service_pb2.SetWebhookWorkerPausedRequest(name=n, paused=True),
        ),
        (admin.DeleteWebhookWorker, lambda n: service_pb2.DeleteWebhookWorkerRequest(name=n)),
    ]
    for call, request in calls:
        details = await expect_code(call, request("nobody"), grpc.StatusCode.NOT_FOUND)
        assert "nobody" in details
        await expect_code(call, request("no way"), grpc.StatusCode.INVALID_ARGUMENT)
        await expect_code(call, request(""), grpc.StatusCode.INVALID_ARGUMENT)
    assert await broker.list_webhook_workers() == []


async def test_read_only_allows_reads_and_refuses_webhook_mutations(
    make_api: MakeApi, broker: Broker
) -> None:
    api = await make_api(read_only=True)
    await broker.upsert_webhook_worker(
        WebhookWorkerSpec(name=NAME, url="https://a.example.com/", queues={"q": 1})
    )
    before = await broker.list_webhook_workers()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stub: Any = service_pb2_grpc.AdminServiceStub
        admin = stub(channel)
        got = await admin.GetWebhookWorker(service_pb2.GetWebhookWorkerRequest(name=NAME))
        assert got.worker.name == NAME
        listed = await admin.ListWebhookWorkers(service_pb2.ListWebhookWorkersRequest())
        assert [w.name for w in listed.workers] == [NAME]
        denied = grpc.StatusCode.PERMISSION_DENIED
        await expect_code(admin.UpsertWebhookWorker, upsert(wire_worker()), denied)
        await expect_code(
            admin.SetWebhookWorkerPaused,
            service_pb2.SetWebhookWorkerPausedRequest(name=NAME, paused=True),
            denied,
        )
        await expect_code(
            admin.DeleteWebhookWorker, service_pb2.DeleteWebhookWorkerRequest(name=NAME), denied
        )
    assert await broker.list_webhook_workers() == before


# ---------------------------------------------------------------- callbacks


class FakeGateway:
    """Stands in for the webhook gateway: answers ``WebhookCallback`` requests on the
    worker's callback subject (queue group "webhook") with ``reply``, and keeps them."""

    def __init__(self, reply: Reply | None = None) -> None:
        self.reply = reply or Reply(status=Reply.STATUS_OK)
        self.callbacks: list[cluster_pb2.WebhookCallback] = []
        self._sub: Subscription | None = None

    async def start(self, bus: Bus, worker: str = NAME) -> FakeGateway:
        async def answer(callback: cluster_pb2.WebhookCallback) -> Reply:
            self.callbacks.append(callback)
            return self.reply

        self._sub = await bus.serve_webhook_callbacks(worker, answer)
        await bus.nc.flush()
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None


def lease_token(
    secret: str = NEW_SECRET,
    *,
    worker: str = NAME,
    task_id: str = TASK_ID,
    lease_id: str = LEASE_ID,
    queue: str = "wh-a",
) -> str:
    return mint_lease_token(secret, LeaseClaims(worker, task_id, lease_id, queue))


def report(
    token: str,
    outcome: service_pb2.Outcome = service_pb2.OUTCOME_SUCCESS,
    *,
    result: bytes = b"",
    error: str = "",
    retry_after: Duration | None = None,
) -> service_pb2.WebhookReportResultRequest:
    request = service_pb2.WebhookReportResultRequest(
        lease_token=token, outcome=outcome, result=result, error=error
    )
    if retry_after is not None:
        request.retry_after.CopyFrom(retry_after)
    return request


def seconds(value: float) -> Duration:
    d = Duration()
    d.FromTimedelta(timedelta(seconds=value))
    return d


@pytest.fixture
async def registered(broker: Broker) -> WebhookWorker:
    """The registration callbacks are verified against: two secrets, newest first, sealed
    as the api seals them."""
    return await broker.upsert_webhook_worker(
        WebhookWorkerSpec(
            name=NAME,
            url="https://hooks.example.com/conveyor",
            queues={"wh-a": 1},
            secrets=KEYRING.seal_all(NAME, (NEW_SECRET, OLD_SECRET)),
        )
    )


@pytest.fixture
def hooks(channel: grpc.aio.Channel) -> Any:
    """A raw WebhookService stub."""
    stub: Any = service_pb2_grpc.WebhookServiceStub
    return stub(channel)


@pytest.fixture
async def gateway(bus: Bus, registered: WebhookWorker) -> AsyncIterator[FakeGateway]:
    fake = await FakeGateway().start(bus)
    yield fake
    await fake.stop()


def _tampered() -> str:
    # Claims of another task under the MAC of this one.
    real = lease_token().split(".")
    other = lease_token(task_id="01HZZZZZZZZZZZZZZZZZZZZZZC").split(".")
    return ".".join([real[0], other[1], real[2]])


FORGED: dict[str, Callable[[], str]] = {
    "empty": lambda: "",
    "garbage": lambda: "not-a-token",
    "wrong-version": lambda: "v2." + lease_token().split(".", 1)[1],
    "unknown-secret": lambda: lease_token("someone-elses-secret"),
    "unknown-worker": lambda: lease_token(worker="nobody"),
    "bad-worker-name": lambda: lease_token(worker="no way"),
    "tampered-claims": _tampered,
    "truncated-mac": lambda: lease_token()[:-4],
    # Claims nested past the JSON parser's depth: was a RecursionError, INTERNAL.
    "deeply-nested": lambda: "v1." + _b64(b"[" * 3000) + ".AAAA",
    "claims-not-an-object": lambda: "v1." + _b64(b'["w", "t"]') + ".AAAA",
    "non-ascii": lambda: "v1.\u00e9\u00e9.AAAA",
    "nul-in-claims": lambda: "v1." + _b64(b'{"w": "a\\u0000"}') + ".AAAA",
}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.mark.parametrize("case", sorted(FORGED))
async def test_a_bad_or_forged_token_is_unauthenticated_and_routes_nothing(
    hooks: Any, gateway: FakeGateway, case: str
) -> None:
    token = FORGED[case]()
    for call, request in (
        (hooks.Heartbeat, service_pb2.WebhookHeartbeatRequest(lease_token=token)),
        (hooks.ReportResult, report(token)),
    ):
        details = await expect_code(call, request, grpc.StatusCode.UNAUTHENTICATED)
        assert details == "invalid lease token"
    assert gateway.callbacks == []


async def test_a_worker_without_secrets_accepts_no_token(
    hooks: Any, broker: Broker, bus: Bus
) -> None:
    await broker.upsert_webhook_worker(
        WebhookWorkerSpec(name="bare", url="https://a.example.com/", queues={"q": 1})
    )
    fake = await FakeGateway().start(bus, "bare")
    await expect_code(
        hooks.Heartbeat,
        service_pb2.WebhookHeartbeatRequest(lease_token=lease_token(worker="bare")),
        grpc.StatusCode.UNAUTHENTICATED,
    )
    assert fake.callbacks == []
    await fake.stop()


async def test_plaintext_secrets_from_before_encryption_still_verify(
    hooks: Any, broker: Broker, bus: Bus
) -> None:
    await broker.upsert_webhook_worker(
        WebhookWorkerSpec(
            name="legacy", url="https://a.example.com/", queues={"q": 1}, secrets=("short",)
        )
    )
    fake = await FakeGateway().start(bus, "legacy")
    token = lease_token("short", worker="legacy", queue="q")
    await hooks.Heartbeat(service_pb2.WebhookHeartbeatRequest(lease_token=token))
    assert len(fake.callbacks) == 1
    await fake.stop()


async def test_secrets_sealed_with_a_key_the_api_lacks_are_unavailable_not_garbage(
    hooks: Any, broker: Broker, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = SecretKeyring.parse(generate_key("gone"))
    await broker.upsert_webhook_worker(
        WebhookWorkerSpec(
            name="rekeyed",
            url="https://a.example.com/",
            queues={"q": 1},
            secrets=elsewhere.seal_all("rekeyed", (NEW_SECRET,)),
        )
    )
    fake = await FakeGateway().start(bus, "rekeyed")
    token = lease_token(worker="rekeyed", queue="q")
    details = await expect_code(
        hooks.Heartbeat,
        service_pb2.WebhookHeartbeatRequest(lease_token=token),
        grpc.StatusCode.UNAVAILABLE,
    )
    assert "cannot read the secrets of webhook worker rekeyed" in details
    assert "encrypted with key 'gone', which is not configured" in caplog.text
    assert fake.callbacks == []
    await fake.stop()


async def test_heartbeat_routes_to_the_gateway_and_returns_the_new_expiry(
    hooks: Any, gateway: FakeGateway
) -> None:
    expires = datetime(2030, 1, 2, 3, 4, 5, 250_000, tzinfo=UTC)
    gateway.reply = Reply(status=Reply.STATUS_OK, lease_expires_at=expires.timestamp())
    response = await hooks.Heartbeat(
        service_pb2.WebhookHeartbeatRequest(lease_token=lease_token(), progress=b'{"pct":40}')
    )
    assert response.lease_expires_at.ToDatetime(tzinfo=UTC) == expires
    [callback] = gateway.callbacks
    assert (callback.worker, callback.task_id, callback.lease_id, callback.queue) == (
        NAME,
        TASK_ID,
        LEASE_ID,
        "wh-a",
    )
    assert callback.WhichOneof("kind") == "heartbeat"
    assert callback.heartbeat.progress == b'{"pct":40}'


async def test_a_token_signed_with_a_rotated_out_secret_works_while_it_is_listed(
    hooks: Any, gateway: FakeGateway, admin: Any
) -> None:
    await hooks.Heartbeat(service_pb2.WebhookHeartbeatRequest(lease_token=lease_token(OLD_SECRET)))
    await hooks.ReportResult(report(lease_token(OLD_SECRET, lease_id="01HZZZZZZZZZZZZZZZZZZZZZZD")))
    assert [c.lease_id for c in gateway.callbacks] == [LEASE_ID, "01HZZZZZZZZZZZZZZZZZZZZZZD"]
    # The rotation ends: the old secret is dropped, and its tokens stop working at once.
    await admin.UpsertWebhookWorker(upsert(wire_worker(queues={"wh-a": 1}, secrets=(NEW_SECRET,))))
    await expect_code(
        hooks.Heartbeat,
        service_pb2.WebhookHeartbeatRequest(lease_token=lease_token(OLD_SECRET)),
        grpc.StatusCode.UNAUTHENTICATED,
    )
    await hooks.Heartbeat(service_pb2.WebhookHeartbeatRequest(lease_token=lease_token()))
    assert len(gateway.callbacks) == 3


async def test_report_result_routes_every_field(hooks: Any, gateway: FakeGateway) -> None:
    await hooks.ReportResult(report(lease_token(), result=b'{"ok":true}'))
    await hooks.ReportResult(
        report(
            lease_token(),
            service_pb2.OUTCOME_FAILURE,
            error="upstream said no",
            retry_after=seconds(2.5),
        )
    )
    await hooks.ReportResult(report(lease_token(), service_pb2.OUTCOME_FAILURE, error="again"))
    await hooks.ReportResult(report(lease_token(), service_pb2.OUTCOME_SKIP_RETRY, error="bad"))
    await hooks.ReportResult(
        report(lease_token(), service_pb2.OUTCOME_RELEASE, retry_after=seconds(0))
    )
    results = [c.result for c in gateway.callbacks]
    assert all(c.WhichOneof("kind") == "result" for c in gateway.callbacks)
    assert all(
        (c.worker, c.task_id, c.lease_id) == (NAME, TASK_ID, LEASE_ID) for c in gateway.callbacks
    )
    assert [(r.outcome, r.result, r.error, r.retry_after) for r in results] == [
        (service_pb2.OUTCOME_SUCCESS, b'{"ok":true}', "", -1.0),
        (service_pb2.OUTCOME_FAILURE, b"", "upstream said no", 2.5),
        (service_pb2.OUTCOME_FAILURE, b"", "again", -1.0),
        (service_pb2.OUTCOME_SKIP_RETRY, b"", "bad", -1.0),
        (service_pb2.OUTCOME_RELEASE, b"", "", 0.0),
    ]


async def test_gateway_reply_statuses_map_to_grpc_codes(hooks: Any, gateway: FakeGateway) -> None:
    gateway.reply = Reply(status=Reply.STATUS_LEASE_LOST, message="reaped")
    details = await expect_code(
        hooks.ReportResult, report(lease_token()), grpc.StatusCode.FAILED_PRECONDITION
    )
    assert details == "lease lost"
    await expect_code(
        hooks.Heartbeat,
        service_pb2.WebhookHeartbeatRequest(lease_token=lease_token()),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    gateway.reply = Reply(status=Reply.STATUS_INVALID, message="release is not allowed here")
    details = await expect_code(
        hooks.ReportResult, report(lease_token()), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert details == "release is not allowed here"
    gateway.reply = Reply(status=Reply.STATUS_OK)
    assert await hooks.ReportResult(report(lease_token())) == (
        service_pb2.WebhookReportResultResponse()
    )
    assert len(gateway.callbacks) == 4


async def test_bad_reports_are_invalid_argument_before_any_routing(
    make_api: MakeApi, gateway: FakeGateway
) -> None:
    api = await make_api(max_result=64)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stub: Any = service_pb2_grpc.WebhookServiceStub
        hooks = stub(channel)
        bad = {
            "outcome must be": report(lease_token(), service_pb2.OUTCOME_UNSPECIFIED),
            "got 99": report(lease_token(), 99),  # type: ignore[arg-type]
            "retry_after must be >= 0": report(
                lease_token(), service_pb2.OUTCOME_FAILURE, retry_after=seconds(-1)
            ),
            "result is 65 bytes; the limit is 64": report(lease_token(), result=b"x" * 65),
        }
        for expected, request in bad.items():
            details = await expect_code(
                hooks.ReportResult, request, grpc.StatusCode.INVALID_ARGUMENT
            )
            assert expected in details
        details = await expect_code(
            hooks.Heartbeat,
            service_pb2.WebhookHeartbeatRequest(lease_token=lease_token(), progress=b"x" * 65),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert "progress is 65 bytes" in details
        # At the limit is fine.
        await hooks.ReportResult(report(lease_token(), result=b"x" * 64))
    assert [c.result.result for c in gateway.callbacks] == [b"x" * 64]


async def test_a_retry_after_too_long_to_represent_is_invalid_argument(
    hooks: Any, gateway: FakeGateway
) -> None:
    month = 30 * 24 * 3600
    bad = {
        "retry_after must be at most 30 days": [
            Duration(seconds=month, nanos=1),
            Duration(seconds=month + 1),
            Duration(seconds=10**12),  # past what a timedelta holds
            Duration(seconds=2**63 - 1, nanos=999_999_999),
        ],
        "retry_after is not a valid Duration": [Duration(seconds=1, nanos=2_000_000_000)],
        "retry_after must be >= 0": [Duration(seconds=-(2**63)), Duration(nanos=-1)],
    }
    for expected, durations in bad.items():
        for duration in durations:
            request = report(lease_token(), service_pb2.OUTCOME_FAILURE, retry_after=duration)
            details = await expect_code(
                hooks.ReportResult, request, grpc.StatusCode.INVALID_ARGUMENT
            )
            assert expected in details, (duration, details)
    assert gateway.callbacks == []
    # Exactly 30 days is fine, and routed to the second.
    await hooks.ReportResult(
        report(lease_token(), service_pb2.OUTCOME_FAILURE, retry_after=Duration(seconds=month))
    )
    [callback] = gateway.callbacks
    assert callback.result.retry_after == month


async def test_a_broker_failure_in_the_gateway_is_unavailable(
    hooks: Any, gateway: FakeGateway
) -> None:
    gateway.reply = Reply(status=Reply.STATUS_INVALID, message="broker unavailable: retry")
    for call, request in (
        (hooks.Heartbeat, service_pb2.WebhookHeartbeatRequest(lease_token=lease_token())),
        (hooks.ReportResult, report(lease_token())),
    ):
        details = await expect_code(call, request, grpc.StatusCode.UNAVAILABLE)
        assert details == f"webhook worker {NAME} could not reach its broker; retry"
    assert len(gateway.callbacks) == 2


async def test_no_running_gateway_is_unavailable(hooks: Any, registered: WebhookWorker) -> None:
    for call, request in (
        (hooks.Heartbeat, service_pb2.WebhookHeartbeatRequest(lease_token=lease_token())),
        (hooks.ReportResult, report(lease_token())),
    ):
        details = await expect_code(call, request, grpc.StatusCode.UNAVAILABLE)
        assert details == f"webhook worker {NAME} is not running; retry"


async def test_callbacks_need_no_bearer_token_when_auth_is_on(
    make_api: MakeApi, gateway: FakeGateway
) -> None:
    api: ApiServer = await make_api(
        auth_tokens=[f"tests:admin:{TOKEN}"], allow_unauthenticated=False
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stub: Any = service_pb2_grpc.WebhookServiceStub
        await stub(channel).ReportResult(report(lease_token()))
        admin_stub: Any = service_pb2_grpc.AdminServiceStub
        await expect_code(
            admin_stub(channel).ListWebhookWorkers,
            service_pb2.ListWebhookWorkersRequest(),
            grpc.StatusCode.UNAUTHENTICATED,
        )
    assert len(gateway.callbacks) == 1


async def test_the_sdk_callbacks_reach_the_gateway(api: ApiServer, gateway: FakeGateway) -> None:
    from conveyor import FailedPrecondition
    from conveyor.webhooks import AsyncCallbacks

    expires = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    gateway.reply = Reply(status=Reply.STATUS_OK, lease_expires_at=expires.timestamp())
    async with AsyncCallbacks(f"127.0.0.1:{api.port}") as callbacks:
        assert await callbacks.heartbeat(lease_token(OLD_SECRET), progress={"pct": 10}) == expires
        await callbacks.report_result(lease_token(), "failure", error="later", retry_after=4)
        gateway.reply = Reply(status=Reply.STATUS_LEASE_LOST)
        with pytest.raises(FailedPrecondition, match="lease lost"):
            await callbacks.report_result(lease_token(), "success", result=[1])
    beat, failed, _lost = gateway.callbacks
    assert beat.heartbeat.progress == b'{"pct":10}'
    assert (failed.result.outcome, failed.result.error, failed.result.retry_after) == (
        service_pb2.OUTCOME_FAILURE,
        "later",
        4.0,
    )
