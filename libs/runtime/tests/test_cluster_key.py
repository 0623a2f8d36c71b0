"""The cluster key's seals: what is accepted and what is refused, with a clock the test
moves; the keys and settings that are refused at start."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from conveyor_runtime.cluster_key import (
    MAX_AGE,
    SEAL_HEADER,
    ClusterAuth,
    ClusterKeyError,
    generate_key,
    parse_keys,
)
from conveyor_runtime.settings import (
    CommonSettings,
    DispatcherSettings,
    MaintenanceSettings,
    WebhookSettings,
)
from conveyor_testkit.cluster_keys import cluster_auth
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

SUBJECT = "conveyor.gw.g1.dispatch"
BODY = b"\x0a\x04mail"


class Clock:
    def __init__(self, now: float = 1_900_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_sealed_message_verifies_under_the_same_key() -> None:
    auth = cluster_auth()
    headers = auth.seal(SUBJECT, BODY)
    assert auth.check(SUBJECT, BODY, headers) is None


def test_a_seal_binds_the_subject_the_body_and_the_times() -> None:
    auth = cluster_auth()
    headers = auth.seal(SUBJECT, BODY, within=2.0)
    assert auth.check("conveyor.gw.g2.dispatch", BODY, headers) == "bad-mac"
    assert auth.check(SUBJECT, BODY + b"\x10\x01", headers) == "bad-mac"
    version, kid, sent, deadline, mac = headers[SEAL_HEADER].split(".")
    later = f"{version}.{kid}.{int(sent) + 1000}.{deadline}.{mac}"
    assert auth.check(SUBJECT, BODY, {SEAL_HEADER: later}) == "bad-mac"
    no_deadline = f"{version}.{kid}.{sent}.0.{mac}"
    assert auth.check(SUBJECT, BODY, {SEAL_HEADER: no_deadline}) == "bad-mac"


def test_unsealed_malformed_and_foreign_messages_are_refused() -> None:
    auth = cluster_auth()
    assert auth.check(SUBJECT, BODY, None) == "unsealed"
    assert auth.check(SUBJECT, BODY, {}) == "unsealed"
    assert auth.check(SUBJECT, BODY, {SEAL_HEADER: "garbage"}) == "malformed"
    assert auth.check(SUBJECT, BODY, {SEAL_HEADER: "2.a.1.0.x"}) == "malformed"
    assert auth.check(SUBJECT, BODY, {SEAL_HEADER: "1.a.x.0.x"}) == "malformed"
    foreign = cluster_auth(generate_key()).seal(SUBJECT, BODY)
    reason = auth.check(SUBJECT, BODY, foreign)
    assert reason is not None
    assert reason.startswith("unknown-key: ")
    # A seal without a MAC (a service with allow_unsigned and no key) is not enough.
    unsigned = ClusterAuth([], allow_unsigned=True).seal(SUBJECT, BODY)
    assert auth.check(SUBJECT, BODY, unsigned) == "no-mac"
    # A forger who knows the key id but not the key.
    kid = auth.key_ids[0]
    assert auth.check(SUBJECT, BODY, {SEAL_HEADER: f"1.{kid}.1.0.{'a' * 32}"}) == "bad-mac"


def test_an_old_message_is_refused_so_a_captured_one_cannot_be_replayed() -> None:
    clock = Clock()
    auth = cluster_auth(now=clock)
    headers = auth.seal(SUBJECT, BODY)
    clock.now += MAX_AGE - 1
    assert auth.check(SUBJECT, BODY, headers) is None
    clock.now += 2
    reason = auth.check(SUBJECT, BODY, headers)
    assert reason is not None
    assert reason.startswith("expired: sent 31.0s ago")


def test_a_message_from_the_future_is_refused() -> None:
    clock = Clock()
    auth = cluster_auth(now=clock)
    clock.now += MAX_AGE + 1
    headers = auth.seal(SUBJECT, BODY)
    clock.now -= MAX_AGE + 1
    reason = auth.check(SUBJECT, BODY, headers)
    assert reason is not None
    assert reason.startswith("future: ")


def test_a_request_past_its_deadline_is_refused() -> None:
    clock = Clock()
    auth = cluster_auth(now=clock)
    headers = auth.seal(SUBJECT, BODY, within=2.0)
    clock.now += 1.99
    assert auth.check(SUBJECT, BODY, headers) is None
    clock.now += 0.02
    reason = auth.check(SUBJECT, BODY, headers)
    assert reason is not None
    assert reason.startswith("late: past its deadline by 0.010s")


def test_rotation_every_listed_key_verifies_and_the_first_signs() -> None:
    old, new = generate_key(), generate_key()
    before = cluster_auth(old)
    during = cluster_auth(new, old)
    after = cluster_auth(new)
    from_old = before.seal(SUBJECT, BODY)
    from_new = during.seal(SUBJECT, BODY)
    assert during.check(SUBJECT, BODY, from_old) is None
    assert during.check(SUBJECT, BODY, from_new) is None
    assert after.check(SUBJECT, BODY, from_new) is None
    assert before.check(SUBJECT, BODY, from_new) is not None  # first step: key on all
    assert after.check(SUBJECT, BODY, from_old) is not None  # last step: old one gone
    assert during.key_ids == [after.key_ids[0], before.key_ids[0]]


def test_allow_unsigned_accepts_no_seal_but_never_a_wrong_one() -> None:
    upgrading = cluster_auth(allow_unsigned=True)
    assert upgrading.check(SUBJECT, BODY, None) is None
    unsigned = ClusterAuth([], allow_unsigned=True).seal(SUBJECT, BODY)
    assert upgrading.check(SUBJECT, BODY, unsigned) is None
    assert upgrading.check(SUBJECT, BODY, cluster_auth().seal(SUBJECT, BODY)) is None
    foreign = cluster_auth(generate_key()).seal(SUBJECT, BODY)
    assert upgrading.check(SUBJECT, BODY, foreign) is not None
    # With no key at all, a sealed message cannot be checked: it is taken (the first step
    # of a rolling upgrade), but its times still count.
    keyless = ClusterAuth([], allow_unsigned=True)
    assert keyless.check(SUBJECT, BODY, cluster_auth().seal(SUBJECT, BODY)) is None
    clock = Clock()
    stale = ClusterAuth([], allow_unsigned=True, now=clock).seal(SUBJECT, BODY, within=1.0)
    clock.now += 2
    assert ClusterAuth([], allow_unsigned=True, now=clock).check(SUBJECT, BODY, stale)


def test_no_key_is_refused_unless_unsigned_is_allowed() -> None:
    with pytest.raises(ClusterKeyError, match="CONVEYOR_ALLOW_UNSIGNED"):
        ClusterAuth([])
    with pytest.raises(ClusterKeyError, match="at least 32"):
        ClusterAuth([b"short"])


def test_keys_decode_from_base64_of_32_bytes_or_more() -> None:
    raw = bytes(range(40))
    assert parse_keys([base64.b64encode(raw).decode()]) == [raw]
    assert parse_keys([base64.urlsafe_b64encode(raw).decode().rstrip("=")]) == [raw]
    with pytest.raises(ClusterKeyError, match="key 2 is not base64"):
        parse_keys([generate_key(), "not base64!"])
    with pytest.raises(ClusterKeyError, match="key 1 is 16 bytes"):
        parse_keys([base64.b64encode(bytes(16)).decode()])


# ------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    "settings_type", [DispatcherSettings, MaintenanceSettings, WebhookSettings]
)
def test_a_service_refuses_to_start_without_a_cluster_key(
    settings_type: type[CommonSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONVEYOR_CLUSTER_KEY")
    with pytest.raises(ValidationError, match="no cluster key"):
        settings_type()
    assert settings_type(allow_unsigned=True).cluster_key == []
    # Commands that never speak NATS (conveyor migrate) need none.
    assert CommonSettings().cluster_key == []


def test_the_cluster_key_comes_from_the_environment_or_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first, second = generate_key(), generate_key()
    monkeypatch.setenv("CONVEYOR_CLUSTER_KEY", f"{first}, {second}")
    settings = DispatcherSettings()
    assert settings.cluster_key == [first, second]
    assert ClusterAuth.from_settings(settings).key_ids == cluster_auth(first, second).key_ids

    monkeypatch.delenv("CONVEYOR_CLUSTER_KEY")
    path = tmp_path / "cluster.key"
    path.write_text(f"# rotated on Monday\n{second}\n\n{first}\n")
    monkeypatch.setenv("CONVEYOR_CLUSTER_KEY_FILE", str(path))
    auth = ClusterAuth.from_settings(DispatcherSettings())
    assert auth.key_ids == cluster_auth(second, first).key_ids


def test_bad_cluster_key_settings_are_refused_with_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ValidationError, match="key 1 is 5 bytes"):
        DispatcherSettings(cluster_key=["c2hvcnQ="])
    missing = tmp_path / "missing.key"
    with pytest.raises(ValidationError, match="cannot read"):
        DispatcherSettings(cluster_key=[], cluster_key_file=str(missing))
    empty = tmp_path / "empty.key"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValidationError, match="holds no key"):
        DispatcherSettings(cluster_key=[], cluster_key_file=str(empty))
    both = tmp_path / "both.key"
    both.write_text(generate_key())
    with pytest.raises(ValidationError, match="both set"):
        DispatcherSettings(cluster_key_file=str(both))


@pytest.mark.parametrize("size", [32, 64, 100])
def test_the_mac_is_hmac_sha256(size: int) -> None:
    """Seals use HMAC-SHA256 with the key states computed once: the same MAC as the
    standard library's (its first 128 bits), keys longer than a block included."""
    import hmac

    key = bytes(range(size))
    auth = ClusterAuth([key], now=Clock())
    _, _, sent, deadline, mac = auth.seal(SUBJECT, BODY)[SEAL_HEADER].split(".")
    expected = hmac.digest(key, f"1\n{SUBJECT}\n{sent}\n{deadline}\n".encode() + BODY, "sha256")
    assert mac == expected[:16].hex()


def test_a_seal_of_any_text_is_refused_never_raises() -> None:
    # Found by the fuzz suite: a seal whose MAC held a non-ASCII character (NATS headers
    # decode as UTF-8) made hmac.compare_digest raise TypeError in every subscriber, and
    # times of thousands of digits made the refusal's message overflow a float.
    clock = Clock()
    auth = ClusterAuth(parse_keys([generate_key()]), now=clock)
    kid = auth.key_ids[0]
    huge = "9" * 4000
    mac = auth.seal(SUBJECT, BODY)[SEAL_HEADER].split(".")[-1]
    for seal, reason in [
        (f"1.{kid}.1.0.\x80", "bad-mac"),
        (f"1.{kid}.1.0.é{'a' * 31}", "bad-mac"),
        (f"1.{kid}.{huge}.0.{'a' * 32}", "malformed"),
        (f"1.{kid}.-{huge}.0.{'a' * 32}", "malformed"),
        (f"1.{kid}.1.{huge}.{'a' * 32}", "malformed"),
        (f"1.{kid}.١٢٣.0.{mac}", "malformed"),
        (f"1.{kid}. 1.0.{mac}", "malformed"),
        (f"1.{kid}.1_0.0.{mac}", "malformed"),
    ]:
        assert auth.check(SUBJECT, BODY, {SEAL_HEADER: seal}) == reason, seal
    unsigned = ClusterAuth([], allow_unsigned=True, now=clock)
    for sent in (huge, f"-{huge}"):
        assert unsigned.check(SUBJECT, BODY, {SEAL_HEADER: f"1..{sent}.0."}) == "malformed"


@given(
    seal=st.one_of(
        st.text(),
        st.lists(st.text(), min_size=5, max_size=5).map(".".join),
        st.lists(st.one_of(st.text(), st.integers().map(str)), min_size=4, max_size=4).map(
            lambda parts: ".".join(["1", *parts])
        ),
    ),
    allow_unsigned=st.booleans(),
)
def test_check_answers_any_header(seal: str, allow_unsigned: bool) -> None:
    auth = ClusterAuth(parse_keys([generate_key()]), allow_unsigned=allow_unsigned)
    for text in (seal, seal.replace(".", f".{auth.key_ids[0]}.", 1)):
        reason = auth.check(SUBJECT, BODY, {SEAL_HEADER: text})
        assert reason is None or isinstance(reason, str)
