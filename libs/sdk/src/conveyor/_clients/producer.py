"""The asyncio producer client, :class:`AsyncClient`; scripts/gen_sync_clients.py turns
it into the blocking :class:`Client` (``producer_sync.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from conveyor_protos.v1 import service_pb2 as svc

from conveyor._channel import DEFAULT_TARGET, TlsFile
from conveyor._clients.producer_wire import ProducerBase
from conveyor._clients.transport import AsyncRpcClient, with_task_id
from conveyor._errors import ConveyorError
from conveyor._payload import Codec, JsonCodec
from conveyor._tracing import enqueue_trace
from conveyor._types import DurationLike, EnqueueResult, OnFailure, TaskInfo, TaskSpec, spec


class AsyncClient(ProducerBase, AsyncRpcClient):
    """Enqueue tasks and read them back, from asyncio code.

    ``target`` is the api server's ``host:port`` (any gRPC target string works, e.g.
    ``ipv4:10.0.0.1:50051,10.0.0.2:50051``), or ``https://host:port`` for TLS.
    ``token`` is sent as a bearer token. ``codec`` encodes payloads and decodes payloads,
    progress and results (JSON by default). ``timeout`` bounds every call (a timedelta or
    seconds; ``None`` for no bound).

    TLS: an ``https://`` target, ``tls=True`` or any TLS file selects it (a plain
    ``host:port`` stays plaintext). ``tls_ca`` is the CA bundle that verifies the server
    (default: the system's CAs); ``tls_cert`` and ``tls_key`` are the client certificate
    a server with mutual TLS asks for. Each is a PEM file's path, or its contents as
    ``bytes``.

    Use it as an async context manager, or call :meth:`close` when done::

        async with AsyncClient("127.0.0.1:50051") as client:
            info = await client.enqueue("email.send", {"to": "a@example.com"}, queue="emails")

    The gRPC channel is opened on first use, inside the running event loop.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        codec: Codec | None = None,
        timeout: DurationLike | None = 30.0,
        tls: bool | None = None,
        tls_ca: TlsFile | None = None,
        tls_cert: TlsFile | None = None,
        tls_key: TlsFile | None = None,
    ) -> None:
        super().__init__(
            target,
            token=token,
            codec=codec or JsonCodec(),
            timeout=timeout,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )

    async def enqueue(
        self,
        type: str,
        payload: Any = None,
        *,
        queue: str = "default",
        id: str | None = None,
        headers: Mapping[str, str] | None = None,
        max_retry: int | None = None,
        timeout: DurationLike | None = None,  # noqa: ASYNC109 - the task's, not this call's
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
        """Enqueue one task of ``type`` and return it as stored.

        The options are those of :func:`conveyor.spec` (see :class:`TaskOptions`);
        ``timeout`` here is the task's per-attempt timeout, not the call's. Enqueue is
        idempotent on ``id``: an existing id returns the stored task unchanged. Raises
        :class:`AlreadyExists` (with ``existing_id``) when a live task holds
        ``unique_key``, :class:`InvalidArgument` for bad input.
        """
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
        return await self.enqueue_spec(item)

    async def enqueue_spec(self, item: TaskSpec) -> TaskInfo:
        """Enqueue one prepared :class:`TaskSpec` (see :meth:`enqueue`)."""
        request = self._enqueue_request(item)
        with enqueue_trace("conveyor.enqueue", [request.task]) as trace:
            trace.stamp([request.task])
            response = await self._call(
                "Enqueue", request, svc.EnqueueResponse, metadata=trace.metadata
            )
            trace.identify(response.task.id)
        return self._task(response)

    async def enqueue_batch(self, items: Iterable[TaskSpec]) -> list[EnqueueResult]:
        """Enqueue up to 1000 tasks; each one succeeds or fails on its own.

        Returns one :class:`EnqueueResult` per item, in order: ``task`` on success,
        ``error`` (an SDK exception, not raised) on failure.
        """
        request = self._batch_request(items)
        tasks = request.tasks
        if not tasks:
            return []
        with enqueue_trace("conveyor.enqueue_batch", tasks) as trace:
            trace.stamp(tasks)
            response = await self._call(
                "EnqueueBatch", request, svc.EnqueueBatchResponse, metadata=trace.metadata
            )
        return self._batch_results(response, len(tasks))

    async def enqueue_tx(self, items: Iterable[TaskSpec]) -> list[TaskInfo]:
        """Enqueue up to 1000 tasks all-or-nothing; raise if any of them is refused."""
        request = self._tx_request(items)
        tasks = request.tasks
        if not tasks:
            return []
        with enqueue_trace("conveyor.enqueue_tx", tasks) as trace:
            trace.stamp(tasks)
            response = await self._call(
                "EnqueueTx", request, svc.EnqueueTxResponse, metadata=trace.metadata
            )
        return self._tx_results(response, len(tasks))

    async def get_task(self, id: str) -> TaskInfo:
        """The task with this id; raises :class:`TaskNotFound` when there is none."""
        try:
            response = await self._call("GetTask", svc.GetTaskRequest(id=id), svc.GetTaskResponse)
        except ConveyorError as exc:
            raise with_task_id(exc, id) from None
        return self._task(response)
