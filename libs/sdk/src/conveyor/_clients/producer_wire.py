"""TaskService on the wire for the producer clients: the requests they send and what
their responses become. Proto types stay in here; the clients and their callers only
see SDK types."""

from __future__ import annotations

from collections.abc import Iterable

from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from conveyor._clients.task_wire import (
    item_result_from_wire,
    spec_into,
    spec_to_wire,
    task_from_wire,
)
from conveyor._errors import ConveyorError, InvalidArgument
from conveyor._payload import Codec
from conveyor._types import MAX_BATCH, EnqueueResult, TaskInfo, TaskSpec, spec

TASK_SERVICE = "/conveyor.v1.TaskService/"


class ProducerBase:
    """What both producer clients share: request building and response parsing."""

    _codec: Codec
    _service = TASK_SERVICE

    spec = staticmethod(spec)

    def _enqueue_request(self, item: TaskSpec) -> svc.EnqueueRequest:
        return svc.EnqueueRequest(task=spec_to_wire(item, self._codec))

    def _batch_request(self, items: Iterable[TaskSpec]) -> svc.EnqueueBatchRequest:
        request = svc.EnqueueBatchRequest()
        self._fill(request.tasks, items)
        return request

    def _tx_request(self, items: Iterable[TaskSpec]) -> svc.EnqueueTxRequest:
        request = svc.EnqueueTxRequest()
        self._fill(request.tasks, items)
        return request

    def _fill(
        self, tasks: RepeatedCompositeFieldContainer[pb.NewTask], items: Iterable[TaskSpec]
    ) -> None:
        # Written into the request itself: a thousand tasks built on their own and then
        # copied in would cost a copy each, and a thousand more objects alive meanwhile.
        specs = list(items)
        if len(specs) > MAX_BATCH:
            raise InvalidArgument(f"a batch holds at most {MAX_BATCH} tasks, got {len(specs)}")
        for index, item in enumerate(specs):
            if not isinstance(item, TaskSpec):
                raise InvalidArgument(f"item {index} is not a TaskSpec: {item!r}")
        codec = self._codec
        for item in specs:
            spec_into(tasks, item, codec)

    def _task(self, response: svc.EnqueueResponse | svc.GetTaskResponse) -> TaskInfo:
        if not response.HasField("task"):
            raise ConveyorError("the server response carries no task", code="INTERNAL")
        return task_from_wire(response.task, self._codec)

    def _batch_results(self, response: svc.EnqueueBatchResponse, n: int) -> list[EnqueueResult]:
        if len(response.results) != n:
            raise ConveyorError(
                f"the server answered {len(response.results)} results for {n} tasks",
                code="INTERNAL",
            )
        return [item_result_from_wire(item, self._codec) for item in response.results]

    def _tx_results(self, response: svc.EnqueueTxResponse, n: int) -> list[TaskInfo]:
        if len(response.tasks) != n:
            raise ConveyorError(
                f"the server answered {len(response.tasks)} tasks for {n}", code="INTERNAL"
            )
        return [task_from_wire(task, self._codec) for task in response.tasks]
