"""What a handler reads of its task's dependencies: their states and results, fetched
from the server (WorkerService.GetDependencyResults) page by page, under the delivery's
lease."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb

from conveyor._payload import Codec, decode_value
from conveyor._types import TaskState

#: Fetches the page of the running task's dependencies after a cursor ('' for the first).
FetchPage = Callable[[str], Awaitable[svc.GetDependencyResultsResponse]]


def _state(value: int) -> TaskState | None:
    # The worker speaks no client module (they stay apart): the wire names are the states'.
    if not value:
        return None
    try:
        return TaskState(pb.TaskState.Name(value).removeprefix("TASK_STATE_").lower())
    except ValueError:
        return TaskState.UNKNOWN


@dataclass(frozen=True, slots=True)
class DependencyResult:
    """One dependency of the running task, as stored when it was read.

    ``state`` is None when the dependency is no longer stored (purged after it completed,
    or deleted). ``result`` is its return value, decoded by the worker's codec (None when
    it returned nothing or did not complete); ``error`` why it failed, when it did.
    """

    task_id: str
    state: TaskState | None
    result: Any
    error: str | None

    @property
    def completed(self) -> bool:
        """True when the dependency completed."""
        return self.state is TaskState.COMPLETED


async def read_dependencies(fetch: FetchPage, codec: Codec) -> list[DependencyResult]:
    """Every dependency, in the order the task named them (all pages)."""
    found: list[DependencyResult] = []
    cursor = ""
    while True:
        page = await fetch(cursor)
        for item in page.results:
            found.append(
                DependencyResult(
                    task_id=item.task_id,
                    state=_state(item.state),
                    result=decode_value(codec, item.result) if item.has_result else None,
                    error=item.last_error or None,
                )
            )
        if not page.next_cursor:
            return found
        cursor = page.next_cursor
