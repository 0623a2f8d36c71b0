"""The REST admin API against a real api service (memory broker, private NATS), called in
process through httpx's ASGI transport."""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import httpx
import pytest
from conveyor_api import ApiServer
from conveyor_broker import Breaker, BreakerStatus, FakeClock
from conveyor_rest.app import create_app
from conveyor_runtime.nats_connect import NatsClient, connect_nats
from conveyor_runtime.settings import ApiSettings
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.webhooks import WEBHOOK_KEY, FakeDns

ADMIN = "ops-admin-secret-0123456789"
READER = "ops-reader-secret-0123456789"
PRODUCER = "ops-producer-secret-0123456789"
OPENED = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


async def start_api(
    nats_url: str, **overrides: Any
) -> tuple[ApiServer, CountingBroker, NatsClient]:
    clock = FakeClock()
    broker = CountingBroker(clock)
    nc = await connect_nats(nats_url, name="rest-test")
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "nats_url": nats_url,
        "subject_prefix": f"t{uuid.uuid4().hex[:12]}",
        "broker": "memory",
        "allow_unauthenticated": True,
        "register_tick": 60.0,
        "enqueue_batch_window": 0.005,
        "webhook_secret_key": WEBHOOK_KEY,
    }
    options.update(overrides)
    server = ApiServer(ApiSettings(**options), broker, nc, clock, resolve=FakeDns({}).lookup)
    await server.start()
    return server, broker, nc


async def rest_client(
    nats_url: str, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, CountingBroker]]:
    server, broker, nc = await start_api(nats_url, **overrides)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    app = create_app(f"127.0.0.1:{server.port}", channel=channel)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://rest") as client:
            yield client, broker
    finally:
        await channel.close()
        await server.stop(grace=1.0)
        await nc.close()
        await broker.close()


@pytest.fixture
async def rest(nats_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The REST app in front of a real api with auth off."""
    async for client, _ in rest_client(nats_url):
        yield client


@pytest.fixture
async def rest_broker(nats_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, CountingBroker]]:
    """The REST app in front of a real api with auth off, and the api's broker."""
    async for both in rest_client(nats_url):
        yield both


@pytest.fixture
async def rest_auth(nats_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The REST app in front of a real api with an admin and a read-only token."""
    tokens = [f"ops:admin:{ADMIN}", f"viewer:read-only:{READER}", f"ci:producer:{PRODUCER}"]
    async for client, _ in rest_client(nats_url, auth_tokens=tokens, allow_unauthenticated=False):
        yield client


pytestmark = pytest.mark.nats


async def test_enqueue_get_list_cancel(rest: httpx.AsyncClient) -> None:
    body = {
        "type": "email.send",
        "queue": "emails",
        "payload": {"to": "a@b.c"},
        "options": {"maxRetry": 3},
    }
    made = await rest.post("/v1/tasks", json=body)
    assert made.status_code == 200, made.text
    task = made.json()["task"]
    assert task["state"] == "TASK_STATE_PENDING"

    got = await rest.get(f"/v1/tasks/{task['id']}")
    assert got.status_code == 200
    assert got.json()["task"]["type"] == "email.send"
    assert base64.b64decode(got.json()["task"]["payload"]) == b'{"to":"a@b.c"}'

    page = await rest.get("/v1/tasks", params={"queue": "emails", "state": "pending"})
    assert [t["id"] for t in page.json()["tasks"]] == [task["id"]]

    stats = await rest.get("/v1/queues/emails/stats")
    assert stats.json()["stats"]["counts"]["pending"] == "1"

    cancelled = await rest.post(f"/v1/tasks/{task['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["task"]["state"] == "TASK_STATE_CANCELED"

    assert (await rest.post("/v1/queues/emails/pause")).status_code == 200
    assert (await rest.get("/v1/queues/emails/stats")).json()["stats"]["paused"] is True
    assert (await rest.post("/v1/queues/emails/resume")).status_code == 200

    batch = await rest.post("/v1/tasks:batch", json={"action": "delete", "ids": [task["id"]]})
    assert batch.status_code == 200, batch.text
    assert batch.json()["affected"] == 1


async def test_problem_json_for_grpc_errors_and_bad_input(rest: httpx.AsyncClient) -> None:
    malformed = await rest.get("/v1/tasks/no-such-task")
    assert malformed.status_code == 400
    assert malformed.headers["content-type"] == "application/problem+json"
    assert malformed.json()["code"] == "INVALID_ARGUMENT"

    missing = await rest.get("/v1/tasks/01ARZ3NDEKTSV4RRFFQ69G5FAV")
    assert missing.status_code == 404, missing.text
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.json()["code"] == "NOT_FOUND"

    bad_state = await rest.get("/v1/tasks", params={"state": "sideways"})
    assert bad_state.status_code == 400
    assert bad_state.json()["code"] == "INVALID_ARGUMENT"

    # A field the message does not have: the body's schema refuses it.
    bad_field = await rest.post("/v1/tasks", json={"type": "x", "nonsense": 1})
    assert bad_field.status_code == 422
    assert bad_field.headers["content-type"] == "application/problem+json"
    assert bad_field.json()["code"] == "INVALID_ARGUMENT"
    assert "nonsense" in bad_field.json()["detail"]
    # A value the protobuf parser refuses (not an RFC 3339 time): a 400 problem.
    bad_value = await rest.post(
        "/v1/tasks", json={"type": "x", "options": {"processAt": "tomorrow"}}
    )
    assert bad_value.status_code == 400
    assert bad_value.json()["code"] == "INVALID_ARGUMENT"

    bad_limit = await rest.get("/v1/tasks", params={"limit": 0})
    assert bad_limit.status_code == 422
    assert bad_limit.json()["code"] == "INVALID_ARGUMENT"

    bad_action = await rest.post("/v1/tasks:batch", json={"action": "explode"})
    assert bad_action.status_code == 400


async def test_tokens_and_roles_pass_through(rest_auth: httpx.AsyncClient) -> None:
    anonymous = await rest_auth.get("/v1/queues")
    assert anonymous.status_code == 401
    assert anonymous.json()["code"] == "UNAUTHENTICATED"

    reader = {"authorization": f"Bearer {READER}"}
    assert (await rest_auth.get("/v1/queues", headers=reader)).status_code == 200
    refused = await rest_auth.post("/v1/queues/emails/pause", headers=reader)
    assert refused.status_code == 403
    assert refused.json()["code"] == "PERMISSION_DENIED"

    admin = {"authorization": f"Bearer {ADMIN}"}
    assert (await rest_auth.post("/v1/queues/emails/pause", headers=admin)).status_code == 200


async def test_openapi_document(rest: httpx.AsyncClient) -> None:
    doc = (await rest.get("/openapi.json")).json()
    assert "/v1/tasks/{task_id}/cancel" in doc["paths"]
    assert (await rest.get("/docs")).status_code == 200


async def test_cron_webhooks_and_seams(rest: httpx.AsyncClient) -> None:
    entry = {"spec": "@every 1h", "task": {"type": "report.build", "queue": "reports"}}
    put = await rest.put("/v1/cron/nightly", json=entry)
    assert put.status_code == 200, put.text
    assert (await rest.get("/v1/cron/nightly")).json()["entry"]["spec"] == "@every 1h"
    paused = await rest.post("/v1/cron/nightly/pause")
    assert paused.json()["entry"]["paused"] is True
    triggered = await rest.post("/v1/cron/nightly/trigger")
    assert triggered.json()["task"]["type"] == "report.build"
    assert [e["name"] for e in (await rest.get("/v1/cron")).json()["entries"]] == ["nightly"]
    assert (await rest.delete("/v1/cron/nightly")).status_code == 200
    gone = await rest.get("/v1/cron/nightly")
    assert gone.status_code == 404
    assert gone.json()["code"] == "NOT_FOUND"

    assert (await rest.get("/v1/webhooks")).json() == {"workers": []}
    assert (await rest.get("/v1/webhooks/nobody")).status_code == 404
    assert (await rest.get("/v1/cluster")).status_code == 200
    for path in ("/v1/limits/concurrency", "/v1/groups"):
        answer = await rest.get(path)
        assert answer.status_code in (200, 501), answer.text
        if answer.status_code == 501:
            assert answer.json()["code"] == "UNIMPLEMENTED"


async def test_rate_limits(rest: httpx.AsyncClient) -> None:
    put = await rest.put("/v1/limits/rate/calls", json={"perSecond": 50, "burst": 5})
    assert put.status_code == 200, put.text
    assert put.json()["limit"] == {"queue": "calls", "perSecond": 50.0, "burst": 5}
    default = await rest.put("/v1/limits/rate/slow", json={"perSecond": 0.5})
    assert default.json()["limit"]["burst"] == 1
    listed = (await rest.get("/v1/limits/rate")).json()["limits"]
    assert [limit["queue"] for limit in listed] == ["calls", "slow"]
    bad = await rest.put("/v1/limits/rate/calls", json={"perSecond": -1})
    assert bad.status_code == 400
    assert bad.json()["code"] == "INVALID_ARGUMENT"
    assert "per_second" in bad.json()["detail"]
    assert (await rest.get("/v1/limits/rate")).json()["limits"][0]["perSecond"] == 50.0
    assert (await rest.delete("/v1/limits/rate/calls")).status_code == 200
    gone = await rest.delete("/v1/limits/rate/calls")
    assert gone.status_code == 404
    assert gone.json()["code"] == "NOT_FOUND"


async def test_concurrency_limits(rest: httpx.AsyncClient) -> None:
    put = await rest.put("/v1/limits/concurrency/calls", json={"perKey": 2})
    assert put.status_code == 200, put.text
    assert put.json()["limit"] == {"queue": "calls", "perKey": 2, "pattern": "*"}
    vip = await rest.put("/v1/limits/concurrency/calls", json={"perKey": 5, "pattern": "vip-*"})
    assert vip.status_code == 200, vip.text
    listed = (await rest.get("/v1/limits/concurrency")).json()["limits"]
    assert [(c["pattern"], c["perKey"]) for c in listed] == [("*", 2), ("vip-*", 5)]
    bad = await rest.put("/v1/limits/concurrency/calls", json={"perKey": 0})
    assert bad.status_code == 400
    assert bad.json()["code"] == "INVALID_ARGUMENT"
    assert "per_key" in bad.json()["detail"]
    assert len((await rest.get("/v1/limits/concurrency")).json()["limits"]) == 2
    gone = await rest.delete("/v1/limits/concurrency/calls", params={"pattern": "vip-*"})
    assert gone.status_code == 200, gone.text
    assert (await rest.delete("/v1/limits/concurrency/calls")).status_code == 200
    missing = await rest.delete("/v1/limits/concurrency/calls")
    assert missing.status_code == 404
    assert missing.json()["code"] == "NOT_FOUND"


async def test_breaker_configs(rest: httpx.AsyncClient) -> None:
    body = {"failures": 5, "window": "60s", "cooldown": "30s"}
    put = await rest.put("/v1/limits/breakers/calls", json=body)
    assert put.status_code == 200, put.text
    assert put.json()["config"] == {
        "queue": "calls",
        "pattern": "*",
        "failures": 5,
        "window": "60s",
        "cooldown": "30s",
        "scope": "BREAKER_SCOPE_WORKER",
    }
    pay = {"failures": 2, "window": "10s", "cooldown": "0.500s", "pattern": "pay.*"}
    for scope in ("queue", "BREAKER_SCOPE_QUEUE"):
        made = await rest.put("/v1/limits/breakers/calls", json={**pay, "scope": scope})
        assert made.status_code == 200, made.text
        assert made.json()["config"]["scope"] == "BREAKER_SCOPE_QUEUE"
    other = await rest.put("/v1/limits/breakers/other", json={**body, "scope": "worker"})
    assert other.status_code == 200, other.text
    listed = (await rest.get("/v1/limits/breakers")).json()["configs"]
    assert [(c["queue"], c["pattern"], c["scope"]) for c in listed] == [
        ("calls", "*", "BREAKER_SCOPE_WORKER"),
        ("calls", "pay.*", "BREAKER_SCOPE_QUEUE"),
        ("other", "*", "BREAKER_SCOPE_WORKER"),
    ]
    one = (await rest.get("/v1/limits/breakers", params={"queue": "other"})).json()["configs"]
    assert [c["queue"] for c in one] == ["other"]

    for bad, says in (
        ({**body, "failures": 0}, "failures"),
        ({**body, "window": "0.5s"}, "window"),
        ({"failures": 5, "cooldown": "30s"}, "window is required"),
        ({**body, "cooldown": "0.01s"}, "cooldown"),
        ({**body, "scope": "everyone"}, "scope"),
        ({**body, "window": "a minute"}, "window"),
        ({**body, "pattern": "x" * 300}, "pattern"),
    ):
        refused = await rest.put("/v1/limits/breakers/calls", json=bad)
        assert refused.status_code == 400, (bad, refused.text)
        assert refused.json()["code"] == "INVALID_ARGUMENT"
        assert says in refused.json()["detail"], refused.json()
    assert (await rest.get("/v1/limits/breakers")).json()["configs"] == listed

    gone = await rest.delete("/v1/limits/breakers/calls", params={"pattern": "pay.*"})
    assert gone.status_code == 200, gone.text
    assert (await rest.delete("/v1/limits/breakers/calls")).status_code == 200
    missing = await rest.delete("/v1/limits/breakers/calls")
    assert missing.status_code == 404
    assert missing.json()["code"] == "NOT_FOUND"
    assert (await rest.delete("/v1/limits/breakers/a b")).status_code == 400


async def test_open_breakers_and_queue_stats(
    rest_broker: tuple[httpx.AsyncClient, CountingBroker],
) -> None:
    rest, broker = rest_broker
    assert (await rest.get("/v1/breakers")).json() == {"breakers": []}
    await rest.post("/v1/tasks", json={"type": "pay.charge", "queue": "pay"})
    assert (await rest.get("/v1/queues/pay/stats")).json()["stats"]["breakers"] == []
    await broker.put_breaker(
        Breaker(
            queue="pay",
            type="pay.charge",
            status=BreakerStatus.OPEN,
            opened_at=OPENED,
            until=OPENED + timedelta(seconds=30),
            failures=5,
            gateway="gw-1",
            worker_id="worker-1",
        )
    )
    listed = (await rest.get("/v1/breakers")).json()["breakers"]
    assert listed == [
        {
            "queue": "pay",
            "type": "pay.charge",
            "scope": "BREAKER_SCOPE_WORKER",
            "gateway": "gw-1",
            "workerId": "worker-1",
            "state": "open",
            "openedAt": "2030-01-02T03:04:05Z",
            "until": "2030-01-02T03:04:35Z",
            "failures": 5,
        }
    ]
    assert (await rest.get("/v1/breakers", params={"queue": "mail"})).json() == {"breakers": []}
    bad = await rest.get("/v1/breakers", params={"queue": "a b"})
    assert bad.status_code == 400
    assert bad.json()["code"] == "INVALID_ARGUMENT"
    stats = (await rest.get("/v1/queues/pay/stats")).json()["stats"]
    assert stats["breakers"] == listed
    queues = (await rest.get("/v1/queues")).json()["queues"]
    assert [(q["queue"], q["breakers"]) for q in queues] == [("pay", listed)]


async def test_producer_gets_its_task(rest_auth: httpx.AsyncClient) -> None:
    admin = {"authorization": f"Bearer {ADMIN}"}
    made = await rest_auth.post("/v1/tasks", json={"type": "t", "queue": "q"}, headers=admin)
    task_id = made.json()["task"]["id"]
    reader = {"authorization": f"Bearer {READER}"}
    assert (await rest_auth.get(f"/v1/tasks/{task_id}", headers=reader)).status_code == 200
    denied = await rest_auth.post("/v1/tasks", json={"type": "t"}, headers=reader)
    assert denied.status_code == 403


async def test_dashboard_pages(rest: httpx.AsyncClient) -> None:
    made = await rest.post("/v1/tasks", json={"type": "t", "queue": "ui-queue"})
    task_id = made.json()["task"]["id"]
    home = await rest.get("/ui")
    assert home.status_code == 200
    assert "ui-queue" in home.text
    opened = await rest.get("/ui/task", params={"id": task_id})
    assert opened.status_code == 200
    assert task_id in opened.text
    assert (await rest.get("/ui/task", params={"id": "bad"})).status_code == 400


async def test_whoami_names_what_a_token_may_do(
    rest: httpx.AsyncClient, rest_auth: httpx.AsyncClient, nats_url: str
) -> None:
    """What the api's WhoAmI answers, for every kind of caller."""
    assert (await rest.get("/v1/whoami")).json() == {
        "role": "admin",
        "can_read": True,
        "can_mutate": True,
        "token_role": "admin",
        "token_name": "",
        "auth_enabled": False,
        "read_only": False,
    }
    anonymous = await rest_auth.get("/v1/whoami")
    assert anonymous.status_code == 401
    assert anonymous.json()["code"] == "UNAUTHENTICATED"
    reader = await rest_auth.get("/v1/whoami", headers={"authorization": f"Bearer {READER}"})
    assert reader.json() == {
        "role": "read-only",
        "can_read": True,
        "can_mutate": False,
        "token_role": "read-only",
        "token_name": "viewer",
        "auth_enabled": True,
        "read_only": False,
    }
    admin = await rest_auth.get("/v1/whoami", headers={"authorization": f"Bearer {ADMIN}"})
    assert (admin.json()["role"], admin.json()["token_name"]) == ("admin", "ops")
    producer = await rest_auth.get("/v1/whoami", headers={"authorization": f"Bearer {PRODUCER}"})
    assert producer.status_code == 200, producer.text
    assert (producer.json()["role"], producer.json()["token_role"]) == ("none", "producer")
    # An admin token on a read-only api may only read.
    tokens = [f"ops:admin:{ADMIN}"]
    async for strict, _ in rest_client(
        nats_url, auth_tokens=tokens, allow_unauthenticated=False, read_only=True
    ):
        me = (await strict.get("/v1/whoami", headers={"authorization": f"Bearer {ADMIN}"})).json()
        assert (me["role"], me["token_role"], me["read_only"]) == ("read-only", "admin", True)


async def test_dashboard_search_webhooks_events_and_static(rest: httpx.AsyncClient) -> None:
    for n in range(3):
        body = {"type": "kind.a" if n else "kind.b", "queue": "ui-s", "payload": {"n": n}}
        assert (await rest.post("/v1/tasks", json=body)).status_code == 200
    listed = await rest.get("/ui/tasks", params={"queue": "ui-s", "state": "pending"})
    assert listed.status_code == 200
    assert listed.text.count("<tr data-id=") == 3
    assert "every task in queue ui-s in state pending" in listed.text
    typed = await rest.get("/ui/tasks", params={"queue": "ui-s", "type": "kind.a"})
    assert typed.text.count("<tr data-id=") == 2
    assert "the 2 tasks on this page" in typed.text
    paged = await rest.get("/ui/tasks", params={"queue": "ui-s", "limit": 1})
    assert 'id="next"' in paged.text
    assert (await rest.get("/ui/tasks", params={"state": "nope"})).status_code == 400
    jump = await rest.get("/ui/tasks", params={"id": "abc"})
    assert jump.status_code == 303
    assert jump.headers["location"] == "/ui/task?id=abc"
    assert (await rest.get("/ui/webhooks")).status_code == 200
    assert 'id="events"' in (await rest.get("/ui/events")).text
    fragment = await rest.get("/ui", params={"fragment": "true"})
    assert fragment.text.startswith('<table id="queues">')
    script = await rest.get("/ui/static/app.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert (await rest.get("/ui/static/app.css")).status_code == 200
    assert (await rest.get("/ui/static/nope.js")).status_code == 404


async def test_dashboard_escapes_and_asks_for_a_token(
    rest: httpx.AsyncClient, rest_auth: httpx.AsyncClient
) -> None:
    body = {"type": "t", "queue": "ui-esc", "payload": {"x": "<script>alert(1)</script>"}}
    task_id = (await rest.post("/v1/tasks", json=body)).json()["task"]["id"]
    opened = await rest.get("/ui/task", params={"id": task_id})
    assert "<script>alert" not in opened.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in opened.text

    asked = await rest_auth.get("/ui")
    assert asked.status_code == 401
    assert 'id="login"' in asked.text
    rest_auth.cookies.set("conveyor_token", READER)
    assert (await rest_auth.get("/ui")).status_code == 200
