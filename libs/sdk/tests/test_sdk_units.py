"""Pure logic of the SDK: public surface, codecs, options, conversions, errors, outcomes,
result coalescing and reconnect backoff."""

from __future__ import annotations

import importlib.metadata
import inspect
import random
import re
import time
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import conveyor
import grpc
import grpc.aio
import pytest
from conveyor import (
    AlreadyExists,
    CodecError,
    ConveyorError,
    DeadlineExceeded,
    InvalidArgument,
    JsonCodec,
    OnFailure,
    RawCodec,
    ReconnectBackoff,
    RetryAfter,
    SkipRetry,
    TaskContext,
    TaskNotFound,
    TaskOptions,
    TaskState,
    Unavailable,
    Worker,
    spec,
    webhooks,
)
from conveyor._clients.task_wire import (
    item_result_from_wire,
    options_from_wire,
    options_to_wire,
    spec_to_wire,
    task_from_wire,
)
from conveyor._errors import error_from_rpc, error_from_status
from conveyor._payload import decode_value, encode_value
from conveyor._worker.execution import (
    MAX_ERROR_LEN,
    Registration,
    describe_exception,
    result_for_exception,
    time_limit,
)
from conveyor._worker.outbox import Outbox, result_frames
from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb

T0 = datetime(2030, 1, 1, tzinfo=UTC)

EXPORTED = {
    "AdminClient",
    "AlreadyExists",
    "AsyncAdminClient",
    "AsyncClient",
    "AsyncEventStream",
    "BatchActionResult",
    "BatchContext",
    "Breaker",
    "BreakerConfig",
    "BreakerConfigNotFound",
    "BreakerScope",
    "BreakerState",
    "ClusterInfo",
    "ClusterNode",
    "ConcurrencyLimit",
    "ConcurrencyLimitNotFound",
    "WebhookGateway",
    "WorkerSession",
    "EventStream",
    "QueueInfo",
    "QueuePage",
    "TaskEvent",
    "TaskPage",
    "Client",
    "Codec",
    "CodecError",
    "ConveyorError",
    "CronEntry",
    "CronEntryNotFound",
    "GroupConfig",
    "GroupConfigNotFound",
    "GroupStats",
    "CronMisfire",
    "CronSpec",
    "DeadlineExceeded",
    "DependencyOutcome",
    "DependencyPage",
    "DependencyResult",
    "EnqueueResult",
    "FailedPrecondition",
    "InvalidArgument",
    "JsonCodec",
    "OnFailure",
    "PermissionDenied",
    "RateLimit",
    "RateLimitNotFound",
    "RawCodec",
    "ReconnectBackoff",
    "ResourceExhausted",
    "RetryAfter",
    "SkipRetry",
    "TaskContext",
    "TaskDependency",
    "TaskInfo",
    "TaskNotFound",
    "TaskOptions",
    "TaskSpec",
    "TaskState",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "WebhookWorker",
    "WebhookWorkerNotFound",
    "WhoAmI",
    "Worker",
    "__version__",
    "cron",
    "new_task_id",
    "spec",
    "webhooks",
}


# ------------------------------------------------------------------- public surface


def test_exported_names() -> None:
    assert set(conveyor.__all__) == EXPORTED
    for name in conveyor.__all__:
        assert hasattr(conveyor, name), name


def test_webhooks_exported_names() -> None:
    assert set(webhooks.__all__) == {
        "DEFAULT_TOLERANCE",
        "ID_HEADER",
        "SIGNATURE_HEADER",
        "STANDARD_SIGNATURE_HEADER",
        "TIMESTAMP_HEADER",
        "WHSEC_PREFIX",
        "AsyncCallbacks",
        "Callbacks",
        "Outcome",
        "ReplayGuard",
        "delivery_id",
        "standard_secret",
        "verify_signature",
        "verify_webhook",
    }
    for name in webhooks.__all__:
        assert hasattr(webhooks, name), name


def test_public_api_is_documented_and_proto_free() -> None:
    for name in sorted(EXPORTED - {"__version__"}):
        obj = getattr(conveyor, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        assert "conveyor_protos" not in getattr(obj, "__module__", ""), name
        if not inspect.isclass(obj):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_") or (not callable(member) and not isinstance(member, property)):
                continue
            assert inspect.getdoc(getattr(obj, attr)), f"{name}.{attr} has no docstring"


def test_version_matches_the_distribution() -> None:
    assert conveyor.__version__ == importlib.metadata.version("conveyor-sdk")


@pytest.mark.parametrize(
    ("blocking", "asyncio_twin"),
    [
        (conveyor.Client, conveyor.AsyncClient),
        (conveyor.AdminClient, conveyor.AsyncAdminClient),
        (webhooks.Callbacks, webhooks.AsyncCallbacks),
    ],
)
def test_blocking_clients_have_the_methods_of_their_asyncio_twins(
    blocking: type, asyncio_twin: type
) -> None:
    def methods(cls: type) -> dict[str, Any]:
        return {
            name: member
            for name, member in vars(cls).items()
            if callable(member) and (not name.startswith("_") or name == "__init__")
        }

    expected = methods(asyncio_twin)
    assert methods(blocking).keys() == expected.keys()
    assert len(expected) >= 3
    for name, method in methods(blocking).items():
        twin = expected[name]
        assert inspect.signature(method).parameters == inspect.signature(twin).parameters, name
        assert not inspect.iscoroutinefunction(method), name
        assert not inspect.isasyncgenfunction(method), name
        assert inspect.getdoc(method), name


# --------------------------------------------------------------------------- codecs


def test_json_codec_is_compact_utf8() -> None:
    codec = JsonCodec()
    assert codec.encode({"a": [1, 2], "b": "é"}) == '{"a":[1,2],"b":"é"}'.encode()
    assert codec.decode(b'{"a":[1,2]}') == {"a": [1, 2]}
    with pytest.raises(TypeError):
        codec.encode(object())
    with pytest.raises(ValueError, match="Expecting"):
        codec.decode(b"{nope")


def test_raw_codec_passes_bytes_through() -> None:
    codec = RawCodec()
    assert codec.encode(bytearray(b"\x00\x01")) == b"\x00\x01"
    assert codec.decode(b"\xff") == b"\xff"
    with pytest.raises(TypeError, match="bytes only"):
        codec.encode("text")
    assert isinstance(codec, conveyor.Codec)
    assert isinstance(JsonCodec(), conveyor.Codec)


def test_empty_bytes_mean_no_value() -> None:
    assert encode_value(JsonCodec(), None) == b""
    assert decode_value(JsonCodec(), b"") is None
    assert encode_value(JsonCodec(), 0) == b"0"
    assert decode_value(RawCodec(), b"") is None


# ------------------------------------------------------------------------- options


def test_spec_normalizes_durations_and_on_failure() -> None:
    item = spec("t", {"x": 1}, timeout=2, unique_key="k", unique_ttl=1.5, on_failure="continue")
    assert item.options.timeout == timedelta(seconds=2)
    assert item.options.unique_ttl == timedelta(seconds=1.5)
    assert item.options.on_failure is OnFailure.CONTINUE
    assert item.queue == "default"
    assert item.payload == {"x": 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"queue": "has space"}, "queue"),
        ({"queue": ""}, "queue"),
        ({"max_retry": -1}, "max_retry"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": "5s"}, "timeout"),
        ({"retention": -1}, "retention"),
        ({"deadline": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"process_at": T0, "process_in": 5}, "exclusive"),
        ({"unique_ttl": 5}, "unique_key"),
        ({"group": ""}, "group"),
        ({"depends_on": "01H"}, "depends_on"),
        ({"on_failure": "explode"}, "on_failure"),
        ({"headers": {"k": 1}}, "headers"),
        # Names are matched whole; text fields hold no control characters.
        ({"queue": "0\n"}, "queue"),
        ({"queue": "\u0430bc"}, "queue"),
        ({"queue": "\uff31"}, "queue"),
        ({"headers": {"k": "v\x00"}}, "header 'k' contains the control character"),
        ({"headers": {"k\x00": "v"}}, "header key contains the control character"),
        ({"unique_key": "k\x00"}, "unique_key contains the control character"),
        ({"concurrency_key": "c\n"}, "concurrency_key contains"),
    ],
)
def test_spec_rejects_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        spec("t", **kwargs)


def test_spec_rejects_a_bad_type() -> None:
    with pytest.raises(InvalidArgument, match="type"):
        spec("")
    with pytest.raises(InvalidArgument, match="type"):
        spec("x" * 257)
    with pytest.raises(InvalidArgument, match="task type contains the control character"):
        spec("t\x00")
    assert spec("envoyé ✉").type == "envoyé ✉"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"queues": ["0\n"]}, "invalid queue name"),
        ({"queues": {"q": 1001}}, "1..1000"),
        ({"queues": [f"q{n}" for n in range(1001)]}, "at most 1000 queues"),
        ({"concurrency": 10_001}, "concurrency must be an int in 1..10000"),
        ({"labels": {f"k{n}": "v" for n in range(17)}}, "at most 16 labels"),
        ({"labels": {"k" * 65: "v"}}, "label key"),
        ({"labels": {"k": "v" * 257}}, "longer than 256"),
        ({"labels": {"k": "v\x00"}}, "label 'k' contains the control character"),
        ({"labels": {"k": 1}}, "strings to strings"),
        ({"worker_id": "w" * 257}, "worker_id"),
        ({"worker_id": "w\n"}, "worker_id contains the control character"),
        ({"min_server_version": "1" * 65}, "min_server_version"),
    ],
)
def test_worker_checks_its_hello_before_connecting(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        Worker(**kwargs)


# --------------------------------------------------------------------- conversions


def test_a_clone_has_the_handlers_and_options_for_another_target() -> None:
    original = Worker(
        "prod:50051",
        queues={"a": 2, "b": 1},
        concurrency=7,
        labels={"zone": "x"},
        grace_period=3,
        worker_id="w-1",
        token="secret-of-production",
    )

    @original.task("t")
    async def handler(payload: Any, ctx: Any) -> None:
        return None

    twin = original.clone("127.0.0.1:9", concurrency=2)
    assert twin.target == "127.0.0.1:9"
    assert original.target == "prod:50051"
    assert twin.task_types == ["t"]
    assert twin.queues == {"a": 2, "b": 1}
    assert (twin.concurrency, original.concurrency) == (2, 7)
    assert twin.labels == {"zone": "x"}
    assert twin.worker_id == "w-1"
    assert twin.grace_period == timedelta(seconds=3)
    assert twin._token is None  # the production token stays with the original
    # Handlers registered later on one are not the other's.
    twin.register("u", handler)
    assert original.task_types == ["t"]
    with pytest.raises(InvalidArgument, match="concurrency"):
        original.clone("127.0.0.1:9", concurrency=0)


def test_options_round_trip_through_the_wire() -> None:
    options = TaskOptions(
        max_retry=0,
        timeout=timedelta(seconds=3),
        deadline=datetime(2030, 1, 1, 2, tzinfo=timezone(timedelta(hours=2))),
        process_at=T0,
        expires_at=T0,
        retention=timedelta(0),
        unique_key="k",
        unique_ttl=timedelta(hours=1),
        group="g",
        depends_on=("A", "B"),
        on_failure=OnFailure.CONTINUE,
        concurrency_key="c",
    )
    back = options_from_wire(options_to_wire(options))
    assert back == options
    assert back.deadline is not None
    assert back.deadline.tzinfo is UTC
    assert options_from_wire(options_to_wire(TaskOptions())) == TaskOptions()


def test_spec_to_wire_encodes_with_the_codec() -> None:
    new = spec_to_wire(spec("t", b"\x01", headers={"a": "b"}), RawCodec())
    assert (new.payload, dict(new.headers), new.id) == (b"\x01", {"a": "b"}, "")
    assert spec_to_wire(spec("t"), JsonCodec()).payload == b""
    with pytest.raises(InvalidArgument, match="cannot encode"):
        spec_to_wire(spec("t", "text"), RawCodec())


def test_task_from_wire_maps_states_and_decodes() -> None:
    task = pb.Task(id="A", queue="q", type="t", state=pb.TASK_STATE_ARCHIVED, payload=b"[1]")
    task.completed_at.FromDatetime(T0)
    info = task_from_wire(task, JsonCodec())
    assert (info.state, info.payload, info.completed_at, info.created_at) == (
        TaskState.ARCHIVED,
        [1],
        T0,
        None,
    )
    assert info.state.is_terminal
    assert not TaskState.RETRY.is_terminal
    unknown = pb.Task(id="A", state=42)  # type: ignore[arg-type]
    assert task_from_wire(unknown, JsonCodec()).state is TaskState.UNKNOWN
    with pytest.raises(CodecError, match="payload of task 'A'"):
        task_from_wire(pb.Task(id="A", payload=b"\xff"), JsonCodec())


def test_batch_items_map_errors_by_code() -> None:
    item = svc.EnqueueItemResult(error_code="ALREADY_EXISTS", error="dup", existing_id="X")
    result = item_result_from_wire(item, JsonCodec())
    assert isinstance(result.error, AlreadyExists)
    assert result.error.existing_id == "X"
    assert result.task is None
    assert not result.ok
    odd = item_result_from_wire(
        svc.EnqueueItemResult(error_code="DATA_LOSS", error="?"), JsonCodec()
    )
    assert type(odd.error) is ConveyorError
    assert odd.error.code == "DATA_LOSS"
    empty = item_result_from_wire(svc.EnqueueItemResult(), JsonCodec())
    assert empty.error is not None


# -------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("NOT_FOUND", TaskNotFound),
        ("INVALID_ARGUMENT", InvalidArgument),
        ("UNAVAILABLE", Unavailable),
        ("DEADLINE_EXCEEDED", DeadlineExceeded),
        ("PERMISSION_DENIED", conveyor.PermissionDenied),
        ("UNAUTHENTICATED", conveyor.Unauthenticated),
        ("FAILED_PRECONDITION", conveyor.FailedPrecondition),
        ("RESOURCE_EXHAUSTED", conveyor.ResourceExhausted),
        ("UNIMPLEMENTED", conveyor.Unimplemented),
        ("INTERNAL", ConveyorError),
    ],
)
def test_status_codes_map_to_exceptions(code: str, cls: type[ConveyorError]) -> None:
    error = error_from_status(code, "msg")
    assert type(error) is cls
    assert error.code == code
    assert str(error) == "msg"


def test_rpc_errors_carry_the_existing_id_from_trailing_metadata() -> None:
    exc = grpc.aio.AioRpcError(
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(("conveyor-existing-id", "01EXISTING")),
        details="unique key taken",
    )
    error = error_from_rpc(exc)
    assert isinstance(error, AlreadyExists)
    assert (error.existing_id, error.message) == ("01EXISTING", "unique key taken")
    bare = error_from_rpc(
        grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
    )
    assert isinstance(bare, Unavailable)
    assert bare.message == "unavailable"
    assert isinstance(InvalidArgument("x"), ValueError)
    assert isinstance(TaskNotFound("x"), LookupError)


# ------------------------------------------------------------------------ outcomes


def test_handler_exceptions_map_to_results() -> None:
    skip = result_for_exception("T", "L", SkipRetry("gone for good"))
    assert (skip.outcome, skip.error) == (svc.OUTCOME_SKIP_RETRY, "gone for good")
    later = result_for_exception("T", "L", RetryAfter(timedelta(seconds=7), "busy"))
    assert later.outcome == svc.OUTCOME_FAILURE
    assert later.retry_after.ToTimedelta() == timedelta(seconds=7)
    assert later.error == "RetryAfter: busy"

    class Throttled(Exception):
        retry_after = 3

    throttled = result_for_exception("T", "L", Throttled("slow down"))
    assert throttled.retry_after.ToTimedelta() == timedelta(seconds=3)
    plain = result_for_exception("T", "L", KeyError("k"))
    assert (plain.outcome, plain.error, plain.HasField("retry_after")) == (
        svc.OUTCOME_FAILURE,
        "KeyError: 'k'",
        False,
    )
    assert describe_exception(RuntimeError()) == "RuntimeError"
    assert len(describe_exception(ValueError("x" * 10_000))) == MAX_ERROR_LEN
    with pytest.raises(ValueError, match=">= 0"):
        RetryAfter(-1)


def test_time_limit_is_the_tighter_of_timeout_and_deadline() -> None:
    assert time_limit(None, None, T0) is None
    assert time_limit(timedelta(seconds=5), None, T0) == 5
    assert time_limit(timedelta(seconds=5), T0 + timedelta(seconds=2), T0) == 2
    assert time_limit(None, T0 - timedelta(seconds=1), T0) == -1
    assert time_limit(timedelta(0), None, T0) is None


def test_registration_tells_async_handlers_from_sync_ones() -> None:
    async def coroutine(payload: Any, ctx: TaskContext) -> None:
        return None

    def function(payload: Any, ctx: TaskContext) -> None:
        return None

    class AsyncCallable:
        async def __call__(self, payload: Any, ctx: TaskContext) -> None:
            return None

    assert Registration.of("a", coroutine).is_async
    assert not Registration.of("b", function).is_async
    assert Registration.of("c", AsyncCallable()).is_async
    with pytest.raises(TypeError):
        Registration.of("d", "not callable")  # type: ignore[arg-type]


# ------------------------------------------------------------------- coalescing


def result(task_id: str, size: int = 0) -> svc.Result:
    return svc.Result(
        task_id=task_id, lease_id="L", outcome=svc.OUTCOME_SUCCESS, result=b"x" * size
    )


def test_one_result_is_a_plain_result_frame_and_many_are_batched() -> None:
    assert result_frames([]) == []
    (single,) = result_frames([result("A")])
    assert single.WhichOneof("frame") == "result"
    (batch,) = result_frames([result("A"), result("B"), result("C")])
    assert [r.task_id for r in batch.batch_result.results] == ["A", "B", "C"]


def test_batches_are_cut_by_size_and_count() -> None:
    frames = result_frames([result(str(i), 400) for i in range(5)], max_bytes=1000)
    assert [len(f.batch_result.results) or 1 for f in frames] == [2, 2, 1]
    assert frames[-1].WhichOneof("frame") == "result"
    frames = result_frames([result(str(i)) for i in range(7)], max_results=3)
    assert [len(f.batch_result.results) or 1 for f in frames] == [3, 3, 1]


async def test_outbox_coalesces_and_orders_frames() -> None:
    outbox = Outbox()
    assert not outbox.pending
    outbox.put_frame(svc.WorkerFrame(heartbeat=svc.Heartbeat()))
    outbox.put_result(result("A"))
    outbox.put_progress("A", "L", b"1")
    outbox.put_progress("A", "L", b"2")
    outbox.put_result(result("B"))
    await outbox.wait()
    kinds = [f.WhichOneof("frame") for f in outbox.drain()]
    assert kinds == ["progress", "batch_result", "heartbeat"]
    assert not outbox.pending
    outbox.put_progress("B", "L", b"3")
    (frame,) = outbox.drain()
    assert frame.progress.progress == b"3"
    outbox.written()
    await outbox.flushed()
    outbox.close()
    outbox.put_result(result("C"))
    assert outbox.closed
    assert outbox.drain() == []


# ------------------------------------------------------------------------- backoff


def test_reconnect_backoff_doubles_to_its_cap() -> None:
    backoff = ReconnectBackoff(initial=0.1, maximum=5.0, jitter=0.0)
    assert [backoff.delay(n) for n in range(8)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    )
    jittered = ReconnectBackoff(jitter=0.5)
    rng = random.Random(1)
    assert all(0.8 <= jittered.delay(4, rng) <= 1.6 for _ in range(100))
    with pytest.raises(InvalidArgument):
        ReconnectBackoff(initial=0)


def test_new_task_ids_are_ulids_stamped_with_the_time() -> None:
    crockford = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    before = time.time_ns() // 1_000_000
    made = [conveyor.new_task_id() for _ in range(100)]
    after = time.time_ns() // 1_000_000
    ulid = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")
    assert all(ulid.fullmatch(i) for i in made)
    assert len(set(made)) == 100
    for task_id in made:
        millis = 0
        for char in task_id[:10]:
            millis = millis * 32 + crockford.index(char)
        # The time comes first, so ids made in a later millisecond sort later.
        assert before <= millis <= after
