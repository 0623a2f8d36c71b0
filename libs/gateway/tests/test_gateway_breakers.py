"""Circuit breakers per task type in a gateway (conveyor_gateway.breakers): a MemoryBroker
on a FakeClock, the session's nats-server, offers made to the gateway directly and the
worker's Results fed to it, as in test_gateway.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import timedelta

import pytest
from conveyor_broker import (
    BreakerConfig,
    BreakerScope,
    BreakerStatus,
    FakeClock,
    NewTask,
    Task,
)
from conveyor_broker.memory import MemoryBroker
from conveyor_gateway import AckBatcher, BreakerConfigs, Gateway, GatewayConfig, WakePublisher
from conveyor_gateway.config import WorkerSpec
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.wire import task_to_envelope
from conveyor_testkit.polling import wait_until
from prometheus_client import REGISTRY

TTL = timedelta(seconds=30)
COOLDOWN = timedelta(seconds=10)


class Recording:
    def __init__(self) -> None:
        self.dispatched: list[str] = []

    def dispatch(self, tasks: Sequence[task_pb2.TaskEnvelope]) -> None:
        self.dispatched += [env.id for env in tasks]

    def dispatch_batch(self, batch: service_pb2.BatchDispatch) -> None:
        pass

    def cancel(self, task_id: str, lease_id: str, reason: str) -> None:
        pass


class Rig:
    def __init__(self, broker: MemoryBroker, bus: Bus, clock: FakeClock) -> None:
        self.broker, self.bus, self.clock = broker, bus, clock
        self.configs = BreakerConfigs(broker)
        self.acks = AckBatcher(broker)
        self.wakes = WakePublisher(bus)
        self.transport = Recording()
        self.gateway = Gateway(
            "gw-brk",
            WorkerSpec(queues={"q": 1}, concurrency=10, worker_id="w-1"),
            broker=broker,
            bus=bus,
            config=GatewayConfig(lease_ttl=TTL, register_tick=60.0, max_result=100, clock=clock),
            acks=self.acks,
            wakes=self.wakes,
            transport=self.transport,
            connected_at=clock.now(),
            breakers=self.configs,
        )

    def configure(self, scope: BreakerScope = BreakerScope.WORKER) -> None:
        self.configs.set(
            [
                BreakerConfig(
                    queue="q",
                    pattern="flaky*",
                    failures=3,
                    window=timedelta(seconds=60),
                    cooldown=COOLDOWN,
                    scope=scope,
                )
            ]
        )

    async def leased(self, task_type: str, n: int = 1) -> list[Task]:
        for _ in range(n):
            await self.broker.enqueue(NewTask(queue="q", type=task_type))
        return await self.broker.lease("q", n, TTL, only_types=[task_type])

    def offer(self, tasks: Sequence[Task], *, probe: bool = False) -> cluster_pb2.DispatchReply:
        envelopes = [task_to_envelope(t) for t in tasks]
        for env in envelopes:
            env.probe = probe
        request = cluster_pb2.DispatchRequest(queue="q", dispatcher="d", tasks=envelopes)
        return self.gateway._credits.answer(request)

    def finish(self, task: Task, *, ok: bool) -> None:
        outcome = service_pb2.OUTCOME_SUCCESS if ok else service_pb2.OUTCOME_FAILURE
        self.gateway.on_results(
            [service_pb2.Result(task_id=task.id, lease_id=task.lease_id or "", outcome=outcome)]
        )

    async def fail_through(self, n: int, task_type: str = "flaky") -> None:
        for task in await self.leased(task_type, n):
            assert self.offer([task]).accepted == [task.id]
            self.finish(task, ok=False)


@pytest.fixture
async def rig(bus: Bus, clock: FakeClock) -> AsyncIterator[Rig]:
    broker = MemoryBroker(clock)
    r = Rig(broker, bus, clock)
    yield r
    await r.gateway.close()
    await r.acks.aclose()
    await r.wakes.aclose()
    await broker.close()


async def test_a_workers_breaker_blocks_its_type_after_the_failures(rig: Rig) -> None:
    rig.configure()
    await rig.fail_through(2)
    assert rig.gateway._credits.blocked("q") == []
    await rig.fail_through(1)
    assert rig.gateway._credits.blocked("q") == ["flaky"]
    # A task of the type offered anyway is refused; other types go on.
    (flaky,) = await rig.leased("flaky")
    (other,) = await rig.leased("other")
    reply = rig.offer([flaky, other])
    assert list(reply.accepted) == [other.id]
    assert list(reply.blocked_types) == ["flaky"]

    async def stored() -> bool:
        return [b.status for b in await rig.broker.list_breakers("q")] == [BreakerStatus.OPEN]

    await wait_until(stored)
    (row,) = await rig.broker.list_breakers("q")
    assert (row.type, row.gateway, row.worker_id, row.failures) == ("flaky", "gw-brk", "w-1", 3)
    assert row.until == rig.clock.now() + COOLDOWN


async def test_a_half_open_breaker_lets_one_probe_through_and_its_success_closes_it(
    rig: Rig,
) -> None:
    rig.configure()
    await rig.fail_through(3)
    rig.clock.advance(COOLDOWN)
    rig.gateway.breakers.tick("q", "flaky")  # type: ignore[union-attr]
    assert rig.gateway._credits.blocked("q") == []  # half-open: announced again
    first, second = await rig.leased("flaky", 2)
    assert list(rig.offer([first, second]).accepted) == [first.id]  # the probe alone
    assert rig.gateway._credits.blocked("q") == ["flaky"]  # until its outcome
    rig.finish(first, ok=True)
    assert rig.gateway._credits.blocked("q") == []

    async def dropped() -> bool:
        return await rig.broker.list_breakers("q") == []

    await wait_until(dropped)
    # Closed: the count starts afresh.
    await rig.fail_through(2)
    assert rig.gateway._credits.blocked("q") == []


async def test_a_failed_probe_opens_it_again(rig: Rig) -> None:
    rig.configure()
    await rig.fail_through(3)
    rig.clock.advance(COOLDOWN)
    rig.gateway.breakers.tick("q", "flaky")  # type: ignore[union-attr]
    (probe,) = await rig.leased("flaky")
    assert list(rig.offer([probe]).accepted) == [probe.id]
    rig.finish(probe, ok=False)
    assert rig.gateway._credits.blocked("q") == ["flaky"]
    breakers = rig.gateway.breakers
    assert breakers is not None
    assert breakers.opened == 2


async def test_types_without_a_config_and_successes_open_nothing(rig: Rig) -> None:
    rig.configure()
    await rig.fail_through(5, task_type="other")  # no pattern matches "other"
    for task in await rig.leased("flaky", 5):
        rig.offer([task])
        rig.finish(task, ok=True)
    assert rig.gateway._credits.blocked("q") == []


async def test_a_queue_wide_breaker_is_stored_for_the_dispatchers_and_its_probe_closes_it(
    rig: Rig,
) -> None:
    rig.configure(BreakerScope.QUEUE)
    await rig.fail_through(2)
    running = await rig.leased("flaky", 3)
    assert len(rig.offer(running).accepted) == 3  # still closed: taken
    await rig.fail_through(1)
    # Blocked here too while it cools down (the dispatchers hear of it a moment later).
    assert rig.gateway._credits.blocked("q") == ["flaky"]
    (early,) = await rig.leased("flaky")
    assert list(rig.offer([early]).accepted) == []

    async def stored() -> bool:
        rows = await rig.broker.list_breakers("q")
        return [(b.gateway, b.status) for b in rows] == [("", BreakerStatus.OPEN)]

    await wait_until(stored)
    # Failures of attempts that were running when it opened do not open it again.
    for task in running:
        rig.finish(task, ok=False)
    breakers = rig.gateway.breakers
    assert breakers is not None
    assert breakers.opened == 1
    (probe,) = await rig.leased("flaky")
    assert list(rig.offer([probe], probe=True).accepted) == [probe.id]
    rig.finish(probe, ok=True)

    async def dropped() -> bool:
        return await rig.broker.list_breakers("q") == []

    await wait_until(dropped)
    assert breakers.closed == 1


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_openings_and_closings_are_counted_and_the_states_read_at_scrape_time(
    rig: Rig,
) -> None:
    labels = {"queue": "q", "type": "flaky"}
    transitions = "conveyor_type_breaker_transitions_total"
    opened = _sample(transitions, event="opened", **labels) or 0.0
    closed = _sample(transitions, event="closed", **labels) or 0.0
    rig.configure()
    await rig.fail_through(2)
    # Counting failures: a breaker, closed.
    assert _sample("conveyor_type_breaker_state", **labels) == 0
    assert _sample("conveyor_type_breakers_open", **labels) == 0
    await rig.fail_through(1)
    assert _sample("conveyor_type_breaker_state", **labels) == 2
    assert _sample("conveyor_type_breakers_open", **labels) == 1
    assert _sample(transitions, event="opened", **labels) == opened + 1
    # Its cool-down over, it reads half-open before any timer has run.
    rig.clock.advance(COOLDOWN)
    assert _sample("conveyor_type_breaker_state", **labels) == 1
    rig.gateway.breakers.tick("q", "flaky")  # type: ignore[union-attr]
    (probe,) = await rig.leased("flaky")
    assert list(rig.offer([probe]).accepted) == [probe.id]
    assert _sample("conveyor_type_breaker_state", **labels) == 1
    rig.finish(probe, ok=True)
    assert _sample("conveyor_type_breaker_state", **labels) == 0
    assert _sample("conveyor_type_breakers_open", **labels) == 0
    assert _sample(transitions, event="closed", **labels) == closed + 1
    # A gateway closed reports nothing more.
    breakers = rig.gateway.breakers
    assert breakers is not None
    await breakers.aclose()
    assert _sample("conveyor_type_breaker_state", **labels) is None


async def test_a_queue_wide_breaker_reads_open_for_its_cool_down_where_it_opened(
    rig: Rig,
) -> None:
    labels = {"queue": "q", "type": "flaky"}
    rig.configure(BreakerScope.QUEUE)
    await rig.fail_through(3)
    assert _sample("conveyor_type_breaker_state", **labels) == 2
    assert _sample("conveyor_type_breakers_open", **labels) == 1
    rig.clock.advance(COOLDOWN)
    # From here on the dispatchers and the probe decide: closed as far as it knows.
    assert _sample("conveyor_type_breaker_state", **labels) == 0
