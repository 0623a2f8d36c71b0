"""How an endpoint's answer to a delivery becomes an outcome. Pure: no I/O.

:func:`parse_response` turns the HTTP status and body into one of

- :class:`Accepted`: the endpoint took the task asynchronously (``"accepted"``);
- :class:`Finished`: a final outcome (success, failure, skip_retry, release);
- :class:`Broken`: anything else (a JSON-RPC error, a non-2xx status, a body that is not a
  valid JSON-RPC response), which fails the attempt with the server's backoff.
  ``transport`` marks the failures the endpoint's circuit breaker counts.

Connection errors and timeouts never reach the parser; :func:`transport_failure` names them.

:func:`parse_batch_response` does the same for an aggregation group's batch call: a
:class:`BatchFinished` (a final outcome for every member: the batch's own ``outcome``
for all of them, or each member's from ``results``), or a :class:`Broken` that fails
every member alike. ``accepted`` is refused for a batch (:data:`ASYNC_BATCH_ERROR`).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping, Sequence
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
#: The error of every member of a batch whose endpoint answered "accepted".
ASYNC_BATCH_ERROR = "asynchronous completion is not supported for batches"
#: The error of a member a batch's answer gave no outcome (no ``results`` entry and no
#: batch ``outcome``).
MISSING_MEMBER_ERROR = "the endpoint's batch answer gave this task no outcome"


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


@dataclass(frozen=True, slots=True)
class BatchFinished:
    """A batch's answer: the final outcome of each member, by task id (every member)."""

    outcomes: Mapping[str, Finished]


BatchReply = BatchFinished | Broken


def clip(text: str, limit: int = MAX_ERROR) -> str:
    """``text``, cut to ``limit`` characters with a marker when longer."""
    return text if len(text) <= limit else text[: limit - 15] + " ...(truncated)"


def transport_failure(error: str) -> Broken:
    """A delivery that got no HTTP answer (connection error, timeout)."""
    return Broken(clip(error), transport=True)


def _invalid(reason: str) -> Broken:
    return Broken(clip(f"invalid JSON-RPC response from the endpoint: {reason}"))


def _http_failure(status: int) -> Broken | None:
    if status >= 500:
        return Broken(f"endpoint answered HTTP {status}", transport=True)
    if not 200 <= status < 300:
        return Broken(f"endpoint answered HTTP {status}")
    return None


def parse_response(status: int, body: bytes, request_id: str) -> Reply:
    """The outcome of a delivery whose call had id ``request_id``, from the endpoint's
    HTTP ``status`` and ``body``. Never raises: a body nested too deeply to parse is
    invalid like any other bad body."""
    failed = _http_failure(status)
    if failed is not None:
        return failed
    try:
        doc = _response_result(body, request_id)
        return doc if isinstance(doc, Broken) else _result(doc)
    except RecursionError:
        return _invalid("the body is nested too deeply")


def parse_batch_response(
    status: int, body: bytes, request_id: str, task_ids: Sequence[str]
) -> BatchReply:
    """The outcome of each member (``task_ids``) of a batch whose call had id
    ``request_id``, from the endpoint's HTTP ``status`` and ``body``; or the one failure
    of them all (a bad status or body, a JSON-RPC error, ``accepted``). Never raises."""
    failed = _http_failure(status)
    if failed is not None:
        return failed
    try:
        doc = _response_result(body, request_id)
        return doc if isinstance(doc, Broken) else _batch_result(doc, task_ids)
    except RecursionError:
        return _invalid("the body is nested too deeply")


def _response_result(body: bytes, request_id: str) -> Any:
    """The ``result`` member of a valid JSON-RPC response to call ``request_id``, or the
    Broken the body stands for (a JSON-RPC error, an invalid response)."""
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
    return doc["result"]


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
    return _finished(result, OUTCOMES[outcome])


def _finished(
    result: dict[str, Any], outcome: service_pb2.Outcome, where: str = ""
) -> Finished | Broken:
    """The Finished of ``outcome`` with the ``result``, ``error`` and ``retry_after`` of
    the answer ``result`` (``where``: names it in a complaint, e.g. ``results[2]: ``)."""
    data = b""
    encoded = result.get("result")
    if encoded is not None:
        if not isinstance(encoded, str):
            return _invalid(f'{where}"result" must be a base64 string')
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            return _invalid(f'{where}"result" is not valid base64')
    error = result.get("error")
    if error is not None and not isinstance(error, str):
        return _invalid(f'{where}"error" must be a string')
    retry_after = result.get("retry_after")
    if retry_after is not None:
        if (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, int | float)
            or not math.isfinite(retry_after)
            or retry_after < 0
        ):
            return _invalid(f'{where}"retry_after" must be a number of seconds >= 0')
        retry_after = float(retry_after)
    return Finished(outcome, data, clip(error or ""), retry_after)


def _batch_result(result: Any, task_ids: Sequence[str]) -> BatchReply:
    """A batch's ``result``: an ``outcome`` for every member (fields as a single task's
    answer), and/or ``results``, one entry per member, each with its ``task_id``."""
    if not isinstance(result, dict):
        return _invalid('"result" is not an object')
    if result.get("outcome") == ACCEPTED:
        return Broken(ASYNC_BATCH_ERROR)
    every: Finished | None = None
    if result.get("outcome") is not None:
        answer = _result(result)
        if not isinstance(answer, Finished):
            assert isinstance(answer, Broken)  # Accepted is handled above
            return answer
        every = answer
    entries = result.get("results")
    if entries is None and every is None:
        return _invalid('a batch answer needs an "outcome" or "results"')
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        return _invalid('"results" is not a list')
    members = set(task_ids)
    outcomes: dict[str, Finished] = {}
    for n, entry in enumerate(entries):
        where = f"results[{n}]: "
        if not isinstance(entry, dict):
            return _invalid(f"{where}not an object")
        task_id = entry.get("task_id")
        if not isinstance(task_id, str) or task_id not in members:
            return _invalid(f'{where}"task_id" {task_id!r} is not a task of the batch')
        if task_id in outcomes:
            return _invalid(f"{where}task {task_id} is answered twice")
        member = _member_result(entry, where)
        if not isinstance(member, Finished):
            return member
        outcomes[task_id] = member
    missing = every or Finished(service_pb2.OUTCOME_FAILURE, error=MISSING_MEMBER_ERROR)
    return BatchFinished({task_id: outcomes.get(task_id, missing) for task_id in task_ids})


def _member_result(entry: dict[str, Any], where: str) -> Finished | Broken:
    """One ``results`` entry: its ``outcome``, or with none, a failure when it has an
    ``error`` and a success when not; ``"retry": false`` makes a failure a skip_retry."""
    outcome = entry.get("outcome")
    retry = entry.get("retry")
    if retry is not None and not isinstance(retry, bool):
        return _invalid(f'{where}"retry" must be true or false')
    if outcome == ACCEPTED:
        return Broken(ASYNC_BATCH_ERROR)
    if outcome is None:
        failed = entry.get("error") is not None
        code = service_pb2.OUTCOME_FAILURE if failed else service_pb2.OUTCOME_SUCCESS
    elif isinstance(outcome, str) and outcome in OUTCOMES:
        code = OUTCOMES[outcome]
    else:
        return _invalid(f'{where}"outcome" {outcome!r} is not one of {", ".join(OUTCOMES)}')
    if code == service_pb2.OUTCOME_FAILURE and retry is False:
        code = service_pb2.OUTCOME_SKIP_RETRY
    return _finished(entry, code, where)
