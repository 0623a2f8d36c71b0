"""The blocking operator client, :class:`AdminClient`: the twin of
:class:`~conveyor._clients.admin.AsyncAdminClient`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

from conveyor_protos.v1 import service_pb2 as svc

from conveyor._channel import DEFAULT_TARGET
from conveyor._clients.admin_types import BatchActionResult, QueueInfo, TaskPage, WebhookWorker
from conveyor._clients.admin_wire import (
    ARCHIVE,
    CANCEL,
    DELETE,
    RESCHEDULE,
    REVIVE,
    RUN_NOW,
    AdminBase,
    StateLike,
    batch_request,
    batch_result,
    list_request,
    queue_info,
    reschedule_request,
    response_type,
    watch_request,
    webhook_from_wire,
    webhook_request,
    with_webhook_name,
)
from conveyor._clients.events import EventStream
from conveyor._clients.transport import SyncRpcClient, with_task_id
from conveyor._errors import ConveyorError
from conveyor._payload import Codec, JsonCodec
from conveyor._types import DurationLike, TaskInfo


class AdminClient(AdminBase, SyncRpcClient):
    """The blocking twin of :class:`AsyncAdminClient`, with the same methods and
    arguments (``iter_tasks`` is a plain iterator, ``watch_events`` a blocking
    :class:`EventStream`)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        codec: Codec | None = None,
        timeout: DurationLike | None = 30.0,
    ) -> None:
        super().__init__(target, token=token, codec=codec or JsonCodec(), timeout=timeout)

    def get_task(self, id: str) -> TaskInfo:
        """The task with this id; raises :class:`TaskNotFound` when there is none."""
        return self._task(self._act("GetTask", svc.GetTaskRequest(id=id), id))

    def list_tasks(
        self,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """One page of tasks (see :meth:`AsyncAdminClient.list_tasks`)."""
        request = list_request(queue, state, limit, cursor)
        return self._page(self._call("ListTasks", request, svc.ListTasksResponse))

    def iter_tasks(
        self, *, queue: str | None = None, state: StateLike | None = None, page_size: int = 100
    ) -> Iterator[TaskInfo]:
        """Every matching task, page after page."""
        cursor: str | None = None
        while True:
            page = self.list_tasks(queue=queue, state=state, limit=page_size, cursor=cursor)
            yield from page.tasks
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def cancel_task(self, id: str) -> TaskInfo:
        """Cancel a waiting task; abort a running one (it lands in ``archived``)."""
        return self._task(self._act("CancelTask", svc.TaskActionRequest(id=id), id))

    def run_task_now(self, id: str) -> TaskInfo:
        """Make a scheduled or retrying task due at once."""
        return self._task(self._act("RunTaskNow", svc.TaskActionRequest(id=id), id))

    def delete_task(self, id: str) -> None:
        """Delete a task that is not running."""
        self._act("DeleteTask", svc.TaskActionRequest(id=id), id)

    def archive_task(self, id: str) -> TaskInfo:
        """Archive a waiting task now."""
        return self._task(self._act("ArchiveTask", svc.TaskActionRequest(id=id), id))

    def revive_task(self, id: str) -> TaskInfo:
        """Bring an archived task back, due at once."""
        return self._task(self._act("ReviveTask", svc.TaskActionRequest(id=id), id))

    def reschedule_task(self, id: str, process_at: datetime) -> TaskInfo:
        """Move a waiting task to ``process_at`` (timezone-aware)."""
        return self._task(self._act("RescheduleTask", reschedule_request(id, process_at), id))

    def _act(self, method: str, request: object, id: str) -> Any:
        try:
            return self._call(method, request, response_type(method))
        except ConveyorError as exc:
            raise with_task_id(exc, id) from None

    def cancel_tasks(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`cancel_task` on many tasks."""
        return self._batch(batch_request(CANCEL, ids, queue, state))

    def run_tasks_now(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`run_task_now` on many tasks."""
        return self._batch(batch_request(RUN_NOW, ids, queue, state))

    def delete_tasks(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`delete_task` on many tasks."""
        return self._batch(batch_request(DELETE, ids, queue, state))

    def archive_tasks(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`archive_task` on many tasks."""
        return self._batch(batch_request(ARCHIVE, ids, queue, state))

    def revive_tasks(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`revive_task` on many tasks."""
        return self._batch(batch_request(REVIVE, ids, queue, state))

    def reschedule_tasks(
        self,
        process_at: datetime,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`reschedule_task` on many tasks."""
        return self._batch(batch_request(RESCHEDULE, ids, queue, state, process_at))

    def _batch(self, request: svc.BatchTaskActionRequest) -> BatchActionResult:
        return batch_result(self._call("BatchTaskAction", request, svc.BatchTaskActionResponse))

    def list_queues(self) -> list[QueueInfo]:
        """Every queue that has tasks or a pause flag, by name, with its counts."""
        response = self._call("ListQueues", svc.ListQueuesRequest(), svc.ListQueuesResponse)
        return [queue_info(stats) for stats in response.queues]

    def queue_stats(self, queue: str) -> QueueInfo:
        """One queue's counts and pause flag."""
        request = svc.GetQueueStatsRequest(queue=queue)
        return queue_info(self._call("GetQueueStats", request, svc.GetQueueStatsResponse).stats)

    def pause_queue(self, queue: str) -> None:
        """Stop dispatching ``queue`` at once (persisted)."""
        self._call("PauseQueue", svc.PauseQueueRequest(queue=queue), svc.PauseQueueResponse)

    def resume_queue(self, queue: str) -> None:
        """Dispatch ``queue`` again."""
        self._call("ResumeQueue", svc.ResumeQueueRequest(queue=queue), svc.ResumeQueueResponse)

    def upsert_webhook_worker(
        self,
        name: str,
        url: str,
        queues: Mapping[str, int] | Iterable[str],
        *,
        concurrency: int = 10,
        timeout: DurationLike = 30.0,
        paused: bool = False,
        secrets: Iterable[str] = (),
    ) -> WebhookWorker:
        """Register (or replace) a webhook worker (see
        :meth:`AsyncAdminClient.upsert_webhook_worker`); secrets are never returned."""
        request = webhook_request(
            name,
            url,
            queues,
            concurrency=concurrency,
            timeout=timeout,
            paused=paused,
            secrets=secrets,
        )
        response = self._webhook(
            "UpsertWebhookWorker", request, svc.UpsertWebhookWorkerResponse, name
        )
        return webhook_from_wire(response.worker)

    def get_webhook_worker(self, name: str) -> WebhookWorker:
        """The registration ``name``; :class:`WebhookWorkerNotFound` when there is none."""
        request = svc.GetWebhookWorkerRequest(name=name)
        response = self._webhook("GetWebhookWorker", request, svc.GetWebhookWorkerResponse, name)
        return webhook_from_wire(response.worker)

    def list_webhook_workers(self) -> list[WebhookWorker]:
        """Every webhook worker registration, by name."""
        request = svc.ListWebhookWorkersRequest()
        response = self._call("ListWebhookWorkers", request, svc.ListWebhookWorkersResponse)
        return [webhook_from_wire(worker) for worker in response.workers]

    def pause_webhook_worker(self, name: str) -> None:
        """Stop new deliveries to ``name`` (deliveries in flight finish)."""
        request = svc.SetWebhookWorkerPausedRequest(name=name, paused=True)
        self._webhook("SetWebhookWorkerPaused", request, svc.SetWebhookWorkerPausedResponse, name)

    def resume_webhook_worker(self, name: str) -> None:
        """Deliver to ``name`` again."""
        request = svc.SetWebhookWorkerPausedRequest(name=name, paused=False)
        self._webhook("SetWebhookWorkerPaused", request, svc.SetWebhookWorkerPausedResponse, name)

    def delete_webhook_worker(self, name: str) -> None:
        """Remove the registration ``name`` (deliveries in flight finish)."""
        request = svc.DeleteWebhookWorkerRequest(name=name)
        self._webhook("DeleteWebhookWorker", request, svc.DeleteWebhookWorkerResponse, name)

    def _webhook(self, method: str, request: object, response_type: Any, name: str) -> Any:
        try:
            return self._call(method, request, response_type)
        except ConveyorError as exc:
            raise with_webhook_name(exc, name) from None

    def watch_events(
        self, *, queues: Iterable[str] = (), states: Iterable[StateLike] = ()
    ) -> EventStream:
        """Live lifecycle events (see :meth:`AsyncAdminClient.watch_events`); use it as
        ``with admin.watch_events() as events: for event in events: ...``."""
        return EventStream(
            self._stream("WatchEvents", watch_request(queues, states), svc.TaskEvent)
        )
