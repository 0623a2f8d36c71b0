"""How an endpoint's answer to a delivery becomes an outcome. Pure: no I/O.

:func:`parse_response` turns the HTTP status and body into one of

- :class:`Accepted`: the endpoint took the task asynchronously (``"accepted"``);
- :class:`Finished`: a final outcome (success, failure, skip_retry, release);
- :class:`Broken`: anything else (a JSON-RPC error, a non-2xx status, a body that is not a
  valid JSON-RPC response), which fails the attempt with the server's backoff.
  ``transport`` marks the failures the endpoint's circuit breaker counts.

Connection errors and timeouts never reach the parser; :func:`transport_failure` names them.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from typing import Any

from conveyor_protos.v1 import service_pb2

#: Longest error text taken from an endpoint (longer ones are cut, with a marker).
MAX_ERROR = 4096

OUTCOMES: dict[str, service_pb2.Outcome] = {
    "success": service_pb2.OUTCOME_SUCCESS,
    "failure": service_pb2.OUTCOME_FAILURE,
    "skip_retry": service_pb2.OUTCOME_SKIP_RETRY,
    "release": service_pb2.OUTCOME_RELEASE,
}
ACCEPTED = "accepted"


@dataclass(frozen=True, slots=True)
class Accepted:
    """The endpoint runs the task asynchronously and reports through callbacks."""


@dataclass(frozen=True, slots=True)
class Finished:
    """A final outcome: ``retry_after`` in seconds (FAILURE; None: the server's backoff)."""

    outcome: service_pb2.Outcome
    result: bytes = b""
    error: str = ""
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class Broken:
    """The delivery failed: fail the attempt with ``error`` and the server's backoff.
    ``transport``: a connection error, a timeout or a 5xx (the circuit breaker counts it)."""

    error: str
    transport: bool = False


Reply = Accepted | Finished | Broken


def clip(text: str, limit: int = MAX_ERROR) -> str:
    """``text``, cut to ``limit`` characters with a marker when longer."""
    return text if len(text) <= limit else text[: limit - 15] + " ...(truncated)"


def transport_failure(error: str) -> Broken:
    """A delivery that got no HTTP answer (connection error, timeout)."""
    return Broken(clip(error), transport=True)


def _invalid(reason: str) -> Broken:
    return Broken(clip(f"invalid JSON-RPC response from the endpoint: {reason}"))


def parse_response(status: int, body: bytes, request_id: str) -> Reply:
    """The outcome of a delivery whose call had id ``request_id``, from the endpoint's
    HTTP ``status`` and ``body``. Never raises: a body nested too deeply to parse is
    invalid like any other bad body."""
    if status >= 500:
        return Broken(f"endpoint answered HTTP {status}", transport=True)
    if not 200 <= status < 300:
        return Broken(f"endpoint answered HTTP {status}")
    try:
        return _parse(body, request_id)
    except RecursionError:
        return _invalid("the body is nested too deeply")


def _parse(body: bytes, request_id: str) -> Reply:
    try:
        doc: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return _invalid("the body is not JSON")
    if not isinstance(doc, dict):
        return _invalid("the body is not a JSON object")
    if doc.get("jsonrpc") != "2.0":
        return _invalid('"jsonrpc" is not "2.0"')
    if doc.get("id") != request_id:
        return _invalid(f'"id" is {doc.get("id")!r}, expected {request_id!r}')
    has_error, has_result = "error" in doc, "result" in doc
    if has_error == has_result:
        return _invalid('exactly one of "result" and "error" is required')
    if has_error:
        return _rpc_error(doc["error"])
    return _result(doc["result"])


def _rpc_error(error: Any) -> Broken:
    if not isinstance(error, dict):
        return _invalid('"error" is not an object')
    message, code = error.get("message"), error.get("code")
    if isinstance(message, str) and message:
        return Broken(clip(message))
    return Broken(f"JSON-RPC error {code}" if isinstance(code, int) else "JSON-RPC error")


def _result(result: Any) -> Reply:
    if not isinstance(result, dict):
        return _invalid('"result" is not an object')
    outcome = result.get("outcome")
    if outcome == ACCEPTED:
        return Accepted()
    if not isinstance(outcome, str) or outcome not in OUTCOMES:
        allowed = ", ".join([*OUTCOMES, ACCEPTED])
        return _invalid(f'"outcome" {outcome!r} is not one of {allowed}')
    data = b""
    encoded = result.get("result")
    if encoded is not None:
        if not isinstance(encoded, str):
            return _invalid('"result" must be a base64 string')
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            return _invalid('"result" is not valid base64')
    error = result.get("error")
    if error is not None and not isinstance(error, str):
        return _invalid('"error" must be a string')
    retry_after = result.get("retry_after")
    if retry_after is not None:
        if (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, int | float)
            or not math.isfinite(retry_after)
            or retry_after < 0
        ):
            return _invalid('"retry_after" must be a number of seconds >= 0')
        retry_after = float(retry_after)
    return Finished(OUTCOMES[outcome], data, clip(error or ""), retry_after)
