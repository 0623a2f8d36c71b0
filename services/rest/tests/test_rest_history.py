"""The history behind the dashboard's charts: the ring of samples (unit tests, explicit
times), and the sampler against a real api (private NATS, memory broker, real gRPC) on
the api's own fake clock, served by the history route and drawn on the queues page.
Nothing sleeps for time: the clock moves when a test says so."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import httpx
import pytest
from conveyor_api import ApiServer
from conveyor_broker import FakeClock
from conveyor_protos.v1 import task_pb2 as task_pb
from conveyor_rest.app import create_app
from conveyor_rest.dashboard import chart, per_minute, queue_charts, seconds
from conveyor_rest.history import HOUR, QueueHistory, QueueSampler, Sample, waited
from conveyor_runtime.nats_connect import NatsClient, connect_nats
from conveyor_runtime.settings import ApiSettings
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.polling import wait_until
from conveyor_testkit.webhooks import WEBHOOK_KEY, FakeDns

ADMIN = "charts-admin-secret-0123456789"
READER = "charts-reader-secret-0123456789"
T0 = datetime(2030, 1, 1, tzinfo=UTC).timestamp()


def sample(at: float, completed: int = 0, **counts: Any) -> Sample:
    return Sample(
        at=at,
        completed=completed,
        archived=counts.get("archived", 0),
        pending=counts.get("pending", 0),
        active=counts.get("active", 0),
        latency=counts.get("latency", 0.0),
    )


# ------------------------------------------------------------------ the ring


def test_points_are_the_changes_between_samples() -> None:
    history = QueueHistory(interval=10)
    history.record(T0, {"q": sample(T0, 5, archived=1)})
    history.record(T0 + 10, {"q": sample(T0 + 10, 8, archived=1, pending=2, latency=1.5)})
    history.record(T0 + 40, {"q": sample(T0 + 40, 20, archived=3)})
    # Retention purged ended tasks: the count went down, which is no completion.
    history.record(T0 + 50, {"q": sample(T0 + 50, 2)})
    points = history.points("q")
    assert [(p.completed, p.failed, p.per_minute) for p in points] == [
        (None, None, None),
        (3, 0, 18.0),
        (12, 2, 24.0),
        (0, 0, 0.0),
    ]
    assert points[1].sample.latency == 1.5
    assert history.points("unknown") == []
    assert history.last_at == T0 + 50


def test_the_ring_keeps_the_last_hour_only() -> None:
    history = QueueHistory(interval=60)
    for minute in range(90):
        at = T0 + 60 * minute
        history.record(at, {"q": sample(at, minute)})
    kept = history.samples("q")
    # The newest round is at 89 min: everything from 29 min on is within the hour.
    assert kept[0].at == T0 + 60 * 29
    assert kept[-1].at == T0 + 60 * 89
    assert len(kept) == 61
    # A queue that stopped being sampled ages out with its last sample.
    history.record(T0 + 60 * 89 + HOUR + 1, {"other": sample(T0 + 60 * 89 + HOUR + 1)})
    assert history.queues() == ["other"]


def test_a_late_sampler_still_holds_the_hour_and_the_ring_stays_bounded() -> None:
    history = QueueHistory(window=100, interval=10, max_queues=2)
    for n in range(50):  # faster than its interval: the ring's bound holds anyway
        history.record(T0 + n, {"a": sample(T0 + n), "b": sample(T0 + n), "c": sample(T0 + n)})
    assert len(history.samples("a")) == 100 // 10 + 2
    assert history.queues() == ["a", "b"], "no more than max_queues queues"


def test_waited_is_since_the_task_became_pending() -> None:
    task = task_pb.Task()
    assert waited(task, T0) == 0.0
    task.created_at.FromSeconds(int(T0) - 100)
    assert waited(task, T0) == 100.0
    task.updated_at.FromSeconds(int(T0) - 7)
    assert waited(task, T0) == 7.0
    assert waited(task, T0 - 60) == 0.0, "a clock behind the api's waits no time"


def test_charts_draw_the_values_on_the_hour_with_gaps() -> None:
    points = [(T0, 1.0), (T0 + 10, None), (T0 + 20, 4.0), (T0 + 30, 2.0)]
    svg = chart(
        points, now=T0 + 30, span=60, kind="throughput", label="per minute", show=per_minute
    )
    assert svg.count("<circle") == 1, "the lone value before the gap"
    assert svg.count("<polyline") == 1
    assert 'data-points="3"' in svg
    assert "2.0/min now, 4.0/min at most in the last 60 s" in svg
    assert "<svg" not in chart(
        [(T0, None)], now=T0, span=60, kind="latency", label="l", show=seconds
    )
    assert (seconds(0.25), seconds(12.0), seconds(600.0)) == ("250 ms", "12.0 s", "10.0 min")


def test_a_young_history_is_charted_over_the_time_it_covers() -> None:
    history = QueueHistory(interval=10)
    assert queue_charts(history, "q")[0].startswith('<span class="muted"')
    for n in range(4):
        at = T0 + 10 * n
        history.record(at, {"q": sample(at, 6 * n, latency=float(n))})
    rate, latency = queue_charts(history, "q")
    # 30 s of samples: drawn over ten samples' worth (100 s), not squeezed into an hour.
    assert "36/min now, 36/min at most in the last 100 s" in rate
    assert "3.0 s now, 3.0 s at most in the last 100 s" in latency
    for n in range(4, 400):
        at = T0 + 10 * n
        history.record(at, {"q": sample(at, 6 * n)})
    assert "in the last 60 min" in queue_charts(history, "q")[0]


# ------------------------------------------------------------- against an api


@dataclass
class Charts:
    """A REST app in front of a real api, its history and a sampler on the api's clock."""

    client: httpx.AsyncClient
    broker: CountingBroker
    clock: FakeClock
    history: QueueHistory
    sampler: QueueSampler


async def charts_stack(nats_url: str, token: str | None, **api: Any) -> AsyncIterator[Charts]:
    clock = FakeClock()
    broker = CountingBroker(clock)
    nc = await connect_nats(nats_url, name="rest-history-test")
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "nats_url": nats_url,
        "subject_prefix": f"t{uuid.uuid4().hex[:12]}",
        "broker": "memory",
        "allow_unauthenticated": True,
        "register_tick": 60.0,
        "webhook_secret_key": WEBHOOK_KEY,
        **api,
    }
    server = ApiServer(ApiSettings(**options), broker, nc, clock, resolve=FakeDns({}).lookup)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    history = QueueHistory(interval=10)
    app = create_app(f"127.0.0.1:{server.port}", channel=channel, history=history)
    sampler = QueueSampler(
        app.state.link.admin,
        history,
        interval=10,
        token=token,
        clock=lambda: clock.now().timestamp(),
    )
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://rest") as client:
            yield Charts(client, broker, clock, history, sampler)
    finally:
        await sampler.stop()
        await channel.close()
        await stop_api(server, broker, nc)


async def stop_api(server: ApiServer, broker: CountingBroker, nc: NatsClient) -> None:
    await server.stop(grace=1.0)
    await nc.close()
    await broker.close()


@pytest.fixture
async def charts(nats_url: str) -> AsyncIterator[Charts]:
    async for stack in charts_stack(nats_url, None):
        yield stack


pytestmark = pytest.mark.nats


async def complete(broker: CountingBroker, queue: str, n: int) -> None:
    """Lease ``n`` tasks of ``queue`` and complete them, as a worker would."""
    for task in await broker.lease(queue, n, timedelta(seconds=30)):
        assert task.lease_id is not None
        await broker.ack(task.id, task.lease_id, b"{}")


async def test_the_history_route_serves_what_the_sampler_took(charts: Charts) -> None:
    rest = charts.client
    for n in range(5):
        made = await rest.post("/v1/tasks", json={"type": "t", "queue": "charted", "payload": n})
        assert made.status_code == 200, made.text
    charts.clock.advance(timedelta(seconds=4))
    assert await charts.sampler.sample()
    await complete(charts.broker, "charted", 3)
    charts.clock.advance(timedelta(seconds=30))
    assert await charts.sampler.sample()

    got = await rest.get("/v1/queues/charted/history")
    assert got.status_code == 200, got.text
    body = got.json()
    assert (body["queue"], body["interval_seconds"], body["window_seconds"]) == (
        "charted",
        10,
        HOUR,
    )
    first, second = body["points"]
    assert first["at"] == "2030-01-01T00:00:04.000Z"
    assert (first["completed"], first["pending"], first["latency_seconds"]) == (None, 5, 4.0)
    assert second["at"] == "2030-01-01T00:00:34.000Z"
    assert (second["completed"], second["failed"], second["completed_per_minute"]) == (3, 0, 6.0)
    # The two left were enqueued at 0 s and are still pending at 34 s.
    assert (second["pending"], second["active"], second["latency_seconds"]) == (2, 0, 34.0)

    # A queue nobody sampled has no points; a bad name is the api's 400 problem.
    assert (await rest.get("/v1/queues/quiet/history")).json()["points"] == []
    bad = await rest.get("/v1/queues/a b/history")
    assert bad.status_code == 400
    assert bad.json()["code"] == "INVALID_ARGUMENT"

    # The queues page, opened after the samples, charts them.
    page = (await rest.get("/ui")).text
    row = page[page.index('<tr data-queue="charted">') :]
    row = row[: row.index("</tr>")]
    assert '<svg class="chart throughput"' in row
    assert "completed per minute: 6.0/min now" in row
    assert '<svg class="chart latency"' in row
    assert "oldest pending task waited: 34.0 s now" in row
    assert "sampled by this REST process every 10 s" in page


async def test_the_sampler_runs_in_the_background_until_stopped(charts: Charts) -> None:
    await charts.client.post("/v1/tasks", json={"type": "t", "queue": "bg"})
    charts.sampler.start()  # samples at once, then every interval
    await wait_until(lambda: charts.history.samples("bg") != [], within=10.0)
    await charts.sampler.stop()
    assert charts.history.samples("bg")[0].pending == 1


async def test_the_sampler_needs_a_token_that_may_read(nats_url: str) -> None:
    tokens = [f"ops:admin:{ADMIN}", f"viewer:read-only:{READER}"]
    auth = {"auth_tokens": tokens, "allow_unauthenticated": False}
    async for anonymous in charts_stack(nats_url, None, **auth):
        assert not await anonymous.sampler.sample()
        assert anonymous.history.queues() == []
    async for stack in charts_stack(nats_url, READER, **auth):
        admin = {"authorization": f"Bearer {ADMIN}"}
        await stack.client.post("/v1/tasks", json={"type": "t", "queue": "ro"}, headers=admin)
        assert await stack.sampler.sample()
        assert stack.history.queues() == ["ro"]
        # The history route asks the api whether the caller may read the queue's stats.
        refused = await stack.client.get("/v1/queues/ro/history")
        assert refused.status_code == 401
        reader = {"authorization": f"Bearer {READER}"}
        allowed = await stack.client.get("/v1/queues/ro/history", headers=reader)
        assert [p["pending"] for p in allowed.json()["points"]] == [1]
