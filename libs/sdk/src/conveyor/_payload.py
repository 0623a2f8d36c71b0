"""Payloads, results and progress values as the bytes on the wire: the codecs that
encode them, and the rule that empty bytes mean "no value"."""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Codec(Protocol):
    """Encodes values to bytes and back.

    A codec is used for task payloads (producer side: encode, worker side: decode), handler
    results and progress values. The SDK never hands a codec ``None`` or empty bytes: empty
    bytes on the wire mean "no value" and read back as ``None``.
    """

    def encode(self, value: Any) -> bytes:
        """Serialize ``value``; raise on values the codec cannot represent."""
        ...

    def decode(self, data: bytes) -> Any:
        """Deserialize ``data`` produced by :meth:`encode`."""
        ...


#: What ``json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)``
#: uses, made once: ``dumps`` with options builds a new encoder every call, which costs more
#: than encoding a small payload (a batch of a thousand tasks encodes a thousand of them).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class JsonCodec:
    """Compact UTF-8 JSON: the default codec.

    ``encode`` raises ``TypeError`` (from :mod:`json`) for values JSON cannot hold and
    ``ValueError`` for NaN and infinities (standard JSON has none);
    ``decode`` raises ``ValueError`` for bytes that are not valid UTF-8 JSON.
    """

    __slots__ = ()

    def encode(self, value: Any) -> bytes:
        """``value`` as compact JSON (no spaces after separators, non-ASCII kept as UTF-8)."""
        # Standard JSON only: NaN and Infinity are refused (every other language's JSON
        # parser refuses them too), so the attempt fails with a clear error instead.
        if not value and type(value) is dict:
            return b"{}"  # what the encoder makes of it, for a tenth of the cost: a common payload
        return _ENCODER.encode(value).encode("utf-8")

    def decode(self, data: bytes) -> Any:
        """The JSON value held in ``data``."""
        if data == b"{}":
            return {}  # a new one each time, as json.loads makes it, for a tenth of the cost
        return json.loads(data.decode("utf-8"))

    def __repr__(self) -> str:
        return "JsonCodec()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JsonCodec)

    def __hash__(self) -> int:
        return hash(JsonCodec)


class RawCodec:
    """Bytes passthrough, for payloads that are already serialized (protobuf, msgpack...).

    ``encode`` accepts ``bytes``, ``bytearray`` or ``memoryview``; ``decode`` returns
    ``bytes``.
    """

    __slots__ = ()

    def encode(self, value: Any) -> bytes:
        """``value`` as bytes; ``TypeError`` for anything that is not bytes-like."""
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value)
        raise TypeError(f"RawCodec encodes bytes only, not {type(value).__name__}")

    def decode(self, data: bytes) -> Any:
        """``data`` unchanged."""
        return bytes(data)

    def __repr__(self) -> str:
        return "RawCodec()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RawCodec)

    def __hash__(self) -> int:
        return hash(RawCodec)


def encode_value(codec: Codec, value: Any) -> bytes:
    """``None`` as empty bytes (no value), anything else through ``codec``."""
    if value is None:
        return b""
    return codec.encode(value)


def decode_value(codec: Codec, data: bytes) -> Any:
    """Empty bytes as ``None`` (no value), anything else through ``codec``."""
    if not data:
        return None
    return codec.decode(data)
