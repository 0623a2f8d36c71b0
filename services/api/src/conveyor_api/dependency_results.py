"""WorkerService.GetDependencyResults: the results of the dependencies of a task, for the
worker that runs it.

The caller proves it runs the task with the lease id of its delivery: the task must be
ACTIVE under that lease (FAILED_PRECONDITION otherwise, as for any outcome on a lost
lease). The dependencies come in the order the task named them, a page at a time (one
broker read per page), each page at most ``limit`` and about :data:`PAGE_BYTES` of
results.
"""

from __future__ import annotations

from conveyor_broker import Broker, InvalidTask, LeaseLost, TaskState
from conveyor_broker.validation import check_task_id
from conveyor_protos.v1 import service_pb2
from conveyor_runtime import wire

#: A page ends before the result that would take it past this many bytes (the first
#: result always comes): a page of big results stays a few MiB.
PAGE_BYTES = 4 * 1024 * 1024
#: Results a page holds when the request sets no limit; the most it may ask for.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


async def dependency_results(
    broker: Broker, request: service_pb2.GetDependencyResultsRequest
) -> service_pb2.GetDependencyResultsResponse:
    """One page of the results of ``request.task_id``'s dependencies. Raises InvalidTask
    for a bad request and LeaseLost when the task is not running under
    ``request.lease_id``."""
    check_task_id(request.task_id)
    limit = request.limit or DEFAULT_LIMIT
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidTask(f"limit must be in 1..{MAX_LIMIT}, got {limit}")
    start = 0
    if request.cursor:
        if not request.cursor.isdigit() or len(request.cursor) > 6:
            raise InvalidTask(f"malformed cursor {request.cursor!r}")
        start = int(request.cursor)
    task = await broker.get_task(request.task_id)
    if task.state is not TaskState.ACTIVE or task.lease_id != request.lease_id:
        raise LeaseLost(request.task_id, request.lease_id)
    ids = task.depends_on[start : start + limit]
    stored = {dep.id: dep for dep in await broker.get_tasks(ids)}
    results: list[service_pb2.DependencyResult] = []
    budget = PAGE_BYTES
    for dep_id in ids:
        dep = stored.get(dep_id)
        if dep is None:
            item = service_pb2.DependencyResult(task_id=dep_id)
        else:
            item = service_pb2.DependencyResult(
                task_id=dep_id,
                state=wire.state_to_proto(dep.state),
                result=dep.result or b"",
                has_result=dep.result is not None,
                last_error=dep.last_error or "" if dep.state is not TaskState.COMPLETED else "",
            )
        budget -= len(item.result) + len(item.last_error) + 64
        if budget < 0 and results:
            break
        results.append(item)
    end = start + len(results)
    more = end < len(task.depends_on)
    return service_pb2.GetDependencyResultsResponse(
        results=results, next_cursor=str(end) if more else ""
    )
