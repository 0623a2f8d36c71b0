"""Encryption at rest as every service configures it: CONVEYOR_ENCRYPTION_KEYS (or its
file) makes open_broker wrap the broker in an EncryptedBroker, and key material never
reaches a log, a repr or an error."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conveyor_broker.encrypted import EncryptedBroker
from conveyor_broker.keyring import BINARY_PREFIX, generate_key
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.types import NewTask
from conveyor_runtime.broker_factory import open_broker
from conveyor_runtime.service import settings_errors
from conveyor_runtime.settings import CommonSettings, DispatcherSettings
from pydantic import ValidationError

OLD = generate_key("k1")
NEW = generate_key("k2")
MATERIAL = [OLD.partition(":")[2], NEW.partition(":")[2]]


def assert_no_material(text: str) -> None:
    for material in MATERIAL:
        assert material not in text
        assert material[:16] not in text


async def test_without_keys_the_broker_is_plain() -> None:
    broker = await open_broker(CommonSettings(broker="memory"))
    try:
        assert isinstance(broker, MemoryBroker)
    finally:
        await broker.close()


async def test_keys_wrap_the_broker_and_are_never_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = CommonSettings(broker="memory", encryption_keys=f"{OLD},*{NEW}")
    with caplog.at_level(logging.DEBUG):
        broker = await open_broker(settings)
        try:
            assert isinstance(broker, EncryptedBroker)
            assert broker.keyring.primary == "k2"
            assert (await broker.info()).driver == "memory+encrypted"
            task = (await broker.enqueue(NewTask("q", "t", payload=b"secret"))).task
            raw = await broker.inner.get_task(task.id)
            assert raw.payload.startswith(BINARY_PREFIX)
            await broker.lease("q", 1, settings.lease_ttl_delta)
        finally:
            await broker.close()
    assert "broker.encrypted primary_key=k2 keys=k2,k1" in caplog.text
    assert_no_material(caplog.text)
    assert_no_material(repr(settings))
    assert_no_material(str(settings.model_dump()))
    assert_no_material(repr(broker.keyring))


async def test_keys_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# the primary first\n*{NEW}\n{OLD}\n")
    broker = await open_broker(CommonSettings(broker="memory", encryption_keys_file=str(path)))
    try:
        assert isinstance(broker, EncryptedBroker)
        assert broker.keyring.ids == ("k2", "k1")
    finally:
        await broker.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"encryption_keys": f"{OLD},{NEW}"}, "none is marked primary"),
        ({"encryption_keys": f"{OLD}x"}, "key 'k1' is not the base64 of 32 bytes"),
        ({"encryption_keys": OLD, "encryption_keys_file": "/nonexistent"}, "not both"),
        ({"encryption_keys_file": "/nonexistent/keys"}, "cannot read"),
    ],
)
def test_bad_keys_are_a_clear_settings_error_without_material(
    fields: dict[str, str], message: str
) -> None:
    with pytest.raises(ValidationError) as info:
        CommonSettings(broker="memory", **fields)  # type: ignore[arg-type]
    text = settings_errors(info.value)
    assert message in text
    assert_no_material(text)
    assert_no_material(str(info.value))


def test_a_service_with_a_bad_key_says_so_in_one_line_without_it() -> None:
    # A real process: the service's start-up prints nothing of the keys (not even of the
    # broken one, NEW cut short: its first 16 characters are checked), only which is wrong.
    bad = f"{OLD},*{NEW[:-8]}"
    env = {"CONVEYOR_ENCRYPTION_KEYS": bad, "CONVEYOR_ALLOW_UNSIGNED": "true", "PATH": ""}
    done = subprocess.run(
        [sys.executable, "-m", "conveyor_dispatcher"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "key 'k2' is not the base64 of 32 bytes" in done.stderr
    assert_no_material(done.stdout + done.stderr)


def test_every_service_takes_the_setting() -> None:
    assert "encryption_keys" in DispatcherSettings.model_fields
    assert "encryption_keys_file" in DispatcherSettings.model_fields
