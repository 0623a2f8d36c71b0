"""Run a service as a process, and the per-process context every service works with.

A service's ``__main__`` is a few lines::

    async def main(settings: DispatcherSettings, stop: asyncio.Event) -> None:
        async with open_runtime(settings, name="dispatcher") as rt:
            dispatcher = Dispatcher(settings, rt.broker, rt.nc, rt.clock)
            await dispatcher.start()
            await stop.wait()
            await dispatcher.stop()

    sys.exit(run_service(main, DispatcherSettings.from_args(sys.argv[1:]), name="dispatcher"))

The first SIGTERM/SIGINT sets ``stop`` (graceful) and ends at once any start-up wait in
:func:`open_runtime` (for NATS, Postgres): the process then exits with code 0. A service
that has not stopped ``stop_grace`` seconds after that signal, or a second signal, cancels
the service (exit code 1).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvloop
from conveyor_broker.clock import Clock, SystemClock
from conveyor_broker.interface import Broker
from nats.aio.client import Client as NatsClient
from pydantic import ValidationError

from conveyor_runtime import health, metrics
from conveyor_runtime.broker_factory import PostgresConnectError, open_broker
from conveyor_runtime.bus import Bus
from conveyor_runtime.cluster_key import ClusterAuth, ClusterKeyError
from conveyor_runtime.events import EventGate, EventPublisher
from conveyor_runtime.health import Health
from conveyor_runtime.logging import configure_logging
from conveyor_runtime.nats_connect import (
    NatsConnectError,
    NatsSecurity,
    close_nats,
    connect_nats,
)
from conveyor_runtime.ownership import BucketError
from conveyor_runtime.settings import CommonSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.tasks import cancel_and_wait
from conveyor_runtime.tracing import configure_tracing, shutdown_tracing

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=CommonSettings)
T = TypeVar("T")
ServiceMain = Callable[[S, asyncio.Event], Coroutine[Any, Any, None]]


#: The running service's stop event (set by :func:`run_service`): start-up waits end on it.
_STOP: ContextVar[asyncio.Event | None] = ContextVar("conveyor_service_stop", default=None)


class StartupAborted(Exception):
    """A stop signal arrived while the service was still starting (waiting for NATS or
    Postgres): the start-up was abandoned, which is a clean stop."""


async def _until_stopped(step: Coroutine[Any, Any, T], what: str) -> T:
    """``step``'s result, unless the service's stop event is set first: then ``step`` is
    canceled and :class:`StartupAborted` raised. Outside :func:`run_service`, just
    ``step``."""
    stop = _STOP.get()
    if stop is None:
        return await step
    if stop.is_set():
        step.close()
        raise StartupAborted(what)
    work = asyncio.ensure_future(step)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if work.done():
        return work.result()
    await cancel_and_wait([work])
    raise StartupAborted(what)


@dataclass(frozen=True, slots=True)
class Runtime:
    """What a service process works with: its broker, clock, NATS connection, subjects
    and the bus over them."""

    settings: CommonSettings
    broker: Broker
    nc: NatsClient
    clock: Clock
    subjects: Subjects
    bus: Bus
    events: EventPublisher | None
    #: Attaches ``events`` to the broker while someone watches (``events = on_demand``).
    gate: EventGate | None = None
    #: The process's health signals: give it to what can fail without NATS or the broker
    #: noticing (the KV buckets); the health file stays fresh only while it is clean.
    health: Health = field(default_factory=Health)


@asynccontextmanager
async def open_runtime(
    settings: CommonSettings,
    *,
    name: str,
    clock: Clock | None = None,
    publish_events: bool = True,
) -> AsyncIterator[Runtime]:
    """Open the broker and the NATS connection (over TLS and with the credentials the
    settings name); close both on the way out.

    With ``publish_events`` the broker's lifecycle events are published to
    ``<prefix>.events.<queue>.<state>`` (see :mod:`conveyor_runtime.events`): always, or
    while someone watches (``settings.events``).
    """
    clock = clock or SystemClock()
    subjects = Subjects(settings.subject_prefix)
    auth = ClusterAuth.from_settings(settings)  # an unusable key fails before any link
    configure_tracing(
        name,
        settings.instance_id,
        settings.otlp_endpoint,
        sample_ratio=settings.trace_sample_ratio,
    )
    signals = Health()
    broker = await _until_stopped(open_broker(settings, clock), "broker")
    try:
        nc = await _until_stopped(
            connect_nats(
                settings.nats_url,
                name=f"{name}-{settings.instance_id}",
                security=NatsSecurity.from_settings(settings),
            ),
            "nats",
        )
        bus = Bus(nc, subjects, auth)
        events = EventPublisher(bus) if publish_events else None
        gate: EventGate | None = None
        try:
            if events is not None:
                await events.start()
                if settings.events == "always":
                    broker.set_event_sink(events)
                else:
                    gate = EventGate(broker, events, bus)
                    await gate.start()
            server = metrics.start_metrics_server(settings.metrics_host, settings.metrics_port)
            unwatch = metrics.watch_runtime(name, broker, nc)
            beat = (
                asyncio.create_task(health.beat(settings.health_file, nc, broker, health=signals))
                if settings.health_file
                else None
            )
            try:
                yield Runtime(settings, broker, nc, clock, subjects, bus, events, gate, signals)
            finally:
                if server is not None:
                    await asyncio.to_thread(server.stop)
                unwatch()
                if beat is not None:
                    await cancel_and_wait([beat])
        finally:
            if gate is not None:
                await gate.stop()
            broker.set_event_sink(None)
            if events is not None:
                await events.stop()
            await close_nats(nc)
    finally:
        await broker.close()
        shutdown_tracing()


#: How many more container objects than were freed may pile up before the cyclic garbage
#: collector's youngest pass runs (CPython's default is 700): see :func:`settle_heap`.
GC_YOUNG_THRESHOLD = 10_000


def settle_heap() -> None:
    """Tune the cyclic garbage collector for a long-running service, once its modules are
    imported.

    Everything made so far (modules, classes, functions: some 80,000 objects in the api)
    lives as long as the process, yet every full collection walked all of it: under load
    a full pass ran every few thousand tasks and cost tens of milliseconds, a quarter of
    the api's CPU during a batch enqueue. ``gc.freeze()`` moves it out of the collector's
    sight for good. And at most 700 objects between the youngest passes made one every
    few dozen tasks (each task keeps a few objects alive until its commit), each pass
    walking the in-flight ones again: :data:`GC_YOUNG_THRESHOLD` lets them be fewer.
    Cycles are still collected, a little later; memory is not affected otherwise.
    """
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


def run_service(main: ServiceMain[S], settings: S, *, name: str) -> int:
    """Run ``main(settings, stop)`` on uvloop until it returns; the process exit code.

    Logging is configured from the settings first. SIGTERM/SIGINT set ``stop`` (and end
    a start-up wait in :func:`open_runtime` at once: exit code 0); a second signal, or
    ``main`` still running ``settings.stop_grace`` seconds later, cancels ``main`` (exit
    code 1). An exception out of ``main`` is logged and gives exit code 1. The garbage
    collector is tuned for a long-running process first (:func:`settle_heap`).
    """
    configure_logging(settings.log_level, settings.log_format)
    settle_heap()

    async def wrapper() -> None:
        stop = asyncio.Event()
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()

        first_signal_at: list[float] = []

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                # Ctrl-C under a wrapper (uv run, a shell) often arrives twice at once:
                # from the terminal and forwarded. Only a later, deliberate one forces.
                if loop.time() - first_signal_at[0] < 1.0:
                    return
                logger.warning("service.forced_stop name=%s signal=%s", name, sig.name)
                if task is not None:
                    task.cancel()
                return
            logger.info("service.stopping name=%s signal=%s", name, sig.name)
            first_signal_at.append(loop.time())
            stop.set()
            loop.call_later(settings.stop_grace, out_of_grace)

        def out_of_grace() -> None:
            logger.warning(
                "service.forced_stop name=%s reason=stop_grace grace=%s", name, settings.stop_grace
            )
            if task is not None:
                task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        _STOP.set(stop)
        logger.info("service.starting name=%s instance=%s", name, settings.instance_id)
        try:
            await main(settings, stop)
        except StartupAborted as exc:
            logger.info("service.stopped name=%s during=start-up waiting_for=%s", name, exc)
            return
        logger.info("service.stopped name=%s", name)

    try:
        uvloop.run(wrapper())
    except asyncio.CancelledError:
        return 1
    except (NatsConnectError, PostgresConnectError, ClusterKeyError, BucketError) as exc:
        # A refused link (credentials, TLS), an unusable cluster key or a KV bucket NATS
        # will not create: one clear line, no traceback.
        logger.error("service.failed name=%s error=%s", name, exc)
        return 1
    except Exception:
        logger.exception("service.crashed name=%s", name)
        return 1
    return 0


def settings_errors(exc: ValidationError) -> str:
    """One line per problem of ``exc``, without the values given: a setting can hold a
    secret (a token, a DSN's password), and pydantic's own text quotes every input."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        message = str(error["msg"]).removeprefix("Value error, ")
        where = ".".join(str(part) for part in error["loc"])
        lines.append(f"  {where}: {message}" if where else f"  {message}")
    return "\n".join(lines)


def service_main(
    settings_type: type[S],
    serve: ServiceMain[S],
    argv: Sequence[str] | None,
    *,
    name: str,
) -> int:
    """A service's ``main``: settings from ``argv`` (None: ``sys.argv[1:]``) and the
    environment, then :func:`run_service`. Invalid settings print one message and give
    exit code 2."""
    try:
        settings = settings_type.from_args(sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        print(f"conveyor-{name}: invalid settings:\n{settings_errors(exc)}", file=sys.stderr)
        return 2
    return run_service(serve, settings, name=name)
