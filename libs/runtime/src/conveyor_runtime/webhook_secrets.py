"""Webhook secrets at rest: sealed with AES-256-GCM under a server key.

A registration's signing secrets must be usable by the server (it signs every delivery
and verifies every lease token with them), so they cannot be hashed; instead the api seals
each one before the broker stores it, and the api and the webhook service open them when
they need them. Whoever reads the database (a backup, a replica, a leaked dump) sees
only sealed values.

A sealed value is text, so it fits the broker's secrets column as it is (no migration)::

    enc:v1:<key id>:<base64url(nonce || ciphertext+tag)>

with a fresh 96-bit nonce per value and the associated data ``conveyor webhook secret
v1``, the key id and the registration's name: a value copied to another registration, or
relabeled with another key id, does not open.

Keys come from ``CONVEYOR_WEBHOOK_SECRET_KEY`` (or ``CONVEYOR_WEBHOOK_SECRET_KEY_FILE``):
``<id>:<base64 of 32 random bytes>``, comma- (or line-) separated, **newest first**. The
first key seals; every listed key opens. Rotating: put the new key first and keep the old
one listed; the webhook leader re-seals every stored secret under the new key (see
:mod:`conveyor_webhook.manager`); then drop the old key. A value that names a key no
longer listed, or that does not open with its key (a wrong key, a tampered value), is a
:class:`SecretKeyError` naming the key id, never garbage.

Values stored before encryption existed (plaintext, no ``enc:v1:`` prefix) still open as
themselves, and the webhook leader seals them once a key is configured.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets as random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

#: What every sealed value starts with.
SEALED_PREFIX = "enc:v1:"
KEY_SETTING = "CONVEYOR_WEBHOOK_SECRET_KEY"
KEY_BYTES = 32
NONCE_BYTES = 12
#: A key id: short, printable, no separator of the formats it appears in.
KEY_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_AAD = b"conveyor webhook secret v1"


class SecretKeyError(Exception):
    """A stored webhook secret that cannot be opened (its key is not configured, or it
    does not decrypt with it), or a secret that cannot be sealed (no key configured)."""


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def is_sealed(stored: str) -> bool:
    """True when ``stored`` is a sealed value (not a plaintext one from before)."""
    return stored.startswith(SEALED_PREFIX)


def key_id_of(stored: str) -> str | None:
    """The key id a sealed value names (None: plaintext)."""
    if not is_sealed(stored):
        return None
    return stored[len(SEALED_PREFIX) :].partition(":")[0]


def generate_key(key_id: str | None = None) -> str:
    """A new key as the setting takes it: ``<id>:<base64 of 32 random bytes>`` (the id
    defaults to ``k`` and a random suffix)."""
    kid = key_id or f"k{random.token_hex(4)}"
    return f"{kid}:{base64.b64encode(random.token_bytes(KEY_BYTES)).decode('ascii')}"


@dataclass(frozen=True, slots=True)
class SecretKeyring:
    """The server keys that seal and open webhook secrets, newest first (empty: none
    configured, and then only plaintext values open)."""

    keys: tuple[tuple[str, bytes], ...] = ()

    @classmethod
    def parse(cls, text: str) -> SecretKeyring:
        """The keys of ``text`` (``<id>:<base64>``, comma- or line-separated, newest
        first). Raises ValueError saying what is wrong, never quoting key material."""
        keys: list[tuple[str, bytes]] = []
        for position, entry in enumerate(re.split(r"[,\n]", text), start=1):
            entry = entry.strip()
            if not entry or entry.startswith("#"):
                continue
            kid, sep, encoded = entry.partition(":")
            if not sep or not KEY_ID_RE.fullmatch(kid):
                raise ValueError(
                    f"webhook secret key #{position} is not <id>:<base64 of {KEY_BYTES} bytes> "
                    "(the id: 1-32 letters, digits, '_', '-' or '.')"
                )
            try:
                key = base64.b64decode(encoded.strip(), validate=True)
            except (binascii.Error, ValueError):
                key = b""
            if len(key) != KEY_BYTES:
                raise ValueError(
                    f"webhook secret key {kid!r} is not the base64 of {KEY_BYTES} bytes "
                    "(make one with: openssl rand -base64 32)"
                )
            if any(kid == known for known, _ in keys):
                raise ValueError(f"webhook secret key id {kid!r} is listed twice")
            keys.append((kid, key))
        return cls(tuple(keys))

    @classmethod
    def load(cls, value: str | None, file: str | None) -> SecretKeyring:
        """The keyring of the settings: ``value`` (the key list) or the contents of
        ``file``; empty when neither is set. Raises ValueError when both are set or the
        file cannot be read."""
        if value and file:
            raise ValueError(f"set {KEY_SETTING} or {KEY_SETTING}_FILE, not both")
        if file:
            try:
                value = Path(file).read_text()
            except OSError as exc:
                raise ValueError(f"cannot read {KEY_SETTING}_FILE {file}: {exc.strerror}") from None
        return cls.parse(value or "")

    @property
    def primary(self) -> str | None:
        """The id of the key that seals (the first), None when no key is configured."""
        return self.keys[0][0] if self.keys else None

    def _key(self, kid: str) -> bytes | None:
        return next((key for known, key in self.keys if known == kid), None)

    @staticmethod
    def _aad(kid: str, name: str) -> bytes:
        return b"\x00".join((_AAD, kid.encode(), name.encode()))

    def seal(self, name: str, secret: str) -> str:
        """``secret`` of registration ``name``, sealed under the newest key. Raises
        SecretKeyError when no key is configured."""
        if not self.keys:
            raise SecretKeyError(
                f"no webhook secret key is configured: set {KEY_SETTING} (or "
                f"{KEY_SETTING}_FILE) to store webhook secrets encrypted"
            )
        kid, key = self.keys[0]
        nonce = os.urandom(NONCE_BYTES)
        sealed = AESGCM(key).encrypt(nonce, secret.encode(), self._aad(kid, name))
        return f"{SEALED_PREFIX}{kid}:{_b64url(nonce + sealed)}"

    def seal_all(self, name: str, secrets: Iterable[str]) -> tuple[str, ...]:
        """Every one of ``secrets`` sealed (see :meth:`seal`)."""
        return tuple(self.seal(name, secret) for secret in secrets)

    def open(self, name: str, stored: str) -> str:
        """The secret a stored value of registration ``name`` holds (a plaintext value:
        itself). Raises SecretKeyError naming the key id when it cannot be opened."""
        if not is_sealed(stored):
            return stored
        kid, _, blob = stored[len(SEALED_PREFIX) :].partition(":")
        key = self._key(kid)
        if key is None:
            configured = ", ".join(known for known, _ in self.keys) or "none"
            raise SecretKeyError(
                f"a secret of webhook worker {name!r} is encrypted with key {kid!r}, which "
                f"is not configured ({KEY_SETTING} lists: {configured})"
            )
        try:
            raw = _unb64url(blob)
            opened = AESGCM(key).decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], self._aad(kid, name))
            return opened.decode()
        except (InvalidTag, ValueError, binascii.Error):
            raise SecretKeyError(
                f"a secret of webhook worker {name!r} does not decrypt with key {kid!r}: "
                "the configured key is not the one it was sealed with, or the stored value "
                "was altered"
            ) from None

    def open_all(self, name: str, stored: Sequence[str]) -> tuple[str, ...]:
        """Every stored value of registration ``name`` opened (see :meth:`open`)."""
        return tuple(self.open(name, value) for value in stored)

    def stale(self, stored: Sequence[str]) -> bool:
        """True when some of ``stored`` should be sealed again: plaintext, or sealed with
        a key other than the newest (always False with no key configured)."""
        primary = self.primary
        return primary is not None and any(key_id_of(value) != primary for value in stored)
