"""The keys of the encrypted broker, and the envelope of every value it encrypts.

A :class:`Keyring` holds AES-256 keys by id, one of them the **primary**: the primary
encrypts, every key decrypts. Keys come from the setting ``CONVEYOR_ENCRYPTION_KEYS`` (or
the file ``CONVEYOR_ENCRYPTION_KEYS_FILE`` names)::

    *k2:<base64 of 32 random bytes>,k1:<base64 of 32 random bytes>

entries separated by commas or new lines (``#`` starts a comment line), the primary
marked with ``*`` (a lone key needs no mark). ``conveyor keys new`` makes a key;
``openssl rand -base64 32`` makes the base64 part. Key material is never logged, never
part of a ``repr`` and never quoted in an error.

The envelope (version 1)
------------------------

Each value is sealed on its own with AES-256-GCM, a fresh random 96-bit nonce, and the
associated data ``conveyor task v1 \\0 <field> \\0 <key id> \\0 <task id>``, where
``field`` is ``payload``, ``progress``, ``result``, ``last_error`` or ``header:<name>``.
So a sealed value opens only in its own field of its own task, under the key id it
names: one copied to another task (or another field), or relabeled with another key id,
does not open. A cron entry's task template is sealed the same way with
``cron:<entry name>`` in the place of the task id (:func:`template_subject`; a task id
never holds a colon), and each task made from it is sealed again to its own id. Binary values (payload, progress, result) are bytes::

    00 'C' 'V' 'E'   magic (4 bytes)
    01               envelope version
    n                length of the key id (1..32)
    <key id>         n ASCII bytes
    <nonce>          12 bytes
    <ciphertext>     as long as the plaintext, then the 16-byte GCM tag

Text values (header values, last error) are text::

    enc:v1:<key id>:<base64url, unpadded, of nonce || ciphertext || tag>

A value that does not start with its envelope's prefix is plaintext (stored before
encryption was turned on, or one of the broker's own fixed error texts) and reads as
itself. The key id sits in clear at a fixed place, so the database can count values per
key (``conveyor keys status``) and find the ones a rotation must rewrite without
decrypting anything.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from conveyor_broker.errors import BrokerError

#: The setting that lists the keys (and, with ``_FILE``, the file that holds them).
KEYS_SETTING = "CONVEYOR_ENCRYPTION_KEYS"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
#: A key id: short, printable, none of the separators of the formats it appears in.
KEY_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,32}")
#: What a binary envelope starts with: the magic, then the version.
BINARY_MAGIC = b"\x00CVE"
ENVELOPE_VERSION = 1
BINARY_PREFIX = BINARY_MAGIC + bytes([ENVELOPE_VERSION])
#: What a text envelope starts with.
TEXT_PREFIX = "enc:v1:"
_AAD = b"conveyor task v1"

#: The fields of a task the encrypted broker seals (header values are ``header:<name>``).
PAYLOAD = "payload"
PROGRESS = "progress"
RESULT = "result"
LAST_ERROR = "last_error"
HEADER = "header:"


def template_subject(entry: str) -> str:
    """What the template of cron entry ``entry`` is sealed to, where a task's values name
    the task id: ``cron:<entry>`` (a task id never holds a colon, so the two never
    meet)."""
    return f"cron:{entry}"


class KeyringError(ValueError):
    """The keys as configured cannot be used (malformed, duplicated, no primary...). The
    message names the key id or the entry's position, never key material."""


class DecryptionError(BrokerError):
    """A stored value that cannot be decrypted: its key is not configured, or it does
    not open with it (a wrong key under the same id, a value altered or moved)."""

    def __init__(self, message: str, *, task_id: str, field: str, key_id: str) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.field = field
        self.key_id = key_id


def describe_field(field: str) -> str:
    """A field as a sentence names it: ``payload``, ``header 'trace'``..."""
    if field.startswith(HEADER):
        return f"header {field[len(HEADER) :]!r}"
    return field.replace("_", " ")


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def generate_key(key_id: str | None = None) -> str:
    """A new key as the setting takes it: ``<id>:<base64 of 32 random bytes>`` (the id
    defaults to ``k`` and a random suffix)."""
    kid = key_id or f"k{secrets.token_hex(4)}"
    if not KEY_ID_RE.fullmatch(kid):
        raise KeyringError(f"invalid key id {kid!r}: 1-32 letters, digits, '_', '-' or '.'")
    return f"{kid}:{base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode('ascii')}"


def binary_key_id(stored: bytes) -> str | None:
    """The key id a stored binary value names (None: plaintext)."""
    if not stored.startswith(BINARY_PREFIX) or len(stored) < len(BINARY_PREFIX) + 1:
        return None
    size = stored[len(BINARY_PREFIX)]
    start = len(BINARY_PREFIX) + 1
    return stored[start : start + size].decode("ascii", errors="replace")


def text_key_id(stored: str) -> str | None:
    """The key id a stored text value names (None: plaintext)."""
    if not stored.startswith(TEXT_PREFIX):
        return None
    return stored[len(TEXT_PREFIX) :].partition(":")[0]


class Keyring:
    """AES-256-GCM keys by id; ``primary`` seals, every key opens. Immutable."""

    __slots__ = ("_aads", "_binary_heads", "_ciphers", "_primary", "_text_heads")

    def __init__(self, keys: Mapping[str, bytes], primary: str) -> None:
        if not keys:
            raise KeyringError("a keyring needs at least one key")
        for kid, key in keys.items():
            if not KEY_ID_RE.fullmatch(kid):
                raise KeyringError(f"invalid key id {kid!r}: 1-32 letters, digits, '_', '-' or '.'")
            if len(key) != KEY_BYTES:
                raise KeyringError(f"key {kid!r} is not {KEY_BYTES} bytes long")
        if primary not in keys:
            raise KeyringError(f"the primary key {primary!r} is not one of the keys")
        self._ciphers = {kid: AESGCM(key) for kid, key in keys.items()}
        self._primary = primary
        self._binary_heads = {
            kid: BINARY_PREFIX + bytes([len(kid)]) + kid.encode("ascii") for kid in keys
        }
        self._text_heads = {kid: f"{TEXT_PREFIX}{kid}:" for kid in keys}
        # The associated data of the fixed fields, but for the task id (hot path).
        self._aads = {
            (field, kid): self._aad_head(field, kid)
            for field in (PAYLOAD, PROGRESS, RESULT, LAST_ERROR)
            for kid in keys
        }

    # ------------------------------------------------------------- configuration

    @classmethod
    def parse(cls, text: str, *, source: str = KEYS_SETTING) -> Keyring:
        """The keys of ``text`` (see the module docstring). Raises KeyringError saying
        what is wrong, naming ``source`` and the key id or position, never key
        material."""
        keys: dict[str, bytes] = {}
        marked: list[str] = []
        # Comment lines go first (a comment may hold a comma), then entries by comma.
        lines = (line for line in text.splitlines() if not line.strip().startswith("#"))
        entries = [part.strip() for line in lines for part in line.split(",")]
        for position, entry in enumerate((e for e in entries if e), start=1):
            primary = entry.startswith("*")
            kid, sep, encoded = entry.removeprefix("*").partition(":")
            kid = kid.strip()
            if not sep or not KEY_ID_RE.fullmatch(kid):
                raise KeyringError(
                    f"{source}: entry #{position} is not [*]<id>:<base64 of {KEY_BYTES} "
                    "bytes> (the id: 1-32 letters, digits, '_', '-' or '.'; '*' marks the "
                    "primary key)"
                )
            try:
                key = base64.b64decode(encoded.strip(), validate=True)
            except (binascii.Error, ValueError):
                key = b""
            if len(key) != KEY_BYTES:
                raise KeyringError(
                    f"{source}: key {kid!r} is not the base64 of {KEY_BYTES} bytes (make "
                    "one with `conveyor keys new` or `openssl rand -base64 32`)"
                )
            if kid in keys:
                raise KeyringError(f"{source}: key id {kid!r} is listed twice")
            keys[kid] = key
            if primary:
                marked.append(kid)
        if not keys:
            raise KeyringError(f"{source} lists no key")
        if len(marked) > 1:
            raise KeyringError(
                f"{source}: several keys are marked primary ({', '.join(marked)}): mark one"
            )
        if not marked:
            if len(keys) > 1:
                raise KeyringError(
                    f"{source} lists {len(keys)} keys and none is marked primary: put '*' "
                    "before the id of the key that encrypts"
                )
            marked = list(keys)
        return cls(keys, marked[0])

    @classmethod
    def load(cls, value: str | None, file: str | None) -> Keyring | None:
        """The keyring of the settings: ``value`` (the key list) or the contents of
        ``file``; None when neither is set (no encryption). Raises KeyringError when both
        are set, the file cannot be read, or the keys are malformed."""
        if value and file:
            raise KeyringError(f"set {KEYS_SETTING} or {KEYS_SETTING}_FILE, not both")
        if file:
            try:
                text = Path(file).read_text()
            except OSError as exc:
                raise KeyringError(
                    f"cannot read {KEYS_SETTING}_FILE {file}: {exc.strerror}"
                ) from None
            return cls.parse(text, source=f"{KEYS_SETTING}_FILE")
        if not value:
            return None
        return cls.parse(value)

    @property
    def primary(self) -> str:
        """The id of the key that encrypts."""
        return self._primary

    @property
    def ids(self) -> tuple[str, ...]:
        """Every key id, primary first, then the others by id."""
        return (self._primary, *sorted(kid for kid in self._ciphers if kid != self._primary))

    def __repr__(self) -> str:
        return f"Keyring(primary={self._primary!r}, ids={self.ids!r})"

    # ----------------------------------------------------------------- envelope

    @staticmethod
    def _aad_head(field: str, kid: str) -> bytes:
        return b"\x00".join((_AAD, field.encode(), kid.encode(), b""))

    def _aad(self, task_id: str, field: str, kid: str) -> bytes:
        head = self._aads.get((field, kid))
        if head is None:
            head = self._aad_head(field, kid)
        return head + task_id.encode()

    def seal_bytes(self, task_id: str, field: str, plain: bytes) -> bytes:
        """``plain`` (the ``field`` of task ``task_id``) in a binary envelope under the
        primary key."""
        kid = self._primary
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._ciphers[kid].encrypt(nonce, plain, self._aad(task_id, field, kid))
        return b"".join((self._binary_heads[kid], nonce, sealed))

    def seal_text(self, task_id: str, field: str, plain: str) -> str:
        """``plain`` (the ``field`` of task ``task_id``) in a text envelope under the
        primary key."""
        kid = self._primary
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._ciphers[kid].encrypt(nonce, plain.encode(), self._aad(task_id, field, kid))
        return self._text_heads[kid] + _b64url(nonce + sealed)

    def open_bytes(self, task_id: str, field: str, stored: bytes) -> bytes:
        """The plaintext of a stored binary value (a plaintext one: itself). Raises
        DecryptionError naming the key id when it cannot be opened."""
        if not stored.startswith(BINARY_PREFIX):
            return stored
        start = len(BINARY_PREFIX) + 1
        size = stored[len(BINARY_PREFIX)] if len(stored) >= start else 0
        kid = stored[start : start + size].decode("ascii", errors="replace")
        raw = stored[start + size :]
        return self._open(task_id, field, kid, raw)

    def open_text(self, task_id: str, field: str, stored: str) -> str:
        """The plaintext of a stored text value (a plaintext one: itself). Raises
        DecryptionError naming the key id when it cannot be opened."""
        if not stored.startswith(TEXT_PREFIX):
            return stored
        kid, _, blob = stored[len(TEXT_PREFIX) :].partition(":")
        try:
            raw = _unb64url(blob)
        except (binascii.Error, ValueError):
            raw = b""
        return self._open(task_id, field, kid, raw).decode(errors="replace")

    def _open(self, task_id: str, field: str, kid: str, raw: bytes) -> bytes:
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise DecryptionError(
                f"the {describe_field(field)} of task {task_id} is encrypted with key {kid!r}, which is not "
                f"configured ({KEYS_SETTING} lists: {', '.join(self.ids)})",
                task_id=task_id,
                field=field,
                key_id=kid,
            )
        try:
            if len(raw) < NONCE_BYTES + TAG_BYTES:
                raise InvalidTag
            return cipher.decrypt(
                raw[:NONCE_BYTES], raw[NONCE_BYTES:], self._aad(task_id, field, kid)
            )
        except InvalidTag:
            raise DecryptionError(
                f"the {describe_field(field)} of task {task_id} does not decrypt with key {kid!r}: the "
                "configured key of that id is not the one it was encrypted with, or the "
                "stored value was altered or belongs to another task",
                task_id=task_id,
                field=field,
                key_id=kid,
            ) from None

    def needs_rotation_bytes(self, stored: bytes | None) -> bool:
        """True when a stored binary value is not sealed under the primary key."""
        return stored is not None and not stored.startswith(self._binary_heads[self._primary])

    def needs_rotation_text(self, stored: str | None) -> bool:
        """True when a stored text value is not sealed under the primary key."""
        return stored is not None and not stored.startswith(self._text_heads[self._primary])

    def binary_head(self, kid: str | None = None) -> bytes:
        """What every binary value sealed under ``kid`` (default: the primary) starts
        with."""
        return self._binary_heads[kid or self._primary]

    def text_head(self, kid: str | None = None) -> str:
        """What every text value sealed under ``kid`` (default: the primary) starts
        with."""
        return self._text_heads[kid or self._primary]


def keyring_from_keys(keys: Sequence[tuple[str, bytes]], primary: str | None = None) -> Keyring:
    """A keyring of ``keys`` (``(id, 32 bytes)`` pairs); the primary defaults to the
    first."""
    if not keys:
        raise KeyringError("a keyring needs at least one key")
    return Keyring(dict(keys), primary or keys[0][0])
