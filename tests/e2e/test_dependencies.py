"""Dependencies end to end, through real processes: each policy (a diamond and a chain
that complete, a cascade across three levels, a mixed-policy fan-in), the resolver's
leader killed mid-cascade and the api killed right after a completion commits (the
sweep leaves nothing blocked), and bad input."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conveyor import (
    AsyncAdminClient,
    AsyncClient,
    InvalidArgument,
    OnFailure,
    TaskState,
    spec,
)
from conveyor_broker import SystemClock, TaskListParams
from conveyor_broker import TaskState as StoredState
from conveyor_broker.ids import new_id, new_ids
from conveyor_broker.postgres import PostgresBroker
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster, Proc
from tests.e2e.lifecycle import Stack, start_stack, wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

#: Generous: the machine is shared, and a resolution waits on a pass now and then.
WITHIN = 60.0


def ids(count: int) -> list[str]:
    """Fresh task ids, in ascending order, for tasks that others name in one EnqueueTx."""
    return sorted(new_ids(SystemClock().now(), count))


def started_at(stack: Stack, task_id: str) -> int:
    [line] = stack.lines("start", task_id)
    return int(line[-1])


def done_at(stack: Stack, task_id: str) -> int:
    [line] = stack.lines("done", task_id)
    return int(line[-1])


async def test_a_diamond_runs_each_task_after_what_it_waits_for(
    cluster: Cluster, tmp_path: Path
) -> None:
    stack = await start_stack(cluster, tmp_path, queues={"dag": 1})
    top, left, right, join = ids(4)
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        stored = await client.enqueue_tx(
            [
                spec("e2e.noop", {"n": 4}, queue="dag", id=join, depends_on=[left, right]),
                spec("e2e.noop", {"n": 2}, queue="dag", id=left, depends_on=[top]),
                spec("e2e.noop", {"n": 3}, queue="dag", id=right, depends_on=[top]),
                spec("e2e.noop", {"n": 1}, queue="dag", id=top),
            ]
        )
        assert [t.state for t in stored] == [TaskState.BLOCKED] * 3 + [TaskState.PENDING]
        await wait_state(admin, join, TaskState.COMPLETED, within=WITHIN)
    for branch in (left, right):
        assert started_at(stack, branch) > done_at(stack, top)
        assert started_at(stack, join) > done_at(stack, branch)


async def test_a_chain_runs_link_after_link(cluster: Cluster, tmp_path: Path) -> None:
    stack = await start_stack(cluster, tmp_path, queues={"chain": 1})
    links = ids(8)
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        await client.enqueue_tx(
            [
                spec("e2e.noop", {"link": n}, queue="chain", id=link, depends_on=links[n - 1 : n])
                for n, link in enumerate(links)
            ]
        )
        await wait_state(admin, links[-1], TaskState.COMPLETED, within=WITHIN)
    for earlier, later in itertools.pairwise(links):
        assert started_at(stack, later) > done_at(stack, earlier)


async def test_a_cascade_cancels_three_levels_and_each_policy_follows(
    cluster: Cluster, tmp_path: Path
) -> None:
    stack = await start_stack(cluster, tmp_path, queues={"cascade": 1})
    root, one, two, three, runs, held = ids(6)
    cascade = OnFailure.CASCADE_CANCEL
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        await client.enqueue_tx(
            [
                spec("e2e.skip", {"error": "root fails"}, queue="cascade", id=root),
                spec(
                    "e2e.noop", {}, queue="cascade", id=one, depends_on=[root], on_failure=cascade
                ),
                spec("e2e.noop", {}, queue="cascade", id=two, depends_on=[one], on_failure=cascade),
                spec(
                    "e2e.noop", {}, queue="cascade", id=three, depends_on=[two], on_failure=cascade
                ),
                # Past the cascade: CONTINUE runs anyway, BLOCK waits for an operator.
                spec(
                    "e2e.noop",
                    {},
                    queue="cascade",
                    id=runs,
                    depends_on=[three],
                    on_failure=OnFailure.CONTINUE,
                ),
                spec("e2e.noop", {}, queue="cascade", id=held, depends_on=[one]),
            ]
        )
        await wait_state(admin, runs, TaskState.COMPLETED, within=WITHIN)
        for task_id, cause in ((one, root), (two, one), (three, two)):
            task = await admin.get_task(task_id)
            assert task.state is TaskState.CANCELED
            assert task.last_error == f"canceled: dependency {cause} did not complete"
        assert (await admin.get_task(root)).state is TaskState.ARCHIVED
        assert (await admin.get_task(held)).state is TaskState.BLOCKED
    # Nothing that was canceled ever ran.
    for task_id in (one, two, three, held):
        assert stack.lines("start", task_id) == []


async def test_a_mixed_policy_fan_in(cluster: Cluster, tmp_path: Path) -> None:
    stack = await start_stack(cluster, tmp_path, queues={"fan": 1})
    parents = ids(5)
    block, go, cancel = ids(3)
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        await client.enqueue_tx(
            [
                *(spec("e2e.noop", {}, queue="fan", id=p) for p in parents[:4]),
                spec("e2e.fail", {"error": "always"}, queue="fan", id=parents[4], max_retry=0),
                spec("e2e.noop", {}, queue="fan", id=block, depends_on=parents),
                spec(
                    "e2e.noop",
                    {},
                    queue="fan",
                    id=go,
                    depends_on=parents,
                    on_failure=OnFailure.CONTINUE,
                ),
                spec(
                    "e2e.noop",
                    {},
                    queue="fan",
                    id=cancel,
                    depends_on=parents,
                    on_failure=OnFailure.CASCADE_CANCEL,
                ),
            ]
        )
        await wait_state(admin, go, TaskState.COMPLETED, within=WITHIN)
        await wait_state(admin, cancel, TaskState.CANCELED, within=WITHIN)
        assert (await admin.get_task(parents[4])).state is TaskState.ARCHIVED
        assert (await admin.get_task(block)).state is TaskState.BLOCKED
    assert started_at(stack, go) > max(done_at(stack, p) for p in parents[:4])


async def _count(store: PostgresBroker, queue: str, state: StoredState) -> int:
    page = await store.list_tasks(TaskListParams(queue=queue, state=state, limit=1000))
    return len(page.tasks)


def _resolver_leader(cluster: Cluster) -> Proc:
    leaders = [
        p
        for p in cluster.procs
        if p.name.startswith("maintenance")
        and p.alive()
        and "maintenance.leader_elected role=resolver" in p.log()
    ]
    assert len(leaders) == 1, [p.name for p in leaders]
    return leaders[0]


async def test_the_resolver_leader_killed_mid_cascade_leaves_nothing_blocked(
    cluster: Cluster, tmp_path: Path, store: PostgresBroker
) -> None:
    # A chain of 1,000 cascading tasks: one level per resolution, so the kill lands
    # somewhere along it. A second maintenance process stands by.
    env = {"CONVEYOR_LEADER_TTL": "2", "CONVEYOR_RESOLVE_SWEEP_AGE": "0.5"}
    stack = await start_stack(cluster, tmp_path, queues={"doomed": 1}, env=env)
    cluster.start_maintenance()
    chain = ids(1000)
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        await client.enqueue_tx(
            [spec("e2e.skip", {}, queue="doomed", id=chain[0])]
            + [
                spec(
                    "e2e.noop",
                    {},
                    queue="doomed",
                    id=link,
                    depends_on=[chain[n]],
                    on_failure=OnFailure.CASCADE_CANCEL,
                )
                for n, link in enumerate(chain[1:])
            ]
        )
        await wait_until(
            lambda: any(
                "maintenance.leader_elected role=resolver" in p.log()
                for p in cluster.procs
                if p.name.startswith("maintenance")
            ),
            within=WITHIN,
            interval=POLL_INTERVAL,
            message="a resolver leader",
        )
        leader = _resolver_leader(cluster)

        async def underway() -> bool:
            return await _count(store, "doomed", StoredState.CANCELED) >= 5

        await wait_until(underway, within=WITHIN, interval=0.01, message="cascade underway")
        leader.kill9()
        canceled_at_kill = await _count(store, "doomed", StoredState.CANCELED)

        async def settled() -> bool:
            return await _count(store, "doomed", StoredState.BLOCKED) == 0

        await wait_until(settled, within=120, interval=0.2, message="cascade finished")
        assert await _count(store, "doomed", StoredState.CANCELED) == len(chain) - 1
        assert (await admin.get_task(chain[0])).state is TaskState.ARCHIVED
    assert canceled_at_kill < len(chain) - 1, "the cascade was over before the kill"
    assert all(stack.lines("start", link) == [] for link in chain[1:])


async def test_the_api_killed_after_a_completion_commits_leaves_nothing_blocked(
    cluster: Cluster, tmp_path: Path, store: PostgresBroker
) -> None:
    # No resolver hears the completion (maintenance is down when it commits, and the api
    # that would announce it again is killed): the sweep of a maintenance process
    # started afterwards finds it.
    stack = await start_stack(
        cluster, tmp_path, queues={"first": 1, "then": 1}, env={"CONVEYOR_RESOLVE_SWEEP_AGE": "1"}
    )
    [api] = [p for p in cluster.procs if p.name.startswith("api")]
    [maintenance] = [p for p in cluster.procs if p.name.startswith("maintenance")]
    first, then = ids(2)
    async with AsyncClient(stack.target) as client:
        await client.enqueue_tx(
            [
                spec("e2e.sleep", {"seconds": 1.0}, queue="first", id=first),
                spec("e2e.noop", {}, queue="then", id=then, depends_on=[first]),
            ]
        )

        async def running() -> bool:
            return (await store.get_task(first)).state is StoredState.ACTIVE

        await wait_until(running, within=WITHIN, interval=POLL_INTERVAL, message="first runs")
    maintenance.kill9()

    async def committed() -> bool:
        return (await store.get_task(first)).state is StoredState.COMPLETED

    await wait_until(committed, within=WITHIN, interval=0.02, message="first completed")
    api.kill9()
    assert (await store.get_task(then)).state is StoredState.BLOCKED
    cluster.start_maintenance()

    async def promoted() -> bool:
        return (await store.get_task(then)).state is not StoredState.BLOCKED

    await wait_until(promoted, within=WITHIN, interval=POLL_INTERVAL, message="then promoted")
    # A new api on the same port: the worker reconnects and runs it (the dispatcher may
    # have offered it to the dead api's gateway meanwhile: released, or reaped).
    assert api.port is not None
    await cluster.start_api(port=api.port)
    async with AsyncAdminClient(stack.target) as admin:
        await wait_state(admin, then, TaskState.COMPLETED, within=WITHIN)


async def test_bad_dependencies_are_refused_and_nothing_is_stored(
    cluster: Cluster, tmp_path: Path, store: PostgresBroker
) -> None:
    stack = await start_stack(cluster, tmp_path, queues={"bad": 1})
    before = len((await store.list_tasks(TaskListParams(limit=1000))).tasks)
    a, b, c = ids(3)
    async with AsyncClient(stack.target) as client:
        with pytest.raises(InvalidArgument, match="unknown dependency"):
            await client.enqueue("e2e.noop", {}, queue="bad", depends_on=[a])
        with pytest.raises(InvalidArgument, match="itself"):
            await client.enqueue("e2e.noop", {}, queue="bad", id=a, depends_on=[a])
        with pytest.raises(InvalidArgument, match="at most 10000"):
            await client.enqueue(
                "e2e.noop", {}, queue="bad", depends_on=new_ids(SystemClock().now(), 10_001)
            )
        with pytest.raises(InvalidArgument, match="dependency cycle") as cycle:
            await client.enqueue_tx(
                [
                    spec("e2e.noop", {}, queue="bad", id=a, depends_on=[c]),
                    spec("e2e.noop", {}, queue="bad", id=b, depends_on=[a]),
                    spec("e2e.noop", {}, queue="bad", id=c, depends_on=[b]),
                ]
            )
        for task_id in (a, b, c):
            assert task_id in str(cycle.value)
        # In a batch, the bad item alone is refused.
        missing = new_id(SystemClock().now())
        results = await client.enqueue_batch(
            [
                spec("e2e.noop", {}, queue="bad"),
                spec("e2e.noop", {}, queue="bad", depends_on=[missing]),
            ]
        )
        assert results[0].created
        assert isinstance(results[1].error, InvalidArgument)
    after = len((await store.list_tasks(TaskListParams(limit=1000))).tasks)
    assert after == before + 1
