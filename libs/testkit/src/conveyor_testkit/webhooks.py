"""Testing the webhook service: a real HTTP endpoint that records deliveries and answers as
told, shortcuts to register a worker and submit tasks, and a :class:`Rig` bundling one
registration under test with everything around it (its pytest fixtures are in
:mod:`conveyor_testkit.fixtures`).

The endpoint listens on 127.0.0.1, which the webhook service refuses to deliver to by
default: every rig here allows exactly that address (:data:`LOCAL_ENDPOINTS`) and gives
its services a secret key (:data:`WEBHOOK_KEY`), as an operator would; registrations it
stores directly in the broker are sealed with that key, as the api does. :class:`FakeDns`
makes names resolve where a test wants.

Nothing here sleeps for time: waits poll a condition until a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import uuid
from collections.abc import Awaitable, Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from conveyor_broker import (
    Broker,
    FakeClock,
    NewTask,
    TaskState,
    WebhookWorker,
    WebhookWorkerSpec,
)
from conveyor_broker.clock import Clock
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.settings import WebhookSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.webhook_secrets import SecretKeyring, generate_key
from conveyor_webhook.gateway import WebhookGateway
from conveyor_webhook.manager import WebhookManager
from nats.aio.client import Client as NATS

from conveyor_testkit.polling import wait_until

#: The allow-list of every rig: the address its endpoints listen on, and no more.
LOCAL_ENDPOINTS = "127.0.0.1/32"
#: The key that seals the webhook secrets of every rig (one per test run).
WEBHOOK_KEY = generate_key("test")
#: :data:`WEBHOOK_KEY` as a keyring.
KEYRING = SecretKeyring.parse(WEBHOOK_KEY)
#: Secrets long enough to register (32 bytes and more), newest first.
SECRET = "newest-secret-0123456789abcdefghij"
OLD_SECRET = "older-secret-0123456789abcdefghijk"


class FakeDns(AbstractResolver):
    """A resolver that knows only the names it is given: ``answers[name]`` is the list of
    answers (each a list of addresses) of successive look-ups; the last one repeats. An
    unknown name does not resolve. Both an aiohttp resolver (for the webhook service's
    sessions) and a :data:`~conveyor_runtime.webhook_urls.Resolve` (:meth:`lookup`, for
    the api's registration check). ``lookups`` counts the look-ups per name."""

    def __init__(self, answers: Mapping[str, Sequence[Sequence[str]]]) -> None:
        self._answers = {name: [list(a) for a in seq] for name, seq in answers.items()}
        self.lookups: dict[str, int] = {}

    def _next(self, host: str) -> list[str]:
        answers = self._answers.get(host)
        if not answers:
            raise OSError(socket.EAI_NONAME, f"{host} does not resolve (FakeDns)")
        count = self.lookups.get(host, 0)
        self.lookups[host] = count + 1
        return answers[min(count, len(answers) - 1)]

    async def lookup(self, host: str, port: int) -> list[str]:
        """The next answer for ``host`` (a Resolve)."""
        return self._next(host)

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        """The next answer for ``host``, as aiohttp wants it."""
        return [
            {
                "hostname": host,
                "host": address,
                "port": port,
                "family": socket.AF_INET6 if ":" in address else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for address in self._next(host)
        ]

    async def close(self) -> None:
        """Nothing to close."""


@dataclass
class Delivery:
    """One POST the endpoint received."""

    headers: dict[str, str]
    body: bytes
    call: dict[str, Any]

    @property
    def task_id(self) -> str:
        """The delivered task's id."""
        return str(self.call["params"]["task_id"])

    @property
    def lease_id(self) -> str:
        """The delivery's lease id (the JSON-RPC id)."""
        return str(self.call["id"])

    @property
    def token(self) -> str:
        """The delivery's lease token."""
        return str(self.call["params"]["lease_token"])


#: How the endpoint answers one delivery.
Answer = Callable[[Delivery], Awaitable[web.StreamResponse]]


def rpc(outcome: str, *, result: bytes | None = None, **extra: Any) -> Answer:
    """Answer HTTP 200 with a JSON-RPC result of ``outcome`` (the call's id echoed)."""

    async def answer(delivery: Delivery) -> web.StreamResponse:
        body: dict[str, Any] = {"outcome": outcome, **extra}
        if result is not None:
            body["result"] = base64.b64encode(result).decode()
        return web.json_response({"jsonrpc": "2.0", "id": delivery.lease_id, "result": body})

    return answer


def rpc_error(message: str, code: int = -32000) -> Answer:
    """Answer HTTP 200 with a JSON-RPC error object."""

    async def answer(delivery: Delivery) -> web.StreamResponse:
        error = {"code": code, "message": message}
        return web.json_response({"jsonrpc": "2.0", "id": delivery.lease_id, "error": error})

    return answer


def status(code: int) -> Answer:
    """Answer with a bare HTTP status."""

    async def answer(delivery: Delivery) -> web.StreamResponse:
        return web.Response(status=code, text="nope")

    return answer


@dataclass
class Endpoint:
    """A webhook endpoint on a free local port: records every delivery, answers with
    ``answer``. Use as ``async with Endpoint() as ep``."""

    answer: Answer = field(default_factory=lambda: rpc("success"))
    deliveries: list[Delivery] = field(default_factory=list)
    url: str = ""
    #: Set to let answers made by :meth:`hold` go out.
    release: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        delivery = Delivery(dict(request.headers), body, json.loads(body))
        self.deliveries.append(delivery)
        return await self.answer(delivery)

    def hold(self, then: Answer) -> None:
        """From now on, answer with ``then`` only once ``release`` is set."""

        async def answer(delivery: Delivery) -> web.StreamResponse:
            await self.release.wait()
            return await then(delivery)

        self.answer = answer

    async def __aenter__(self) -> Endpoint:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
        await web.SockSite(self._runner, sock).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


class _Book(Protocol):
    @property
    def book(self) -> Container[str]: ...


class _Dispatcher(Protocol):
    def queue(self, name: str) -> _Book | None: ...


async def register(
    broker: Broker, url: str, name: str, *, sealed: bool = True, **overrides: Any
) -> WebhookWorker:
    """Store a registration ``name`` for ``url`` (concurrency 4, timeout 10 s, secrets
    :data:`SECRET` and :data:`OLD_SECRET` unless overridden), its secrets sealed with
    :data:`KEYRING` as the api seals them (``sealed=False``: stored as given, like a
    registration from before secrets were encrypted)."""
    fields: dict[str, Any] = {
        "name": name,
        "url": url,
        "queues": {"hooks": 1},
        "concurrency": 4,
        "timeout": timedelta(seconds=10),
        "secrets": (SECRET, OLD_SECRET),
    }
    fields.update(overrides)
    if sealed:
        fields["secrets"] = KEYRING.seal_all(name, fields["secrets"])
    return await broker.upsert_webhook_worker(WebhookWorkerSpec(**fields))


async def running_gateway(
    manager: WebhookManager, dispatcher: _Dispatcher, name: str, queue: str
) -> WebhookGateway:
    """Wait until ``manager`` leads, reconcile (and let drains finish), and wait until
    ``dispatcher`` (the owner of ``queue``) has the gateway of ``name`` in its book."""
    await wait_until(lambda: manager.leading)
    await manager.reconcile()
    await manager.settled()
    gateway = manager.gateways[name]
    await wait_until(lambda: _knows(dispatcher, queue, gateway.id))
    return gateway


def _knows(dispatcher: _Dispatcher, queue: str, gateway_id: str) -> bool:
    qd = dispatcher.queue(queue)
    return qd is not None and gateway_id in qd.book


async def submit(broker: Broker, bus: Bus, queue: str, **fields: Any) -> str:
    """Enqueue a task on ``queue`` and wake the queue; the task id."""
    fields.setdefault("payload", b'{"amount": 42}')
    fields.setdefault("type", "invoice.charge")
    result = await broker.enqueue(NewTask(queue=queue, **fields))
    await bus.publish(cluster_pb2.Wake(queue=queue))
    await bus.nc.flush()
    return result.task.id


async def send_callback(
    bus: Bus,
    worker: str,
    *,
    task_id: str,
    lease_id: str,
    queue: str,
    beat: bytes | None = None,
    outcome: cluster_pb2.WebhookOutcome | None = None,
) -> cluster_pb2.WebhookCallbackReply:
    """Send a WebhookCallback (a heartbeat with ``beat`` progress, or the ``outcome``) to
    webhook worker ``worker`` the way the api's WebhookService does; the reply."""
    request = cluster_pb2.WebhookCallback(
        worker=worker, task_id=task_id, lease_id=lease_id, queue=queue
    )
    if outcome is not None:
        request.result.CopyFrom(outcome)
    else:
        request.heartbeat.CopyFrom(cluster_pb2.WebhookBeat(progress=beat or b""))
    return await bus.webhook_callback(request, within=5.0)


class Managers:
    """Starts WebhookManagers on one broker, NATS connection and subject prefix, with
    settings overrides as keywords (by default allowing :data:`LOCAL_ENDPOINTS` and
    keyed with :data:`WEBHOOK_KEY`); stops every one on the way out of ``async with``."""

    def __init__(
        self, broker: Broker, nc: NATS, clock: Clock, nats_url: str, subjects: Subjects
    ) -> None:
        self._broker = broker
        self._nc = nc
        self._clock = clock
        self._defaults: dict[str, Any] = {
            "nats_url": nats_url,
            "subject_prefix": subjects.prefix,
            "broker": "memory",
            "leader_ttl": 2.0,
            "reconcile_tick": 60.0,
            "register_tick": 5.0,
            "callback_address": "api.test:50051",
            "webhook_allow_networks": LOCAL_ENDPOINTS,
            "webhook_secret_key": WEBHOOK_KEY,
        }
        self.started: list[WebhookManager] = []

    async def __call__(
        self, *, resolver: AbstractResolver | None = None, **overrides: Any
    ) -> WebhookManager:
        """A started manager (``resolver``: the one its gateways look names up with)."""
        options = {"instance_id": f"wh-{uuid.uuid4().hex[:6]}", **self._defaults, **overrides}
        manager = WebhookManager(
            WebhookSettings(**options),
            self._broker,
            self._nc,
            self._clock,
            resolver=(lambda: resolver) if resolver is not None else None,
        )
        await manager.start()
        self.started.append(manager)
        return manager

    async def __aenter__(self) -> Managers:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for manager in reversed(self.started):
            await manager.stop()


@dataclass
class Rig:
    """One webhook registration under test (``name``, serving ``queue``) with everything
    around it: a broker on a FakeClock, the NATS bus, a real :class:`Endpoint` (the
    registration's url), the dispatcher owning the queue, and :class:`Managers` to run
    the gateways. The shortcuts below default to that registration and queue."""

    broker: Broker
    bus: Bus
    clock: FakeClock
    endpoint: Endpoint
    managers: Managers
    dispatcher: _Dispatcher
    name: str = "billing"
    queue: str = "hooks"

    async def register(self, **overrides: Any) -> WebhookWorker:
        """Store the registration for the endpoint (see :func:`register`)."""
        return await register(self.broker, self.endpoint.url, self.name, **overrides)

    async def running(self, manager: WebhookManager, queue: str | None = None) -> WebhookGateway:
        """The registration's gateway once ``manager`` runs it and the dispatcher of
        ``queue`` (default: the rig's) knows it (see :func:`running_gateway`)."""
        return await running_gateway(manager, self.dispatcher, self.name, queue or self.queue)

    async def start(
        self, *, manager_options: dict[str, Any] | None = None, **registration: Any
    ) -> tuple[WebhookManager, WebhookGateway]:
        """Store the registration (``registration``: overrides), start a manager
        (``manager_options``: settings overrides); the manager and its running gateway."""
        await self.register(**registration)
        manager = await self.managers(**(manager_options or {}))
        return manager, await self.running(manager)

    async def start_gateway(
        self, *, manager_options: dict[str, Any] | None = None, **registration: Any
    ) -> WebhookGateway:
        """:meth:`start`, for when the manager does not matter: the running gateway."""
        _, gateway = await self.start(manager_options=manager_options, **registration)
        return gateway

    def knows(self, gateway: WebhookGateway, queue: str | None = None) -> bool:
        """True while the dispatcher of ``queue`` (default: the rig's) has ``gateway`` in
        its book."""
        return _knows(self.dispatcher, queue or self.queue, gateway.id)

    async def submit(self, queue: str | None = None, **fields: Any) -> str:
        """Enqueue a task on ``queue`` (default: the rig's) and wake it (see
        :func:`submit`); the task id."""
        return await submit(self.broker, self.bus, queue or self.queue, **fields)

    async def park(self, gateway: WebhookGateway) -> Delivery:
        """Submit a task the endpoint accepts (whatever it answers otherwise); its
        delivery once ``gateway`` parked it (the only one parked there)."""
        answer = self.endpoint.answer
        self.endpoint.answer = rpc("accepted")
        task_id = await self.submit()
        await wait_until(lambda: gateway.parked == 1)
        self.endpoint.answer = answer
        [delivery] = [d for d in self.endpoint.deliveries if d.task_id == task_id]
        return delivery

    async def accepted_delivery(
        self, *, manager_options: dict[str, Any] | None = None, **registration: Any
    ) -> tuple[WebhookGateway, Delivery]:
        """:meth:`start_gateway`, then :meth:`park` a delivery on it: the gateway and the
        delivery (the only one the endpoint got)."""
        gateway = await self.start_gateway(manager_options=manager_options, **registration)
        delivery = await self.park(gateway)
        assert self.endpoint.deliveries == [delivery]
        return gateway, delivery

    async def state_of(self, task_id: str) -> TaskState:
        """The task's state in the broker."""
        return (await self.broker.get_task(task_id)).state

    async def wait_state(self, task_id: str, state: TaskState) -> None:
        """Wait until the task is in ``state``."""

        async def reached() -> bool:
            return await self.state_of(task_id) == state

        await wait_until(reached)

    async def wait_lease(self, task_id: str, expires: datetime) -> None:
        """Wait until the task's lease expires at ``expires`` (extended by a heartbeat)."""

        async def extended() -> bool:
            return (await self.broker.get_task(task_id)).lease_expires_at == expires

        await wait_until(extended)

    async def callback(
        self,
        delivery: Delivery,
        *,
        beat: bytes | None = None,
        outcome: cluster_pb2.WebhookOutcome | None = None,
        lease_id: str | None = None,
        task_id: str | None = None,
        queue: str | None = None,
    ) -> cluster_pb2.WebhookCallbackReply:
        """Send a callback for ``delivery`` (a heartbeat with ``beat`` progress unless
        ``outcome``) the way the api's WebhookService does (see :func:`send_callback`);
        ``lease_id``, ``task_id`` and ``queue`` stand in for the delivery's own."""
        return await send_callback(
            self.bus,
            self.name,
            task_id=task_id or delivery.task_id,
            lease_id=lease_id or delivery.lease_id,
            queue=queue or self.queue,
            beat=beat,
            outcome=outcome,
        )
