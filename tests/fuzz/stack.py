"""The services the fuzz suite attacks, as real processes, and what it checks after each
test.

One :class:`Stack` serves every fuzz test: an api, a dispatcher, a maintenance and a webhook
service process on a throwaway database and a private nats-server, sealed with one
cluster key (:class:`tests.e2e.harness.Cluster`), plus

- a *canary*: an SDK worker process serving a queue of its own, the well-behaved client
  that must not notice the fuzzing (:meth:`Stack.round_trip`);
- a *snapshot*: tasks in several states on a paused queue, a queue row and a webhook
  registration, which no fuzzed call names and which must stay byte for byte as they
  were (:meth:`Stack.snapshot`);
- a webhook registration whose endpoint (:class:`RawEndpoint`) answers each delivery with
  whatever bytes the test says.

After each test the services must be alive, their logs free of unhandled errors
(:func:`log_problems`), the snapshot unchanged and the canary's round trip working.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc
from conveyor import AsyncAdminClient, AsyncClient, TaskState
from conveyor_protos.v1 import service_pb2, task_pb2
from conveyor_runtime.cluster_key import ClusterAuth, parse_keys
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster, Proc

# ------------------------------------------------------------------ statuses

#: What a call may end with for bad input: a clear refusal, never INTERNAL or UNKNOWN.
#: RESOURCE_EXHAUSTED only for a message past the server's receive limit (checked apart).
ALLOWED_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)
#: The api's receive limit: the largest payload or result (1 MiB) and 256 KiB more
#: (conveyor_api.server.FRAME_HEADROOM).
MAX_MESSAGE = 1024 * 1024 + 256 * 1024
#: The longest status message, in UTF-8 bytes (docs/protocol.md).
MAX_STATUS_MESSAGE = 1024


def status_problem(code: grpc.StatusCode, details: str | None, sent: int) -> str | None:
    """What is wrong with a call that ended with ``code`` and ``details`` after the
    client sent a message of ``sent`` bytes, or None."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if sent > MAX_MESSAGE:
            return None
        return f"RESOURCE_EXHAUSTED for a {sent}-byte message: {details!r}"
    if code not in ALLOWED_CODES:
        return f"{code.name}: {details!r}"
    if details and len(details.encode(errors="replace")) > MAX_STATUS_MESSAGE + 64:
        return f"{code.name} with a status message of {len(details)} characters"
    return None


# ---------------------------------------------------------------------- logs

#: A log line of an unhandled error: a traceback, an ERROR line, NATS's error callback
#: (a subscription's handler raised), an outcome retried on a healthy database (the
#: broker raised something other than its own errors), or the repr of an exception that
#: only a bug raises.
_PROBLEM = re.compile(
    r"Traceback|^\S+ (?:ERROR|CRITICAL) |nats\.error |_failed .*retrying|"
    r"Task exception was never retrieved|Exception in callback|"
    r"\b(?:TypeError|KeyError|AttributeError|IndexError|OverflowError|ZeroDivisionError|"
    r"AssertionError|RecursionError|NameError|UnicodeDecodeError|UnicodeEncodeError|"
    r"DataError|NumericValueOutOfRangeError|DatetimeFieldOverflowError|"
    r"InvalidTextRepresentationError|CharacterNotInRepertoireError|"
    r"UntranslatableCharacterError|ProgramLimitExceededError)\(",
    re.MULTILINE,
)


def log_problems(text: str) -> list[str]:
    """The lines of ``text`` that tell of an unhandled error (with what follows each)."""
    lines = text.splitlines()
    found: list[str] = []
    for n, line in enumerate(lines):
        if _PROBLEM.search(line):
            found.append("\n".join(lines[n : n + 12]))
    return found


# ------------------------------------------------------------------ endpoint


@dataclass
class Delivery:
    """One POST the raw endpoint read."""

    head: bytes
    body: bytes
    call: dict[str, Any]

    @property
    def task_id(self) -> str:
        return str(self.call["params"]["task_id"])

    @property
    def lease_id(self) -> str:
        return str(self.call["id"])

    @property
    def token(self) -> str:
        return str(self.call["params"]["lease_token"])


#: How the endpoint answers a delivery: the whole HTTP response, as bytes.
Answer = Callable[[Delivery], bytes]


def http_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """An HTTP/1.1 response (the connection closes after it)."""
    head = [f"HTTP/1.1 {status} X"]
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    all_headers.setdefault("Content-Length", str(len(body)))
    all_headers["Connection"] = "close"
    head += [f"{k}: {v}" for k, v in all_headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def rpc_answer(outcome: str, **fields: Any) -> Answer:
    """A JSON-RPC answer with ``outcome`` that echoes the delivery's id."""

    def answer(delivery: Delivery) -> bytes:
        result = {"outcome": outcome, **fields}
        doc = {"jsonrpc": "2.0", "id": delivery.lease_id, "result": result}
        return http_response(200, json.dumps(doc).encode())

    return answer


@dataclass
class RawEndpoint:
    """A webhook endpoint on 127.0.0.1 that writes whatever bytes ``answers[task id]``
    makes for a task's first delivery (later ones, and tasks with no answer set, get a
    plain success) and closes the connection."""

    answers: dict[str, Answer] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)
    url: str = ""
    _server: asyncio.Server | None = None

    async def start(self) -> RawEndpoint:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/hook"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    def of(self, task_id: str) -> list[Delivery]:
        """The deliveries of ``task_id`` so far."""
        return [d for d in self.deliveries if d.task_id == task_id]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            found = re.search(rb"(?i)content-length:\s*(\d+)", head)
            body = await reader.readexactly(int(found.group(1)) if found else 0)
            delivery = Delivery(head, body, json.loads(body))
            first = not self.of(delivery.task_id)
            self.deliveries.append(delivery)
            answer = self.answers.get(delivery.task_id) if first else None
            writer.write((answer or rpc_answer("success"))(delivery))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


# ---------------------------------------------------------------------- stack


def new_name(kind: str) -> str:
    """A name nothing fuzzed can produce (strategies.names are ``fz...``)."""
    return f"{kind}-{uuid.uuid4().hex}"


@dataclass
class Stack:
    """The running services and what the fuzz tests need to reach and check them."""

    cluster: Cluster
    target: str
    dsn: str
    canary_queue: str
    snapshot_queue: str
    webhook_name: str
    webhook_queue: str
    endpoint: RawEndpoint
    channel: grpc.aio.Channel
    client: AsyncClient
    admin: AsyncAdminClient
    db: asyncpg.Connection
    baseline: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __repr__(self) -> str:
        # Hypothesis prints the arguments of a failing example: the stack is not one.
        return f"Stack(target={self.target!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    @property
    def auth(self) -> ClusterAuth:
        """Seals as the services do (the cluster key)."""
        return ClusterAuth(parse_keys([self.cluster.cluster_key]))

    @property
    def services(self) -> list[Proc]:
        return [p for p in self.cluster.procs if not p.name.startswith("worker")]

    @property
    def procs(self) -> list[Proc]:
        return list(self.cluster.procs)

    def dead(self) -> list[str]:
        """The processes that are no longer running, with the end of their logs."""
        return [f"{p.name} died:\n{p.log()[-3000:]}" for p in self.procs if not p.alive()]

    def log_sizes(self) -> dict[str, int]:
        """How much each process has logged so far (to check only what comes after)."""
        return {p.name: len(p.log()) for p in self.procs}

    def new_log_problems(self, since: dict[str, int]) -> list[str]:
        """Lines telling of unhandled errors that the processes logged after ``since``."""
        found: list[str] = []
        for p in self.procs:
            for problem in log_problems(p.log()[since.get(p.name, 0) :]):
                found.append(f"[{p.name}] {problem}")
        return found

    async def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """The stored rows no fuzzed call names: the snapshot queue's tasks and row, the
        webhook registration."""
        rows = {
            "tasks": await self.db.fetch(
                "SELECT * FROM conveyor_tasks WHERE queue = $1 ORDER BY id", self.snapshot_queue
            ),
            "queue": await self.db.fetch(
                "SELECT * FROM conveyor_queues WHERE queue = $1", self.snapshot_queue
            ),
            "webhook": await self.db.fetch(
                "SELECT * FROM conveyor_webhook_workers WHERE name = $1", self.webhook_name
            ),
        }
        return {k: [dict(r) for r in v] for k, v in rows.items()}

    async def fingerprint(self) -> tuple[Any, ...]:
        """What a refused call must not change: how many tasks, queues and webhook
        registrations are stored, and when a queue or a registration last changed (tasks
        change by themselves: the dispatcher leases, the reaper reaps)."""
        row = await self.db.fetchrow(
            "SELECT (SELECT count(*) FROM conveyor_tasks),"
            " (SELECT count(*) FROM conveyor_queues),"
            " (SELECT max(updated_at) FROM conveyor_queues),"
            " (SELECT count(*) FROM conveyor_webhook_workers),"
            " (SELECT max(updated_at) FROM conveyor_webhook_workers)"
        )
        assert row is not None
        return tuple(row)

    async def round_trip(self, within: float = 30.0) -> None:
        """A task enqueued by a well-behaved producer is run by the canary worker."""
        task = await self.client.enqueue("e2e.noop", {}, queue=self.canary_queue)

        async def completed() -> bool:
            return (await self.client.get_task(task.id)).state is TaskState.COMPLETED

        await wait_until(
            completed, within=within, interval=POLL_INTERVAL, message="the canary round trip"
        )

    async def task_state(self, task_id: str) -> int:
        """The stored state of a task (a ``task_pb2.TaskState``)."""
        stub: Any = self.channel.unary_unary(
            "/conveyor.v1.AdminService/GetTask",
            request_serializer=service_pb2.GetTaskRequest.SerializeToString,
            response_deserializer=service_pb2.GetTaskResponse.FromString,
        )
        response = await stub(service_pb2.GetTaskRequest(id=task_id), timeout=10)
        return int(response.task.state)

    async def settled(self, task_id: str, *, within: float = 20.0) -> int:
        """Wait until a task is no longer ACTIVE; its state."""
        state: int = task_pb2.TASK_STATE_ACTIVE

        async def not_active() -> bool:
            nonlocal state
            state = await self.task_state(task_id)
            return state != task_pb2.TASK_STATE_ACTIVE

        await wait_until(
            not_active, within=within, interval=POLL_INTERVAL, message=f"task {task_id} settles"
        )
        return state


# --------------------------------------------------------------- raw calls


async def unary(
    channel: grpc.aio.Channel, path: str, body: bytes, *, deadline: float = 15.0
) -> tuple[grpc.StatusCode, str | None, bytes]:
    """Call ``path`` with ``body`` as the request's bytes; (code, details, response)."""
    call: Any = channel.unary_unary(path)
    try:
        response = await call(bytes(body), timeout=deadline)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details(), b""
    return grpc.StatusCode.OK, None, bytes(response)


async def poll(
    step: Callable[[], bool | Awaitable[bool]], message: str, within: float = 20.0
) -> None:
    """:func:`wait_until` at the end-to-end tests' interval."""
    await wait_until(step, within=within, interval=POLL_INTERVAL, message=message)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
