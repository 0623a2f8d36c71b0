"""AdminService: inspection straight from the broker, and operator actions that are a
broker write followed by a NATS nudge (a wake, a control reload, or a cancel broadcast).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import grpc
from conveyor_broker import (
    DEFAULT_MAX_RETRY,
    MAX_BATCH,
    Breaker,
    Broker,
    BrokerError,
    DependencyListParams,
    InvalidTask,
    NotSupported,
    Task,
    TaskListParams,
    TaskState,
)
from conveyor_broker.clock import Clock
from conveyor_broker.types import CANCELED_WHILE_RUNNING_ERROR
from conveyor_broker.validation import (
    MAX_PAYLOAD,
    check_cron_name,
    check_queue,
    check_task_id,
    check_webhook_name,
)
from conveyor_gateway import WakePublisher
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus, Published
from conveyor_runtime.cluster_view import NodeCard, merge_nodes
from conveyor_runtime.events import WATCH_REANNOUNCE, EventGate
from conveyor_runtime.webhook_secrets import SecretKeyError, SecretKeyring
from conveyor_runtime.webhook_urls import AddressPolicy, UrlGuard
from conveyor_runtime.wire import TaskDefaults
from google.protobuf.timestamp_pb2 import Timestamp
from nats.aio.subscription import Subscription

from conveyor_api.auth import who_am_i
from conveyor_api.broker_status import abort_for_error
from conveyor_api.session import SessionRegistry

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from conveyor_runtime.tokens import Token

    _Context = grpc.aio.ServicerContext[Any, Any]
    #: Who a call's metadata names: the token it presents (BearerAuthInterceptor.caller).
    Caller = Callable[[Any], Token | None]

#: Most tasks one BatchTaskAction touches.
MAX_BATCH_ACTION = 1000
#: ListTasks: a page ends before the task that would take it past this many bytes
#: (conveyor_broker.types.listed_size), so a page of big tasks stays a few MiB.
LIST_PAGE_BYTES = 4 * 1024 * 1024
#: ListTasks page size when the request sets none.
DEFAULT_TASK_PAGE = 100
#: ListQueues page size when the request sets none (and the most it may ask for): what a
#: caller that knows no paging (an older SDK) gets.
DEFAULT_QUEUE_PAGE = MAX_BATCH
#: Broker calls a BatchTaskAction runs at once.
_BATCH_CONCURRENCY = 16
#: Event messages (each a run of events) a slow WatchEvents caller may fall behind by
#: before events are dropped.
_WATCH_BACKLOG = 10_000
#: Distinct queues one WatchEvents call may name (one NATS subscription each; with no
#: queue named it watches them all through one). 100,000 names held the api's event loop
#: for about half a minute.
MAX_WATCH_QUEUES = 1_000

#: AdminService methods that exist on the wire but not yet in this server.
NOT_YET_IMPLEMENTED: tuple[str, ...] = ()


class AdminService(service_pb2_grpc.AdminServiceServicer):
    """Operator API. Mutations are refused by the read-only interceptor when configured."""

    def __init__(
        self,
        *,
        broker: Broker,
        bus: Bus,
        wakes: WakePublisher,
        registry: SessionRegistry,
        server_version: str,
        clock: Clock,
        event_gate: EventGate | None = None,
        url_guard: UrlGuard | None = None,
        keyring: SecretKeyring | None = None,
        task_defaults: TaskDefaults | None = None,
        instance: str = "",
        card: NodeCard | None = None,
        cluster_info_window: float = 0.25,
        caller: Caller | None = None,
        read_only: bool = False,
    ) -> None:
        """``url_guard`` checks where webhook URLs point (default: public addresses only);
        ``keyring`` seals webhook secrets (default: none, and registering a secret is
        FAILED_PRECONDITION); ``task_defaults`` are the producer's limits, which a cron
        entry's task template must keep too. ``instance`` names this api; ``card`` is its
        own entry in the cluster view, and GetClusterInfo waits ``cluster_info_window``
        seconds for every process's. ``caller`` names the token a call's metadata
        presents (None: auth is off) and ``read_only`` says the api refuses mutations:
        what WhoAmI reports (the interceptors enforce both)."""
        self._caller = caller
        self._read_only = read_only
        self._broker = broker
        self._instance = instance
        self._card = card
        self._cluster_info_window = cluster_info_window
        self._task_defaults = task_defaults or TaskDefaults(
            max_retry=DEFAULT_MAX_RETRY, retention=timedelta(days=1), max_payload=MAX_PAYLOAD
        )
        self._url_guard = url_guard or UrlGuard(AddressPolicy.from_networks([]))
        self._keyring = keyring or SecretKeyring()
        self._clock = clock
        self._event_gate = event_gate
        self._bus = bus
        self._wakes = wakes
        self._registry = registry
        self._server_version = server_version
        self._watchers: set[asyncio.Queue[list[service_pb2.TaskEvent] | None]] = set()

    def end_watches(self) -> None:
        """End every WatchEvents stream (OK status), so a server stop need not wait."""
        for inbox in self._watchers:
            while True:
                try:
                    inbox.put_nowait(None)
                    break
                except asyncio.QueueFull:
                    inbox.get_nowait()  # the watcher is leaving: its backlog no longer matters

    # ------------------------------------------------------------- reads

    async def GetTask(
        self, request: service_pb2.GetTaskRequest, context: _Context
    ) -> service_pb2.GetTaskResponse:
        """One task by id."""
        try:
            check_task_id(request.id)
            task = await self._broker.get_task(request.id)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.GetTaskResponse(task=wire.task_to_proto(task))

    async def ListTasks(
        self, request: service_pb2.ListTasksRequest, context: _Context
    ) -> service_pb2.ListTasksResponse:
        """A page of tasks, filtered by queue and state: at most ``limit`` tasks and about
        LIST_PAGE_BYTES, with or without their payloads."""
        try:
            if request.queue:
                check_queue(request.queue)
            page = await self._broker.list_tasks(
                TaskListParams(
                    queue=request.queue or None,
                    state=wire.state_filter(request.state),
                    limit=request.limit or DEFAULT_TASK_PAGE,
                    cursor=request.cursor or None,
                    max_bytes=LIST_PAGE_BYTES,
                    omit_payloads=request.omit_payloads,
                )
            )
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListTasksResponse(
            tasks=[wire.task_to_proto(t) for t in page.tasks], next_cursor=page.next_cursor or ""
        )

    async def ListQueues(
        self, request: service_pb2.ListQueuesRequest, context: _Context
    ) -> service_pb2.ListQueuesResponse:
        """A page of the known queues, by name, with their per-state counts and their
        breakers that are not closed."""
        try:
            page = await self._broker.list_queues(
                after=request.cursor or None, limit=request.limit or DEFAULT_QUEUE_PAGE
            )
            by_queue: defaultdict[str, list[Breaker]] = defaultdict(list)
            if page.queues:
                for breaker in await self._breakers(None):  # one query for the whole page
                    by_queue[breaker.queue].append(breaker)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListQueuesResponse(
            queues=[wire.stats_to_proto(s, by_queue.get(s.queue, ())) for s in page.queues],
            next_cursor=page.next_cursor or "",
        )

    async def GetQueueStats(
        self, request: service_pb2.GetQueueStatsRequest, context: _Context
    ) -> service_pb2.GetQueueStatsResponse:
        """One queue's counts (all zero for a queue never seen) and its breakers that
        are not closed."""
        try:
            check_queue(request.queue)
            stats = await self._broker.queue_stats(request.queue)
            breakers = await self._breakers(request.queue)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.GetQueueStatsResponse(stats=wire.stats_to_proto(stats[0], breakers))

    async def _breakers(self, queue: str | None) -> Sequence[Breaker]:
        """The breakers that are not closed (of ``queue``, or of every queue) for the
        queue stats; none from a broker that keeps no breakers."""
        try:
            return await self._broker.list_breakers(queue)
        except NotSupported:
            return ()

    async def GetClusterInfo(
        self, request: service_pb2.GetClusterInfoRequest, context: _Context
    ) -> service_pb2.GetClusterInfoResponse:
        """Every service process that answers within the window (api nodes with their
        worker sessions, dispatchers with the queues they own, leaders, webhook gateways)
        and the broker driver. Without NATS, this api's own entry alone."""
        try:
            info = await self._broker.info()
        except Exception as exc:
            await abort_for_error(context, exc)
        try:
            nodes = await self._bus.gather_nodes(within=self._cluster_info_window)
        except Exception as exc:
            logger.warning("cluster_info.gather_failed error=%r", exc)
            nodes = []
        if self._card is not None:
            mine = self._card.describe()
            if not any(
                n.kind == mine.kind and n.pid == mine.pid and n.instance == mine.instance
                for n in nodes
            ):
                nodes.append(mine)
        response = service_pb2.GetClusterInfoResponse(
            server_version=self._server_version, broker=info.driver, answered_by=self._instance
        )
        merge_nodes(nodes, response)
        return response

    async def WhoAmI(
        self, request: service_pb2.WhoAmIRequest, context: _Context
    ) -> service_pb2.WhoAmIResponse:
        """The caller's token's role and what it may do here (any authenticated token may
        ask: BearerAuthInterceptor lets this method through for every role)."""
        if self._caller is None:
            return who_am_i(None, auth_enabled=False, read_only=self._read_only)
        token = self._caller(context.invocation_metadata())
        if token is None:  # the interceptor refuses such a call before it gets here
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        return who_am_i(token, auth_enabled=True, read_only=self._read_only)

    async def WatchEvents(
        self, request: service_pb2.WatchEventsRequest, context: _Context
    ) -> AsyncIterator[service_pb2.TaskEvent]:
        """Live lifecycle events. Initial metadata is sent once the subscription is live,
        so a caller can wait for it before causing the events it wants to see."""
        try:
            queues = set(request.queues)
            if len(queues) > MAX_WATCH_QUEUES:
                raise InvalidTask(
                    f"WatchEvents takes at most {MAX_WATCH_QUEUES:,} distinct queues "
                    f"(got {len(queues):,}); name none to watch every queue"
                )
            for queue in queues:
                check_queue(queue)
            for state in request.states:
                wire.state_filter(state)
        except InvalidTask as exc:
            await abort_for_error(context, exc)
        wanted_states = set(request.states)
        inbox: asyncio.Queue[list[service_pb2.TaskEvent] | None] = asyncio.Queue(
            maxsize=_WATCH_BACKLOG
        )

        def on_events(events: list[service_pb2.TaskEvent]) -> None:
            try:
                inbox.put_nowait(events)
            except asyncio.QueueFull:
                logger.warning("watch_events.dropped reason=backlog_full")

        subs: list[Subscription] = []
        for queue in sorted(queues):
            subs.append(await self._bus.subscribe_events(on_events, queue=queue))
        if not subs:
            subs.append(await self._bus.subscribe_events(on_events))
        self._watchers.add(inbox)
        await self._announce_watch()  # before the first event could matter to the caller
        announcer = asyncio.get_running_loop().create_task(self._keep_announcing())
        try:
            await self._bus.nc.flush()
            await context.send_initial_metadata(())
            while True:
                events = await inbox.get()
                if events is None:
                    return
                for event in events:
                    if not wanted_states or event.state in wanted_states:
                        yield event
        finally:
            announcer.cancel()
            self._watchers.discard(inbox)
            for sub in subs:
                try:
                    await sub.unsubscribe()
                except Exception as exc:
                    logger.debug("watch_events.unsubscribe_failed error=%r", exc)

    async def _announce_watch(self) -> None:
        """Make every process publish events for a while (by default they publish only
        while watched: see :mod:`conveyor_runtime.events`)."""
        if self._event_gate is not None:
            self._event_gate.keep_open()  # this process: at once, no round trip
        try:
            await self._bus.publish_watch()
        except Exception as exc:
            logger.warning("watch_events.announce_failed error=%r", exc)

    async def _keep_announcing(self) -> None:
        while True:
            await asyncio.sleep(WATCH_REANNOUNCE)
            await self._announce_watch()

    # ---------------------------------------------------------- queue flags

    async def _set_paused(self, queue: str, paused: bool, context: _Context) -> None:
        try:
            check_queue(queue)
            await self._broker.set_queue_paused(queue, paused)
        except Exception as exc:
            await abort_for_error(context, exc)
        reason = "paused" if paused else "resumed"
        await self._publish(cluster_pb2.Control(queue=queue, reason=reason))
        logger.info("admin.queue_%s queue=%s", reason, queue)

    async def PauseQueue(
        self, request: service_pb2.PauseQueueRequest, context: _Context
    ) -> service_pb2.PauseQueueResponse:
        """Persist the pause flag, then tell the queue's dispatcher to reload."""
        await self._set_paused(request.queue, True, context)
        return service_pb2.PauseQueueResponse()

    async def ResumeQueue(
        self, request: service_pb2.ResumeQueueRequest, context: _Context
    ) -> service_pb2.ResumeQueueResponse:
        """Clear the pause flag, then tell the queue's dispatcher to reload."""
        await self._set_paused(request.queue, False, context)
        return service_pb2.ResumeQueueResponse()

    # ---------------------------------------------------------- task actions

    async def _publish(self, message: Published) -> None:
        # Hints only: the broker write already happened, so a lost publish just delays.
        try:
            await self._bus.publish(message)
        except Exception as exc:
            logger.warning("admin.publish_failed message=%s error=%r", type(message).__name__, exc)

    async def _act(
        self, action: int, task_id: str, process_at: datetime | None = None
    ) -> Task | None:
        """Run one task action and its nudge. Raises BrokerError."""
        check_task_id(task_id)
        broker = self._broker
        if action == service_pb2.TASK_ACTION_CANCEL:
            task = await broker.cancel_task(task_id)
            if task.state is TaskState.ARCHIVED and task.last_error == CANCELED_WHILE_RUNNING_ERROR:
                # It was running: its gateway (wherever it is) tells the worker to stop.
                await self._publish(
                    cluster_pb2.CancelBroadcast(
                        task_id=task_id, reason=CANCELED_WHILE_RUNNING_ERROR
                    )
                )
            return task
        if action == service_pb2.TASK_ACTION_DELETE:
            await broker.delete_task(task_id)
            return None
        if action == service_pb2.TASK_ACTION_ARCHIVE:
            return await broker.archive_task(task_id)
        if action == service_pb2.TASK_ACTION_RUN_NOW:
            task = await broker.run_task_now(task_id)
        elif action == service_pb2.TASK_ACTION_REVIVE:
            task = await broker.revive_task(task_id)
        elif action == service_pb2.TASK_ACTION_RESCHEDULE:
            if process_at is None:
                raise InvalidTask("reschedule needs process_at")
            task = await broker.reschedule_task(task_id, process_at)
        else:
            raise InvalidTask(f"unknown task action {action}")
        self._wakes.when_due(task, self._clock.now())
        return task

    async def _single(
        self, action: int, task_id: str, context: _Context, process_at: datetime | None = None
    ) -> service_pb2.TaskActionResponse:
        try:
            task = await self._act(action, task_id, process_at)
        except Exception as exc:
            await abort_for_error(context, exc)
        logger.info("admin.task_action action=%s task=%s", _action_name(action), task_id)
        if task is None:
            return service_pb2.TaskActionResponse()
        return service_pb2.TaskActionResponse(task=wire.task_to_proto(task))

    async def CancelTask(
        self, request: service_pb2.TaskActionRequest, context: _Context
    ) -> service_pb2.TaskActionResponse:
        """Cancel a waiting task; abort a running one (its worker is told to stop). Tasks
        that wait for it follow their policies (the resolver hears of the end)."""
        return await self._single(service_pb2.TASK_ACTION_CANCEL, request.id, context)

    async def RunTaskNow(
        self, request: service_pb2.TaskActionRequest, context: _Context
    ) -> service_pb2.TaskActionResponse:
        """Make a waiting task due now and wake its queue (a BLOCKED one too: it runs
        despite its unmet dependencies)."""
        return await self._single(service_pb2.TASK_ACTION_RUN_NOW, request.id, context)

    async def DeleteTask(
        self, request: service_pb2.TaskActionRequest, context: _Context
    ) -> service_pb2.TaskActionResponse:
        """Delete a task that is not running."""
        return await self._single(service_pb2.TASK_ACTION_DELETE, request.id, context)

    async def ArchiveTask(
        self, request: service_pb2.TaskActionRequest, context: _Context
    ) -> service_pb2.TaskActionResponse:
        """Archive a waiting task."""
        return await self._single(service_pb2.TASK_ACTION_ARCHIVE, request.id, context)

    async def ReviveTask(
        self, request: service_pb2.TaskActionRequest, context: _Context
    ) -> service_pb2.TaskActionResponse:
        """Bring an archived task back as pending and wake its queue."""
        return await self._single(service_pb2.TASK_ACTION_REVIVE, request.id, context)

    async def RescheduleTask(
        self, request: service_pb2.RescheduleTaskRequest, context: _Context
    ) -> service_pb2.TaskActionResponse:
        """Move a waiting task to ``process_at``."""
        if not request.HasField("process_at"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "process_at is required")
        try:
            when = _process_at(request.process_at)
        except InvalidTask as exc:
            await abort_for_error(context, exc)
        return await self._single(service_pb2.TASK_ACTION_RESCHEDULE, request.id, context, when)

    async def BatchTaskAction(
        self, request: service_pb2.BatchTaskActionRequest, context: _Context
    ) -> service_pb2.BatchTaskActionResponse:
        """One action over up to 1000 tasks, chosen by ids or by queue and state."""
        try:
            ids, process_at = await self._select(request)
        except Exception as exc:
            await abort_for_error(context, exc)
        limiter = asyncio.Semaphore(_BATCH_CONCURRENCY)
        failures: dict[str, str] = {}

        async def one(task_id: str) -> bool:
            async with limiter:
                try:
                    await self._act(request.action, task_id, process_at)
                except BrokerError as exc:
                    failures[task_id] = str(exc)
                    return False
                return True

        done = await asyncio.gather(*(one(i) for i in ids))
        logger.info(
            "admin.batch_action action=%s selected=%d affected=%d",
            _action_name(request.action),
            len(ids),
            sum(done),
        )
        return service_pb2.BatchTaskActionResponse(affected=sum(done), failures=failures)

    async def ListTaskDependencies(
        self, request: service_pb2.ListTaskDependenciesRequest, context: _Context
    ) -> service_pb2.ListTaskDependenciesResponse:
        """A page of a task's dependency edges: the tasks it waits for, or those that wait
        for it, each with how the edge stands and the other task's state."""
        try:
            page = await self._broker.list_dependencies(
                DependencyListParams(
                    task_id=request.id,
                    dependents=request.dependents,
                    limit=request.limit or DEFAULT_TASK_PAGE,
                    cursor=request.cursor or None,
                )
            )
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListTaskDependenciesResponse(
            dependencies=[wire.dependency_to_proto(link) for link in page.links],
            next_cursor=page.next_cursor or "",
        )

    # ------------------------------------------------------- webhook workers
    # No NATS nudge: the webhook manager converges on the stored registrations every
    # reconcile tick. Secrets are write-only: no response ever carries them, and the
    # broker only ever sees them sealed (conveyor_runtime.webhook_secrets).

    async def UpsertWebhookWorker(
        self, request: service_pb2.UpsertWebhookWorkerRequest, context: _Context
    ) -> service_pb2.UpsertWebhookWorkerResponse:
        """Create or replace a registration (no secrets given: the stored ones stay).

        The URL must point at an address deliveries may reach (INVALID_ARGUMENT
        otherwise, see :mod:`conveyor_runtime.webhook_urls`); secrets are sealed under
        the server key before they are stored (none configured: FAILED_PRECONDITION)."""
        try:
            if not request.HasField("worker"):
                raise InvalidTask("worker is required")
            spec = wire.webhook_spec_from_proto(request.worker)
            await self._url_guard.check(spec.url)
            sealed = self._keyring.seal_all(spec.name, spec.secrets)
            worker = await self._broker.upsert_webhook_worker(replace(spec, secrets=sealed))
        except SecretKeyError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:
            await abort_for_error(context, exc)
        logger.info(
            "admin.webhook_upserted name=%s queues=%s concurrency=%d paused=%s secrets=%d "
            "batch_types=%d",
            worker.name,
            ",".join(sorted(worker.queues)),
            worker.concurrency,
            worker.paused,
            len(worker.secrets),
            len(worker.batch_types),
        )
        return service_pb2.UpsertWebhookWorkerResponse(worker=wire.webhook_worker_to_proto(worker))

    async def GetWebhookWorker(
        self, request: service_pb2.GetWebhookWorkerRequest, context: _Context
    ) -> service_pb2.GetWebhookWorkerResponse:
        """One registration by name (without its secrets)."""
        try:
            check_webhook_name(request.name)
            worker = await self._broker.get_webhook_worker(request.name)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.GetWebhookWorkerResponse(worker=wire.webhook_worker_to_proto(worker))

    async def ListWebhookWorkers(
        self, request: service_pb2.ListWebhookWorkersRequest, context: _Context
    ) -> service_pb2.ListWebhookWorkersResponse:
        """Every registration, by name (without secrets)."""
        try:
            workers = await self._broker.list_webhook_workers()
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListWebhookWorkersResponse(
            workers=[wire.webhook_worker_to_proto(w) for w in workers]
        )

    async def SetWebhookWorkerPaused(
        self, request: service_pb2.SetWebhookWorkerPausedRequest, context: _Context
    ) -> service_pb2.SetWebhookWorkerPausedResponse:
        """Pause (no new deliveries) or resume a registration."""
        try:
            check_webhook_name(request.name)
            await self._broker.set_webhook_worker_paused(request.name, request.paused)
        except Exception as exc:
            await abort_for_error(context, exc)
        logger.info("admin.webhook_paused name=%s paused=%s", request.name, request.paused)
        return service_pb2.SetWebhookWorkerPausedResponse()

    async def DeleteWebhookWorker(
        self, request: service_pb2.DeleteWebhookWorkerRequest, context: _Context
    ) -> service_pb2.DeleteWebhookWorkerResponse:
        """Delete a registration (its gateway drains on the manager's next reconcile)."""
        try:
            check_webhook_name(request.name)
            await self._broker.delete_webhook_worker(request.name)
        except Exception as exc:
            await abort_for_error(context, exc)
        logger.info("admin.webhook_deleted name=%s", request.name)
        return service_pb2.DeleteWebhookWorkerResponse()

    # ----------------------------------------------------------- cron entries
    # No NATS nudge: the scheduler leader reads the entries on every pass (each
    # promote tick).

    async def UpsertCronEntry(
        self, request: service_pb2.UpsertCronEntryRequest, context: _Context
    ) -> service_pb2.UpsertCronEntryResponse:
        """Create or replace an entry. Applying the same entry again keeps its next run
        (an application that applies its entries at every start skips no slot)."""
        try:
            if not request.HasField("entry"):
                raise InvalidTask("entry is required")
            spec = wire.cron_spec_from_proto(request.entry, self._clock, self._task_defaults)
            entry = await self._broker.upsert_cron_entry(spec)
        except Exception as exc:
            await abort_for_error(context, exc)
        logger.info(
            "admin.cron_upserted name=%s schedule=%r timezone=%s queue=%s paused=%s",
            entry.name,
            entry.schedule,
            entry.timezone,
            entry.task.queue,
            entry.paused,
        )
        return service_pb2.UpsertCronEntryResponse(entry=wire.cron_entry_to_proto(entry))

    async def GetCronEntry(
        self, request: service_pb2.GetCronEntryRequest, context: _Context
    ) -> service_pb2.GetCronEntryResponse:
        """One entry by name."""
        try:
            check_cron_name(request.name)
            entry = await self._broker.get_cron_entry(request.name)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.GetCronEntryResponse(entry=wire.cron_entry_to_proto(entry))

    async def ListCronEntries(
        self, request: service_pb2.ListCronEntriesRequest, context: _Context
    ) -> service_pb2.ListCronEntriesResponse:
        """Every entry, by name."""
        try:
            entries = await self._broker.list_cron_entries()
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListCronEntriesResponse(
            entries=[wire.cron_entry_to_proto(e) for e in entries]
        )

    async def SetCronPaused(
        self, request: service_pb2.SetCronPausedRequest, context: _Context
    ) -> service_pb2.SetCronPausedResponse:
        """Pause an entry (the slots that pass meanwhile never fire) or resume it (from
        its first slot after now)."""
        try:
            check_cron_name(request.name)
            entry = await self._broker.set_cron_paused(request.name, request.paused)
        except Exception as exc:
            await abort_for_error(context, exc)
        logger.info("admin.cron_paused name=%s paused=%s", request.name, request.paused)
        return service_pb2.SetCronPausedResponse(entry=wire.cron_entry_to_proto(entry))

    async def DeleteCronEntry(
        self, request: service_pb2.DeleteCronEntryRequest, context: _Context
    ) -> service_pb2.DeleteCronEntryResponse:
        """Delete an entry (the tasks it made stay)."""
        try:
            check_cron_name(request.name)
            await self._broker.delete_cron_entry(request.name)
        except Exception as exc:
            await abort_for_error(context, exc)
        logger.info("admin.cron_deleted name=%s", request.name)
        return service_pb2.DeleteCronEntryResponse()

    async def TriggerCronEntry(
        self, request: service_pb2.TriggerCronEntryRequest, context: _Context
    ) -> service_pb2.TriggerCronEntryResponse:
        """Enqueue the entry's task now (paused or not); its schedule is unchanged."""
        try:
            check_cron_name(request.name)
            result = await self._broker.trigger_cron_entry(request.name)
        except Exception as exc:
            await abort_for_error(context, exc)
        self._wakes.when_due(result.task, self._clock.now())
        logger.info("admin.cron_triggered name=%s task_id=%s", request.name, result.task.id)
        return service_pb2.TriggerCronEntryResponse(task=wire.task_to_proto(result.task))

    # ----------------------------------------------------- aggregation groups
    # No NATS nudge: the group sweeper reads the configs on every pass.

    async def SetGroupConfig(
        self, request: service_pb2.SetGroupConfigRequest, context: _Context
    ) -> service_pb2.SetGroupConfigResponse:
        """Create or replace the config of a queue and group pattern; unset fields take
        the server defaults."""
        try:
            if not request.HasField("config"):
                raise InvalidTask("config is required")
            config = await self._broker.set_group_config(
                wire.group_config_from_proto(request.config)
            )
        except Exception as exc:
            await abort_for_error(context, exc)
        logger.info(
            "admin.group_config_set queue=%s pattern=%r max_size=%d max_delay=%s grace=%s",
            config.queue,
            config.pattern,
            config.max_size,
            config.max_delay,
            config.grace_period,
        )
        return service_pb2.SetGroupConfigResponse(config=wire.group_config_to_proto(config))

    async def DeleteGroupConfig(
        self, request: service_pb2.DeleteGroupConfigRequest, context: _Context
    ) -> service_pb2.DeleteGroupConfigResponse:
        """Delete a config (NOT_FOUND when none is stored); its groups take the next
        matching one, or the defaults."""
        pattern = request.pattern or "*"
        try:
            await self._broker.delete_group_config(request.queue, pattern)
        except Exception as exc:
            await abort_for_error(context, exc)
        logger.info("admin.group_config_deleted queue=%s pattern=%r", request.queue, pattern)
        return service_pb2.DeleteGroupConfigResponse()

    async def ListGroupConfigs(
        self, request: service_pb2.ListGroupConfigsRequest, context: _Context
    ) -> service_pb2.ListGroupConfigsResponse:
        """The stored configs (of one queue, or all), by queue then pattern."""
        try:
            configs = await self._broker.list_group_configs(request.queue or None)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListGroupConfigsResponse(
            configs=[wire.group_config_to_proto(c) for c in configs]
        )

    async def GetGroupStats(
        self, request: service_pb2.GetGroupStatsRequest, context: _Context
    ) -> service_pb2.GetGroupStatsResponse:
        """The groups with waiting members (of one queue, or all): how many, and when the
        first and the last joined; by queue then group, at most ``limit`` (1..1000)."""
        try:
            stats = await self._broker.group_stats(
                request.queue or None, request.limit or MAX_BATCH
            )
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.GetGroupStatsResponse(
            groups=[wire.group_stats_to_proto(s) for s in stats]
        )

    # ------------------------------------------------------------ rate limits
    # A change is a Control to the queue's owner, which reloads the limit at once.

    async def SetRateLimit(
        self, request: service_pb2.SetRateLimitRequest, context: _Context
    ) -> service_pb2.SetRateLimitResponse:
        """Create or replace a queue's rate limit (burst 0: one second of tokens). A
        replaced limit keeps the tokens its bucket holds (at most the new burst)."""
        try:
            if not request.HasField("limit"):
                raise InvalidTask("limit is required")
            limit = await self._broker.set_rate_limit(wire.rate_limit_from_proto(request.limit))
        except Exception as exc:
            await abort_for_error(context, exc)
        await self._publish(cluster_pb2.Control(queue=limit.queue, reason="rate_limit"))
        logger.info(
            "admin.rate_limit_set queue=%s per_second=%s burst=%d",
            limit.queue,
            limit.per_second,
            limit.burst,
        )
        return service_pb2.SetRateLimitResponse(limit=wire.rate_limit_to_proto(limit))

    async def DeleteRateLimit(
        self, request: service_pb2.DeleteRateLimitRequest, context: _Context
    ) -> service_pb2.DeleteRateLimitResponse:
        """Delete a queue's rate limit (NOT_FOUND when it has none): it flows unlimited."""
        try:
            await self._broker.delete_rate_limit(request.queue)
        except Exception as exc:
            await abort_for_error(context, exc)
        await self._publish(cluster_pb2.Control(queue=request.queue, reason="rate_limit"))
        logger.info("admin.rate_limit_deleted queue=%s", request.queue)
        return service_pb2.DeleteRateLimitResponse()

    async def ListRateLimits(
        self, request: service_pb2.ListRateLimitsRequest, context: _Context
    ) -> service_pb2.ListRateLimitsResponse:
        """Every stored rate limit, by queue."""
        try:
            limits = await self._broker.list_rate_limits()
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListRateLimitsResponse(
            limits=[wire.rate_limit_to_proto(limit) for limit in limits]
        )

    # ----------------------------------------------------- concurrency limits
    # The broker enforces them as it leases; a change may make HELD tasks PENDING, so
    # the queue is woken.

    async def SetConcurrencyLimit(
        self, request: service_pb2.SetConcurrencyLimitRequest, context: _Context
    ) -> service_pb2.SetConcurrencyLimitResponse:
        """Create or replace the per-key limit of a queue and key pattern (empty: ``*``).
        HELD tasks whose key now has room are PENDING at once."""
        try:
            if not request.HasField("limit"):
                raise InvalidTask("limit is required")
            limit = await self._broker.set_concurrency_limit(
                wire.concurrency_limit_from_proto(request.limit)
            )
        except Exception as exc:
            await abort_for_error(context, exc)
        self._wakes.wake(limit.queue)
        logger.info(
            "admin.concurrency_limit_set queue=%s pattern=%s per_key=%d",
            limit.queue,
            limit.pattern,
            limit.per_key,
        )
        return service_pb2.SetConcurrencyLimitResponse(limit=wire.concurrency_limit_to_proto(limit))

    async def DeleteConcurrencyLimit(
        self, request: service_pb2.DeleteConcurrencyLimitRequest, context: _Context
    ) -> service_pb2.DeleteConcurrencyLimitResponse:
        """Delete the limit of a queue and key pattern (empty: ``*``; NOT_FOUND when
        there is none); the keys it limited take another pattern's limit or none."""
        pattern = request.pattern or "*"
        try:
            await self._broker.delete_concurrency_limit(request.queue, pattern)
        except Exception as exc:
            await abort_for_error(context, exc)
        self._wakes.wake(request.queue)
        logger.info("admin.concurrency_limit_deleted queue=%s pattern=%s", request.queue, pattern)
        return service_pb2.DeleteConcurrencyLimitResponse()

    async def ListConcurrencyLimits(
        self, request: service_pb2.ListConcurrencyLimitsRequest, context: _Context
    ) -> service_pb2.ListConcurrencyLimitsResponse:
        """The stored limits (of ``queue``, or of every queue), by queue and pattern."""
        try:
            limits = await self._broker.list_concurrency_limits(request.queue or None)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListConcurrencyLimitsResponse(
            limits=[wire.concurrency_limit_to_proto(limit) for limit in limits]
        )

    # ------------------------------------------------------- circuit breakers
    # The gateways obey them (the dispatchers too, for queue-wide ones); a change is a
    # Control to the queue's owner, which reloads its configs at once.

    async def SetBreakerConfig(
        self, request: service_pb2.SetBreakerConfigRequest, context: _Context
    ) -> service_pb2.SetBreakerConfigResponse:
        """Create or replace the breaker config of a queue and type pattern (empty:
        ``*``; scope UNSPECIFIED: WORKER). Bad input is INVALID_ARGUMENT and stores
        nothing."""
        try:
            if not request.HasField("config"):
                raise InvalidTask("config is required")
            config = await self._broker.set_breaker_config(
                wire.breaker_config_from_proto(request.config)
            )
        except Exception as exc:
            await abort_for_error(context, exc)
        await self._publish(cluster_pb2.Control(queue=config.queue, reason="breakers"))
        logger.info(
            "admin.breaker_config_set queue=%s pattern=%s failures=%d window=%s cooldown=%s "
            "scope=%s",
            config.queue,
            config.pattern,
            config.failures,
            config.window,
            config.cooldown,
            config.scope.value,
        )
        return service_pb2.SetBreakerConfigResponse(config=wire.breaker_config_to_proto(config))

    async def DeleteBreakerConfig(
        self, request: service_pb2.DeleteBreakerConfigRequest, context: _Context
    ) -> service_pb2.DeleteBreakerConfigResponse:
        """Delete the breaker config of a queue and type pattern (empty: ``*``;
        NOT_FOUND when there is none); the types it covered take another pattern's
        config, or have no breaker."""
        pattern = request.pattern or "*"
        try:
            await self._broker.delete_breaker_config(request.queue, pattern)
        except Exception as exc:
            await abort_for_error(context, exc)
        await self._publish(cluster_pb2.Control(queue=request.queue, reason="breakers"))
        logger.info("admin.breaker_config_deleted queue=%s pattern=%s", request.queue, pattern)
        return service_pb2.DeleteBreakerConfigResponse()

    async def ListBreakerConfigs(
        self, request: service_pb2.ListBreakerConfigsRequest, context: _Context
    ) -> service_pb2.ListBreakerConfigsResponse:
        """The stored breaker configs (of ``queue``, or of every queue), by queue and
        pattern."""
        try:
            configs = await self._broker.list_breaker_configs(request.queue or None)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListBreakerConfigsResponse(
            configs=[wire.breaker_config_to_proto(c) for c in configs]
        )

    async def ListBreakers(
        self, request: service_pb2.ListBreakersRequest, context: _Context
    ) -> service_pb2.ListBreakersResponse:
        """The breakers that are not closed (open or half-open), of ``queue`` or of
        every queue."""
        try:
            breakers = await self._broker.list_breakers(request.queue or None)
        except Exception as exc:
            await abort_for_error(context, exc)
        return service_pb2.ListBreakersResponse(
            breakers=[wire.breaker_to_proto(b) for b in breakers]
        )

    async def _select(
        self, request: service_pb2.BatchTaskActionRequest
    ) -> tuple[list[str], datetime | None]:
        action = request.action
        if action not in _ACTION_NAMES:
            raise InvalidTask(f"unknown or missing task action {action}")
        process_at: datetime | None = None
        if action == service_pb2.TASK_ACTION_RESCHEDULE:
            if not request.HasField("process_at"):
                raise InvalidTask("RESCHEDULE needs process_at")
            process_at = _process_at(request.process_at)
        selector = request.selector
        if selector.ids:
            if selector.queue or selector.state:
                raise InvalidTask("select by ids or by queue and state, not both")
            if len(selector.ids) > MAX_BATCH_ACTION:
                raise InvalidTask(
                    f"at most {MAX_BATCH_ACTION} ids per batch action, got {len(selector.ids)}"
                )
            return list(dict.fromkeys(selector.ids)), process_at
        if not selector.queue:
            raise InvalidTask("the selector needs ids, or a queue (and optionally a state)")
        check_queue(selector.queue)
        page = await self._broker.list_tasks(
            TaskListParams(
                queue=selector.queue,
                state=wire.state_filter(selector.state),
                limit=MAX_BATCH_ACTION,
                omit_payloads=True,  # only the ids are wanted
            )
        )
        return [t.id for t in page.tasks], process_at


_ACTION_NAMES: dict[int, str] = {
    value: name.removeprefix("TASK_ACTION_")
    for name, value in service_pb2.TaskAction.items()
    if value != service_pb2.TASK_ACTION_UNSPECIFIED
}


def _process_at(value: Timestamp) -> datetime:
    """A request's ``process_at``; InvalidTask when it is no valid Timestamp (seconds
    beyond years 1-9999, nanos outside 0-999,999,999), which protobuf refuses with a
    ValueError."""
    try:
        return wire.from_timestamp(value)
    except (ValueError, OverflowError) as exc:
        raise InvalidTask(f"process_at is not a valid Timestamp: {exc}") from None


def _action_name(action: int) -> str:
    return _ACTION_NAMES.get(action, str(action))


def _not_yet(name: str) -> Any:
    async def method(self: AdminService, request: object, context: _Context) -> None:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"AdminService.{name} is not implemented by this server yet",
        )

    method.__name__ = name
    method.__qualname__ = f"AdminService.{name}"
    return method


for _name in NOT_YET_IMPLEMENTED:
    setattr(AdminService, _name, _not_yet(_name))
