"""Webhook secrets at rest: sealing, opening, key rotation, and clear errors."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from conveyor_runtime.settings import ApiSettings, WebhookSettings
from conveyor_runtime.webhook_secrets import (
    SecretKeyError,
    SecretKeyring,
    generate_key,
    is_sealed,
    key_id_of,
)

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
K1 = generate_key("k1")
K2 = generate_key("k2")


def test_sealed_values_open_only_under_their_name_and_never_show_the_secret() -> None:
    ring = SecretKeyring.parse(K1)
    sealed = ring.seal("billing", SECRET)
    assert sealed.startswith("enc:v1:k1:")
    assert is_sealed(sealed)
    assert key_id_of(sealed) == "k1"
    assert SECRET not in sealed
    assert SECRET.removeprefix("whsec_") not in sealed
    assert ring.seal("billing", SECRET) != sealed  # a fresh nonce each time
    assert ring.open("billing", sealed) == SECRET
    with pytest.raises(SecretKeyError, match="'other' does not decrypt with key 'k1'"):
        ring.open("other", sealed)
    tampered = sealed[:-2] + ("A" if sealed[-2] != "A" else "B") + sealed[-1]
    with pytest.raises(SecretKeyError, match="does not decrypt with key 'k1'"):
        ring.open("billing", tampered)
    # Relabeled with another configured key id: does not open either.
    both = SecretKeyring.parse(f"{K1},{K2}")
    with pytest.raises(SecretKeyError, match="key 'k2'"):
        both.open("billing", sealed.replace(":k1:", ":k2:"))


def test_a_wrong_or_missing_key_is_an_error_naming_the_key_id() -> None:
    sealed = SecretKeyring.parse(K1).seal("billing", SECRET)
    # Same id, other key material: wrong key.
    impostor = SecretKeyring.parse(generate_key("k1"))
    with pytest.raises(SecretKeyError, match="does not decrypt with key 'k1'") as wrong:
        impostor.open("billing", sealed)
    assert SECRET not in str(wrong.value)
    with pytest.raises(SecretKeyError, match=r"key 'k1', which is not configured .*lists: k2"):
        SecretKeyring.parse(K2).open("billing", sealed)
    with pytest.raises(SecretKeyError, match="lists: none"):
        SecretKeyring().open("billing", sealed)
    with pytest.raises(SecretKeyError, match="no webhook secret key is configured"):
        SecretKeyring().seal("billing", SECRET)


def test_rotation_new_key_first_seals_and_the_old_one_still_opens() -> None:
    old = SecretKeyring.parse(K1)
    sealed_old = old.seal("billing", SECRET)
    rotated = SecretKeyring.parse(f"{K2}\n{K1}")
    assert rotated.primary == "k2"
    assert rotated.open("billing", sealed_old) == SECRET
    assert rotated.seal("billing", SECRET).startswith("enc:v1:k2:")
    assert rotated.stale([sealed_old])
    assert not rotated.stale([rotated.seal("billing", SECRET)])
    assert not old.stale([sealed_old])


def test_plaintext_values_from_before_open_as_themselves_and_are_stale() -> None:
    ring = SecretKeyring.parse(K1)
    assert ring.open("billing", "legacy-secret") == "legacy-secret"
    assert ring.stale(["legacy-secret"])
    assert not SecretKeyring().stale(["legacy-secret"])  # nothing to seal with
    assert SecretKeyring().open("billing", "legacy-secret") == "legacy-secret"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("k1", "#1 is not <id>:<base64"),
        ("bad id!:" + base64.b64encode(b"x" * 32).decode(), "#1 is not <id>"),
        ("k1:" + base64.b64encode(b"x" * 16).decode(), "'k1' is not the base64 of 32 bytes"),
        ("k1:not base64!!", "'k1' is not the base64 of 32 bytes"),
        (f"{K1},{K1}", "'k1' is listed twice"),
    ],
)
def test_a_malformed_key_list_is_refused_without_quoting_key_material(
    text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        SecretKeyring.parse(text)
    material = text.partition(":")[2]
    assert len(material) < 8 or material not in str(info.value)


def test_settings_load_the_keys_from_the_variable_or_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# newest first\n{K2}\n{K1}\n")
    ring = WebhookSettings(webhook_secret_key_file=str(key_file)).secret_keyring()
    assert [kid for kid, _ in ring.keys] == ["k2", "k1"]
    assert (
        ApiSettings(host="127.0.0.1", allow_unauthenticated=True, webhook_secret_key=K1)
        .secret_keyring()
        .primary
        == "k1"
    )
    assert WebhookSettings().secret_keyring().keys == ()
    with pytest.raises(ValueError, match="not both"):
        WebhookSettings(webhook_secret_key=K1, webhook_secret_key_file=str(key_file))
    with pytest.raises(ValueError, match="cannot read CONVEYOR_WEBHOOK_SECRET_KEY_FILE"):
        WebhookSettings(webhook_secret_key_file=str(tmp_path / "missing"))
    # A bad key fails the settings, and the error shows none of what was given.
    bad = "k1:" + base64.b64encode(b"secret-material!").decode()
    with pytest.raises(ValueError, match="'k1' is not the base64 of 32 bytes") as info:
        WebhookSettings(webhook_secret_key=bad)
    assert bad.partition(":")[2] not in str(info.value)
    assert "secret-material" not in repr(WebhookSettings(webhook_secret_key=K1))
