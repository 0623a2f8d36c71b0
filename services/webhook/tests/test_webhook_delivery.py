"""The wire format of a delivery and the parsing of the endpoint's answer (pure parts)."""

from __future__ import annotations

import base64
import hmac
import json
from datetime import UTC, datetime, timedelta

import pytest
from conveyor_protos.v1 import service_pb2, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.webhook_auth import (
    LeaseClaims,
    verify_delivery,
    verify_lease_token,
    verify_standard,
)
from conveyor_webhook.delivery import (
    DELIVERY_HEADER,
    METHOD,
    USER_AGENT,
    delivery_body,
    delivery_headers,
    rfc3339,
)
from conveyor_webhook.gateway import as_result
from conveyor_webhook.response import (
    MAX_ERROR,
    Accepted,
    Broken,
    Finished,
    parse_response,
    transport_failure,
)
from google.protobuf.timestamp_pb2 import Timestamp

TASK = "01J00000000000000000000001"
LEASE = "01J0000000000000000000000L"
EXPIRES = datetime(2030, 1, 1, 0, 0, 30, tzinfo=UTC)


def envelope(**fields: object) -> task_pb2.TaskEnvelope:
    env = task_pb2.TaskEnvelope(
        id=TASK,
        queue="emails",
        type="email.send",
        payload=b'{"to": "a@b.c"}\x00\xff',
        headers={"trace": "abc"},
        lease_id=LEASE,
        attempt=2,
        max_retry=7,
        lease_expires_at=wire.timestamp(EXPIRES),
    )
    for name, value in fields.items():
        getattr(env, name).CopyFrom(value)
    return env


def rpc(result: object = None, *, error: object = None, id_: object = LEASE) -> bytes:
    doc: dict[str, object] = {"jsonrpc": "2.0", "id": id_}
    if error is not None:
        doc["error"] = error
    else:
        doc["result"] = result
    return json.dumps(doc).encode()


# ---------------------------------------------------------------- delivery


def test_the_body_is_a_json_rpc_call_carrying_the_task() -> None:
    body, token = delivery_body(
        envelope(), worker="billing", secret="new", callback="api.example:50051"
    )
    call = json.loads(body)
    assert call["jsonrpc"] == "2.0"
    assert call["id"] == LEASE
    assert call["method"] == METHOD == "conveyor.task"
    params = call["params"]
    assert params == {
        "task_id": TASK,
        "queue": "emails",
        "type": "email.send",
        "payload": base64.b64encode(b'{"to": "a@b.c"}\x00\xff').decode(),
        "headers": {"trace": "abc"},
        "attempt": 2,
        "max_retry": 7,
        "lease_token": token,
        "lease_expires_at": "2030-01-01T00:00:30Z",
        "deadline": None,
        "callback": "api.example:50051",
    }


def test_the_lease_token_names_the_delivery_and_verifies_with_the_secret() -> None:
    _, token = delivery_body(envelope(), worker="billing", secret="new", callback="")
    claims = verify_lease_token(token, ["old", "new"])
    assert claims == LeaseClaims(worker="billing", task_id=TASK, lease_id=LEASE, queue="emails")


def test_a_deadline_is_an_rfc3339_utc_timestamp() -> None:
    deadline = datetime(2030, 1, 2, 3, 4, 5, 600000, tzinfo=UTC)
    body, _ = delivery_body(
        envelope(deadline=wire.timestamp(deadline)), worker="w", secret="s", callback=""
    )
    assert json.loads(body)["params"]["deadline"] == "2030-01-02T03:04:05.600000Z"
    assert rfc3339(datetime(2030, 1, 1, 1, tzinfo=UTC) + timedelta(hours=1)).endswith("02:00:00Z")


def test_times_protobuf_refuses_are_sent_as_null() -> None:
    # Found by the fuzz suite: a forged dispatch offer whose lease_expires_at had nanos out
    # of range crashed the delivery (a ValueError from protobuf) after the gateway took it.
    env = envelope(deadline=Timestamp(seconds=2**40))
    env.lease_expires_at.nanos = -5
    body, _ = delivery_body(env, worker="w", secret="s", callback="")
    params = json.loads(body)["params"]
    assert (params["lease_expires_at"], params["deadline"]) == (None, None)


def test_headers_sign_the_exact_body_with_the_given_secret() -> None:
    body, _ = delivery_body(envelope(), worker="w", secret="newest", callback="")
    headers = delivery_headers(
        body, task_id=TASK, delivery_id=LEASE, secret="newest", timestamp=1_900_000_000
    )
    assert headers["Content-Type"] == "application/json"
    # Standard Webhooks: the delivery id (the lease id), the time, the signature over both
    # and the body.
    assert headers["webhook-id"] == LEASE
    assert headers["webhook-timestamp"] == "1900000000"
    expected = hmac.new(b"newest", f"{LEASE}.1900000000.".encode() + body, "sha256").digest()
    assert headers["webhook-signature"] == "v1," + base64.b64encode(expected).decode()
    now = 1_900_000_000
    assert verify_standard(headers, body, ["older", "newest"], now=now)
    assert not verify_standard(headers, body, ["older"], now=now)
    assert not verify_standard(headers, body + b" ", ["newest"], now=now)
    assert not verify_standard({**headers, "webhook-id": "other"}, body, ["newest"], now=now)
    assert not verify_standard(headers, body, ["newest"], now=now + 301)
    assert headers[DELIVERY_HEADER] == TASK
    assert headers["User-Agent"] == USER_AGENT
    assert USER_AGENT.startswith("conveyor-webhook/")
    signature = headers["Conveyor-Signature"]
    assert signature.startswith("t=1900000000,v1=")
    assert verify_delivery(signature, body, ["newest"], now=1_900_000_000)
    assert not verify_delivery(signature, body, ["older"], now=1_900_000_000)
    assert not verify_delivery(signature, body + b" ", ["newest"], now=1_900_000_000)
    assert "traceparent" not in headers


def test_the_tasks_trace_context_goes_along_as_http_headers() -> None:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    env = envelope()
    env.headers.update({"traceparent": traceparent, "tracestate": "v=1", "other": "x"})
    body, _ = delivery_body(env, worker="w", secret="newest", callback="")
    headers = delivery_headers(
        body,
        task_id=TASK,
        delivery_id=LEASE,
        secret="newest",
        timestamp=1_900_000_000,
        task_headers=env.headers,
    )
    assert headers["traceparent"] == traceparent
    assert headers["tracestate"] == "v=1"
    assert "other" not in headers
    # What no HTTP header may carry (task headers hold any printable text) is left out.
    env.headers["traceparent"] = "é" * 10
    odd = delivery_headers(
        body, task_id=TASK, delivery_id=LEASE, secret="s", timestamp=1, task_headers=env.headers
    )
    assert "traceparent" not in odd
    assert odd["tracestate"] == "v=1"


# ---------------------------------------------------------------- response


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        ("success", service_pb2.OUTCOME_SUCCESS),
        ("failure", service_pb2.OUTCOME_FAILURE),
        ("skip_retry", service_pb2.OUTCOME_SKIP_RETRY),
        ("release", service_pb2.OUTCOME_RELEASE),
    ],
)
def test_each_final_outcome_parses(outcome: str, expected: service_pb2.Outcome) -> None:
    assert parse_response(200, rpc({"outcome": outcome}), LEASE) == Finished(expected)


def test_success_carries_its_base64_result() -> None:
    body = rpc({"outcome": "success", "result": base64.b64encode(b"\x00done").decode()})
    assert parse_response(200, body, LEASE) == Finished(service_pb2.OUTCOME_SUCCESS, b"\x00done")


def test_failure_carries_its_error_and_retry_after() -> None:
    body = rpc({"outcome": "failure", "error": "smtp down", "retry_after": 120})
    reply = parse_response(200, body, LEASE)
    assert reply == Finished(service_pb2.OUTCOME_FAILURE, b"", "smtp down", 120.0)


def test_accepted_is_asynchronous_mode() -> None:
    assert parse_response(200, rpc({"outcome": "accepted"}), LEASE) == Accepted()


def test_a_json_rpc_error_fails_with_its_message() -> None:
    body = rpc(error={"code": -32000, "message": "handler exploded"})
    assert parse_response(200, body, LEASE) == Broken("handler exploded")
    assert parse_response(200, rpc(error={"code": -32603}), LEASE) == Broken(
        "JSON-RPC error -32603"
    )


def test_server_errors_are_transport_failures_and_client_errors_are_not() -> None:
    assert parse_response(503, b"", LEASE) == Broken("endpoint answered HTTP 503", transport=True)
    assert parse_response(404, b"", LEASE) == Broken("endpoint answered HTTP 404")
    assert parse_response(302, b"", LEASE) == Broken("endpoint answered HTTP 302")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"jsonrpc": "1.0", "id": LEASE, "result": {}}).encode(), '"jsonrpc"'),
        (rpc({"outcome": "success"}, id_="someone-else"), '"id"'),
        (
            json.dumps({"jsonrpc": "2.0", "id": LEASE, "result": {}, "error": {}}).encode(),
            "exactly one",
        ),
        (json.dumps({"jsonrpc": "2.0", "id": LEASE}).encode(), "exactly one"),
        (rpc("success"), '"result" is not an object'),
        (rpc({"outcome": "done"}), '"outcome"'),
        (rpc({"outcome": "success", "result": "%%%"}), "base64"),
        (rpc({"outcome": "success", "result": 7}), "base64"),
        (rpc({"outcome": "failure", "error": 7}), '"error"'),
        (rpc({"outcome": "failure", "retry_after": -1}), '"retry_after"'),
        (rpc({"outcome": "failure", "retry_after": True}), '"retry_after"'),
        (rpc({"outcome": "failure", "retry_after": "5"}), '"retry_after"'),
        (rpc(error="boom"), '"error" is not an object'),
    ],
)
def test_a_body_that_is_not_a_valid_response_fails_without_counting(
    body: bytes, reason: str
) -> None:
    reply = parse_response(200, body, LEASE)
    assert isinstance(reply, Broken)
    assert not reply.transport
    assert reply.error.startswith("invalid JSON-RPC response from the endpoint")
    assert reason in reply.error


def test_long_errors_are_clipped() -> None:
    reply = parse_response(200, rpc(error={"code": 1, "message": "x" * 100_000}), LEASE)
    assert isinstance(reply, Broken)
    assert len(reply.error) == MAX_ERROR
    assert reply.error.endswith("(truncated)")


def test_transport_failure_counts() -> None:
    assert transport_failure("connection refused") == Broken("connection refused", transport=True)


# --------------------------------------------------------------- as_result


def test_as_result_maps_answers_to_stream_results() -> None:
    finished = Finished(service_pb2.OUTCOME_FAILURE, b"", "later", 90.0)
    result = as_result(finished, TASK, LEASE)
    assert (result.task_id, result.lease_id) == (TASK, LEASE)
    assert result.outcome == service_pb2.OUTCOME_FAILURE
    assert result.error == "later"
    assert wire.from_duration(result.retry_after) == timedelta(seconds=90)

    no_delay = as_result(Finished(service_pb2.OUTCOME_FAILURE, error="x"), TASK, LEASE)
    assert not no_delay.HasField("retry_after")

    broken = as_result(Broken("HTTP 500", transport=True), TASK, LEASE)
    assert broken.outcome == service_pb2.OUTCOME_FAILURE
    assert broken.error == "HTTP 500"
    assert not broken.HasField("retry_after")

    ok = as_result(Finished(service_pb2.OUTCOME_SUCCESS, b"r"), TASK, LEASE)
    assert (ok.outcome, ok.result) == (service_pb2.OUTCOME_SUCCESS, b"r")


def test_a_body_nested_too_deeply_is_an_invalid_response() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    for body in (
        deep,
        b'{"jsonrpc": "2.0", "id": "' + LEASE.encode() + b'", "result": ' + deep + b"}",
    ):
        reply = parse_response(200, body, LEASE)
        assert reply == Broken(
            "invalid JSON-RPC response from the endpoint: the body is nested too deeply"
        )
        assert not reply.transport
