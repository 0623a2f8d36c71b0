"""The memory and Postgres brokers agree: random operation sequences, same observable state.

Each example applies one random sequence of operations to a MemoryBroker and to a
PostgresBroker (in a fresh schema), each on its own FakeClock moved identically. Task ids
come from a small fixed pool so operations collide (idempotent enqueue, unique keys,
lease-scoped calls on the wrong task). After every operation the two must agree on the
outcome (value or exception type), the events reported, the dependency work reported to
the dependency sink, and the observable state: every task (except its lease id, which is
random), queue_stats, pending_count, due_queues, due_among, the webhook worker
registrations, the cron entries (with what is due), the group configs, stats and due
groups, and each task's dependency edges both ways.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest
from conveyor_broker.clock import FakeClock
from conveyor_broker.cron import CronSchedule
from conveyor_broker.errors import BrokerError
from conveyor_broker.interface import Broker
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_broker.types import (
    CronEntry,
    CronEntrySpec,
    CronFired,
    CronMisfire,
    DependencyListParams,
    DependencyPage,
    DueGroup,
    EnqueueResult,
    GroupConfig,
    GroupStats,
    HolderReleaseParams,
    LeaseReapParams,
    NewTask,
    OnFailure,
    QueueStats,
    RateGrant,
    RateLimit,
    ReapedTask,
    ReleasedTask,
    Resolution,
    Task,
    TaskEvent,
    TaskListParams,
    TaskState,
    TerminalPurgeParams,
    WebhookWorker,
    WebhookWorkerSpec,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ulid import ULID

pytestmark = pytest.mark.postgres

if TYPE_CHECKING:
    Pool = asyncpg.Pool[asyncpg.Record]

QUEUES = ("alpha", "beta")
SLOTS = 10
#: Fixed, ordered task ids, so both brokers see the same ids and the same id order.
IDS = [str(ULID.from_int((1 << 80) * 1_000_000 + n)) for n in range(SLOTS)]
#: The holders leases name (see Broker.release_dead_holders).
HOLDERS = ("h1", "h2")
#: A well-formed lease id that no broker ever hands out.
STALE_LEASE = str(ULID.from_int(7))


@dataclass
class Side:
    """One broker under test, its clock, the lease ids it handed out, its events and
    what it reported to its dependency sink."""

    broker: Broker
    clock: FakeClock
    leases: dict[str, str]
    events: list[TaskEvent]
    resolutions: list[Resolution] = field(default_factory=list)

    async def lease(
        self, queue: str, limit: int, ttl: timedelta, holders: tuple[str, ...] = ()
    ) -> list[Task]:
        leased = await self.broker.lease(queue, limit, ttl, holders=holders)
        self.leases.update((t.id, t.lease_id or "") for t in leased)
        return leased

    async def target(self, pick: int, live: bool) -> tuple[str, str]:
        """The (task id, lease id) a lease-scoped operation uses.

        With ``live``: one of the ACTIVE tasks under its current lease, leasing one first
        when none is out and some queue has due work (random sequences rarely line up
        enqueue, lease and outcome by themselves). Otherwise, or when there is nothing
        to lease: a slot under the last lease this side saw for it (often lost by now).
        """
        if live:
            active = (
                await self.broker.list_tasks(TaskListParams(state=TaskState.ACTIVE, limit=100))
            ).tasks
            if not active:
                due = await self.broker.pending_count()
                if due:
                    active = await self.lease(min(due), 1, timedelta(seconds=30))
            if active:
                task = active[pick % len(active)]
                return task.id, self.leases.get(task.id, STALE_LEASE)
        task_id = IDS[pick % SLOTS]
        return task_id, self.leases.get(task_id, STALE_LEASE)


# ---------------------------------------------------------------------------- operations


@dataclass(frozen=True)
class Spec:
    """One task to enqueue; times are seconds relative to now."""

    slot: int
    queue: str
    delay: int | None
    unique: str | None
    unique_ttl: int | None
    expires_in: int | None
    max_retry: int
    group: bool
    #: Dependencies, as offsets from ``slot``.
    deps: tuple[int, ...]
    on_failure: OnFailure
    retention: int | None

    def build(self, now: datetime) -> NewTask:
        return NewTask(
            queue=self.queue,
            type="equivalence",
            payload=f"payload-{self.slot}".encode(),
            id=IDS[self.slot],
            max_retry=self.max_retry,
            process_at=None if self.delay is None else now + timedelta(seconds=self.delay),
            expires_at=None
            if self.expires_in is None
            else now + timedelta(seconds=self.expires_in),
            retention=None if self.retention is None else timedelta(seconds=self.retention),
            unique_key=self.unique,
            unique_ttl=None
            if self.unique is None or self.unique_ttl is None
            else timedelta(seconds=self.unique_ttl),
            group="g" if self.group else None,
            depends_on=tuple(IDS[(self.slot + dep) % SLOTS] for dep in self.deps),
            on_failure=self.on_failure,
        )


WEBHOOKS = ("hook-a", "hook-b")


@dataclass(frozen=True)
class Hook:
    """One webhook registration to upsert (concurrency 0 is invalid on purpose)."""

    name: str
    queues: tuple[str, ...]
    concurrency: int
    timeout_ms: int
    paused: bool
    secrets: tuple[str, ...]
    batch_types: tuple[str, ...] = ()

    def build(self) -> WebhookWorkerSpec:
        return WebhookWorkerSpec(
            name=self.name,
            url=f"https://hooks.example.com/{self.name}",
            queues={queue: n + 1 for n, queue in enumerate(self.queues)},
            concurrency=self.concurrency,
            timeout=timedelta(milliseconds=self.timeout_ms),
            paused=self.paused,
            secrets=self.secrets,
            batch_types=self.batch_types,
        )


CRONS = ("cron-a", "cron-b")


@dataclass(frozen=True)
class Cron:
    """One cron entry to upsert (the last schedule never fires: refused)."""

    name: str
    schedule: str
    queue: str
    paused: bool
    skip: bool

    def build(self) -> CronEntrySpec:
        return CronEntrySpec(
            name=self.name,
            schedule=self.schedule,
            task=NewTask(self.queue, "cron", payload=self.name.encode(), headers={"h": "v"}),
            timezone="Europe/Paris",
            paused=self.paused,
            misfire=CronMisfire.SKIP if self.skip else CronMisfire.RUN_ONCE,
        )


async def _fire(b: Broker, name: str, stale: bool, with_slot: bool) -> CronFired:
    """Fire entry ``name``'s next run as a scheduler would (or one that read a stale one)."""
    entries = {entry.name: entry for entry in await b.list_cron_entries()}
    entry = entries.get(name)
    expected = entry.next_run_at if entry is not None else None
    if expected is None or stale:
        expected = datetime(2030, 1, 1, 0, 5, tzinfo=UTC)
    schedule = CronSchedule.parse(entry.schedule if entry else "* * * * *", "Europe/Paris")
    return await b.fire_cron_entry(
        name, expected, schedule.next_after(expected), expected if with_slot else None
    )


@dataclass(frozen=True)
class Op:
    """An operation: a broker method name and its arguments (slots stand for task ids)."""

    name: str
    args: tuple[Any, ...] = ()

    async def apply(self, side: Side) -> Any:
        b, now, a = side.broker, side.clock.now(), self.args
        match self.name:
            case "enqueue" | "enqueue_run":
                return await b.enqueue_batch([spec.build(now) for spec in a[0]])
            case "lease":
                queue = a[0]
                if a[3]:
                    # Aim at a queue with due work, when there is one (both sides agree
                    # on which while their states agree).
                    queue = min(await b.pending_count(), default=queue)
                # One holder for all (which of several holders a task gets is not part
                # of the contract): nobody, or a name.
                return await side.lease(queue, a[1], timedelta(seconds=a[2]), (a[4],) * a[1])
            case "extend":
                return await b.extend_lease(*await side.target(*a), timedelta(seconds=5))
            case "ack":
                return await b.ack(*await side.target(*a), b"done")
            case "fail":
                task_id, lease_id = await side.target(a[0], a[1])
                return await b.fail(
                    task_id, lease_id, "boom", timedelta(seconds=a[2]), skip_retry=a[3]
                )
            case "release":
                return await b.release(*await side.target(*a))
            case "archive":
                return await b.archive(*await side.target(*a), "given up")
            case "reap":
                return await b.reap_expired_leases(
                    LeaseReapParams(limit=a[0], retry_delay=timedelta(seconds=a[1]))
                )
            case "beat":
                return await b.beat_holder(a[0])
            case "release_dead":
                return await b.release_dead_holders(
                    HolderReleaseParams(
                        silence=timedelta(seconds=a[0]), alive=frozenset(a[1]), limit=a[2]
                    )
                )
            case "promote":
                return await b.promote_scheduled(a[0])
            case "purge":
                return await b.purge_terminal(
                    TerminalPurgeParams(
                        archive_retention=timedelta(seconds=a[0]),
                        default_retention=timedelta(seconds=a[1]),
                        limit=a[2],
                    )
                )
            case "archive_expired":
                return await b.archive_expired(a[0])
            case "cancel":
                return await b.cancel_task(IDS[a[0]])
            case "run_now":
                return await b.run_task_now(IDS[a[0]])
            case "reschedule":
                return await b.reschedule_task(IDS[a[0]], now + timedelta(seconds=a[1]))
            case "archive_task":
                return await b.archive_task(IDS[a[0]])
            case "revive":
                return await b.revive_task(IDS[a[0]])
            case "delete":
                return await b.delete_task(IDS[a[0]])
            case "finish":
                # End what is due (a few of each queue), so dependencies end often.
                ended = []
                for queue in sorted(await b.pending_count()):
                    for task in await side.lease(queue, 3, timedelta(seconds=30)):
                        lease = task.lease_id or ""
                        if a[0]:
                            ended.append(await b.ack(task.id, lease, b"ok"))
                        else:
                            ended.append(
                                await b.fail(task.id, lease, "no", timedelta(0), skip_retry=True)
                            )
                return ended
            case "resolve":
                return await b.resolve_dependents([IDS[slot] for slot in a[0]], a[1])
            case "sweep":
                return await b.promote_ready_dependents(a[0], min_age=timedelta(seconds=a[1]))
            case "pause":
                return await b.set_queue_paused(a[0], a[1])
            case "advance":
                return side.clock.advance(timedelta(milliseconds=a[0]))
            case "webhook_upsert":
                # A few in a row, so that replaces (and their secret rules) come up often.
                return [await b.upsert_webhook_worker(hook.build()) for hook in a[0]]
            case "webhook_pause":
                return await b.set_webhook_worker_paused(a[0], a[1])
            case "webhook_delete":
                return await b.delete_webhook_worker(a[0])
            case "webhook_secrets":
                return await b.replace_webhook_secrets(a[0], a[1], a[2])
            case "cron_upsert":
                return [await b.upsert_cron_entry(cron.build()) for cron in a[0]]
            case "cron_pause":
                return await b.set_cron_paused(a[0], a[1])
            case "cron_delete":
                return await b.delete_cron_entry(a[0])
            case "cron_fire":
                return await _fire(b, a[0], a[1], a[2])
            case "group_set":
                return await b.set_group_config(
                    GroupConfig(a[0], a[1], a[2], timedelta(seconds=a[3]), timedelta(seconds=a[4]))
                )
            case "group_delete":
                return await b.delete_group_config(a[0], a[1])
            case "rate_set":
                return await b.set_rate_limit(RateLimit(a[0], a[1], a[2]))
            case "rate_delete":
                return await b.delete_rate_limit(a[0])
            case "rate_take":
                return await b.take_rate_tokens(a[0], a[1])
            case "rate_return":
                return await b.return_rate_tokens(a[0], a[1])
            case "lease_group":
                leased = await b.lease_group(a[0], "g", a[1], timedelta(seconds=a[2]))
                side.leases.update((t.id, t.lease_id or "") for t in leased)
                return leased
        raise AssertionError(f"unknown operation {self.name}")


slots = st.integers(0, SLOTS - 1)
# Mostly one queue, so that leases find the tasks just enqueued.
queues = st.sampled_from([QUEUES[0]] * 3 + [QUEUES[1]])
seconds = st.integers(0, 30)
limits = st.integers(1, 3)
# Which task a lease-scoped operation targets; mostly a live lease, sometimes a lost one.
targets = st.tuples(slots, st.sampled_from([True, True, True, False]))


# Few distinct values, so that keys collide and times line up often.
specs = st.builds(
    Spec,
    slot=slots,
    queue=queues,
    delay=st.sampled_from([None] * 5 + [-5, 3, 20]),
    unique=st.sampled_from([None] * 6 + ["k1", "k2"]),
    unique_ttl=st.sampled_from([None, 4, 15]),
    expires_in=st.sampled_from([None, None, None, 5, 20]),
    max_retry=st.integers(0, 3),
    # Grouped tasks wait for lease_group.
    group=st.sampled_from([False] * 5 + [True]),
    # Slots a few after or before the task's own (so never itself): often stored or in
    # the same batch; an unknown one fails the whole batch, and so does a cycle.
    deps=st.sampled_from([()] * 4 + [(1,), (SLOTS - 1,), (SLOTS - 2,), (1, SLOTS - 1), (2,)]),
    on_failure=st.sampled_from(list(OnFailure)),
    retention=st.sampled_from([None, None, 0, 10]),
)


hooks = st.builds(
    Hook,
    name=st.sampled_from(WEBHOOKS),
    # Mostly valid; the last choice of each is invalid, so rejects are compared too.
    queues=st.sampled_from([(QUEUES[0],), QUEUES] * 4 + [()]),
    concurrency=st.sampled_from([1, 5] * 4 + [0]),
    timeout_ms=st.sampled_from([1, 30_000] * 4 + [0]),
    paused=st.booleans(),
    secrets=st.sampled_from([(), ("s1",), ("s2", "s1")] * 3 + [("",)]),
    batch_types=st.sampled_from([(), ("b.t",), ("b.t", "a.t", "b.t")] * 3 + [("",)]),
)
webhook_names = st.sampled_from(WEBHOOKS)
crons = st.builds(
    Cron,
    name=st.sampled_from(CRONS),
    schedule=st.sampled_from(["* * * * *", "*/5 * * * * *", "@every 7s", "0 0 31 2 *"]),
    queue=queues,
    paused=st.sampled_from([False] * 4 + [True]),
    skip=st.booleans(),
)
cron_names = st.sampled_from(CRONS)

_ARGS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "enqueue": st.tuples(st.lists(specs, min_size=1, max_size=3).map(tuple)),
    "lease": st.tuples(
        queues,
        limits,
        st.integers(5, 60),
        st.sampled_from([True] * 3 + [False]),
        # Who holds the leases ("": nobody).
        st.sampled_from(["", "", *HOLDERS]),
    ),
    "beat": st.tuples(st.sampled_from(HOLDERS)),
    "release_dead": st.tuples(st.integers(1, 20), st.sampled_from([(), (), ("h2",)]), limits),
    # Neighbouring slots in one batch, so that their dependencies meet within it.
    "enqueue_run": st.tuples(
        st.tuples(slots, st.lists(specs, min_size=2, max_size=4)).map(
            lambda v: tuple(replace(spec, slot=(v[0] + i) % SLOTS) for i, spec in enumerate(v[1]))
        )
    ),
    "extend": targets,
    "ack": targets,
    "fail": st.tuples(targets, st.integers(0, 10), st.sampled_from([False] * 3 + [True])).map(
        lambda v: (*v[0], v[1], v[2])
    ),
    "release": targets,
    "archive": targets,
    "reap": st.tuples(limits, st.integers(0, 10)),
    "promote": st.tuples(limits),
    "purge": st.tuples(seconds, seconds, limits),
    "archive_expired": st.tuples(limits),
    "cancel": st.tuples(slots),
    "run_now": st.tuples(slots),
    "reschedule": st.tuples(slots, st.integers(-10, 30)),
    "archive_task": st.tuples(slots),
    "revive": st.tuples(slots),
    "delete": st.tuples(slots),
    "resolve": st.tuples(st.lists(slots, min_size=1, max_size=4).map(tuple), limits),
    "sweep": st.tuples(limits, st.sampled_from([0, 0, 5])),
    "finish": st.tuples(st.sampled_from([True, True, False])),
    "pause": st.tuples(queues, st.booleans()),
    "advance": st.tuples(st.integers(1, 15_000)),
    "webhook_upsert": st.tuples(st.lists(hooks, min_size=1, max_size=4).map(tuple)),
    "webhook_pause": st.tuples(webhook_names, st.booleans()),
    "webhook_delete": st.tuples(webhook_names),
    "webhook_secrets": st.tuples(
        webhook_names,
        st.sampled_from([(), ("s1",), ("s2", "s1")]),
        st.sampled_from([("s3",), ("s3", "s2"), ()]),
    ),
    "group_set": st.tuples(
        queues,
        st.sampled_from(["*", "g", "?", "h*"]),
        st.integers(1, 3),
        st.integers(1, 20),
        st.integers(1, 10),
    ),
    "group_delete": st.tuples(queues, st.sampled_from(["*", "g"])),
    "lease_group": st.tuples(queues, limits, st.integers(5, 60)),
    "rate_set": st.tuples(queues, st.sampled_from([0.5, 2.0, 40.0]), st.integers(1, 4)),
    "rate_delete": st.tuples(queues),
    "rate_take": st.tuples(queues, st.integers(1, 5)),
    "rate_return": st.tuples(queues, st.integers(1, 3)),
    "cron_upsert": st.tuples(st.lists(crons, min_size=1, max_size=3).map(tuple)),
    "cron_pause": st.tuples(cron_names, st.booleans()),
    "cron_delete": st.tuples(cron_names),
    "cron_fire": st.tuples(
        cron_names, st.sampled_from([False] * 3 + [True]), st.sampled_from([True] * 3 + [False])
    ),
}
# Weighted towards what moves tasks through their lives: enqueue, lease, outcomes, time.
# (one_of does not weight repeated branches; sampled_from does.)
_KINDS = [
    *["enqueue", "lease"] * 6,
    *["enqueue_run"] * 3,
    *["fail"] * 4,
    *["ack", "advance"] * 3,
    *["beat", "release_dead"] * 2,
    *["resolve", "sweep", "finish"] * 2,
    "release",
    "webhook_upsert",
    "cron_upsert",
    "cron_fire",
    "lease_group",
    "rate_take",
    *_ARGS,
]
operations = st.sampled_from(_KINDS).flatmap(
    lambda kind: _ARGS[kind].map(lambda args: Op(kind, args))
)


# ---------------------------------------------------------------------------- comparison


def _task(task: Task) -> Task:
    return replace(task, lease_id=None, headers=dict(task.headers))


def _normal(value: Any) -> Any:
    """What may be compared across brokers: lease ids are random, everything else not."""
    if isinstance(value, Task):
        return _task(value)
    if isinstance(value, EnqueueResult):
        return (_task(value.task), value.created)
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, QueueStats):
        return (value.queue, value.paused, dict(value.counts))
    if isinstance(value, WebhookWorker):
        return replace(value, queues=dict(value.queues))
    if isinstance(value, Resolution):
        return replace(value, promoted=dict(value.promoted))
    if isinstance(value, DependencyPage):
        return (value.links, value.next_cursor)
    if isinstance(value, CronEntry):
        return replace(value, task=replace(value.task, headers=dict(value.task.headers)))
    if isinstance(value, CronFired):
        return (value.applied, _normal(value.entry), _normal(value.task))
    if isinstance(value, GroupConfig | GroupStats | DueGroup | RateLimit | RateGrant):
        return value
    if isinstance(value, ReapedTask | ReleasedTask | datetime | dict | int | bool) or value is None:
        return value
    raise AssertionError(f"no normal form for {value!r}")


async def _outcome(op: Op, side: Side) -> Any:
    try:
        return ("ok", _normal(await op.apply(side)))
    except BrokerError as exc:
        # Not existing_id: with several conflicts in one batch, which holder is named is
        # not part of the contract.
        return ("raised", type(exc).__name__)


async def _snapshot(broker: Broker) -> tuple[Any, ...]:
    page = await broker.list_tasks(TaskListParams(limit=1000))
    edges = [
        _normal(await broker.list_dependencies(DependencyListParams(t.id, dependents=both)))
        for t in page.tasks
        for both in (False, True)
    ]
    return (
        _normal(page.tasks),
        page.next_cursor,
        _normal(await broker.queue_stats()),
        await broker.pending_count(),
        await broker.due_queues(),
        await broker.due_among([*QUEUES, "gamma"]),
        _normal(await broker.list_webhook_workers()),
        _normal(await broker.list_cron_entries()),
        _normal(await broker.list_due_cron_entries()),
        await broker.list_group_configs(),
        await broker.group_stats(),
        await broker.due_groups(),
        await broker.list_rate_limits(),
        edges,
    )


def _drain(side: Side) -> Counter[TaskEvent]:
    # Events of one operation are compared as a multiset: the order of events within one
    # committed batch is not part of the contract.
    events = Counter(side.events)
    side.events.clear()
    return events


@dataclass(frozen=True)
class Schema:
    """A migrated schema for the Postgres side, emptied before every example."""

    pool: Pool
    tables: list[str]

    async def empty(self) -> None:
        # Truncating is much cheaper than a fresh schema per example, which matters
        # when hypothesis shrinks a failure through hundreds of examples.
        async with self.pool.acquire() as conn:
            await conn.execute(f"TRUNCATE {', '.join(self.tables)}")


@pytest.fixture
async def schema(pg_dsn: str) -> AsyncIterator[Schema]:
    """A fresh, migrated schema (dropped afterwards) and a pool whose search_path is it."""
    name = f"equivalence_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(f'CREATE SCHEMA "{name}"')
        search_path = {"search_path": name}
        conn = await asyncpg.connect(pg_dsn, server_settings=search_path)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        rows = await admin.fetch("SELECT tablename FROM pg_tables WHERE schemaname = $1", name)
        # Everything but the migration bookkeeping holds broker state.
        tables = [f'"{name}"."{r["tablename"]}"' for r in rows if "migration" not in r["tablename"]]
        pool = await asyncpg.create_pool(
            pg_dsn, min_size=1, max_size=2, server_settings=search_path
        )
        try:
            yield Schema(pool, tables)
        finally:
            await pool.close()
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        await admin.close()


# A pass takes seconds. A failure is shrunk for up to hypothesis's own 300 s cap; the
# timeout sits above it so the shrunk example is reported rather than cut off.
@pytest.mark.timeout(420)
@settings(
    max_examples=25,
    deadline=None,
    database=None,
    # The schema is meant to be shared by the examples: each one empties it first.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(operations, min_size=8, max_size=30))
async def test_memory_and_postgres_agree(schema: Schema, ops: list[Op]) -> None:
    await schema.empty()
    memory_clock, postgres_clock = FakeClock(), FakeClock()
    sides = [
        Side(MemoryBroker(memory_clock), memory_clock, {}, []),
        Side(PostgresBroker(schema.pool, postgres_clock), postgres_clock, {}, []),
    ]
    for side in sides:
        side.broker.set_event_sink(side.events.append)
        side.broker.set_dependency_sink(side.resolutions.append)
    memory, pg = sides
    for step, op in enumerate(ops):
        expected, got = await _outcome(op, memory), await _outcome(op, pg)
        assert got == expected, f"step {step}: {op}"
        assert _drain(pg) == _drain(memory), f"events of step {step}: {op}"
        assert _normal(pg.resolutions) == _normal(memory.resolutions), f"sink, step {step}: {op}"
        for side in sides:
            side.resolutions.clear()
        assert await _snapshot(pg.broker) == await _snapshot(memory.broker), (
            f"state after step {step}: {op}"
        )
        for side in sides:
            # due_queues is pending_count's keys, found without counting.
            due = await side.broker.due_queues()
            assert due == sorted(await side.broker.pending_count()), f"step {step}: {op}"
    for side in sides:
        await side.broker.close()
