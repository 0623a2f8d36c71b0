"""The worker: handler registry, lifecycle (run, stop, signals) and reconnects.

One :class:`Worker` keeps one WorkerService.Session stream open at a time (see
``docs/protocol.md``); :mod:`conveyor._worker.session` speaks the stream itself, and the
deliveries run in the :class:`~conveyor._worker.slots.Slots` of the worker's run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Coroutine, Iterable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from conveyor._channel import DEFAULT_TARGET, TlsFile, endpoint
from conveyor._errors import InvalidArgument, error_from_status
from conveyor._limits import (
    MAX_BATCH_TYPES,
    MAX_CONCURRENCY,
    MAX_HELLO_QUEUES,
    MAX_QUEUE_WEIGHT,
    MAX_TYPE_LEN,
    MAX_VERSION_LEN,
    MAX_WORKER_ID_LEN,
    check_labels,
    check_text,
    is_queue_name,
)
from conveyor._payload import Codec, JsonCodec
from conveyor._types import DurationLike, to_timedelta
from conveyor._worker.batch import BatchHandler, BatchRegistration
from conveyor._worker.execution import Handler, Registration
from conveyor._worker.reconnect import ReconnectBackoff
from conveyor._worker.session import FATAL_CODES, SessionEnded, SessionRunner, SessionSettings
from conveyor._worker.slots import Slots

logger = logging.getLogger("conveyor.worker")

#: How long cancelled handlers get to unwind before run() returns without them.
_UNWIND_TIMEOUT = 5.0

H = TypeVar("H", bound=Handler)
B = TypeVar("B", bound=BatchHandler)


def _queue_weights(queues: Mapping[str, int] | Iterable[str]) -> dict[str, int]:
    if isinstance(queues, str):
        queues = [queues]
    weights = dict(queues) if isinstance(queues, Mapping) else dict.fromkeys(queues, 1)
    if not weights:
        raise InvalidArgument("a worker needs at least one queue")
    if len(weights) > MAX_HELLO_QUEUES:
        raise InvalidArgument(
            f"a worker serves at most {MAX_HELLO_QUEUES} queues, got {len(weights)}"
        )
    for name, weight in weights.items():
        if not is_queue_name(name):
            raise InvalidArgument(f"invalid queue name {name!r}")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int)
            or not 1 <= weight <= MAX_QUEUE_WEIGHT
        ):
            raise InvalidArgument(
                f"weight of queue {name!r} must be an int in 1..{MAX_QUEUE_WEIGHT}, got {weight!r}"
            )
    return weights


class Worker:
    """Runs task handlers for the tasks the server pushes to it.

    ``queues`` maps queue names to weights (or lists names, weight 1 each): the worker's
    ``concurrency`` (the most handlers it runs at once, across all queues) is shared by
    the server in proportion to the weights. ``token`` is sent as a bearer token;
    ``codec`` decodes payloads and encodes results and progress (JSON by default);
    ``labels`` and ``worker_id`` describe the worker in the cluster view. ``target`` is
    ``host:port``, or ``https://host:port`` for TLS; ``tls``, ``tls_ca``, ``tls_cert`` and
    ``tls_key`` are those of :class:`AsyncClient` (the CA bundle that verifies the server,
    the client certificate for mutual TLS).
    ``grace_period`` (timedelta or seconds) is how long a stopping worker lets running
    handlers finish before it cancels them and gives their tasks back. ``reconnect``
    paces reconnects after the stream breaks. ``min_server_version`` refuses servers
    older than that. ``max_result_size`` is the largest encoded result the worker sends
    (default: the limit the server announces in Welcome, its ``CONVEYOR_MAX_RESULT``): a
    larger one fails the attempt with a clear error, where sending it would break the
    stream.

    Register handlers with :meth:`task`, then run the worker::

        worker = Worker(queues={"emails": 3, "reports": 1}, concurrency=20)

        @worker.task("email.send")
        async def send(payload, ctx):
            ...

        worker.run_forever()   # blocks; stops gracefully on SIGTERM / SIGINT

    A handler's return value is encoded as the task's result. Raising :class:`SkipRetry`
    archives the task at once; :class:`RetryAfter` (or any exception with a
    ``retry_after`` attribute) retries after that delay; any other exception fails the
    attempt (retried with the server's backoff until ``max_retry`` is exhausted). Plain
    ``def`` handlers run in a thread pool (a thread per handler running at once).

    Tasks of an aggregation group come as one batch to a handler registered with
    :meth:`batch_task` (see there for what its return value means for each member).
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        queues: Mapping[str, int] | Iterable[str] = ("default",),
        concurrency: int = 10,
        token: str | None = None,
        codec: Codec | None = None,
        labels: Mapping[str, str] | None = None,
        grace_period: DurationLike = 30.0,
        worker_id: str | None = None,
        reconnect: ReconnectBackoff | None = None,
        min_server_version: str = "",
        max_result_size: int | None = None,
        tls: bool | None = None,
        tls_ca: TlsFile | None = None,
        tls_cert: TlsFile | None = None,
        tls_key: TlsFile | None = None,
    ) -> None:
        self._endpoint = endpoint(
            target, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        if (
            isinstance(concurrency, bool)
            or not isinstance(concurrency, int)
            or not 1 <= concurrency <= MAX_CONCURRENCY
        ):
            raise InvalidArgument(
                f"concurrency must be an int in 1..{MAX_CONCURRENCY}, got {concurrency!r}"
            )
        if max_result_size is not None and (
            isinstance(max_result_size, bool) or not isinstance(max_result_size, int)
        ):
            raise InvalidArgument(f"max_result_size must be an int, got {max_result_size!r}")
        if max_result_size is not None and max_result_size < 0:
            raise InvalidArgument(f"max_result_size must be >= 0, got {max_result_size}")
        grace = to_timedelta("grace_period", grace_period)
        if grace is None or grace < timedelta(0):
            raise InvalidArgument("grace_period must be >= 0")
        self.target = target
        self.queues = _queue_weights(queues)
        self.concurrency = concurrency
        self.codec: Codec = codec or JsonCodec()
        self.labels = dict(labels or {})
        check_labels(self.labels)
        self.grace_period = grace
        # The default, cut from the left so the pid stays (a hostname is short anyway).
        default_id = f"{socket.gethostname()}:{os.getpid()}"[-MAX_WORKER_ID_LEN:]
        self.worker_id = worker_id or default_id
        if not isinstance(self.worker_id, str) or len(self.worker_id) > MAX_WORKER_ID_LEN:
            raise InvalidArgument(f"worker_id must be a string of at most {MAX_WORKER_ID_LEN}")
        check_text("worker_id", self.worker_id)
        if not isinstance(min_server_version, str) or len(min_server_version) > MAX_VERSION_LEN:
            raise InvalidArgument(
                f"min_server_version must be a string of at most {MAX_VERSION_LEN} characters"
            )
        self.reconnect = reconnect or ReconnectBackoff()
        self.min_server_version = min_server_version
        self.max_result_size = max_result_size
        self._token = token
        self._handlers: dict[str, Registration] = {}
        self._batch_handlers: dict[str, BatchRegistration] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_early = False
        #: The slots of the current (or last) run.
        self._slots: Slots | None = None
        self._runner: SessionRunner | None = None

    # ------------------------------------------------------------------ registry

    def task(self, type: str) -> Callable[[H], H]:
        """Decorator registering the handler of task type ``type``.

        The handler is ``async def f(payload, ctx)`` (run on the event loop) or
        ``def f(payload, ctx)`` (run in a thread); ``payload`` is the decoded payload and
        ``ctx`` a :class:`TaskContext`. The function is returned unchanged.
        """

        def register(fn: H) -> H:
            self.register(type, fn)
            return fn

        return register

    def register(self, type: str, fn: Handler) -> None:
        """Register ``fn`` as the handler of ``type`` (the non-decorator form of
        :meth:`task`). Raises ValueError if ``type`` already has a handler."""
        if not isinstance(type, str) or not type:
            raise InvalidArgument("task type must be a non-empty string")
        if type in self._handlers:
            raise ValueError(f"task type {type!r} already has a handler")
        if type in self._batch_handlers:
            raise ValueError(
                f"task type {type!r} already has a batch handler: a type has one or the other"
            )
        self._handlers[type] = Registration.of(type, fn)

    def batch_task(self, type: str) -> Callable[[B], B]:
        """Decorator registering the batch handler of task type ``type``: the tasks of
        an aggregation group (enqueued with ``group=``) come to it together, as one batch,
        once their group is due (see the queue's group configs).

        The handler is ``async def f(payloads, batch)`` (run on the event loop) or
        ``def f(payloads, batch)`` (run in a thread), called once per batch: ``payloads``
        is the list of the members' decoded payloads, in member order, and ``batch`` a
        :class:`BatchContext` (``batch.tasks[i]`` is the :class:`TaskContext` of
        ``payloads[i]``). A batch takes one of the worker's slots, however many members
        it has. What the handler returns decides each member's outcome:

        - None: every member succeeds, with no result;
        - a list (or tuple) with one item per payload, in the same order, or a dict
          keyed by task id: an item that is an ``Exception`` instance fails that member
          just as raising it from a task handler would (:class:`SkipRetry` archives it,
          :class:`RetryAfter` retries it after its delay, anything else retries it with
          the server's backoff); any other item is that member's result (encoded by the
          worker's codec). A member a dict leaves out succeeds with no result;
        - a list of another length, a dict with keys that are no task of the batch, or
          any other value: every member fails with an error saying so.

        Raising fails every member the way that exception fails a task. The batch's
        time bound is the smallest of its members' timeouts and their earliest deadline:
        past it the handler is cancelled and every member fails with "timed out". A
        member whose payload does not decode fails on its own ("cannot decode payload:
        ...") and the handler runs for the others. The function is returned unchanged.

        A type has a task handler or a batch handler, not both (ValueError).
        """

        def register(fn: B) -> B:
            self.register_batch(type, fn)
            return fn

        return register

    def register_batch(self, type: str, fn: BatchHandler) -> None:
        """Register ``fn`` as the batch handler of ``type`` (the non-decorator form of
        :meth:`batch_task`). Raises ValueError if ``type`` already has a handler of
        either kind, :class:`InvalidArgument` for a type the server would refuse in the
        worker's Hello (1-256 characters, no control characters, at most 100 batch
        types)."""
        if not isinstance(type, str) or not 0 < len(type) <= MAX_TYPE_LEN:
            raise InvalidArgument(f"task type must be a string of 1-{MAX_TYPE_LEN} characters")
        check_text("task type", type)
        if type in self._batch_handlers:
            raise ValueError(f"task type {type!r} already has a batch handler")
        if type in self._handlers:
            raise ValueError(
                f"task type {type!r} already has a task handler: a type has one or the other"
            )
        if len(self._batch_handlers) >= MAX_BATCH_TYPES:
            raise InvalidArgument(f"a worker has at most {MAX_BATCH_TYPES} batch handlers")
        self._batch_handlers[type] = BatchRegistration.of(type, fn)

    def clone(self, target: str, *, token: str | None = None, **options: Any) -> Worker:
        """A new worker with this one's handlers and options, for the server at
        ``target`` (with ``token``, and no TLS unless ``options`` ask for it).
        ``options`` are constructor arguments that replace this worker's own
        (``concurrency=2``, ``queues=[...]``). For tests: an application's module-level
        worker, pointed at a test server (``conveyor_cli.testing``)."""
        settings: dict[str, Any] = {
            "queues": dict(self.queues),
            "concurrency": self.concurrency,
            "codec": self.codec,
            "labels": dict(self.labels),
            "grace_period": self.grace_period,
            "worker_id": self.worker_id,
            "reconnect": self.reconnect,
            "min_server_version": self.min_server_version,
            "max_result_size": self.max_result_size,
        }
        settings.update(options)
        twin = Worker(target, token=token, **settings)
        twin._handlers = dict(self._handlers)
        twin._batch_handlers = dict(self._batch_handlers)
        return twin

    @property
    def task_types(self) -> list[str]:
        """The task types this worker has task handlers for (see :attr:`batch_types`)."""
        return sorted(self._handlers)

    @property
    def batch_types(self) -> list[str]:
        """The task types this worker has batch handlers for (its Hello's
        ``batch_types``)."""
        return sorted(self._batch_handlers)

    @property
    def running(self) -> int:
        """How many handlers run right now (including ones still finishing in a thread)."""
        slots = self._slots
        return slots.running if slots is not None else 0

    @property
    def stopping(self) -> bool:
        """True once shutdown began."""
        slots = self._slots
        return slots is not None and slots.stopping

    @property
    def session_id(self) -> str | None:
        """The id of the current session, or None while disconnected."""
        runner = self._runner
        return runner.session_id if runner is not None else None

    def add_slots(self, queue: str, n: int) -> None:
        """Run up to ``n`` more handlers at once on ``queue`` (fewer when ``n`` is
        negative), from now on; safe to call from any thread.

        :attr:`concurrency` changes by ``n`` (it must stay in 1..10,000), and the
        running session tells the server with a ``Credit`` frame, so the server sends
        that many more (or fewer) tasks of ``queue``. Fewer slots cancel nothing: running
        handlers finish, and new tasks come once enough are done. A reconnected
        session's Hello carries the new concurrency, split by weight across the queues.
        Raises :class:`InvalidArgument` for a queue the worker does not serve, an ``n``
        that is no int or 0, or a concurrency it would take out of bounds.
        """
        if queue not in self.queues:
            raise InvalidArgument(f"queue {queue!r} is not one this worker serves")
        if isinstance(n, bool) or not isinstance(n, int) or n == 0:
            raise InvalidArgument(f"n must be a non-zero int, got {n!r}")
        wanted = self.concurrency + n
        if not 1 <= wanted <= MAX_CONCURRENCY:
            raise InvalidArgument(
                f"concurrency {self.concurrency} {n:+d} = {wanted} is outside 1..{MAX_CONCURRENCY}"
            )
        self.concurrency = wanted
        loop = self._loop
        if loop is None:
            return  # the next run starts with the new concurrency
        if _on_loop_thread(loop):
            self._apply_slots(queue, n)
        else:
            loop.call_soon_threadsafe(self._apply_slots, queue, n)

    def _apply_slots(self, queue: str, n: int) -> None:
        slots = self._slots
        if slots is None or self._loop is None:
            return
        slots.concurrency = max(0, slots.concurrency + n)
        runner = self._runner
        if runner is not None:
            runner.credit(queue, n)
        self._slot_freed()

    # ----------------------------------------------------------------- lifecycle

    def run_forever(self) -> None:
        """Run the worker in a new event loop until SIGTERM or SIGINT; blocks.

        The entry point for scripts. The loop is uvloop's when uvloop is installed (the
        SDK does not require it), asyncio's otherwise. The first signal stops gracefully
        (see :meth:`stop`); a second one cancels running handlers at once. Raises what
        :meth:`run` raises.
        """
        run_event_loop(self.run(handle_signals=True))

    async def run(self, *, handle_signals: bool = False) -> None:
        """Serve tasks until :meth:`stop` is called; reconnect when the stream breaks.

        With ``handle_signals`` SIGTERM and SIGINT call :meth:`stop` (a second signal
        forces it). Returns after a graceful shutdown. Raises :class:`InvalidArgument`,
        :class:`FailedPrecondition`, :class:`Unauthenticated` or :class:`PermissionDenied`
        (the token's role does not allow these queues) when the server refuses the
        session: those do not heal by retrying.
        """
        if self._loop is not None:
            raise RuntimeError("this worker is already running")
        loop = asyncio.get_running_loop()
        # Threads start only as handlers need them (never more than run at once), so
        # the pool's bound is the most slots add_slots can reach.
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=MAX_CONCURRENCY, thread_name_prefix="conveyor-handler"
        )
        slots = Slots(
            concurrency=self.concurrency, codec=self.codec, pool=pool, on_free=self._slot_freed
        )
        self._slots = slots
        self._loop = loop
        installed = self._install_signals(loop) if handle_signals else []
        if self._stop_early:
            self._request_stop(force=False)
        if not self._handlers and not self._batch_handlers:
            logger.warning("worker.no_handlers worker_id=%s", self.worker_id)
        logger.info(
            "worker.start worker_id=%s queues=%s concurrency=%d types=%s batch_types=%s",
            self.worker_id,
            self.queues,
            self.concurrency,
            ",".join(self.task_types),
            ",".join(self.batch_types),
        )
        try:
            await self._serve(slots)
        finally:
            await _finish(slots)
            for sig in installed:
                loop.remove_signal_handler(sig)
            pool.shutdown(wait=False, cancel_futures=True)
            self._loop = None
            self._stop_early = False
            logger.info("worker.stopped worker_id=%s", self.worker_id)

    def stop(self, *, force: bool = False) -> None:
        """Ask the worker to shut down gracefully; safe to call from any thread.

        New dispatches are given back at once (RELEASE); running handlers get the grace
        period to finish, then they are cancelled and their tasks given back; then the
        stream is half-closed and :meth:`run` returns. ``force`` skips the grace period.
        """
        loop = self._loop
        if loop is None:
            self._stop_early = True
            return
        if _on_loop_thread(loop):
            self._request_stop(force)
        else:
            loop.call_soon_threadsafe(self._request_stop, force)

    def _request_stop(self, force: bool) -> None:
        slots = self._slots
        assert slots is not None, "the worker is not running"
        if not slots.stopping:
            logger.info("worker.stopping worker_id=%s force=%s", self.worker_id, force)
        slots.stop(force=force, grace_period=self.grace_period)

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> list[int]:
        installed: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (NotImplementedError, RuntimeError, ValueError):
                continue  # not the main thread, or a platform without loop signal handlers
            installed.append(sig)
        return installed

    def _on_signal(self, sig: int) -> None:
        logger.info("worker.signal signal=%s", signal.Signals(sig).name)
        self._request_stop(force=self.stopping)

    # ------------------------------------------------------------ the main loop

    async def _serve(self, slots: Slots) -> None:
        attempt = 0
        while True:
            while slots.full and not slots.stopping:
                # Handlers of a broken session keep running; connecting while they fill
                # every slot would only take tasks that wait here while other workers
                # could run them.
                await slots.wait_changed(None)
            if slots.stopping:
                return
            runner = SessionRunner(
                self._session_settings(), self._handlers, slots, self._batch_handlers
            )
            self._runner = runner
            try:
                await runner.run()
            except SessionEnded as ended:
                if ended.code in FATAL_CODES:
                    logger.error(
                        "worker.session_refused code=%s details=%s", ended.code, ended.details
                    )
                    raise error_from_status(
                        ended.code, f"the server refused the worker session: {ended.details}"
                    ) from None
                if ended.welcomed:
                    attempt = 0
                delay = self.reconnect.delay(attempt)
                attempt += 1
                details = ended.details
                if ended.code == "UNAVAILABLE":
                    details = self._endpoint.explain(details)
                logger.warning(
                    "worker.disconnected code=%s details=%s retry_in=%.2fs",
                    ended.code,
                    details,
                    delay,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(slots.stopped(), delay)
            else:
                return
            finally:
                self._runner = None

    def _session_settings(self) -> SessionSettings:
        return SessionSettings(
            endpoint=self._endpoint,
            token=self._token,
            queues=self.queues,
            concurrency=self.concurrency,
            labels=self.labels,
            worker_id=self.worker_id,
            min_server_version=self.min_server_version,
            max_result_size=self.max_result_size,
        )

    def _slot_freed(self) -> None:
        runner = self._runner
        if runner is not None and runner.live:
            runner.slot_freed()


async def _finish(slots: Slots) -> None:
    """Let handlers still running finish within the grace period (when stopping; on an
    error they are cancelled at once), then wait briefly for them to unwind."""
    await slots.drained()
    executions = slots.executions()
    for execution in executions:
        execution.cancel("worker stopped")
    tasks = [e.task for e in executions if e.task is not None]
    if tasks:
        await asyncio.wait(tasks, timeout=_UNWIND_TIMEOUT)


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` to completion in a new event loop: uvloop's when it is installed.

    uvloop roughly halves the cost of each stream read and write (every dispatch is one),
    so a worker runs noticeably more tasks per CPU second with it.
    """
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
