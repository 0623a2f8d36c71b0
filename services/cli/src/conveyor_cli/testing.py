"""Conveyor inside an application's own tests: a real server in the test process.

:class:`EmbeddedServer` runs every service (the api, a dispatcher, maintenance and the
webhook service, exactly as ``conveyor dev`` does) with an embedded nats-server, on a
free loopback port, over the memory broker (or Postgres, given a DSN). The application's
real :class:`~conveyor.Client` and :class:`~conveyor.Worker` talk to it over gRPC, so a
test exercises the same code as production::

    from conveyor import AsyncClient
    from conveyor_cli.testing import EmbeddedServer

    from myapp.tasks import worker          # Worker("conveyor.prod:50051", ...)

    async def test_welcome_email() -> None:
        async with EmbeddedServer() as server, server.running(worker):
            async with AsyncClient(server.target) as client:
                task = await client.enqueue("email.send", {"to": "ada@example.com"})
            done = await server.wait_for(task.id)
            assert done.result == {"delivered_to": "ada@example.com"}

:class:`BlockingEmbeddedServer` is the same server on a thread of its own, for blocking
code and for tests on any event loop; ``conveyor_cli.pytest_plugin`` gives it as the
``conveyor_server`` fixture. Auth and TLS are off (loopback only), as in ``conveyor dev``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Collection, Coroutine, Iterator
from contextlib import AsyncExitStack
from typing import Any, TypeVar

from conveyor import AsyncAdminClient, TaskInfo, TaskState, Worker

from conveyor_cli.dev import DevOptions, dev_services

__all__ = ["BlockingEmbeddedServer", "EmbeddedServer", "Unfinished"]

_T = TypeVar("_T")

#: States of a task that still has to run (or is running): what :meth:`drain` waits out.
UNFINISHED = (TaskState.PENDING, TaskState.HELD, TaskState.ACTIVE, TaskState.RETRY)

#: How often the waits below look again.
_POLL = 0.01


class Unfinished(AssertionError):
    """A wait of the embedded server ran out of time: the message says what was left."""


class EmbeddedServer:
    """Every Conveyor service in this event loop, for tests (see the module docstring).

    ``dsn`` stores tasks in that PostgreSQL database (migrated already) instead of in
    memory; ``lease_ttl`` is the seconds a dispatched task stays leased without a
    heartbeat. Use it as ``async with EmbeddedServer() as server``; :attr:`target` is
    its ``host:port``.
    """

    def __init__(self, *, dsn: str | None = None, lease_ttl: float = 30.0) -> None:
        self._options = DevOptions(
            host="127.0.0.1", port=0, dsn=dsn, lease_ttl=lease_ttl, rest_port=None
        )
        self._stack: AsyncExitStack | None = None
        self._target: str | None = None
        self._admin: AsyncAdminClient | None = None

    @property
    def target(self) -> str:
        """``host:port`` of the api: give it to ``Client``, ``AsyncClient`` and ``Worker``."""
        if self._target is None:
            raise RuntimeError("the embedded server is not running")
        return self._target

    async def start(self) -> None:
        """Start every service; returns once the api accepts calls."""
        if self._stack is not None:
            raise RuntimeError("the embedded server is already running")
        stack = AsyncExitStack()
        try:
            services = await stack.enter_async_context(dev_services(self._options))
            self._target = services.target
            self._admin = await stack.enter_async_context(AsyncAdminClient(services.target))
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack

    async def stop(self) -> None:
        """Stop every service (idempotent). Tasks in the memory broker are gone."""
        stack, self._stack = self._stack, None
        self._target = self._admin = None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> EmbeddedServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @contextlib.asynccontextmanager
    async def running(self, worker: Worker, **options: Any) -> AsyncIterator[Worker]:
        """Run a copy of ``worker`` (its handlers and options, ``options`` replacing some:
        see :meth:`conveyor.Worker.clone`) against this server while the block runs; it
        is connected when the block starts, and stopped gracefully when it ends."""
        twin = worker.clone(self.target, **options)
        run = asyncio.get_running_loop().create_task(twin.run())
        try:
            await _until(
                lambda: twin.session_id is not None or run.done(),
                within=10.0,
                what="the worker to connect",
            )
            if run.done():
                run.result()  # the session was refused: say why
            yield twin
        finally:
            twin.stop()
            await asyncio.wait([run], timeout=twin.grace_period.total_seconds() + 5)
            if not run.done():
                run.cancel()
                await asyncio.wait([run])

    async def wait_for(
        self,
        task_id: str,
        *,
        timeout: float = 10.0,  # noqa: ASYNC109 - a test helper's deadline
        states: Collection[TaskState] = (),
    ) -> TaskInfo:
        """The task once it is in one of ``states`` (default: any terminal state:
        completed, archived or canceled). Raises :class:`Unfinished` after ``timeout``
        seconds, naming the state it is still in."""
        admin = self._admin_client()
        wanted = set(states)
        last: list[TaskInfo] = []

        async def arrived() -> bool:
            task = await admin.get_task(task_id)
            last[:] = [task]
            return task.state in wanted if wanted else task.state.is_terminal

        try:
            await _until_async(arrived, within=timeout)
        except Unfinished:
            state = last[0].state if last else "unknown"
            raise Unfinished(
                f"task {task_id} is still {state} after {timeout:g} s"
                + (f" (waited for {', '.join(sorted(wanted))})" if wanted else "")
            ) from None
        return last[0]

    async def drain(
        self,
        *,
        timeout: float = 10.0,  # noqa: ASYNC109 - a test helper's deadline
        queues: Collection[str] = (),
    ) -> None:
        """Wait until no task of ``queues`` (default: every queue) is pending, held, running or
        waiting for a retry. Scheduled, blocked and aggregating tasks are not waited
        for. Raises :class:`Unfinished` after ``timeout`` seconds with what is left."""
        admin = self._admin_client()
        left: dict[str, dict[str, int]] = {}

        async def drained() -> bool:
            left.clear()
            async for queue in admin.iter_queues():
                if queues and queue.name not in queues:
                    continue
                counts = {s.value: queue.count(s) for s in UNFINISHED if queue.count(s)}
                if counts:
                    left[queue.name] = counts
            return not left

        try:
            await _until_async(drained, within=timeout)
        except Unfinished:
            raise Unfinished(f"not drained after {timeout:g} s: {left}") from None

    def _admin_client(self) -> AsyncAdminClient:
        if self._admin is None:
            raise RuntimeError("the embedded server is not running")
        return self._admin


class BlockingEmbeddedServer:
    """An :class:`EmbeddedServer` on a thread (and event loop) of its own: for blocking
    tests (``Client``, ``AdminClient``), and for async tests on any loop. The same
    arguments; use it as ``with BlockingEmbeddedServer() as server``."""

    def __init__(self, *, dsn: str | None = None, lease_ttl: float = 30.0) -> None:
        self._server = EmbeddedServer(dsn=dsn, lease_ttl=lease_ttl)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def target(self) -> str:
        """``host:port`` of the api."""
        return self._server.target

    def start(self) -> None:
        """Start the thread and every service on it; returns once the api accepts calls."""
        if self._thread is not None:
            raise RuntimeError("the embedded server is already running")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="conveyor-embedded", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._call(self._server.start())
        except BaseException:
            self._halt()
            raise

    def stop(self) -> None:
        """Stop every service and the thread (idempotent)."""
        if self._thread is None:
            return
        try:
            self._call(self._server.stop())
        finally:
            self._halt()

    def __enter__(self) -> BlockingEmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def running(self, worker: Worker, **options: Any) -> Iterator[Worker]:
        """:meth:`EmbeddedServer.running`, for a ``with`` block: the copy of ``worker``
        runs on the server's thread."""
        manager = self._server.running(worker, **options)
        twin = self._call(manager.__aenter__())
        try:
            yield twin
        finally:
            self._call(manager.__aexit__(None, None, None))

    def wait_for(
        self, task_id: str, *, timeout: float = 10.0, states: Collection[TaskState] = ()
    ) -> TaskInfo:
        """:meth:`EmbeddedServer.wait_for`, blocking."""
        return self._call(self._server.wait_for(task_id, timeout=timeout, states=states))

    def drain(self, *, timeout: float = 10.0, queues: Collection[str] = ()) -> None:
        """:meth:`EmbeddedServer.drain`, blocking."""
        self._call(self._server.drain(timeout=timeout, queues=queues))

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        loop = self._loop
        if loop is None:
            coro.close()
            raise RuntimeError("the embedded server is not running")
        future: concurrent.futures.Future[_T] = asyncio.run_coroutine_threadsafe(coro, loop)
        return future.result()

    def _halt(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()


async def _until(check: Any, *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() >= deadline:
            raise Unfinished(f"timed out after {within:g} s waiting for {what}")
        await asyncio.sleep(_POLL)


async def _until_async(check: Any, *, within: float) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() >= deadline:
            raise Unfinished(f"timed out after {within:g} s")
        await asyncio.sleep(_POLL)
