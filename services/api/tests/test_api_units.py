"""Pure logic of the api: version checks, Hello validation, auth parsing."""

from __future__ import annotations

import grpc
import pytest
from conveyor_api.auth import BearerAuthInterceptor, _bearer
from conveyor_api.semver import at_least, parse_version
from conveyor_api.session import HelloRejected, check_hello
from conveyor_protos.v1 import service_pb2


def test_parse_version() -> None:
    assert parse_version("1.2.3") == (1, 2, 3)
    assert parse_version("v0.10.0-rc.1") == (0, 10, 0)
    for bad in ("", "1.2", "x.y.z", "1.2.3.4"):
        with pytest.raises(ValueError, match="semantic version"):
            parse_version(bad)


def test_at_least() -> None:
    assert at_least("0.2.0", "0.1.9")
    assert at_least("0.1.0", "0.1.0")
    assert not at_least("0.9.9", "0.10.0")
    assert at_least("1.0.0", "")
    with pytest.raises(ValueError, match="semantic version"):
        at_least("garbage", "")


def _hello(**fields: object) -> service_pb2.Hello:
    base: dict[str, object] = {"queues": {"q": 1}, "concurrency": 2, "sdk_version": "0.1.0"}
    base.update(fields)
    return service_pb2.Hello(**base)  # type: ignore[arg-type]


def test_check_hello_accepts_a_good_hello() -> None:
    spec = check_hello(_hello(labels={"zone": "a"}, worker_id="w1"), "0.1.0", "0.1.0")
    assert spec.queues == {"q": 1}
    assert spec.concurrency == 2
    assert spec.labels == {"zone": "a"}
    assert spec.worker_id == "w1"


@pytest.mark.parametrize(
    ("fields", "code", "text"),
    [
        ({"queues": {}}, grpc.StatusCode.INVALID_ARGUMENT, "at least one queue"),
        (
            {"queues": {f"q{i}": 1 for i in range(1001)}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "at most 1000",
        ),
        ({"queues": {"bad name": 1}}, grpc.StatusCode.INVALID_ARGUMENT, "invalid queue name"),
        ({"queues": {"q": 0}}, grpc.StatusCode.INVALID_ARGUMENT, "weight"),
        ({"concurrency": 0}, grpc.StatusCode.INVALID_ARGUMENT, "concurrency"),
        ({"sdk_version": "0.0.9"}, grpc.StatusCode.FAILED_PRECONDITION, "0.0.9"),
        ({"min_server_version": "9.0.0"}, grpc.StatusCode.FAILED_PRECONDITION, "9.0.0"),
        ({"sdk_version": "new"}, grpc.StatusCode.FAILED_PRECONDITION, "unparsable"),
    ],
)
def test_check_hello_rejects(fields: dict[str, object], code: grpc.StatusCode, text: str) -> None:
    with pytest.raises(HelloRejected) as info:
        check_hello(_hello(**fields), "0.1.0", "0.1.0")
    assert info.value.code == code
    assert text in info.value.message


def test_version_rejection_names_both_versions() -> None:
    with pytest.raises(HelloRejected) as info:
        check_hello(_hello(sdk_version="0.0.1"), "0.1.0", "0.0.5")
    assert "0.1.0" in info.value.message
    assert "0.0.1" in info.value.message
    assert "0.0.5" in info.value.message


def test_bearer_parsing_and_constant_time_check() -> None:
    assert _bearer([("authorization", "Bearer abc")]) == b"abc"
    assert _bearer([("Authorization", "bearer abc")]) == b"abc"
    assert _bearer([("authorization", "Basic abc")]) is None
    assert _bearer([("x-other", "Bearer abc")]) is None
    assert _bearer(None) is None
    auth = BearerAuthInterceptor(["one", "two"])
    assert auth._accepts(b"two")
    assert not auth._accepts(b"three")
    assert not auth._accepts(None)
    with pytest.raises(ValueError, match="token"):
        BearerAuthInterceptor([])


def test_public_names() -> None:
    import conveyor_api

    assert conveyor_api.__all__ == ["ApiServer", "__version__"]
    assert conveyor_api.__version__ == "0.1.0"
