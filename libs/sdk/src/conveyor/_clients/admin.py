"""The asyncio operator client, :class:`AsyncAdminClient`, over the server's
AdminService; scripts/gen_sync_clients.py turns it into the blocking
:class:`AdminClient` (``admin_sync.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import datetime
from typing import Any

from conveyor_protos.v1 import service_pb2 as svc

from conveyor._channel import DEFAULT_TARGET, TlsFile
from conveyor._clients.admin_types import (
    BatchActionResult,
    Breaker,
    BreakerConfig,
    BreakerScope,
    ClusterInfo,
    ConcurrencyLimit,
    CronEntry,
    CronMisfire,
    CronSpec,
    DependencyPage,
    GroupConfig,
    GroupStats,
    QueueInfo,
    QueuePage,
    RateLimit,
    TaskDependency,
    TaskPage,
    WebhookWorker,
    WhoAmI,
    misfire_policy,
)
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
    breaker_config_from_wire,
    breaker_config_request,
    breaker_from_wire,
    cluster_from_wire,
    concurrency_limit_from_wire,
    concurrency_limit_request,
    cron_from_wire,
    cron_request,
    dependencies_request,
    dependency_page,
    group_config_from_wire,
    group_config_request,
    group_stats_from_wire,
    group_stats_request,
    list_request,
    queue_info,
    queues_request,
    rate_limit_from_wire,
    rate_limit_request,
    reschedule_request,
    response_type,
    watch_request,
    webhook_from_wire,
    webhook_request,
    whoami_from_wire,
    with_breaker_config,
    with_concurrency_limit,
    with_cron_name,
    with_group_config,
    with_rate_limit,
    with_webhook_name,
)
from conveyor._clients.events import AsyncEventStream
from conveyor._clients.transport import AsyncRpcClient, with_task_id
from conveyor._errors import ConveyorError, InvalidArgument
from conveyor._payload import Codec, JsonCodec
from conveyor._types import DurationLike, TaskInfo, TaskSpec, to_timedelta


class AsyncAdminClient(AdminBase, AsyncRpcClient):
    """Inspect and operate Conveyor from asyncio code: tasks, queues, lifecycle events.

    Takes the same arguments as :class:`AsyncClient` (``target``, ``token``, ``codec``
    for decoding payloads, progress and results, the per-call ``timeout``, and ``tls``,
    ``tls_ca``, ``tls_cert`` and ``tls_key`` for TLS)::

        async with AsyncAdminClient("127.0.0.1:50051") as admin:
            await admin.pause_queue("emails")
            page = await admin.list_tasks(queue="emails", state="archived")
            await admin.revive_tasks([t.id for t in page.tasks])

    Webhook workers (external HTTP endpoints the server delivers tasks to) are managed
    with ``upsert_webhook_worker``, ``get_webhook_worker``, ``list_webhook_workers``,
    ``pause_webhook_worker``, ``resume_webhook_worker`` and ``delete_webhook_worker``;
    cron entries (tasks the server enqueues on a schedule) with ``upsert_cron_entry``,
    ``apply_cron_entries``, ``get_cron_entry``, ``list_cron_entries``,
    ``pause_cron_entry``, ``resume_cron_entry``, ``trigger_cron_entry`` and
    ``delete_cron_entry``; circuit breakers per task type with ``set_breaker_config``,
    ``list_breaker_configs``, ``delete_breaker_config`` and ``list_breakers`` (those
    open or half-open).

    Every task action also exists in a batch form (``cancel_tasks``...) that selects
    tasks by ``ids``, or by ``queue`` and optionally ``state`` (at most 1000 tasks, the
    first by id), and returns a :class:`BatchActionResult`. Errors are the SDK's
    exceptions: :class:`TaskNotFound` for an unknown id, :class:`FailedPrecondition` for
    an action the task's state does not allow, :class:`InvalidArgument` for bad input,
    :class:`PermissionDenied` on a read-only server, :class:`WebhookWorkerNotFound` for
    an unknown webhook worker, :class:`CronEntryNotFound` for an unknown cron entry,
    :class:`BreakerConfigNotFound` for a breaker config that is not stored.
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

    # ---------------------------------------------------------------- tasks

    async def get_task(self, id: str) -> TaskInfo:
        """The task with this id; raises :class:`TaskNotFound` when there is none."""
        return self._task(await self._act("GetTask", svc.GetTaskRequest(id=id), id))

    async def list_tasks(
        self,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
        limit: int = 100,
        cursor: str | None = None,
        with_payloads: bool = True,
    ) -> TaskPage:
        """One page of tasks (ordered by id), optionally of one ``queue`` and ``state``.

        ``limit`` is 1..1000; pass the page's ``next_cursor`` as ``cursor`` for the next.
        The server also ends a page early, after about 4 MiB of payloads, progress and
        results, so a page may hold fewer than ``limit`` tasks and still not be the last:
        the last has no ``next_cursor``. ``with_payloads=False`` leaves every task's
        ``payload``, ``progress`` and ``result`` out (None), for listings that only need
        states, errors and times: pages are then small and fast.
        """
        request = list_request(queue, state, limit, cursor, with_payloads=with_payloads)
        return self._page(await self._call("ListTasks", request, svc.ListTasksResponse))

    async def iter_tasks(
        self,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
        page_size: int = 100,
        with_payloads: bool = True,
    ) -> AsyncIterator[TaskInfo]:
        """Every matching task, page after page (see :meth:`list_tasks`)."""
        cursor: str | None = None
        while True:
            page = await self.list_tasks(
                queue=queue,
                state=state,
                limit=page_size,
                cursor=cursor,
                with_payloads=with_payloads,
            )
            for task in page.tasks:
                yield task
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def list_dependencies(
        self,
        id: str,
        *,
        dependents: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> DependencyPage:
        """One page of the dependency edges of task ``id``: the tasks it waits for, or
        with ``dependents=True`` the tasks that wait for it; each with how the edge stands
        (:class:`DependencyOutcome`) and the other task's state, by its id. ``limit`` is
        1..1000; pass the page's ``next_cursor`` as ``cursor`` for the next. Raises
        :class:`TaskNotFound` for an unknown task."""
        request = dependencies_request(id, dependents, limit, cursor)
        try:
            response = await self._call(
                "ListTaskDependencies", request, svc.ListTaskDependenciesResponse
            )
        except ConveyorError as exc:
            raise with_task_id(exc, id) from None
        return dependency_page(response)

    async def iter_dependencies(
        self, id: str, *, dependents: bool = False, page_size: int = 100
    ) -> AsyncIterator[TaskDependency]:
        """Every dependency edge of task ``id``, page after page (see
        :meth:`list_dependencies`)."""
        cursor: str | None = None
        while True:
            page = await self.list_dependencies(
                id, dependents=dependents, limit=page_size, cursor=cursor
            )
            for edge in page.dependencies:
                yield edge
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def cancel_task(self, id: str) -> TaskInfo:
        """Cancel a waiting task (it becomes ``canceled``); a running one is aborted: its
        worker is told to stop and the task lands in ``archived``."""
        return self._task(await self._act("CancelTask", svc.TaskActionRequest(id=id), id))

    async def run_task_now(self, id: str) -> TaskInfo:
        """Make a scheduled or retrying task due at once."""
        return self._task(await self._act("RunTaskNow", svc.TaskActionRequest(id=id), id))

    async def delete_task(self, id: str) -> None:
        """Delete a task that is not running (its unique key, if any, is freed)."""
        await self._act("DeleteTask", svc.TaskActionRequest(id=id), id)

    async def archive_task(self, id: str) -> TaskInfo:
        """Archive a waiting task now."""
        return self._task(await self._act("ArchiveTask", svc.TaskActionRequest(id=id), id))

    async def revive_task(self, id: str) -> TaskInfo:
        """Bring an archived task back: due at once, its retries counted from zero."""
        return self._task(await self._act("ReviveTask", svc.TaskActionRequest(id=id), id))

    async def reschedule_task(self, id: str, process_at: datetime) -> TaskInfo:
        """Move a waiting task to ``process_at`` (timezone-aware; a past instant makes it
        due at once)."""
        return self._task(await self._act("RescheduleTask", reschedule_request(id, process_at), id))

    async def _act(self, method: str, request: object, id: str) -> Any:
        try:
            return await self._call(method, request, response_type(method))
        except ConveyorError as exc:
            raise with_task_id(exc, id) from None

    # ---------------------------------------------------------- batch actions

    async def cancel_tasks(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`cancel_task` on many tasks."""
        return await self._batch(batch_request(CANCEL, ids, queue, state))

    async def run_tasks_now(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`run_task_now` on many tasks."""
        return await self._batch(batch_request(RUN_NOW, ids, queue, state))

    async def delete_tasks(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`delete_task` on many tasks."""
        return await self._batch(batch_request(DELETE, ids, queue, state))

    async def archive_tasks(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`archive_task` on many tasks."""
        return await self._batch(batch_request(ARCHIVE, ids, queue, state))

    async def revive_tasks(
        self,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`revive_task` on many tasks."""
        return await self._batch(batch_request(REVIVE, ids, queue, state))

    async def reschedule_tasks(
        self,
        process_at: datetime,
        ids: Iterable[str] | None = None,
        *,
        queue: str | None = None,
        state: StateLike | None = None,
    ) -> BatchActionResult:
        """:meth:`reschedule_task` on many tasks."""
        return await self._batch(batch_request(RESCHEDULE, ids, queue, state, process_at))

    async def _batch(self, request: svc.BatchTaskActionRequest) -> BatchActionResult:
        return batch_result(
            await self._call("BatchTaskAction", request, svc.BatchTaskActionResponse)
        )

    # ---------------------------------------------------------------- queues

    async def list_queues(self, *, limit: int = 100, cursor: str | None = None) -> QueuePage:
        """One page of the queues that have tasks or a pause flag, by name, with their
        counts. ``limit`` is 1..1000; pass the page's ``next_cursor`` as ``cursor`` for
        the next (the last page has none). :meth:`iter_queues` goes through them all."""
        request = queues_request(limit, cursor)
        response = await self._call("ListQueues", request, svc.ListQueuesResponse)
        return QueuePage(
            queues=[queue_info(stats) for stats in response.queues],
            next_cursor=response.next_cursor or None,
        )

    async def iter_queues(self, *, page_size: int = 100) -> AsyncIterator[QueueInfo]:
        """Every queue, page after page (see :meth:`list_queues`)."""
        cursor: str | None = None
        while True:
            page = await self.list_queues(limit=page_size, cursor=cursor)
            for queue in page.queues:
                yield queue
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def queue_stats(self, queue: str) -> QueueInfo:
        """One queue's counts and pause flag (all zero for a queue never used), and its
        circuit breakers that are not closed."""
        request = svc.GetQueueStatsRequest(queue=queue)
        response = await self._call("GetQueueStats", request, svc.GetQueueStatsResponse)
        return queue_info(response.stats)

    async def pause_queue(self, queue: str) -> None:
        """Stop dispatching ``queue`` (running tasks finish; enqueues still land). Takes
        effect at once on the live dispatcher, and persists."""
        await self._call("PauseQueue", svc.PauseQueueRequest(queue=queue), svc.PauseQueueResponse)

    async def resume_queue(self, queue: str) -> None:
        """Dispatch ``queue`` again."""
        request = svc.ResumeQueueRequest(queue=queue)
        await self._call("ResumeQueue", request, svc.ResumeQueueResponse)

    # ------------------------------------------------------- webhook workers

    async def cluster_info(self) -> ClusterInfo:
        """Every service process of the cluster as it describes itself now: api nodes
        with their worker sessions, dispatchers with the queues they own, the leaders of
        the singleton roles, and webhook gateways."""
        response = await self._call(
            "GetClusterInfo", svc.GetClusterInfoRequest(), svc.GetClusterInfoResponse
        )
        return cluster_from_wire(response)

    async def whoami(self) -> WhoAmI:
        """Who the api takes this client's token for, and what it may do on the
        AdminService (any accepted token may ask; a missing or unknown one raises
        :class:`Unauthenticated`, an api older than the call :class:`Unimplemented`)."""
        response = await self._call("WhoAmI", svc.WhoAmIRequest(), svc.WhoAmIResponse)
        return whoami_from_wire(response)

    async def upsert_webhook_worker(
        self,
        name: str,
        url: str,
        queues: Mapping[str, int] | Iterable[str],
        *,
        concurrency: int = 10,
        timeout: DurationLike = 30.0,  # noqa: ASYNC109 (a registration field, not a wait)
        paused: bool = False,
        secrets: Iterable[str] = (),
        batch_types: Iterable[str] = (),
    ) -> WebhookWorker:
        """Register (or replace) the webhook worker ``name``: the server POSTs tasks of
        ``queues`` (name -> weight, or a list of names) to ``url``, at most
        ``concurrency`` at once, each answered within ``timeout`` (seconds or timedelta).

        ``secrets`` sign deliveries and lease tokens, newest first: the newest signs, any
        verifies, so rotate by putting a new one in front and dropping the old one once
        in-flight deliveries are done. Each holds at least 32 bytes of key: ``whsec_`` and
        the base64 of 32 random bytes (``conveyor webhook new-secret``), or a text of at
        least 32 bytes; the server stores them encrypted. No secrets keeps the stored ones
        (a registration gets no deliveries until it has one). ``batch_types``: the task
        types the endpoint takes as whole aggregation groups, one JSON-RPC call
        (``conveyor.batch``) carrying every member of a due group. Every other field is
        replaced. Returns the stored registration (never its secrets);
        :class:`InvalidArgument` for bad input (a short secret, a URL that points at a
        loopback, private, link-local or other non-public address),
        :class:`FailedPrecondition` when the server has no key to store secrets with.
        """
        request = webhook_request(
            name,
            url,
            queues,
            concurrency=concurrency,
            timeout=timeout,
            paused=paused,
            secrets=secrets,
            batch_types=batch_types,
        )
        response = await self._webhook(
            "UpsertWebhookWorker", request, svc.UpsertWebhookWorkerResponse, name
        )
        return webhook_from_wire(response.worker)

    async def get_webhook_worker(self, name: str) -> WebhookWorker:
        """The registration ``name``; :class:`WebhookWorkerNotFound` when there is none."""
        request = svc.GetWebhookWorkerRequest(name=name)
        response = await self._webhook(
            "GetWebhookWorker", request, svc.GetWebhookWorkerResponse, name
        )
        return webhook_from_wire(response.worker)

    async def list_webhook_workers(self) -> list[WebhookWorker]:
        """Every webhook worker registration, by name."""
        request = svc.ListWebhookWorkersRequest()
        response = await self._call("ListWebhookWorkers", request, svc.ListWebhookWorkersResponse)
        return [webhook_from_wire(worker) for worker in response.workers]

    async def pause_webhook_worker(self, name: str) -> None:
        """Stop new deliveries to ``name`` (deliveries in flight finish)."""
        request = svc.SetWebhookWorkerPausedRequest(name=name, paused=True)
        await self._webhook(
            "SetWebhookWorkerPaused", request, svc.SetWebhookWorkerPausedResponse, name
        )

    async def resume_webhook_worker(self, name: str) -> None:
        """Deliver to ``name`` again."""
        request = svc.SetWebhookWorkerPausedRequest(name=name, paused=False)
        await self._webhook(
            "SetWebhookWorkerPaused", request, svc.SetWebhookWorkerPausedResponse, name
        )

    async def delete_webhook_worker(self, name: str) -> None:
        """Remove the registration ``name`` (deliveries in flight finish)."""
        request = svc.DeleteWebhookWorkerRequest(name=name)
        await self._webhook("DeleteWebhookWorker", request, svc.DeleteWebhookWorkerResponse, name)

    async def _webhook(self, method: str, request: object, response_type: Any, name: str) -> Any:
        try:
            return await self._call(method, request, response_type)
        except ConveyorError as exc:
            raise with_webhook_name(exc, name) from None

    # ----------------------------------------------------------- cron entries

    async def upsert_cron_entry(
        self,
        name: str,
        schedule: str,
        task: TaskSpec,
        *,
        timezone: str = "UTC",
        misfire: CronMisfire | str = CronMisfire.RUN_ONCE,
        paused: bool = False,
    ) -> CronEntry:
        """Create or replace the cron entry ``name``: on every slot of ``schedule`` (read
        in the IANA ``timezone``) the server enqueues ``task`` (a :class:`TaskSpec`
        without id, unique key, dependencies or absolute times), once.

        ``schedule``: five cron fields (``"0 3 * * *"``), six with seconds first, an
        alias (``@daily``...) or ``@every <duration>``. ``misfire``: what to do with slots
        missed while the cluster was down, ``"run_once"`` or ``"skip"``. Replacing an
        entry with the same schedule and zone keeps its next run. Returns the stored
        entry; :class:`InvalidArgument` for a bad schedule, zone or task, or a schedule
        that never fires (``0 0 31 2 *``).
        """
        spec = CronSpec(name, schedule, task, timezone, misfire_policy(misfire), paused)
        return await self._upsert_cron(spec)

    async def apply_cron_entries(self, entries: Iterable[CronSpec]) -> list[CronEntry]:
        """Upsert every declared entry (see :func:`conveyor.cron`) and return them as
        stored. Idempotent: an application can apply its entries at every start, and
        an entry whose schedule did not change keeps its next run (no slot is skipped
        or repeated). Entries not in the list are left alone."""
        declared = list(entries)
        names = [entry.name for entry in declared if isinstance(entry, CronSpec)]
        if len(set(names)) != len(names):
            raise InvalidArgument("cron entry names must be unique in one apply")
        return [await self._upsert_cron(entry) for entry in declared]

    async def _upsert_cron(self, entry: CronSpec) -> CronEntry:
        request = cron_request(entry, self._codec)
        response = await self._call("UpsertCronEntry", request, svc.UpsertCronEntryResponse)
        return cron_from_wire(response.entry, self._codec)

    async def get_cron_entry(self, name: str) -> CronEntry:
        """The cron entry ``name``; :class:`CronEntryNotFound` when there is none."""
        request = svc.GetCronEntryRequest(name=name)
        response = await self._cron("GetCronEntry", request, svc.GetCronEntryResponse, name)
        return cron_from_wire(response.entry, self._codec)

    async def list_cron_entries(self) -> list[CronEntry]:
        """Every cron entry, by name."""
        request = svc.ListCronEntriesRequest()
        response = await self._call("ListCronEntries", request, svc.ListCronEntriesResponse)
        return [cron_from_wire(entry, self._codec) for entry in response.entries]

    async def pause_cron_entry(self, name: str) -> CronEntry:
        """Stop entry ``name`` firing; the slots that pass while it is paused never
        fire."""
        request = svc.SetCronPausedRequest(name=name, paused=True)
        response = await self._cron("SetCronPaused", request, svc.SetCronPausedResponse, name)
        return cron_from_wire(response.entry, self._codec)

    async def resume_cron_entry(self, name: str) -> CronEntry:
        """Fire entry ``name`` again, from its first slot after now."""
        request = svc.SetCronPausedRequest(name=name, paused=False)
        response = await self._cron("SetCronPaused", request, svc.SetCronPausedResponse, name)
        return cron_from_wire(response.entry, self._codec)

    async def trigger_cron_entry(self, name: str) -> TaskInfo:
        """Enqueue entry ``name``'s task now, outside its schedule (paused or not; its
        next run is unchanged). Returns the new task."""
        request = svc.TriggerCronEntryRequest(name=name)
        response = await self._cron("TriggerCronEntry", request, svc.TriggerCronEntryResponse, name)
        return self._task(response)

    async def delete_cron_entry(self, name: str) -> None:
        """Delete entry ``name`` (the tasks it created stay)."""
        request = svc.DeleteCronEntryRequest(name=name)
        await self._cron("DeleteCronEntry", request, svc.DeleteCronEntryResponse, name)

    # ----------------------------------------------------------- rate limits

    async def set_rate_limit(
        self, queue: str, per_second: float, *, burst: int | None = None
    ) -> RateLimit:
        """Start at most ``per_second`` tasks of ``queue`` a second (a fraction for less
        than one: 0.5 is one every two seconds), across every worker, and at most
        ``burst`` at once after a quiet spell (None: one second's worth, at least 1).
        Replacing a limit keeps the tokens its bucket holds, so a change never grants a
        fresh burst. Returns the stored limit; :class:`InvalidArgument` for a bad queue,
        a rate outside (0, 1,000,000] or a burst outside 1..1,000,000."""
        request = rate_limit_request(queue, per_second, burst)
        response = await self._call("SetRateLimit", request, svc.SetRateLimitResponse)
        return rate_limit_from_wire(response.limit)

    async def delete_rate_limit(self, queue: str) -> None:
        """Remove ``queue``'s rate limit: its tasks start as fast as workers take them.
        :class:`RateLimitNotFound` when it has none."""
        request = svc.DeleteRateLimitRequest(queue=queue)
        try:
            await self._call("DeleteRateLimit", request, svc.DeleteRateLimitResponse)
        except ConveyorError as exc:
            raise with_rate_limit(exc, queue) from None

    async def list_rate_limits(self) -> list[RateLimit]:
        """Every queue's rate limit, by queue."""
        request = svc.ListRateLimitsRequest()
        response = await self._call("ListRateLimits", request, svc.ListRateLimitsResponse)
        return [rate_limit_from_wire(limit) for limit in response.limits]

    # ---------------------------------------------------- concurrency limits

    async def set_concurrency_limit(
        self, queue: str, per_key: int, *, pattern: str = "*"
    ) -> ConcurrencyLimit:
        """Run at most ``per_key`` tasks of ``queue`` at once per concurrency key (the
        ``concurrency_key`` task option), for the keys matching ``pattern``, across every
        worker. A task of a key at its limit waits (state HELD) without holding up other
        keys. Raising a limit releases waiting tasks at once. Returns the stored limit;
        :class:`InvalidArgument` for a bad queue or pattern or a limit outside
        1..1,000,000."""
        request = concurrency_limit_request(queue, per_key, pattern)
        response = await self._call("SetConcurrencyLimit", request, svc.SetConcurrencyLimitResponse)
        return concurrency_limit_from_wire(response.limit)

    async def delete_concurrency_limit(self, queue: str, *, pattern: str = "*") -> None:
        """Remove ``queue``'s limit for ``pattern``: its keys take another pattern's
        limit, or run unlimited. :class:`ConcurrencyLimitNotFound` when there is none."""
        request = svc.DeleteConcurrencyLimitRequest(queue=queue, pattern=pattern)
        try:
            await self._call("DeleteConcurrencyLimit", request, svc.DeleteConcurrencyLimitResponse)
        except ConveyorError as exc:
            raise with_concurrency_limit(exc, queue, pattern) from None

    async def list_concurrency_limits(self, queue: str | None = None) -> list[ConcurrencyLimit]:
        """The concurrency limits of ``queue`` (None: of every queue), by queue and
        pattern."""
        request = svc.ListConcurrencyLimitsRequest(queue=queue or "")
        response = await self._call(
            "ListConcurrencyLimits", request, svc.ListConcurrencyLimitsResponse
        )
        return [concurrency_limit_from_wire(limit) for limit in response.limits]

    # ------------------------------------------------------ circuit breakers

    async def set_breaker_config(
        self,
        queue: str,
        failures: int,
        window: DurationLike,
        cooldown: DurationLike,
        *,
        pattern: str = "*",
        scope: BreakerScope | str = BreakerScope.WORKER,
    ) -> BreakerConfig:
        """Create or replace the circuit breaker of ``queue``'s task types matching
        ``pattern`` (a glob: ``*`` any text, ``?`` one character; a type takes its
        queue's longest matching pattern). Once ``failures`` attempts of one type fail on
        a worker within ``window``, the type goes to nobody in ``scope`` (``"worker"``:
        that worker; ``"queue"``: every worker of the queue) for ``cooldown``; then one
        probe goes, and its outcome closes the breaker or opens it again. ``window`` and
        ``cooldown`` are timedeltas or seconds. Returns the stored config;
        :class:`InvalidArgument` for a bad queue or pattern, failures outside
        1..10,000, a window outside 1 s .. 1 day or a cooldown outside 100 ms .. 1 day
        (nothing stored changes)."""
        request = breaker_config_request(queue, failures, window, cooldown, pattern, scope)
        response = await self._call("SetBreakerConfig", request, svc.SetBreakerConfigResponse)
        return breaker_config_from_wire(response.config)

    async def delete_breaker_config(self, queue: str, *, pattern: str = "*") -> None:
        """Remove ``queue``'s breaker config for ``pattern``: its types take another
        pattern's config, or have no breaker. :class:`BreakerConfigNotFound` when there
        is none."""
        request = svc.DeleteBreakerConfigRequest(queue=queue, pattern=pattern)
        try:
            await self._call("DeleteBreakerConfig", request, svc.DeleteBreakerConfigResponse)
        except ConveyorError as exc:
            raise with_breaker_config(exc, queue, pattern) from None

    async def list_breaker_configs(self, queue: str | None = None) -> list[BreakerConfig]:
        """The breaker configs of ``queue`` (None: of every queue), by queue and
        pattern."""
        request = svc.ListBreakerConfigsRequest(queue=queue or "")
        response = await self._call("ListBreakerConfigs", request, svc.ListBreakerConfigsResponse)
        return [breaker_config_from_wire(c) for c in response.configs]

    async def list_breakers(self, queue: str | None = None) -> list[Breaker]:
        """The circuit breakers that are not closed (open or half-open) of ``queue``
        (None: of every queue): which type, whose (a worker's, or queue-wide), until
        when, and the failures that opened each."""
        request = svc.ListBreakersRequest(queue=queue or "")
        response = await self._call("ListBreakers", request, svc.ListBreakersResponse)
        return [breaker_from_wire(b) for b in response.breakers]

    # ---------------------------------------------------- aggregation groups

    async def set_group_config(
        self,
        queue: str,
        *,
        pattern: str = "*",
        max_size: int | None = None,
        max_delay: DurationLike | None = None,
        grace_period: DurationLike | None = None,
    ) -> GroupConfig:
        """Create or replace the config of the aggregation groups of ``queue`` whose
        names match ``pattern`` (a glob: ``*`` any text, ``?`` one character). Such a
        group is delivered as one batch once it holds ``max_size`` members,
        ``max_delay`` after its first member joined, or ``grace_period`` after its last
        one did, whichever comes first; what is None takes the server default. Returns
        the stored config; :class:`InvalidArgument` for a bad queue, pattern or value."""
        request = group_config_request(
            queue,
            pattern,
            max_size,
            to_timedelta("max_delay", max_delay),
            to_timedelta("grace_period", grace_period),
        )
        response = await self._call("SetGroupConfig", request, svc.SetGroupConfigResponse)
        return group_config_from_wire(response.config)

    async def delete_group_config(self, queue: str, pattern: str = "*") -> None:
        """Delete the config of ``queue`` and ``pattern``: its groups take the next
        matching config, or the defaults. :class:`GroupConfigNotFound` when none is
        stored."""
        request = svc.DeleteGroupConfigRequest(queue=queue, pattern=pattern)
        try:
            await self._call("DeleteGroupConfig", request, svc.DeleteGroupConfigResponse)
        except ConveyorError as exc:
            raise with_group_config(exc, queue, pattern) from None

    async def list_group_configs(self, queue: str | None = None) -> list[GroupConfig]:
        """The stored group configs (of ``queue``), by queue then pattern."""
        request = svc.ListGroupConfigsRequest(queue=queue or "")
        response = await self._call("ListGroupConfigs", request, svc.ListGroupConfigsResponse)
        return [group_config_from_wire(c) for c in response.configs]

    async def group_stats(self, queue: str | None = None, limit: int = 1000) -> list[GroupStats]:
        """The aggregation groups with members waiting to be delivered (of ``queue``):
        how many, and when the first and the last joined; by queue then group, at most
        ``limit`` (1..1000)."""
        request = group_stats_request(queue, limit)
        response = await self._call("GetGroupStats", request, svc.GetGroupStatsResponse)
        return [group_stats_from_wire(g) for g in response.groups]

    async def _cron(self, method: str, request: object, response_type: Any, name: str) -> Any:
        try:
            return await self._call(method, request, response_type)
        except ConveyorError as exc:
            raise with_cron_name(exc, name) from None

    # ---------------------------------------------------------------- events

    def watch_events(
        self, *, queues: Iterable[str] = (), states: Iterable[StateLike] = ()
    ) -> AsyncEventStream:
        """Live lifecycle events, optionally only of some ``queues`` and ``states``.

        ::

            async with admin.watch_events(queues=["emails"], states=["archived"]) as events:
                async for event in events:
                    print(event.task_id, event.error)

        Entering the ``async with`` waits until the server is subscribed. Events are
        hints delivered at most once: a watcher that falls far behind misses some.
        """
        return AsyncEventStream(
            self._stream("WatchEvents", watch_request(queues, states), svc.TaskEvent)
        )
