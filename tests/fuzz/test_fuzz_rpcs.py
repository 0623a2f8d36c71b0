"""Every RPC of every service the api serves, with arbitrary bytes and with hostile
messages of its request type: a clear status (never INTERNAL or UNKNOWN, never a status
message past 1 KiB), and a request that does not parse changes nothing and is named as
malformed. The api process stays up; what stays stored and the other clients are
checked after each test (``tests/fuzz/conftest.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from conveyor_api.admin_service import NOT_YET_IMPLEMENTED
from conveyor_protos.v1 import service_pb2
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.profile import fuzz
from tests.fuzz.stack import MAX_MESSAGE, Stack, status_problem, unary
from tests.fuzz.strategies import arbitrary_bytes, bodies

pytestmark = [pytest.mark.fuzz, pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

#: Every method of every service in the wire contract.
METHODS: list[MethodDescriptor] = [
    method
    for service in service_pb2.DESCRIPTOR.services_by_name.values()
    for method in service.methods
]
UNARY = [m for m in METHODS if not m.client_streaming and not m.server_streaming]
SERVER_STREAMING = [m for m in METHODS if not m.client_streaming and m.server_streaming]


def path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def ids(method: MethodDescriptor) -> str:
    return f"{method.containing_service.name}.{method.name}"


def parses(method: MethodDescriptor, body: bytes) -> bool:
    """True when the server can parse ``body`` as the method's request."""
    try:
        GetMessageClass(method.input_type).FromString(body)
    except DecodeError:
        return False
    return True


async def check_call(stack: Stack, method: MethodDescriptor, body: bytes) -> None:
    before = await stack.fingerprint()
    code, details, _ = await unary(stack.channel, path(method), body)
    problem = status_problem(code, details, len(body))
    assert problem is None, f"{ids(method)}: {problem}"
    if code != grpc.StatusCode.OK:
        # Refused: nothing stored changed.
        assert await stack.fingerprint() == before, (code, details)
    if not parses(method, body) and len(body) <= 1024 * 1024:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert details is not None
        assert details.startswith("malformed request"), details
    assert not stack.dead(), stack.dead()


def test_every_method_is_fuzzed() -> None:
    """The lists below cover the whole contract: a new RPC is fuzzed without a change here
    (and a client-streaming one would need a test of its own, as Session has)."""
    streamed = [m for m in METHODS if m.client_streaming]
    assert [ids(m) for m in streamed] == ["WorkerService.Session"]
    assert len(UNARY) + len(SERVER_STREAMING) + len(streamed) == len(METHODS)
    assert {m.containing_service.name for m in UNARY} == {
        "TaskService",
        "AdminService",
        "WebhookService",
        "WorkerService",  # GetDependencyResults, beside the Session stream
    }


#: AdminService methods this server answers UNIMPLEMENTED whatever the request: a few
#: examples show that holds for any bytes.
NOT_BUILT = frozenset(NOT_YET_IMPLEMENTED)


@pytest.mark.parametrize("method", [m for m in UNARY if m.name not in NOT_BUILT], ids=ids)
@fuzz(0.6)
@given(data=st.data())
async def test_unary_rpc(stack: Stack, method: MethodDescriptor, data: st.DataObject) -> None:
    """Arbitrary bytes, or a hostile request message (encoded as it is or damaged)."""
    body = data.draw(st.one_of(arbitrary_bytes(), bodies(method.input_type)), label="request")
    await check_call(stack, method, body)


@pytest.mark.parametrize("method", [m for m in UNARY if m.name in NOT_BUILT], ids=ids)
@fuzz(0.2)
@given(data=st.data())
async def test_unary_rpc_not_built_yet(
    stack: Stack, method: MethodDescriptor, data: st.DataObject
) -> None:
    """UNIMPLEMENTED, or INVALID_ARGUMENT for bytes that do not parse, whatever comes."""
    body = data.draw(st.one_of(arbitrary_bytes(), bodies(method.input_type)), label="request")
    code, details, _ = await unary(stack.channel, path(method), body)
    assert code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT) or (
        code == grpc.StatusCode.RESOURCE_EXHAUSTED and len(body) > MAX_MESSAGE
    ), (code, details)


#: How long a server stream that is still open counts as accepted.
STREAM_GRACE = 0.3


@pytest.mark.parametrize("method", SERVER_STREAMING, ids=ids)
@fuzz(0.6)
@given(data=st.data())
async def test_server_streaming_rpc_with_hostile_requests(
    stack: Stack, method: MethodDescriptor, data: st.DataObject
) -> None:
    """A stream the server accepts stays open (it is cancelled after a moment); one it
    refuses ends with a clear status."""
    body = data.draw(st.one_of(arbitrary_bytes(), bodies(method.input_type)), label="request")
    stream: Any = stack.channel.unary_stream(path(method))
    call: Any = stream(bytes(body), timeout=15)
    try:
        async with asyncio.timeout(STREAM_GRACE):
            async for _ in call:
                pass
    except TimeoutError:
        call.cancel()
        assert parses(method, body)
        return
    except grpc.aio.AioRpcError as exc:
        problem = status_problem(exc.code(), exc.details(), len(body))
        assert problem is None, f"{ids(method)}: {problem}"
        return
    code = await call.code()
    assert status_problem(code, await call.details(), len(body)) is None
