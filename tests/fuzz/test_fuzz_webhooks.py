"""Webhooks with a hostile endpoint: the webhook service's HTTP exchange and the callbacks
of asynchronous deliveries.

- The endpoint answers a delivery with hostile bytes: any HTTP status, odd or lying
  headers (Content-Length, chunked encoding), JSON-RPC responses with every field wrong
  in turn (ids, outcomes, base64, errors, retry_after of any type and size, nesting past
  any parser), or no HTTP at all. The webhook service must not die or log an unhandled
  error, and the task ends as the answer says or as a failed attempt: completed,
  archived (no retries left) or due for a retry; never held.
- A delivery answered ``accepted`` is then driven by hostile callbacks: WebhookService
  calls with the delivery's real lease token (and damaged ones) and hostile fields, and
  sealed ``WebhookCallback`` messages straight to the webhook service naming the real
  task and lease. Each call ends with a clear status (never INTERNAL or UNKNOWN); a
  reply's status is one the protocol knows; and a well-formed result completes the task
  unless a fuzzed one already settled it.

There is no HTTP server in the webhook service itself: endpoints are its peers (it POSTs
to them), and their callbacks come in through the api's gRPC WebhookService.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from conveyor_broker.ids import new_id
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.subjects import Subjects
from hypothesis import event, given
from hypothesis import strategies as st

from tests.fuzz.profile import fuzz
from tests.fuzz.stack import Delivery, Stack, b64, http_response, poll, status_problem, unary
from tests.fuzz.strategies import Blob, arbitrary_bytes, blobs, floats, messages_of, text

pytestmark = [pytest.mark.fuzz, pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

SUBJECTS = Subjects()
OUTCOMES = ["success", "failure", "skip_retry", "release", "accepted"]

# ---------------------------------------------------------------- answers

_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    text(),
)
json_values = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(text(), inner, max_size=3)
    ),
    max_leaves=8,
)


def _number_token(value: float) -> str:
    """A JSON number as Python's json writes it (NaN and Infinity too, which it reads)."""
    return json.dumps(value)


@st.composite
def rpc_documents(draw: st.DrawFn) -> Any:
    """A JSON-RPC response, every part of it right or wrong: the caller fills in the id
    (``None`` here means echo the delivery's)."""
    doc: dict[str, Any] = {}
    if draw(st.integers(0, 4)):
        doc["jsonrpc"] = draw(st.one_of(st.just("2.0"), json_values))
    doc["id"] = draw(st.one_of(st.just(None), st.just(None), json_values))
    kind = draw(st.sampled_from(["result", "result", "result", "error", "both", "neither"]))
    if kind in ("result", "both"):
        result: dict[str, Any] = {}
        if draw(st.integers(0, 5)):
            result["outcome"] = draw(st.one_of(st.sampled_from(OUTCOMES), json_values))
        if draw(st.booleans()):
            result["result"] = draw(
                st.one_of(blobs().map(lambda b: b64(b[:70_000])), json_values, text())
            )
        if draw(st.booleans()):
            result["error"] = draw(st.one_of(text(), json_values))
        if draw(st.booleans()):
            result["retry_after"] = draw(
                st.one_of(floats(), st.integers(-(2**70), 2**70), json_values)
            )
        doc["result"] = draw(st.one_of(st.just(result), st.just(result), json_values))
    if kind in ("error", "both"):
        doc["error"] = draw(
            st.one_of(
                st.fixed_dictionaries(
                    {}, optional={"code": json_values, "message": json_values, "data": json_values}
                ),
                json_values,
            )
        )
    return doc


@st.composite
def answers(draw: st.DrawFn) -> Any:
    """How the endpoint answers: a function of the delivery to the HTTP response bytes."""
    shape = draw(st.sampled_from(["rpc", "rpc", "rpc", "rpc", "body", "nested", "raw", "head"]))
    event(f"answer: {shape}")
    status = draw(
        st.one_of(
            st.just(200),
            st.just(200),
            st.sampled_from([201, 204, 299, 301, 304, 400, 404, 418, 500, 502, 599]),
            st.integers(100, 999),
        )
    )
    headers: dict[str, str] = {}
    safe = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)
    if draw(st.integers(0, 3)) == 0:
        headers["Content-Type"] = draw(st.one_of(st.just("text/html"), safe))
    if draw(st.integers(0, 5)) == 0:
        headers["Content-Length"] = draw(
            st.one_of(st.sampled_from(["0", "-1", "1", "abc", "99999999999"]), safe)
        )
    if draw(st.integers(0, 7)) == 0:
        headers["Transfer-Encoding"] = draw(st.sampled_from(["chunked", "gzip", "x"]))
    if draw(st.integers(0, 3)) == 0:
        name = draw(st.text(st.sampled_from("abcdefXYZ-"), min_size=1, max_size=10))
        headers[f"X-{name}"] = draw(safe)
    if shape == "raw":
        raw = draw(arbitrary_bytes())
        return lambda _delivery: bytes(raw[:65536])
    if shape == "head":
        head = draw(
            st.sampled_from([b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200", b"HTTP/9 200 OK\r\n\r\n"])
        )
        tail = draw(arbitrary_bytes())
        return lambda _delivery: head + bytes(tail[:4096])
    if shape == "body":
        body = bytes(draw(arbitrary_bytes())[:65536])
        return lambda _delivery: http_response(status, body, headers)
    if shape == "nested":
        depth = draw(st.sampled_from([100, 1000, 100_000]))
        body = (b"[" * depth) + (b"]" * depth)
        wrapped = b'{"jsonrpc": "2.0", "id": 1, "result": ' + body + b"}"
        return lambda _delivery: http_response(status, wrapped, headers)
    doc = draw(rpc_documents())

    def answer(delivery: Delivery) -> bytes:
        echo = dict(doc)
        if echo.get("id") is None:
            echo["id"] = delivery.lease_id
        try:
            body = json.dumps(echo, allow_nan=True).encode(errors="surrogatepass")
        except (TypeError, ValueError):
            body = b"{}"
        return http_response(status, body, headers)

    return answer


def expected_final(state: int, task: Any) -> bool:
    """True when a task is where a delivery's answer may leave it for good: completed,
    archived, or waiting for a retry that is not due for a while."""
    if state in (task_pb2.TASK_STATE_COMPLETED, task_pb2.TASK_STATE_ARCHIVED):
        return True
    if state == task_pb2.TASK_STATE_RETRY:
        due = task.next_process_at.seconds + task.next_process_at.nanos / 1e9
        return bool(due - datetime.now(UTC).timestamp() > 5)
    return False


async def get_task(stack: Stack, task_id: str) -> Any:
    code, details, data = await unary(
        stack.channel,
        "/conveyor.v1.AdminService/GetTask",
        service_pb2.GetTaskRequest(id=task_id).SerializeToString(),
    )
    assert code == grpc.StatusCode.OK, (code, details)
    return service_pb2.GetTaskResponse.FromString(data).task


async def finish(stack: Stack, delivery: Delivery, *, check: bool = True) -> None:
    """Report success for a parked delivery through WebhookService."""
    request = service_pb2.WebhookReportResultRequest(
        lease_token=delivery.token, outcome=service_pb2.OUTCOME_SUCCESS, result=b'"ok"'
    )
    code, details, _ = await unary(
        stack.channel, "/conveyor.v1.WebhookService/ReportResult", request.SerializeToString()
    )
    assert code == grpc.StatusCode.OK or not check, (code, details)


async def enqueue(stack: Stack, task_id: str, max_retry: int) -> None:
    await stack.client.enqueue(
        "fuzz.hook", {"n": 1}, id=task_id, queue=stack.webhook_queue, max_retry=max_retry
    )


async def first_delivery(stack: Stack, task_id: str) -> Delivery:
    await poll(lambda: bool(stack.endpoint.of(task_id)), f"a delivery of {task_id}")
    return stack.endpoint.of(task_id)[0]


# ---------------------------------------------------------------- tests


@fuzz()
@given(answer=answers(), max_retry=st.sampled_from([0, 0, 1]))
async def test_hostile_answers_to_deliveries(stack: Stack, answer: Any, max_retry: int) -> None:
    task_id = new_id(datetime.now(UTC))
    stack.endpoint.answers[task_id] = answer
    await enqueue(stack, task_id, max_retry)
    delivery = await first_delivery(stack, task_id)
    state = task_pb2.TASK_STATE_ACTIVE
    task: Any = None

    async def settled() -> bool:
        nonlocal state, task
        task = await get_task(stack, task_id)
        state = task.state
        return expected_final(state, task)

    try:
        await poll(settled, f"task {task_id} settles", within=5)
    except TimeoutError:
        if state == task_pb2.TASK_STATE_ACTIVE:
            # Still held: the endpoint answered "accepted" and works on it; it finishes.
            event("parked")
            await finish(stack, delivery)
        await poll(settled, f"task {task_id} settles", within=15)
    event(f"ended {task_pb2.TaskState.Name(state)}")
    assert not stack.dead(), stack.dead()


#: Statuses a callback may end with (RESOURCE_EXHAUSTED only past the message limit).
def _check(code: grpc.StatusCode, details: str | None, sent: int) -> None:
    problem = status_problem(code, details, sent)
    assert problem is None, problem


def damaged(token: str, at: int, to: str) -> str:
    """``token`` with one character replaced (or cut there, when ``to`` is empty)."""
    at %= max(len(token), 1)
    return token[:at] + to + token[at + 1 :] if to else token[:at]


@st.composite
def callbacks(draw: st.DrawFn, delivery: Delivery) -> tuple[str, bytes]:
    """A WebhookService call (method, request bytes) about ``delivery``: hostile fields,
    its real lease token most often (else a damaged one or any text)."""
    token = draw(
        st.one_of(
            *[st.just(delivery.token)] * 4,
            st.builds(
                damaged,
                st.just(delivery.token),
                st.integers(0, 4096),
                st.sampled_from(["", "A", ".", "é"]),
            ),
            text(),
        )
    )
    if draw(st.booleans()):
        request: Any = draw(messages_of(service_pb2.WebhookHeartbeatRequest))
        request.lease_token = token
        return "Heartbeat", Blob(request.SerializeToString())
    request = draw(messages_of(service_pb2.WebhookReportResultRequest))
    request.lease_token = token
    if draw(st.booleans()):
        request.outcome = draw(st.sampled_from([1, 2, 3, 4]))
    return "ReportResult", Blob(request.SerializeToString())


@st.composite
def routed(draw: st.DrawFn, stack: Stack, delivery: Delivery) -> bytes:
    """A sealed-to-be WebhookCallback naming the delivery's task and lease, hostile
    otherwise."""
    callback = cluster_pb2.WebhookCallback(
        worker=draw(st.one_of(st.just(stack.webhook_name), st.just(""), text())),
        task_id=draw(st.one_of(*[st.just(delivery.task_id)] * 3, text())),
        lease_id=draw(st.one_of(*[st.just(delivery.lease_id)] * 3, text())),
        queue=draw(st.one_of(st.just(stack.webhook_queue), st.just(""), text())),
    )
    if draw(st.booleans()):
        callback.heartbeat.progress = draw(blobs())
    elif draw(st.integers(0, 5)):
        outcome: Any = callback.result  # any int: unknown outcomes included
        outcome.outcome = draw(st.one_of(st.sampled_from([1, 2, 3, 4]), st.integers(-3, 9)))
        callback.result.result = draw(blobs())
        callback.result.error = draw(text())
        callback.result.retry_after = draw(floats())
    return Blob(callback.SerializeToString())


@fuzz(0.6)
@given(data=st.data())
async def test_hostile_callbacks_of_a_parked_delivery(stack: Stack, data: st.DataObject) -> None:
    task_id = new_id(datetime.now(UTC))
    stack.endpoint.answers[task_id] = lambda d: http_response(
        200,
        json.dumps(
            {"jsonrpc": "2.0", "id": d.lease_id, "result": {"outcome": "accepted"}}
        ).encode(),
    )
    await enqueue(stack, task_id, 0)
    delivery = await first_delivery(stack, task_id)
    nc = await connect_nats(stack.cluster.nats_url, name="fuzz-callbacks")
    settled = False
    try:
        settled = await _fuzz_callbacks(stack, nc, delivery, data)
    finally:
        await close_nats(nc, drain=False)
        if not settled:
            # Even when the example failed: the parked delivery must not keep its slot
            # (the registration's concurrency) from the next examples.
            await finish(stack, delivery, check=False)
    task = await get_task(stack, task_id)
    if not settled:
        assert task.state == task_pb2.TASK_STATE_COMPLETED, task_pb2.TaskState.Name(task.state)
    else:
        event("settled by a fuzzed callback")
        assert await stack.settled(task_id) != task_pb2.TASK_STATE_ACTIVE
    assert not stack.dead(), stack.dead()


async def _fuzz_callbacks(stack: Stack, nc: Any, delivery: Delivery, data: st.DataObject) -> bool:
    """Send the hostile callbacks; True when one of them settled the delivery."""
    settled = False
    for _ in range(data.draw(st.integers(1, 4), label="calls")):
        if data.draw(st.sampled_from(["grpc", "grpc", "nats"]), label="via") == "grpc":
            method, body = data.draw(callbacks(delivery), label="call")
            code, details, _ = await unary(
                stack.channel, f"/conveyor.v1.WebhookService/{method}", body
            )
            _check(code, details, len(body))
            event(f"{method}: {code.name}")
            if method == "ReportResult" and code == grpc.StatusCode.OK:
                settled = True
        else:
            body = data.draw(routed(stack, delivery), label="callback")
            subject = SUBJECTS.webhook_callback(stack.webhook_name)
            headers = stack.auth.seal(subject, body, within=5.0)
            reply = await nc.request(subject, bytes(body), timeout=10, headers=headers)
            answer = cluster_pb2.WebhookCallbackReply.FromString(reply.data)
            assert answer.status in cluster_pb2.WebhookCallbackReply.Status.values(), answer
            assert math.isfinite(answer.lease_expires_at), answer
            event(f"routed: {cluster_pb2.WebhookCallbackReply.Status.Name(answer.status)}")
            sent = cluster_pb2.WebhookCallback.FromString(body)
            if (
                answer.status == cluster_pb2.WebhookCallbackReply.STATUS_OK
                and sent.WhichOneof("kind") == "result"
            ):
                settled = True
    return settled
