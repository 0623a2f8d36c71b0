"""The Gateway on its own: a MemoryBroker on a FakeClock, the session's private
nats-server, and a transport that records what the worker would have been sent.

The gateway is not started here (nothing subscribes to dispatch offers): offers go to
:meth:`Gateway.accept` directly, the worker's answers to its ``on_*`` methods.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from conveyor_broker import Backoff, FakeClock, LeaseLost, NewTask, Task, TaskState
from conveyor_broker.memory import MemoryBroker
from conveyor_gateway import AckBatcher, Gateway, GatewayConfig, Outcomes, WakePublisher, WorkerSpec
from conveyor_gateway.attempt_bounds import DEADLINE_EXCEEDED_ERROR
from conveyor_gateway.credits import MAX_SLOTS, REDELIVERED_REASON
from conveyor_gateway.gateway import LEASE_LOST_REASON
from conveyor_gateway.outcomes import MAX_RETRY_AFTER
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.wire import task_to_envelope
from conveyor_testkit.polling import wait_until
from conveyor_testkit.transport import RecordingTransport as Recording

TTL = timedelta(seconds=30)
#: One second, then two, ...: exact, so retry times can be checked.
BACKOFF = Backoff(jitter=0.0)


@dataclass
class Parts:
    """What a gateway is built from."""

    broker: MemoryBroker
    bus: Bus
    clock: FakeClock
    acks: AckBatcher
    wakes: WakePublisher
    #: Every gateway made, closed after the test: their attempt timers must not outlive it.
    made: list[Gateway] = field(default_factory=list)

    @property
    def config(self) -> GatewayConfig:
        return GatewayConfig(
            lease_ttl=TTL, register_tick=60.0, max_result=100, backoff=BACKOFF, clock=self.clock
        )

    def gateway(
        self, queues: dict[str, int] | None = None, concurrency: int = 2, **options: Any
    ) -> tuple[Gateway, Recording]:
        transport = Recording()
        spec = WorkerSpec(queues=queues or {"q": 1}, concurrency=concurrency, worker_id="w")
        gateway = Gateway(
            "gw-test",
            spec,
            broker=self.broker,
            bus=self.bus,
            config=self.config,
            acks=self.acks,
            wakes=self.wakes,
            transport=transport,
            connected_at=self.clock.now(),
            **options,
        )
        self.made.append(gateway)
        return gateway, transport

    async def leased(self, n: int, queue: str = "q", **fields: Any) -> list[Task]:
        for _ in range(n):
            await self.broker.enqueue(NewTask(queue=queue, type="t", **fields))
        tasks = await self.broker.lease(queue, n, TTL)
        assert len(tasks) == n
        return tasks

    async def state(self, task_id: str) -> TaskState:
        return (await self.broker.get_task(task_id)).state


@pytest.fixture
async def parts(bus: Bus, clock: FakeClock) -> AsyncIterator[Parts]:
    broker = MemoryBroker(clock)
    p = Parts(broker, bus, clock, AckBatcher(broker), WakePublisher(bus))
    yield p
    for gateway in p.made:
        await gateway.close()
    await p.acks.aclose()
    await p.wakes.aclose()
    await broker.close()


def offer(tasks: Sequence[Task], queue: str = "q") -> cluster_pb2.DispatchRequest:
    return cluster_pb2.DispatchRequest(
        queue=queue, dispatcher="test", tasks=[task_to_envelope(t) for t in tasks]
    )


def lease_of(task: Task) -> str:
    assert task.lease_id is not None
    return task.lease_id


def result(task: Task, outcome: service_pb2.Outcome, **fields: Any) -> service_pb2.Result:
    return service_pb2.Result(task_id=task.id, lease_id=lease_of(task), outcome=outcome, **fields)


# -------------------------------------------------------------- dispatch


async def test_an_offer_is_held_and_handed_over_in_one_call_up_to_the_free_slots(
    parts: Parts,
) -> None:
    gateway, transport = parts.gateway(concurrency=2)
    tasks = await parts.leased(3)

    accepted = gateway.accept(offer(tasks))

    assert accepted == [tasks[0].id, tasks[1].id]
    assert transport.dispatched == [accepted]
    assert (gateway.in_flight, gateway.free("q")) == (2, 0)
    assert gateway.holds(tasks[0].id)
    assert gateway.holds_lease(lease_of(tasks[1]))
    assert not gateway.holds(tasks[2].id)
    assert gateway.free("elsewhere") == 0


async def test_a_task_dispatched_again_drops_its_old_lease_on_the_worker(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=2)
    (task,) = await parts.leased(1)
    gateway.accept(offer([task]))
    again = task_to_envelope(task)
    again.lease_id = "a-newer-lease"

    accepted = gateway.accept(cluster_pb2.DispatchRequest(queue="q", tasks=[again]))

    assert accepted == [task.id]
    assert transport.canceled == [(task.id, lease_of(task), REDELIVERED_REASON)]
    assert (gateway.in_flight, gateway.free("q")) == (1, 1)
    assert gateway.holds_lease("a-newer-lease")
    assert not gateway.holds_lease(lease_of(task))


async def test_an_offer_with_times_protobuf_refuses_is_refused_alone(parts: Parts) -> None:
    # Found by the fuzz suite: a forged offer whose deadline had nanos out of range made
    # accept raise (a ValueError from protobuf), so the gateway never answered and what it
    # had taken before it in the offer was held but never sent to the worker.
    gateway, transport = parts.gateway(concurrency=4)
    tasks = await parts.leased(4)
    envelopes = [task_to_envelope(t) for t in tasks]
    envelopes[1].deadline.nanos = -5
    envelopes[2].timeout.seconds = 2**62
    envelopes[3].deadline.seconds = 2**40

    accepted = gateway.accept(cluster_pb2.DispatchRequest(queue="q", tasks=envelopes))

    assert accepted == [tasks[0].id]
    assert transport.dispatched == [accepted]
    assert (gateway.in_flight, gateway.free("q")) == (1, 3)
    assert not any(gateway.holds(t.id) for t in tasks[1:])


async def test_an_envelope_whose_id_is_no_task_id_is_refused_alone(parts: Parts) -> None:
    # Found by the fuzz suite: a forged offer (sealed, so believed) of a task "fz" was
    # held and run; its ack then made the broker refuse the whole group commit it was in
    # (InvalidTask), so the other workers' acks in that batch were dropped too.
    gateway, transport = parts.gateway(concurrency=3)
    good, other = await parts.leased(2)
    forged = task_pb2.TaskEnvelope(id="fz", queue="q", lease_id="l-forged", attempt=1)

    accepted = gateway.accept(
        cluster_pb2.DispatchRequest(
            queue="q", tasks=[task_to_envelope(good), forged, task_to_envelope(other)]
        )
    )

    assert accepted == [good.id, other.id]
    assert transport.dispatched == [accepted]
    assert not gateway.holds("fz")
    gateway.on_results(
        [
            result(good, service_pb2.OUTCOME_SUCCESS),
            service_pb2.Result(
                task_id="fz", lease_id="l-forged", outcome=service_pb2.OUTCOME_SUCCESS
            ),
            result(other, service_pb2.OUTCOME_SUCCESS),
        ]
    )

    async def completed() -> bool:
        return [await parts.state(t.id) for t in (good, other)] == [TaskState.COMPLETED] * 2

    await wait_until(completed)


# ------------------------------------------------------------- results


async def test_results_free_their_slots_at_once_and_apply_in_the_broker(parts: Parts) -> None:
    gateway, _ = parts.gateway(concurrency=3)
    done, failed, released = await parts.leased(3)
    gateway.accept(offer([done, failed, released]))
    retry_after = service_pb2.Result().retry_after
    retry_after.FromSeconds(7)

    gateway.on_results(
        [
            result(done, service_pb2.OUTCOME_SUCCESS, result=b"ok"),
            result(failed, service_pb2.OUTCOME_FAILURE, error="boom", retry_after=retry_after),
            result(released, service_pb2.OUTCOME_RELEASE),
        ]
    )

    assert (gateway.in_flight, gateway.free("q")) == (0, 3)

    async def applied() -> bool:
        states = [await parts.state(t.id) for t in (done, failed, released)]
        return states == [TaskState.COMPLETED, TaskState.RETRY, TaskState.PENDING]

    await wait_until(applied)
    stored = await parts.broker.get_task(failed.id)
    assert (stored.last_error, stored.available_at) == (
        "boom",
        parts.clock.now() + timedelta(seconds=7),
    )
    assert (await parts.broker.get_task(done.id)).result == b"ok"


async def test_a_retry_after_past_ten_years_is_the_servers_backoff(parts: Parts) -> None:
    # Found by the fuzz suite: a Duration of 10,000 years (the longest protobuf allows) put
    # the retry past the last date Python represents; the broker raised OverflowError,
    # which the gateway took for an outage and retried for ever, the task leased all the
    # while and never retried.
    gateway, _ = parts.gateway(concurrency=3)
    tasks = await parts.leased(3)
    gateway.accept(offer(tasks))
    longest, past_limit, at_limit = (service_pb2.Result().retry_after for _ in range(3))
    longest.seconds = 315_576_000_000
    past_limit.FromTimedelta(MAX_RETRY_AFTER + timedelta(seconds=1))
    at_limit.FromTimedelta(MAX_RETRY_AFTER)

    gateway.on_results(
        [
            result(task, service_pb2.OUTCOME_FAILURE, error="later", retry_after=delay)
            for task, delay in zip(tasks, (longest, past_limit, at_limit), strict=True)
        ]
    )

    async def failed() -> bool:
        return [await parts.state(t.id) for t in tasks] == [TaskState.RETRY] * 3

    await wait_until(failed)
    due = [(await parts.broker.get_task(t.id)).available_at for t in tasks]
    backoff = parts.clock.now() + BACKOFF.delay(0)
    assert due == [backoff, backoff, parts.clock.now() + MAX_RETRY_AFTER]
    assert gateway.backlog == 0


async def test_a_result_for_a_lease_not_held_changes_nothing(parts: Parts) -> None:
    gateway, _ = parts.gateway()
    (task,) = await parts.leased(1)
    gateway.accept(offer([task]))

    stranger = service_pb2.Result(
        task_id=task.id, lease_id="not-ours", outcome=service_pb2.OUTCOME_SUCCESS
    )
    gateway.on_results([stranger, service_pb2.Result(task_id=task.id)])

    assert gateway.in_flight == 1
    assert await parts.state(task.id) == TaskState.ACTIVE


# -------------------------------------------------------- leases, cancel


async def test_the_heartbeat_extends_held_leases_but_the_skipped_and_says_so(
    parts: Parts,
) -> None:
    skips: set[str] = set()
    extended: list[tuple[list[str], datetime]] = []

    def on_extended(leases: Collection[str], until: datetime) -> None:
        extended.append((sorted(leases), until))

    gateway, _ = parts.gateway(heartbeat_skips=skips, on_extended=on_extended)
    beaten, skipped = await parts.leased(2)
    gateway.accept(offer([beaten, skipped]))
    skips.add(lease_of(skipped))
    parts.clock.advance(timedelta(seconds=10))

    gateway.on_heartbeat()

    await wait_until(lambda: bool(extended))
    until = parts.clock.now() + TTL
    assert extended == [([lease_of(beaten)], until)]
    assert (await parts.broker.get_task(beaten.id)).lease_expires_at == until
    assert (await parts.broker.get_task(skipped.id)).lease_expires_at == skipped.lease_expires_at


async def test_extend_held_extends_one_lease_and_drops_a_lost_one(parts: Parts) -> None:
    extended: list[tuple[list[str], datetime]] = []
    gateway, transport = parts.gateway(
        on_extended=lambda leases, until: extended.append((list(leases), until))
    )
    kept, lost = await parts.leased(2)
    gateway.accept(offer([kept, lost]))
    parts.clock.advance(timedelta(seconds=5))

    expires = await gateway.extend_held(kept.id, lease_of(kept))
    assert expires == parts.clock.now() + TTL
    assert extended == [([lease_of(kept)], expires)]
    assert await gateway.extend_held(kept.id, "not-held") is None

    await parts.broker.release(lost.id, lease_of(lost))  # behind the gateway's back
    with pytest.raises(LeaseLost):
        await gateway.extend_held(lost.id, lease_of(lost))
    assert transport.canceled == [(lost.id, lease_of(lost), LEASE_LOST_REASON)]
    assert gateway.in_flight == 1


async def test_a_lease_the_reaper_took_is_cancelled_and_one_merely_late_is_kept(
    parts: Parts,
) -> None:
    gateway, transport = parts.gateway(concurrency=2)
    first, second = await parts.leased(2)
    gateway.accept(offer([first, second]))
    parts.clock.advance(TTL + timedelta(seconds=5))
    # Past their expiry, but the broker still has them as this worker's: kept.
    assert await gateway.check_leases() == 0
    assert transport.canceled == []
    assert gateway.in_flight == 2
    # The reaper releases them; one is leased again by someone else meanwhile.
    assert len(await parts.broker.reap_expired_leases()) == 2
    await parts.broker.lease("q", 1, TTL)
    assert await gateway.check_leases() == 2
    assert sorted(t for t, _, _ in transport.canceled) == sorted([first.id, second.id])
    assert {reason for _, _, reason in transport.canceled} == {LEASE_LOST_REASON}
    assert (gateway.in_flight, gateway.free("q")) == (0, 2)
    # A late Result for a lost lease changes nothing.
    gateway.on_results([result(first, service_pb2.OUTCOME_SUCCESS)])
    assert await parts.state(first.id) is not TaskState.COMPLETED


async def test_a_heartbeat_moves_the_known_expiry_so_nothing_is_looked_up(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=1)
    (task,) = await parts.leased(1)
    gateway.accept(offer([task]))
    parts.clock.advance(TTL - timedelta(seconds=1))
    gateway.on_heartbeat()
    await wait_until(lambda: not gateway._leases._extending)
    parts.clock.advance(TTL - timedelta(seconds=1))
    assert await gateway.check_leases() == 0
    assert gateway.holds(task.id)
    assert transport.canceled == []


async def test_a_draining_gateway_takes_nothing_more_but_completes_what_it_holds(
    parts: Parts,
) -> None:
    gateway, transport = parts.gateway(concurrency=3)
    first, second = await parts.leased(2)
    gateway.accept(offer([first]))
    gateway.drain()
    assert gateway.draining
    assert gateway.free("q") == 0
    assert gateway.accept(offer([second])) == []
    gateway.on_credit("q", 4)
    assert gateway.free("q") == 0
    gateway.on_results([result(first, service_pb2.OUTCOME_SUCCESS)])

    async def completed() -> bool:
        return await parts.state(first.id) is TaskState.COMPLETED

    await wait_until(completed)
    assert transport.dispatched == [[first.id]]


async def test_cancel_tells_the_worker_and_refunds_the_slot(parts: Parts) -> None:
    gateway, transport = parts.gateway(concurrency=1)
    (task,) = await parts.leased(1)
    gateway.accept(offer([task]))

    assert gateway.cancel(task.id, "canceled by an operator")
    assert transport.canceled == [(task.id, lease_of(task), "canceled by an operator")]
    assert gateway.free("q") == 1
    assert not gateway.cancel(task.id, "again")


async def test_close_releases_what_is_held_and_takes_nothing_more(parts: Parts) -> None:
    gateway, _ = parts.gateway()
    first, second = await parts.leased(2)
    gateway.accept(offer([first]))

    await gateway.close()

    assert gateway.closed
    assert await parts.state(first.id) == TaskState.PENDING
    assert gateway.accept(offer([second])) == []
    assert gateway.free("q") == 0


# ------------------------------------------------ the primitives for webhooks


async def test_a_cap_leaves_the_kept_leases_their_slots_on_top(parts: Parts) -> None:
    gateway, _ = parts.gateway(queues={"a": 1, "b": 1}, concurrency=4)
    (kept,) = await parts.leased(1, "a")
    gateway.accept(offer([kept], "a"))

    gateway.cap_concurrency(0, kept=[lease_of(kept)])
    assert gateway.concurrency == 1
    assert (gateway.free("a"), gateway.free("b")) == (0, 0)

    gateway.cap_concurrency(1, kept=[lease_of(kept)])
    assert gateway.concurrency == 2
    assert (gateway.free("a"), gateway.free("b")) == (1, 1)

    gateway.cap_concurrency(0, kept=["not-held"])
    assert gateway.concurrency == 0

    gateway.cap_concurrency(None)
    assert gateway.concurrency == 4
    assert (gateway.free("a"), gateway.free("b")) == (1, 2)
    with pytest.raises(ValueError, match="cap"):
        gateway.cap_concurrency(-1)


async def test_credit_changes_a_queues_slots_and_a_cap_wins_over_it(parts: Parts) -> None:
    gateway, _ = parts.gateway(queues={"a": 1, "b": 1}, concurrency=2)
    gateway.on_credit("a", 3)
    assert gateway.concurrency == 5
    assert (gateway.free("a"), gateway.free("b")) == (4, 1)
    gateway.on_credit("b", -4)
    assert gateway.concurrency == 4
    assert (gateway.free("a"), gateway.free("b")) == (4, 0)
    gateway.on_credit("elsewhere", 7)
    assert gateway.concurrency == 4

    # A cap in force wins; the worker's adjustments come back when it lifts.
    gateway.cap_concurrency(1)
    assert gateway.concurrency == 1
    gateway.on_credit("a", 1)
    assert gateway.concurrency == 1
    gateway.cap_concurrency(None)
    assert gateway.concurrency == 5
    assert (gateway.free("a"), gateway.free("b")) == (5, 0)


async def test_credit_never_takes_a_worker_past_the_most_slots(parts: Parts) -> None:
    gateway, _ = parts.gateway(concurrency=2)
    gateway.on_credit("q", MAX_SLOTS)
    assert gateway.concurrency == MAX_SLOTS
    assert gateway.free("q") == MAX_SLOTS
    gateway.on_credit("q", 1)
    assert gateway.concurrency == MAX_SLOTS


async def test_adopt_holds_an_active_task_leased_elsewhere_with_its_bound(parts: Parts) -> None:
    gateway, _ = parts.gateway(queues={"q": 1}, concurrency=1)
    (task,) = await parts.leased(1, timeout=timedelta(seconds=60))
    (foreign,) = await parts.leased(1, "elsewhere")

    assert gateway.adopt(task)
    assert (gateway.in_flight, gateway.timed) == (1, 1)
    assert gateway.holds_lease(lease_of(task))
    assert not gateway.adopt(task)  # held already
    assert not gateway.adopt(foreign)  # not a queue it serves
    # Adopted past the concurrency: it counts, whatever room there was.
    (another,) = await parts.leased(1)
    assert gateway.adopt(another)
    assert (gateway.in_flight, gateway.free("q")) == (2, 0)


async def test_a_closed_gateway_adopts_nothing(parts: Parts) -> None:
    gateway, _ = parts.gateway()
    (task,) = await parts.leased(1)
    await gateway.close()
    assert not gateway.adopt(task)


async def test_forget_lets_a_delivery_go_without_a_broker_call(parts: Parts) -> None:
    gateway, transport = parts.gateway()
    (task,) = await parts.leased(1)
    gateway.accept(offer([task]))

    assert gateway.forget(lease_of(task))
    assert not gateway.forget(lease_of(task))
    assert gateway.in_flight == 0
    assert transport.canceled == []
    await gateway.close()  # nothing to release
    assert await parts.state(task.id) == TaskState.ACTIVE


async def test_fail_held_fails_the_attempt_with_the_backoff(parts: Parts) -> None:
    gateway, _ = parts.gateway()
    (task,) = await parts.leased(1)
    gateway.accept(offer([task]))

    assert await gateway.fail_held(lease_of(task), "stopped answering")
    assert not await gateway.fail_held(lease_of(task), "again")

    stored = await parts.broker.get_task(task.id)
    assert (stored.state, stored.last_error) == (TaskState.RETRY, "stopped answering")
    assert stored.available_at == parts.clock.now() + BACKOFF.delay(0)
    assert gateway.in_flight == 0


async def test_resolve_applies_a_result_held_or_not(parts: Parts) -> None:
    gateway, _ = parts.gateway()
    held, stranger, lost = await parts.leased(3)
    gateway.accept(offer([held]))

    assert await gateway.resolve(result(held, service_pb2.OUTCOME_SUCCESS), queue="q")
    assert gateway.in_flight == 0
    # Not held here (an earlier incarnation's delivery): the lease-scoped call only.
    assert not await gateway.resolve(result(stranger, service_pb2.OUTCOME_SUCCESS), queue="x")
    assert await gateway.resolve(result(stranger, service_pb2.OUTCOME_SKIP_RETRY), queue="q")
    await parts.broker.release(lost.id, lease_of(lost))
    assert not await gateway.resolve(result(lost, service_pb2.OUTCOME_SUCCESS))

    assert await parts.state(held.id) == TaskState.COMPLETED
    assert await parts.state(stranger.id) == TaskState.ARCHIVED
    assert await parts.state(lost.id) == TaskState.PENDING
    with pytest.raises(ValueError, match="final outcome"):
        await gateway.resolve(service_pb2.Result(task_id=held.id))


# -------------------------------------------------------------- outcomes


async def test_outcomes_need_no_gateway(parts: Parts) -> None:
    outcomes = Outcomes(
        "responder", broker=parts.broker, acks=parts.acks, wakes=parts.wakes, config=parts.config
    )
    (task,) = await parts.leased(1, "a")
    (foreign,) = await parts.leased(1, "b")

    with pytest.raises(ValueError, match="not served"):
        await outcomes.resolve(result(foreign, service_pb2.OUTCOME_SUCCESS), served={"a"})
    assert await outcomes.resolve(result(task, service_pb2.OUTCOME_SUCCESS), served={"a"})
    assert await parts.state(task.id) == TaskState.COMPLETED
    assert await parts.state(foreign.id) == TaskState.ACTIVE


async def test_a_failure_whose_retry_misses_the_deadline_is_archived(parts: Parts) -> None:
    gateway, _ = parts.gateway()
    deadline = parts.clock.now() + timedelta(milliseconds=500)  # before the 1 s backoff
    (task,) = await parts.leased(1, deadline=deadline, max_retry=5)
    gateway.accept(offer([task]))

    assert await gateway.resolve(result(task, service_pb2.OUTCOME_FAILURE, error="nope"))

    stored = await parts.broker.get_task(task.id)
    assert stored.state == TaskState.ARCHIVED
    assert stored.last_error == f"{DEADLINE_EXCEEDED_ERROR} (not retried): nope"


# ------------------------------------------------------------- holder


async def test_registrations_name_the_holder_of_the_gateways_leases(parts: Parts) -> None:
    heard: list[cluster_pb2.Register] = []
    await parts.bus.subscribe(cluster_pb2.Register, heard.append)
    await parts.bus.nc.flush()
    config = GatewayConfig(
        lease_ttl=TTL, register_tick=60.0, max_result=100, clock=parts.clock, holder="api~7"
    )
    gateway = Gateway(
        "gw-holder",
        WorkerSpec(queues={"q": 1, "r": 1}, concurrency=2),
        broker=parts.broker,
        bus=parts.bus,
        config=config,
        acks=parts.acks,
        wakes=parts.wakes,
        transport=Recording(),
        connected_at=parts.clock.now(),
    )
    parts.made.append(gateway)
    await gateway.start()
    await wait_until(lambda: len(heard) >= 2, within=5)
    await gateway.close()
    await wait_until(lambda: any(r.closing for r in heard), within=5)
    assert {(r.queue, r.holder) for r in heard} == {("q", "api~7"), ("r", "api~7")}
    # Without one configured, none is named.
    assert GatewayConfig(lease_ttl=TTL, register_tick=1.0, max_result=1).holder == ""


# -------------------------------------------------------------- metrics


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_outcomes_move_the_task_counters_and_the_run_time_histogram(parts: Parts) -> None:
    gateway, _ = parts.gateway(queues={"metrics-q": 1}, concurrency=3)
    done, failed, skipped = await parts.leased(3, queue="metrics-q")
    labels = {"queue": "metrics-q", "type": "t"}
    before = {
        name: _sample(name, **labels)
        for name in (
            "conveyor_tasks_completed_total",
            "conveyor_tasks_failed_total",
            "conveyor_tasks_retried_total",
            "conveyor_tasks_archived_total",
        )
    }
    runs = _sample("conveyor_task_run_seconds_count", queue="metrics-q")
    held = _sample("conveyor_leases_held")
    gateway.accept(offer([done, failed, skipped], queue="metrics-q"))
    assert _sample("conveyor_leases_held") == held + 3

    gateway.on_results(
        [
            result(done, service_pb2.OUTCOME_SUCCESS, result=b"ok"),
            result(failed, service_pb2.OUTCOME_FAILURE, error="boom"),
            result(skipped, service_pb2.OUTCOME_SKIP_RETRY, error="no"),
        ]
    )
    assert _sample("conveyor_leases_held") == held
    assert _sample("conveyor_task_run_seconds_count", queue="metrics-q") == runs + 3

    async def counted() -> bool:
        return {name: _sample(name, **labels) - n for name, n in before.items()} == {
            "conveyor_tasks_completed_total": 1,
            "conveyor_tasks_failed_total": 2,
            "conveyor_tasks_retried_total": 1,
            "conveyor_tasks_archived_total": 1,
        }

    await wait_until(counted)


async def test_group_commit_counts_the_tasks_it_created(parts: Parts) -> None:
    from conveyor_gateway import EnqueueCommitter

    committer = EnqueueCommitter(parts.broker, window=0.001, max_items=100)
    before = _sample("conveyor_tasks_enqueued_total", queue="metrics-enq", type="t")
    await committer.enqueue_many([NewTask(queue="metrics-enq", type="t") for _ in range(3)])
    dup = "01J0000000000000000000METR"
    await committer.enqueue(NewTask(id=dup, queue="metrics-enq", type="t"))
    await committer.enqueue(NewTask(id=dup, queue="metrics-enq", type="t"))
    await committer.aclose()
    assert _sample("conveyor_tasks_enqueued_total", queue="metrics-enq", type="t") == before + 4
