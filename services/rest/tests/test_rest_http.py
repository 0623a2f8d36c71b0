"""The REST admin API over real HTTP (uvicorn) in front of a real api: Server-Sent Events,
and a bounded schemathesis run over the OpenAPI document (no 5xx, no schema violation)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from conveyor_api import ApiServer
from conveyor_broker import FakeClock
from conveyor_rest.app import create_app
from conveyor_runtime.bus import Bus
from conveyor_runtime.events import EventPublisher
from conveyor_runtime.nats_connect import connect_nats
from conveyor_runtime.settings import ApiSettings
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.cluster_keys import cluster_auth
from conveyor_testkit.webhooks import WEBHOOK_KEY, FakeDns
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.nats


class Stack:
    """An api and the REST app on uvicorn, on an event loop of their own thread."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stopping: asyncio.Event | None = None
        self.base = ""
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.run(),))

    async def run(self) -> None:
        self.stopping = asyncio.Event()
        clock = FakeClock()
        broker = CountingBroker(clock)
        nc = await connect_nats(self.nats_url, name="rest-http-test")
        subjects = Subjects(prefix=f"t{uuid.uuid4().hex[:12]}")
        publisher = EventPublisher(Bus(nc, subjects, cluster_auth()))
        await publisher.start()
        broker.set_event_sink(publisher)
        options: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "nats_url": self.nats_url,
            "subject_prefix": subjects.prefix,
            "broker": "memory",
            "allow_unauthenticated": True,
            "register_tick": 60.0,
            "webhook_secret_key": WEBHOOK_KEY,
        }
        api = ApiServer(ApiSettings(**options), broker, nc, clock, resolve=FakeDns({}).lookup)
        await api.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # connections wait in the backlog until uvicorn accepts them
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(f"127.0.0.1:{api.port}"), log_level="warning")
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        self.ready.set()
        await self.stopping.wait()
        server.should_exit = True
        await serving
        await api.stop(grace=1.0)
        broker.set_event_sink(None)
        await publisher.stop()
        await nc.close()
        await broker.close()

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(30), "the REST stack did not start"

    def stop(self) -> None:
        assert self.stopping is not None
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def stack(nats_url: str) -> Iterator[Stack]:
    s = Stack(nats_url)
    s.start()
    yield s
    s.stop()


def test_events_stream_as_sse(stack: Stack) -> None:
    with (
        httpx.Client(base_url=stack.base, timeout=10) as client,
        client.stream("GET", "/v1/events", params={"queue": "sse"}) as events,
    ):
        assert events.headers["content-type"].startswith("text/event-stream")
        lines = events.iter_lines()
        assert next(lines) == ": watching"  # sent once the subscription is live
        made = client.post("/v1/tasks", json={"type": "t", "queue": "sse"}).json()
        for line in lines:
            if line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                assert event["taskId"] == made["task"]["id"]
                assert event["state"] == "TASK_STATE_PENDING"
                break


def test_openapi_no_5xx_no_schema_violation(stack: Stack) -> None:
    """Schemathesis over every operation but the endless event stream, a few examples
    each, against the real stack: no 5xx answer, every answer as the document says."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance

    schema = schemathesis.openapi.from_url(f"{stack.base}/openapi.json")
    checked = 0
    for result in schema.get_all_operations():
        operation: Any = result.ok()  # type: ignore[union-attr]
        # The event stream never ends; the limits and groups seams answer 501 while the
        # api does not implement those RPCs (tested in test_rest_api).
        if operation.path == "/v1/events" or operation.path.startswith(
            ("/v1/limits", "/v1/groups")
        ):
            continue

        @given(case=operation.as_strategy())
        @settings(
            max_examples=6,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            case.call_and_validate(
                base_url=stack.base, checks=[not_a_server_error, response_schema_conformance]
            )

        check()
        checked += 1
    assert checked > 20
