"""Pure logic of the api: capacity split, version checks, Hello validation, auth parsing."""

from __future__ import annotations

import grpc
import pytest
from conveyor_api import split_capacity
from conveyor_api.auth import BearerAuthInterceptor, _bearer
from conveyor_api.semver import at_least, parse_version
from conveyor_api.session import HelloRejected, check_hello
from conveyor_protos.v1 import service_pb2
from hypothesis import given
from hypothesis import strategies as st


def test_split_capacity_follows_weights() -> None:
    assert split_capacity(10, {"a": 1, "b": 1}) == {"a": 5, "b": 5}
    assert split_capacity(10, {"a": 9, "b": 1}) == {"a": 9, "b": 1}
    assert split_capacity(4, {"a": 3, "b": 1}) == {"a": 3, "b": 1}
    assert split_capacity(7, {"only": 5}) == {"only": 7}


def test_split_capacity_gives_every_queue_a_slot() -> None:
    assert split_capacity(3, {"big": 100, "x": 1, "y": 1}) == {"big": 1, "x": 1, "y": 1}
    assert split_capacity(10, {"big": 1000, "small": 1}) == {"big": 9, "small": 1}
    # Fewer slots than queues: one each; the gateway's session cap keeps the total.
    assert split_capacity(2, {"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}


def test_split_capacity_breaks_ties_deterministically() -> None:
    assert split_capacity(3, {"b": 1, "a": 1}) == {"a": 2, "b": 1}


@pytest.mark.parametrize(
    ("concurrency", "weights"),
    [(0, {"a": 1}), (1, {}), (3, {"a": 0}), (3, {"a": -1})],
)
def test_split_capacity_rejects_bad_input(concurrency: int, weights: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=r"."):
        split_capacity(concurrency, weights)


@given(
    st.integers(min_value=1, max_value=500),
    st.dictionaries(
        st.text(alphabet="abcdefgh", min_size=1, max_size=4),
        st.integers(min_value=1, max_value=50),
        min_size=1,
        max_size=8,
    ),
)
def test_split_capacity_properties(concurrency: int, weights: dict[str, int]) -> None:
    slots = split_capacity(concurrency, weights)
    assert set(slots) == set(weights)
    assert all(n >= 1 for n in slots.values())
    if concurrency >= len(weights):
        assert sum(slots.values()) == concurrency
        total = sum(weights.values())
        ideal = {q: concurrency * w / total for q, w in weights.items()}
        if all(share >= 1 for share in ideal.values()):
            # No floor-at-one lift needed: every queue is within one slot of its share.
            assert all(abs(slots[q] - ideal[q]) < 1 for q in weights)
    else:
        assert sum(slots.values()) == len(weights)


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

    assert conveyor_api.__all__ == ["ApiServer", "__version__", "split_capacity"]
    assert conveyor_api.__version__ == "0.1.0"
