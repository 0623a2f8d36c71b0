"""Webhook workers in the SDK: the admin client's registration methods and
conveyor.webhooks (signature verification, callbacks) against scripted AdminService and
WebhookService doubles on a real gRPC socket."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import inspect
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import grpc.aio
import pytest
from conveyor import (
    AdminClient,
    AsyncAdminClient,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    RawCodec,
    Unauthenticated,
    Unavailable,
    WebhookWorker,
    WebhookWorkerNotFound,
    webhooks,
)
from conveyor.webhooks import (
    AsyncCallbacks,
    Callbacks,
    Outcome,
    ReplayGuard,
    delivery_id,
    standard_secret,
    verify_signature,
    verify_webhook,
)
from conveyor_protos.v1 import service_pb2 as svc
from conveyor_runtime.webhook_auth import (
    sign_delivery,
    signed_headers,
    verify_delivery,
    verify_standard,
)
from conveyor_runtime.webhook_auth import standard_secret as server_standard_secret
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks.webhooks import Webhook as StandardWebhook

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
NOW = 1_900_000_000

_METHODS: dict[str, tuple[str, type[Message]]] = {
    "UpsertWebhookWorker": ("conveyor.v1.AdminService", svc.UpsertWebhookWorkerRequest),
    "GetWebhookWorker": ("conveyor.v1.AdminService", svc.GetWebhookWorkerRequest),
    "ListWebhookWorkers": ("conveyor.v1.AdminService", svc.ListWebhookWorkersRequest),
    "SetWebhookWorkerPaused": ("conveyor.v1.AdminService", svc.SetWebhookWorkerPausedRequest),
    "DeleteWebhookWorker": ("conveyor.v1.AdminService", svc.DeleteWebhookWorkerRequest),
    "Heartbeat": ("conveyor.v1.WebhookService", svc.WebhookHeartbeatRequest),
    "ReportResult": ("conveyor.v1.WebhookService", svc.WebhookReportResultRequest),
}


def stored(request: svc.UpsertWebhookWorkerRequest) -> svc.WebhookWorker:
    """What a server would store and answer: the request's worker, without secrets."""
    worker = svc.WebhookWorker()
    worker.CopyFrom(request.worker)
    del worker.secrets[:]
    worker.created_at.FromDatetime(T0)
    worker.updated_at.FromDatetime(T0 + timedelta(minutes=1))
    return worker


@dataclass
class Double:
    """Scripted AdminService webhook methods and WebhookService: records each request
    with its metadata, answers per method (a reply function or a status code)."""

    replies: dict[str, Callable[[Any], Message] | grpc.StatusCode] = field(default_factory=dict)
    requests: list[tuple[str, Any]] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        by_service: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = {}
        for name, (service, kind) in _METHODS.items():
            by_service.setdefault(service, {})[name] = grpc.unary_unary_rpc_method_handler(
                self._unary(name),
                request_deserializer=kind.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )
        return [
            grpc.method_handlers_generic_handler(service, methods)
            for service, methods in by_service.items()
        ]

    def _unary(self, name: str) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]:
        async def behaviour(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            self.requests.append((name, request))
            self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
            reply = self.replies[name]
            if isinstance(reply, grpc.StatusCode):
                await context.abort(reply, f"{name} refused")
            return reply(request)

        return behaviour


@pytest.fixture
async def double() -> AsyncIterator[tuple[Double, str]]:
    service = Double()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(service.handlers())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield service, f"127.0.0.1:{port}"
    await server.stop(None)


def script_admin(service: Double) -> None:
    service.replies["UpsertWebhookWorker"] = lambda r: svc.UpsertWebhookWorkerResponse(
        worker=stored(r)
    )
    service.replies["GetWebhookWorker"] = lambda r: svc.GetWebhookWorkerResponse(
        worker=svc.WebhookWorker(name=r.name, url="https://a.example.com/", queues={"q": 1})
    )
    service.replies["ListWebhookWorkers"] = lambda _: svc.ListWebhookWorkersResponse(
        workers=[svc.WebhookWorker(name=n, url="https://a.example.com/") for n in ("a", "b")]
    )
    service.replies["SetWebhookWorkerPaused"] = lambda _: svc.SetWebhookWorkerPausedResponse()
    service.replies["DeleteWebhookWorker"] = lambda _: svc.DeleteWebhookWorkerResponse()


# ------------------------------------------------------------- registrations


def test_the_public_type_has_no_secrets_and_no_protos() -> None:
    names = {f.name for f in dataclasses.fields(WebhookWorker)}
    assert names == {
        "name",
        "url",
        "queues",
        "concurrency",
        "timeout",
        "paused",
        "created_at",
        "updated_at",
        "batch_types",
    }
    for name in webhooks.__all__:
        obj = getattr(webhooks, name)
        if callable(obj):
            assert inspect.getdoc(obj), name
            assert "conveyor_protos" not in getattr(obj, "__module__", ""), name


async def test_admin_webhook_methods_send_and_read(double: tuple[Double, str]) -> None:
    service, target = double
    script_admin(service)
    async with AsyncAdminClient(target, token="tok") as admin:
        worker = await admin.upsert_webhook_worker(
            "hooky",
            "https://hooks.example.com/x",
            {"a": 2, "b": 1},
            concurrency=7,
            timeout=timedelta(seconds=12.5),
            paused=True,
            secrets=["new", "old"],
            batch_types=("digest.send", "report.build"),
        )
        assert worker == WebhookWorker(
            name="hooky",
            url="https://hooks.example.com/x",
            queues={"a": 2, "b": 1},
            concurrency=7,
            timeout=timedelta(seconds=12.5),
            paused=True,
            created_at=T0,
            updated_at=T0 + timedelta(minutes=1),
            batch_types=("digest.send", "report.build"),
        )
        # Defaults, a list of queue names (weight 1 each), secrets kept (none sent).
        await admin.upsert_webhook_worker("hooky", "https://hooks.example.com/x", ["a", "b"])
        got = await admin.get_webhook_worker("hooky")
        assert (got.name, dict(got.queues)) == ("hooky", {"q": 1})
        assert [w.name for w in await admin.list_webhook_workers()] == ["a", "b"]
        await admin.pause_webhook_worker("hooky")
        await admin.resume_webhook_worker("hooky")
        assert await admin.delete_webhook_worker("hooky") is None  # type: ignore[func-returns-value]
    names = [name for name, _ in service.requests]
    assert names == [
        "UpsertWebhookWorker",
        "UpsertWebhookWorker",
        "GetWebhookWorker",
        "ListWebhookWorkers",
        "SetWebhookWorkerPaused",
        "SetWebhookWorkerPaused",
        "DeleteWebhookWorker",
    ]
    first: svc.WebhookWorker = service.requests[0][1].worker
    assert (first.name, first.url, dict(first.queues), first.concurrency, first.paused) == (
        "hooky",
        "https://hooks.example.com/x",
        {"a": 2, "b": 1},
        7,
        True,
    )
    assert first.timeout.ToTimedelta() == timedelta(seconds=12.5)
    assert list(first.secrets) == ["new", "old"]
    assert list(first.batch_types) == ["digest.send", "report.build"]
    second: svc.WebhookWorker = service.requests[1][1].worker
    assert list(second.batch_types) == []
    assert (dict(second.queues), second.concurrency, second.paused) == ({"a": 1, "b": 1}, 10, False)
    assert second.timeout.ToTimedelta() == timedelta(seconds=30)
    assert list(second.secrets) == []
    assert [r.paused for n, r in service.requests if n == "SetWebhookWorkerPaused"] == [True, False]
    assert service.requests[-1][1].name == "hooky"
    assert all(m.get("authorization") == "Bearer tok" for m in service.metadata)


async def test_admin_webhook_errors(double: tuple[Double, str]) -> None:
    service, target = double
    service.replies["GetWebhookWorker"] = grpc.StatusCode.NOT_FOUND
    service.replies["DeleteWebhookWorker"] = grpc.StatusCode.NOT_FOUND
    service.replies["UpsertWebhookWorker"] = grpc.StatusCode.INVALID_ARGUMENT
    service.replies["SetWebhookWorkerPaused"] = grpc.StatusCode.PERMISSION_DENIED
    async with AsyncAdminClient(target) as admin:
        with pytest.raises(WebhookWorkerNotFound) as info:
            await admin.get_webhook_worker("nobody")
        assert (info.value.name, info.value.code) == ("nobody", "NOT_FOUND")
        assert isinstance(info.value, LookupError)
        with pytest.raises(WebhookWorkerNotFound):
            await admin.delete_webhook_worker("nobody")
        with pytest.raises(InvalidArgument, match="UpsertWebhookWorker refused"):
            await admin.upsert_webhook_worker("h", "ftp://x", {"q": 1})
        with pytest.raises(PermissionDenied):
            await admin.pause_webhook_worker("h")
        sent = len(service.requests)
        bad: list[dict[str, Any]] = [
            {"secrets": "one-secret"},
            {"secrets": ["ok", 3]},
            {"concurrency": 0},
            {"concurrency": True},
            {"timeout": -1},
            {"timeout": 0},
            {"timeout": "30"},
            {"batch_types": "digest.send"},
            {"batch_types": ["digest.send", 3]},
        ]
        for options in bad:
            with pytest.raises(InvalidArgument):
                await admin.upsert_webhook_worker(
                    "h", "https://a.example.com/", {"q": 1}, **options
                )
        for queues in ({"q": "2"}, {"q": 1.5}, {"q": True}, {"q": 2**40}):
            with pytest.raises(InvalidArgument):
                await admin.upsert_webhook_worker("h", "https://a.example.com/", queues)
    assert len(service.requests) == sent  # the SDK refused those before sending


async def test_the_blocking_admin_client(double: tuple[Double, str]) -> None:
    service, target = double
    script_admin(service)
    service.replies["GetWebhookWorker"] = grpc.StatusCode.NOT_FOUND

    def run() -> WebhookWorker:
        with AdminClient(target) as admin:
            made = admin.upsert_webhook_worker(
                "hooky", "https://a.example.com/", "q", timeout=5, secrets=("s",)
            )
            with pytest.raises(WebhookWorkerNotFound):
                admin.get_webhook_worker("hooky")
            assert [w.name for w in admin.list_webhook_workers()] == ["a", "b"]
            admin.pause_webhook_worker("hooky")
            admin.resume_webhook_worker("hooky")
            admin.delete_webhook_worker("hooky")
            return made

    made = await asyncio.to_thread(run)
    assert (dict(made.queues), made.timeout) == ({"q": 1}, timedelta(seconds=5))
    assert [n for n, _ in service.requests] == [
        "UpsertWebhookWorker",
        "GetWebhookWorker",
        "ListWebhookWorkers",
        "SetWebhookWorkerPaused",
        "SetWebhookWorkerPaused",
        "DeleteWebhookWorker",
    ]


# ---------------------------------------------------------------- signatures

BODY = b'{"jsonrpc":"2.0","id":"01HZ","method":"conveyor.task","params":{}}'
#: Tests of the deprecated Conveyor-Signature check (it warns on every call).
deprecated = pytest.mark.filterwarnings("ignore:verify_signature:DeprecationWarning")
DELIVERY = "01HZZZZZZZZZZZZZZZZZZZZZZB"
KEY32 = bytes(range(32))
WHSEC = "whsec_" + base64.b64encode(KEY32).decode()


def test_verify_signature_is_deprecated_and_takes_whsec_secrets() -> None:
    header = sign_delivery(WHSEC, BODY, NOW)
    with pytest.warns(DeprecationWarning, match="verify_webhook"):
        assert verify_signature(header, BODY, [WHSEC], now=NOW)
    # A whsec_ secret's key is its decoded bytes, on both headers.
    expected = hmac.new(KEY32, f"{NOW}.".encode() + BODY, "sha256").hexdigest()
    assert header == f"t={NOW},v1={expected}"


def test_verify_webhook_accepts_what_the_server_signs() -> None:
    headers = signed_headers("new", DELIVERY, BODY, NOW)
    assert verify_webhook(headers, BODY, ["old", "new"], now=NOW)
    assert verify_webhook(headers, BODY, "new", now=NOW + 300)
    assert verify_webhook(headers, bytearray(BODY), ("new",), now=NOW - 300)
    assert verify_webhook(headers, memoryview(BODY), ("new",), now=NOW)
    # Header names in any case, values as bytes (some frameworks give those).
    shouted = {k.upper(): v.encode() for k, v in headers.items()}
    assert verify_webhook(shouted, BODY, ["new"], now=NOW)  # type: ignore[arg-type]
    # The Standard Webhooks form of a secret verifies the same deliveries.
    assert verify_webhook(headers, BODY, [standard_secret("new")], now=NOW)
    whsec = signed_headers(WHSEC, DELIVERY, BODY, NOW)
    assert verify_webhook(whsec, BODY, [WHSEC], now=NOW)
    assert not verify_webhook(whsec, BODY, [WHSEC.removeprefix("whsec_")], now=NOW)
    assert delivery_id(headers) == DELIVERY


def test_verify_webhook_refuses_everything_else() -> None:
    headers = signed_headers("new", DELIVERY, BODY, NOW)
    sig = headers["webhook-signature"]
    refused: dict[str, tuple[dict[str, str], bytes, list[str], float]] = {
        "wrong secret": (headers, BODY, ["other"], NOW),
        "no secrets": (headers, BODY, [], NOW),
        "other body": (headers, BODY + b" ", ["new"], NOW),
        "too old": (headers, BODY, ["new"], NOW + 301),
        "from the future": (headers, BODY, ["new"], NOW - 301),
        "no headers": ({}, BODY, ["new"], NOW),
        "no id": ({**headers, "webhook-id": ""}, BODY, ["new"], NOW),
        "another id": ({**headers, "webhook-id": "01HZZZZZZZZZZZZZZZZZZZZZZC"}, BODY, ["new"], NOW),
        "moved timestamp": ({**headers, "webhook-timestamp": str(NOW + 1)}, BODY, ["new"], NOW),
        "bad timestamp": ({**headers, "webhook-timestamp": "soon"}, BODY, ["new"], NOW),
        "v2 only": ({**headers, "webhook-signature": "v2," + sig[3:]}, BODY, ["new"], NOW),
        "unpadded": ({**headers, "webhook-signature": sig.rstrip("=")}, BODY, ["new"], NOW),
        "old header only": (
            {"Conveyor-Signature": headers["Conveyor-Signature"]},
            BODY,
            ["new"],
            NOW,
        ),
    }
    for case, (h, body, secrets, now) in refused.items():
        assert not verify_webhook(h, body, secrets, now=now), case
    # Several signatures, one good: accepted (what a rotating sender may send).
    several = {**headers, "webhook-signature": f"v1,{'A' * 43}= v1a,junk {sig}"}
    assert verify_webhook(several, BODY, ["new"], now=NOW)
    assert not verify_webhook(headers, BODY, ["new"], now=NOW + 10, tolerance=5)
    with pytest.raises(TypeError, match="raw request body"):
        verify_webhook(headers, BODY.decode(), ["new"], now=NOW)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="whsec_"):
        verify_webhook(headers, BODY, ["whsec_not base64!"], now=NOW)


@pytest.mark.parametrize(
    "headers",
    [
        {"webhook-id": "é", "webhook-timestamp": str(NOW), "webhook-signature": "v1,x"},
        {"webhook-id": "a b", "webhook-timestamp": str(NOW), "webhook-signature": "v1,x"},
        {"webhook-id": "x" * 5000, "webhook-timestamp": str(NOW), "webhook-signature": "v1"},
        {"webhook-id": "x", "webhook-timestamp": "١٩٠٠٠٠٠٠٠٠", "webhook-signature": "v1,"},
        {"webhook-id": "x", "webhook-timestamp": "9" * 5000, "webhook-signature": "v1,"},
        {"webhook-id": "x", "webhook-timestamp": "+1900000000", "webhook-signature": ","},
        {"webhook-id": "x", "webhook-timestamp": str(NOW), "webhook-signature": "v1,é" * 9},
        {"webhook-id": b"\xff", "webhook-timestamp": str(NOW), "webhook-signature": "v1,"},
        {"webhook-id": None, "webhook-timestamp": 12, "webhook-signature": object()},
        {1: 2},
        "not a mapping",
        None,
    ],
)
def test_malformed_standard_headers_are_false_not_an_exception(headers: Any) -> None:
    assert verify_webhook(headers, BODY, ["new"], now=NOW) is False
    assert delivery_id(headers) is None or isinstance(delivery_id(headers), str)


@given(
    headers=st.dictionaries(
        st.sampled_from(["webhook-id", "Webhook-Timestamp", "webhook-signature", "x"]),
        st.one_of(st.text(max_size=120), st.binary(max_size=60), st.integers()),
    ),
    body=st.binary(max_size=64),
)
@settings(deadline=None)  # a shared machine may pause any example
def test_verify_webhook_never_raises_on_headers(headers: dict[str, Any], body: bytes) -> None:
    assert verify_webhook(headers, body, ["new", "old"], now=NOW) in (True, False)


@given(
    secret=st.text(min_size=1, max_size=40).filter(lambda s: not s.startswith("whsec_")),
    ident=st.text("0123456789ABCDEFGHJKMNPQRSTVWXYZ", min_size=1, max_size=26),
    body=st.binary(max_size=64),
    signed_at=st.integers(NOW - 400, NOW + 400),
    tolerance=st.integers(0, 400),
    other_secret=st.booleans(),
    garble=st.sampled_from(["", "webhook-id", "webhook-timestamp", "webhook-signature"]),
)
@settings(deadline=None)  # a shared machine may pause any example
def test_verify_webhook_agrees_with_the_server(
    secret: str,
    ident: str,
    body: bytes,
    signed_at: int,
    tolerance: int,
    other_secret: bool,
    garble: str,
) -> None:
    headers = signed_headers(secret, ident, body, signed_at)
    if garble:
        headers[garble] = headers[garble][:-2] + "zz"
    secrets = ["someone-else"] + ([] if other_secret else [secret])
    assert verify_webhook(headers, body, secrets, now=NOW, tolerance=tolerance) == (
        verify_standard(headers, body, secrets, NOW, tolerance)
    )


@given(
    key=st.binary(min_size=32, max_size=64),
    raw=st.text(min_size=32, max_size=64).filter(lambda s: not s.startswith("whsec_")),
    body=st.text(max_size=200),
    ident=st.text("0123456789abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=40),
)
@settings(deadline=None)  # a shared machine may pause any example
def test_the_reference_library_and_ours_agree_both_ways(
    key: bytes, raw: str, body: str, ident: str
) -> None:
    now = int(time.time())
    for ours in ("whsec_" + base64.b64encode(key).decode(), raw):
        reference = StandardWebhook(standard_secret(ours))
        # The reference signs, we verify.
        signature = reference.sign(ident, datetime.fromtimestamp(now, UTC), body)
        headers = {
            "webhook-id": ident,
            "webhook-timestamp": str(now),
            "webhook-signature": signature,
        }
        assert verify_webhook(headers, body.encode(), [ours], now=now)
        # We sign (as the server does), the reference verifies.
        ours_headers = signed_headers(ours, ident, body.encode(), now)
        reference.verify(body.encode(), ours_headers, json_parse=False)


def test_standard_secret_maps_plain_text_to_its_bytes() -> None:
    assert standard_secret(WHSEC) == WHSEC
    assert standard_secret("plain") == "whsec_" + base64.b64encode(b"plain").decode()
    assert standard_secret("plain") == server_standard_secret("plain")


def test_the_replay_guard_refuses_a_delivery_id_seen_within_the_window() -> None:
    guard = ReplayGuard(window=600, capacity=3)
    assert guard.first_time("a", now=NOW)
    assert not guard.first_time("a", now=NOW + 599)
    assert guard.first_time("b", now=NOW + 1)
    # Past the window, an id is forgotten (its signature would be too old anyway).
    assert guard.first_time("a", now=NOW + 600)
    assert guard.first_time("c", now=NOW + 601)
    # At capacity, the oldest goes first.
    assert guard.first_time("d", now=NOW + 602)
    assert len(guard) == 3
    assert guard.first_time("b", now=NOW + 603)
    assert not guard.first_time("d", now=NOW + 603)
    with pytest.raises(ValueError, match="window"):
        ReplayGuard(window=0)


@deprecated
def test_verify_signature_accepts_what_the_server_signs() -> None:
    header = sign_delivery("new", BODY, NOW)
    assert verify_signature(header, BODY, ["new", "old"], now=NOW)
    assert verify_signature(header, BODY, "new", now=NOW + 300)
    assert verify_signature(header, bytearray(BODY), ("old", "new"), now=NOW - 300)
    # Rotation: signed with the old secret, which is still listed.
    assert verify_signature(sign_delivery("old", BODY, NOW), BODY, ["new", "old"], now=NOW)


@deprecated
def test_verify_signature_refuses_everything_else() -> None:
    header = sign_delivery("new", BODY, NOW)
    t, v1 = header.split(",")
    refused: dict[str, tuple[str | None, bytes, list[str], float]] = {
        "wrong secret": (header, BODY, ["other"], NOW),
        "no secrets": (header, BODY, [], NOW),
        "other body": (header, BODY + b" ", ["new"], NOW),
        "too old": (header, BODY, ["new"], NOW + 301),
        "from the future": (header, BODY, ["new"], NOW - 301),
        "no header": (None, BODY, ["new"], NOW),
        "empty header": ("", BODY, ["new"], NOW),
        "no timestamp": (v1, BODY, ["new"], NOW),
        "no mac": (t, BODY, ["new"], NOW),
        "bad timestamp": (f"t=soon,{v1}", BODY, ["new"], NOW),
        "moved timestamp": (f"t={NOW + 1},{v1}", BODY, ["new"], NOW),
        "upper-case mac": (f"{t},{v1.upper()}", BODY, ["new"], NOW),
    }
    for case, (h, body, secrets, now) in refused.items():
        assert not verify_signature(h, body, secrets, now=now), case
    assert verify_signature(f"{t}, v0=junk, {v1}", BODY, ["new"], now=NOW)
    assert not verify_signature(header, BODY, ["new"], now=NOW + 10, tolerance=5)
    with pytest.raises(TypeError, match="raw request body"):
        verify_signature(header, BODY.decode(), ["new"], now=NOW)  # type: ignore[arg-type]


@deprecated
def test_verify_signature_defaults_to_the_current_time() -> None:
    import time

    now = int(time.time())
    assert verify_signature(sign_delivery("k", BODY, now), BODY, ["k"])
    assert not verify_signature(sign_delivery("k", BODY, now - 3600), BODY, ["k"])


_HEADER_PARTS = st.one_of(
    st.just("t=1900000000"),
    st.builds(lambda n: f"t={n}", st.integers(NOW - 400, NOW + 400)),
    st.builds(lambda s: f"v1={s}", st.text("0123456789abcdef", min_size=0, max_size=64)),
    st.text(max_size=12),
)


@deprecated
@given(
    secret=st.text(min_size=1, max_size=20).filter(lambda s: not s.startswith("whsec_")),
    body=st.binary(max_size=64),
    signed_at=st.integers(NOW - 400, NOW + 400),
    tolerance=st.integers(0, 400),
    extra=st.lists(_HEADER_PARTS, max_size=3),
    other_secret=st.booleans(),
)
def test_verify_signature_agrees_with_the_server(
    secret: str,
    body: bytes,
    signed_at: int,
    tolerance: int,
    extra: list[str],
    other_secret: bool,
) -> None:
    header = ",".join([sign_delivery(secret, body, signed_at), *extra])
    secrets = ["someone-else"] + ([] if other_secret else [secret])
    assert verify_signature(header, body, secrets, now=NOW, tolerance=tolerance) == (
        verify_delivery(header, body, secrets, NOW, tolerance)
    )
    garbled = ",".join(extra)
    assert verify_signature(garbled, body, secrets, now=NOW, tolerance=tolerance) == (
        verify_delivery(garbled, body, secrets, NOW, tolerance)
    )


@pytest.mark.parametrize(
    "header",
    [
        f"t={NOW},v1=é" + "0" * 63,  # non-ASCII where the hex goes: was a TypeError
        f"t={NOW},v1=" + "é" * 64,
        "t=١٩٠٠٠٠٠٠٠٠,v1=" + "0" * 64,  # other scripts' digits
        "t=" + "9" * 5000,  # past int()'s digit limit
        "t=1" + "0" * 400,  # past a float, were it parsed
        "t=+1900000000",
        "t=1_900_000_000",
        "t= 1900000000",
        "\x00" * 10_000,
        b"t=1900000000,v1=\xff",
        bytearray(b"\xff\xfe"),
        12345,
    ],
)
@deprecated
def test_a_malformed_header_is_false_not_an_exception(header: Any) -> None:
    assert verify_signature(header, BODY, ["new"], now=NOW) is False


@deprecated
def test_the_header_may_be_bytes() -> None:
    header = sign_delivery("new", BODY, NOW)
    assert verify_signature(header.encode(), BODY, ["new"], now=NOW)


@given(
    header=st.one_of(
        st.text(max_size=200),
        st.binary(max_size=200),
        st.builds(
            lambda t, v: f"t={t},v1={v}",
            st.one_of(st.integers(NOW - 400, NOW + 400), st.text(max_size=20)),
            st.text(max_size=80),
        ),
    ),
    body=st.binary(max_size=64),
)
@deprecated
def test_verify_signature_never_raises_on_a_header(header: str | bytes, body: bytes) -> None:
    assert verify_signature(header, body, ["new", "old"], now=NOW) in (True, False)


# ------------------------------------------------------------------ callbacks


def script_callbacks(service: Double, expires: datetime) -> None:
    def beat(_: svc.WebhookHeartbeatRequest) -> svc.WebhookHeartbeatResponse:
        response = svc.WebhookHeartbeatResponse()
        response.lease_expires_at.FromDatetime(expires)
        return response

    service.replies["Heartbeat"] = beat
    service.replies["ReportResult"] = lambda _: svc.WebhookReportResultResponse()


async def test_callbacks_send_the_token_and_encoded_values(double: tuple[Double, str]) -> None:
    service, target = double
    expires = T0 + timedelta(seconds=30)
    script_callbacks(service, expires)
    async with AsyncCallbacks(target) as callbacks:
        assert await callbacks.heartbeat("tok-1", progress={"pct": 50}) == expires
        await callbacks.heartbeat("tok-1")
        await callbacks.report_result("tok-1", Outcome.SUCCESS, result={"ok": True})
        await callbacks.report_result("tok-1", "failure", error="nope", retry_after=2.5)
        await callbacks.report_result("tok-1", "skip_retry", error="bad input")
        await callbacks.report_result("tok-1", Outcome.RELEASE, retry_after=timedelta(0))
    beats = [r for n, r in service.requests if n == "Heartbeat"]
    assert [(b.lease_token, b.progress) for b in beats] == [
        ("tok-1", b'{"pct":50}'),
        ("tok-1", b""),
    ]
    reports: list[svc.WebhookReportResultRequest] = [
        r for n, r in service.requests if n == "ReportResult"
    ]
    assert [
        (
            r.outcome,
            r.result,
            r.error,
            r.retry_after.ToTimedelta() if r.HasField("retry_after") else None,
        )
        for r in reports
    ] == [
        (svc.OUTCOME_SUCCESS, b'{"ok":true}', "", None),
        (svc.OUTCOME_FAILURE, b"", "nope", timedelta(seconds=2.5)),
        (svc.OUTCOME_SKIP_RETRY, b"", "bad input", None),
        (svc.OUTCOME_RELEASE, b"", "", timedelta(0)),
    ]
    # The lease token is the credential: no bearer token goes with a callback.
    assert all("authorization" not in m for m in service.metadata)


async def test_callbacks_errors_and_bad_input(double: tuple[Double, str]) -> None:
    service, target = double
    async with AsyncCallbacks(target, codec=RawCodec()) as callbacks:
        for code, error in (
            (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
            (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
            (grpc.StatusCode.UNAVAILABLE, Unavailable),
            (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        ):
            service.replies["ReportResult"] = code
            with pytest.raises(error):
                await callbacks.report_result("tok", "success", result=b"\x00")
        sent = len(service.requests)
        for outcome in ("accepted", "done", 1):
            with pytest.raises(InvalidArgument, match="outcome must be one of"):
                await callbacks.report_result("tok", outcome)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="retry_after"):
            await callbacks.report_result("tok", "failure", retry_after=-1)
        with pytest.raises(InvalidArgument, match="lease_token"):
            await callbacks.heartbeat("")
        with pytest.raises(InvalidArgument, match="cannot encode the result"):
            await callbacks.report_result("tok", "success", result="not bytes")
        with pytest.raises(InvalidArgument, match="error must be a string"):
            await callbacks.report_result("tok", "failure", error=42)  # type: ignore[arg-type]
    assert len(service.requests) == sent
    assert service.requests[0][1].result == b"\x00"


async def test_the_blocking_callbacks(double: tuple[Double, str]) -> None:
    service, target = double
    expires = T0 + timedelta(seconds=45)
    script_callbacks(service, expires)

    def run() -> datetime | None:
        with Callbacks(target) as callbacks:
            callbacks.report_result("tok", "failure", error="x", retry_after=timedelta(seconds=3))
            return callbacks.heartbeat("tok", progress=[1, 2])

    assert await asyncio.to_thread(run) == expires
    (_, report), (_, beat) = service.requests
    assert (report.outcome, report.retry_after.ToTimedelta()) == (
        svc.OUTCOME_FAILURE,
        timedelta(seconds=3),
    )
    assert json.loads(beat.progress) == [1, 2]
