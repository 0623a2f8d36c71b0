"""Pure logic of the api: version checks, Hello validation, auth parsing."""

from __future__ import annotations

import hmac

import grpc
import pytest
from conveyor_api.auth import ADMIN_READS, BearerAuthInterceptor, _bearer, needed_role
from conveyor_api.semver import at_least, parse_version
from conveyor_api.session import HelloRejected, check_hello
from conveyor_protos.v1 import service_pb2
from conveyor_runtime.tokens import Role, load_tokens


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


@pytest.mark.parametrize("version", ["", "0.0.1", "nightly-2026-12-07"])
def test_a_third_party_sdks_version_is_never_refused(version: str) -> None:
    spec = check_hello(
        _hello(sdk_name="conveyor-typescript", sdk_version=version), "0.1.0", "0.5.0"
    )
    assert spec.sdk_version == version


@pytest.mark.parametrize("name", ["", "conveyor-python"])
def test_the_python_sdk_is_held_to_the_minimum(name: str) -> None:
    with pytest.raises(HelloRejected) as info:
        check_hello(_hello(sdk_name=name, sdk_version="0.0.1"), "0.1.0", "0.5.0")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_third_party_sdk_still_gets_its_min_server_version_checked() -> None:
    with pytest.raises(HelloRejected) as info:
        check_hello(_hello(sdk_name="acme", min_server_version="9.0.0"), "0.1.0", "0.1.0")
    assert "9.0.0" in info.value.message
    with pytest.raises(HelloRejected) as info:
        check_hello(_hello(sdk_name="x" * 65), "0.1.0", "0.1.0")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sdk_name" in info.value.message


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
    with pytest.raises(ValueError, match="token"):
        BearerAuthInterceptor([])


def test_every_configured_secret_is_compared_whichever_matches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = load_tokens([f"t{n}:producer:{n:02d}-secret-of-the-token" for n in range(5)])
    auth = BearerAuthInterceptor(tokens)
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for presented, expected in (
        (b"00-secret-of-the-token", "t0"),
        (b"04-secret-of-the-token", "t4"),
        (b"05-secret-of-the-token", None),
        (b"short", None),
    ):
        compared.clear()
        found = auth.identify(presented)
        assert (found.name if found else None) == expected
        assert len(compared) == len(tokens)
        # Digests of equal length, never the secrets themselves.
        assert {len(a) for a, _ in compared} == {len(b) for _, b in compared} == {32}
    assert auth.identify(None) is None


@pytest.mark.parametrize(
    ("method", "role"),
    [
        ("/conveyor.v1.TaskService/Enqueue", Role.PRODUCER),
        ("/conveyor.v1.TaskService/GetTask", Role.PRODUCER),
        ("/conveyor.v1.WorkerService/Session", Role.WORKER),
        ("/conveyor.v1.AdminService/GetTask", Role.READ_ONLY),
        ("/conveyor.v1.AdminService/ListQueues", Role.READ_ONLY),
        ("/conveyor.v1.AdminService/WatchEvents", Role.READ_ONLY),
        ("/conveyor.v1.AdminService/GetClusterInfo", Role.READ_ONLY),
        ("/conveyor.v1.AdminService/ListWebhookWorkers", Role.READ_ONLY),
        ("/conveyor.v1.AdminService/DeleteTask", Role.ADMIN),
        ("/conveyor.v1.AdminService/UpsertWebhookWorker", Role.ADMIN),
        ("/conveyor.v1.AdminService/PauseQueue", Role.ADMIN),
        ("/conveyor.v1.AdminService/ListBreakerConfigs", Role.READ_ONLY),
        ("/conveyor.v1.AdminService/ListBreakers", Role.READ_ONLY),
        ("/conveyor.v1.AdminService/SetBreakerConfig", Role.ADMIN),
        ("/conveyor.v1.AdminService/DeleteBreakerConfig", Role.ADMIN),
        # A method nobody mapped needs admin: new calls fail closed.
        ("/conveyor.v1.SomethingNew/Do", Role.ADMIN),
    ],
)
def test_the_role_each_call_needs(method: str, role: Role) -> None:
    assert needed_role(method) is role


def test_every_admin_read_is_a_real_method() -> None:
    names = {m.name for m in service_pb2.DESCRIPTOR.services_by_name["AdminService"].methods}
    assert names >= ADMIN_READS


def test_public_names() -> None:
    import conveyor_api

    assert conveyor_api.__all__ == ["ApiServer", "__version__"]
    assert conveyor_api.__version__ == "0.1.0"
