"""The blocking producer client, :class:`Client`: the twin of
:class:`~conveyor._clients.producer.AsyncClient`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from conveyor_protos.v1 import service_pb2 as svc

from conveyor._channel import DEFAULT_TARGET
from conveyor._clients.producer_wire import ProducerBase
from conveyor._clients.transport import SyncRpcClient, with_task_id
from conveyor._errors import ConveyorError
from conveyor._payload import Codec, JsonCodec
from conveyor._types import DurationLike, EnqueueResult, OnFailure, TaskInfo, TaskSpec, spec


class Client(ProducerBase, SyncRpcClient):
    """The blocking twin of :class:`AsyncClient`, with the same methods and arguments.

    It uses gRPC's synchronous channel, so it works in scripts, threads and even inside a
    running event loop (where each call blocks the loop while it waits: prefer
    :class:`AsyncClient` there). Use it as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        codec: Codec | None = None,
        timeout: DurationLike | None = 30.0,
    ) -> None:
        super().__init__(target, token=token, codec=codec or JsonCodec(), timeout=timeout)

    def enqueue(
        self,
        type: str,
        payload: Any = None,
        *,
        queue: str = "default",
        id: str | None = None,
        headers: Mapping[str, str] | None = None,
        max_retry: int | None = None,
        timeout: DurationLike | None = None,
        deadline: datetime | None = None,
        process_at: datetime | None = None,
        process_in: DurationLike | None = None,
        expires_at: datetime | None = None,
        retention: DurationLike | None = None,
        unique_key: str | None = None,
        unique_ttl: DurationLike | None = None,
        group: str | None = None,
        depends_on: Iterable[str] = (),
        on_failure: OnFailure | str = OnFailure.BLOCK,
        concurrency_key: str | None = None,
    ) -> TaskInfo:
        """Enqueue one task of ``type`` and return it as stored (see AsyncClient.enqueue)."""
        item = spec(
            type,
            payload,
            queue=queue,
            id=id,
            headers=headers,
            max_retry=max_retry,
            timeout=timeout,
            deadline=deadline,
            process_at=process_at,
            process_in=process_in,
            expires_at=expires_at,
            retention=retention,
            unique_key=unique_key,
            unique_ttl=unique_ttl,
            group=group,
            depends_on=depends_on,
            on_failure=on_failure,
            concurrency_key=concurrency_key,
        )
        return self.enqueue_spec(item)

    def enqueue_spec(self, item: TaskSpec) -> TaskInfo:
        """Enqueue one prepared :class:`TaskSpec`."""
        return self._task(self._call("Enqueue", self._enqueue_request(item), svc.EnqueueResponse))

    def enqueue_batch(self, items: Iterable[TaskSpec]) -> list[EnqueueResult]:
        """Enqueue up to 1000 tasks; one :class:`EnqueueResult` per item, in order."""
        tasks = self._batch(items)
        if not tasks:
            return []
        request = svc.EnqueueBatchRequest(tasks=tasks)
        response = self._call("EnqueueBatch", request, svc.EnqueueBatchResponse)
        return self._batch_results(response, len(tasks))

    def enqueue_tx(self, items: Iterable[TaskSpec]) -> list[TaskInfo]:
        """Enqueue up to 1000 tasks all-or-nothing; raise if any of them is refused."""
        tasks = self._batch(items)
        if not tasks:
            return []
        response = self._call("EnqueueTx", svc.EnqueueTxRequest(tasks=tasks), svc.EnqueueTxResponse)
        return self._tx_results(response, len(tasks))

    def get_task(self, id: str) -> TaskInfo:
        """The task with this id; raises :class:`TaskNotFound` when there is none."""
        try:
            response = self._call("GetTask", svc.GetTaskRequest(id=id), svc.GetTaskResponse)
        except ConveyorError as exc:
            raise with_task_id(exc, id) from None
        return self._task(response)
