"""Helpers of the task-lifecycle end-to-end tests (``test_lifecycle_*.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from conveyor import AsyncAdminClient, AsyncClient, TaskInfo, TaskNotFound, TaskState
from conveyor_testkit.polling import wait_until

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster

#: Short leases and ticks, so that retries, expiry and purges happen within seconds.
FAST = {
    "CONVEYOR_LEASE_TTL": "2",
    "CONVEYOR_REAP_TICK": "0.2",
    "CONVEYOR_PROMOTE_TICK": "0.2",
    "CONVEYOR_TIMEOUT_GRACE": "0.5",
}


@dataclass(frozen=True)
class Stack:
    """A running api, dispatcher, maintenance and one SDK worker."""

    target: str
    record: Path

    def lines(self, kind: str, task_id: str | None = None) -> list[list[str]]:
        """The worker's record lines of ``kind`` (``start``, ``done``, ``cancelled``...),
        only those of ``task_id`` when given."""
        return [
            f
            for f in read_record(self.record)
            if f[0] == kind and (task_id is None or f[1] == task_id)
        ]


async def start_stack(
    cluster: Cluster,
    tmp_path: Path,
    *,
    queues: Mapping[str, int],
    concurrency: int = 8,
    env: Mapping[str, str] | None = None,
) -> Stack:
    """Start the services (``FAST`` settings plus ``env``) and a worker on ``queues``;
    return once a probe task has completed on each queue (see :func:`_warm_up`)."""
    cluster.settings_env.update({**FAST, **(env or {})})
    target = await cluster.start_services()
    record = tmp_path / "record.txt"
    cluster.start_worker(target, queues=queues, concurrency=concurrency, record=record)
    stack = Stack(target, record)
    await _warm_up(stack, cluster, queues)
    return stack


async def _warm_up(stack: Stack, cluster: Cluster, queues: Iterable[str]) -> None:
    """Return once every process is serving, so time-bound checks start on a live stack:
    a probe task completes on every queue, and the maintenance roles are elected."""
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        probes = [await client.enqueue("e2e.noop", {"probe": True}, queue=q) for q in queues]
        for probe in probes:
            await wait_state(admin, probe.id, TaskState.COMPLETED, within=60)
    [maintenance] = [p for p in cluster.procs if p.name.startswith("maintenance")]
    for role in ("scheduler", "reaper"):
        line = f"maintenance.leader_elected role={role}"
        await wait_until(
            lambda line=line: line in maintenance.log(),  # type: ignore[misc]
            within=60,
            interval=POLL_INTERVAL,
            message=line,
        )


async def wait_state(
    admin: AsyncAdminClient, task_id: str, state: TaskState, *, within: float = 20.0
) -> TaskInfo:
    """Wait until the task is in ``state``; return it as read then."""
    seen: list[TaskInfo] = []

    async def reached() -> bool:
        seen[:] = [await admin.get_task(task_id)]
        return seen[0].state is state

    await wait_until(
        reached, within=within, interval=POLL_INTERVAL, message=f"task {task_id} {state.value}"
    )
    return seen[0]


async def wait_gone(admin: AsyncAdminClient, task_id: str, *, within: float = 20.0) -> None:
    """Wait until the task no longer exists (purged or deleted)."""

    async def gone() -> bool:
        try:
            await admin.get_task(task_id)
        except TaskNotFound:
            return True
        return False

    await wait_until(gone, within=within, interval=POLL_INTERVAL, message=f"task {task_id} purged")
