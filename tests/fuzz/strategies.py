"""Hypothesis strategies for the fuzz suite: hostile bytes, hostile values, and protobuf
messages of any type built from its descriptor, then mutated on the wire.

- :func:`text`, :func:`blobs`, :func:`int32s`... hostile scalar values: control characters
  and NULs, huge strings, boundaries, out-of-range numbers, NaN;
- :func:`messages` builds any message type field by field (every field present or not,
  unknown enum values, invalid Timestamps and Durations, repeated fields past their
  limits), so a request gets past parsing and reaches the handler;
- :func:`mutated` damages a serialized message (bit flips, cuts, inserted bytes, unknown
  fields, invalid UTF-8 in a string field, a field sent with the wrong wire type), which
  reaches the parser, or the handler when the damage still parses.

Names the tests' own state lives under (queues, webhook workers) are random hex that
nothing here can produce, so fuzzed requests never touch it by chance.
"""

from __future__ import annotations

from typing import Any, TypeAlias, TypeVar, cast

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

#: A message's descriptor (protobuf's Python class, or upb's, whose types differ).
Descriptor: TypeAlias = Any

# ------------------------------------------------------------------ scalars


class Blob(bytes):
    """Bytes whose repr shows their length and start only: hypothesis prints every value a
    test drew, and a megabyte printed whole helps nobody."""

    def __repr__(self) -> str:
        head = bytes(self[:64])
        return f"Blob({len(self)} bytes: {head!r}{'...' if len(self) > 64 else ''})"


#: Text that has broken parsers, loggers and subject builders before.
NASTY_TEXT = (
    "",
    " ",
    "\x00",
    "a\x00b",
    "\n",
    "q\n",
    "\r\n",
    "\t",
    "\x1b[31mred",
    "\x7f",
    "\x85",
    "\u2028",
    "\u202e",
    "\ufeff",
    "\ufffd",
    "é",
    "日本語",
    "😀",
    ".",
    "..",
    "*",
    ">",
    "a.b",
    "a b",
    "a*",
    "-",
    "_",
    "0",
    "-1",
    "1e309",
    "NaN",
    "../../etc/passwd",
    "%s%n%x",
    "{}",
    "null",
    "' OR 1=1 --",
    "\\",
    "$KV.x",
    "_INBOX.x",
    "default",
    "conveyor",
    "whsec_",
    "whsec_AAAA",
    "v1.e30.AAAA",
    "http://127.0.0.1:1/",
    "https://example.com/hook",
    "@every 1s",
    "* * * * *",
    "UTC",
    "0.0.0",
    "1.0.0",
    "99999.0.0",
    "01HZZZZZZZZZZZZZZZZZZZZZZZ",
)
#: Lengths just past the limits a field may have (128 names, 256 types and labels, 1 KiB
#: status messages, 4 KiB errors, 64 KiB...).
LONG_LENGTHS = (129, 257, 513, 1025, 4097, 65_537)


def long_text() -> st.SearchStrategy[str]:
    """Strings of a few hundred to tens of thousands of characters."""
    return st.builds(
        lambda unit, n: (unit * n)[:n],
        st.sampled_from(["x", "a\x00", "é", "😀", "\n", "ab-"]),
        st.sampled_from(LONG_LENGTHS),
    )


_NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-"


def names() -> st.SearchStrategy[str]:
    """Plausible names (valid queue, worker and task ids) that name nothing stored."""
    return st.text(_NAME_CHARS, max_size=14).map(lambda tail: f"fz{tail}")


def text() -> st.SearchStrategy[str]:
    """Any string: arbitrary, hostile, huge, or a plausible name."""
    return st.one_of(
        st.text(st.characters(codec="utf-8"), max_size=24),
        st.sampled_from(NASTY_TEXT),
        names(),
        long_text(),
    )


def blobs() -> st.SearchStrategy[bytes]:
    """Any bytes, up to past the api's 1 MiB payload limit."""
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"", b"{}", b"null", b"\x00", b'{"a": 1}', b"\xff\xfe"]),
        st.sampled_from([4097, 1024 * 1024, 1024 * 1024 + 1]).map(lambda n: b"\x00" * n),
    )


def _ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    edges = [0, 1, 2, 3, 16, 17, 100, 101, 1000, 1001, 10_000, 10_001, high, high - 1]
    if signed:
        edges += [-1, -2, low, low + 1]
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def int32s() -> st.SearchStrategy[int]:
    """Any int32, boundaries often."""
    return _ints(32, True)


def int64s() -> st.SearchStrategy[int]:
    """Any int64, boundaries often."""
    return _ints(64, True)


def floats() -> st.SearchStrategy[float]:
    """Any double: NaN, infinities, subnormals, huge."""
    return st.one_of(
        st.sampled_from([0.0, -0.0, -1.0, 0.5, 1e308, -1e308, 1e-320]),
        st.floats(allow_nan=True, allow_infinity=True),
    )


#: Seconds of a Timestamp: 0001-01-01 and 9999-12-31 23:59:59 are the valid bounds.
TIMESTAMP_SECONDS = (
    0,
    -1,
    -62_135_596_800,
    -62_135_596_801,
    253_402_300_799,
    253_402_300_800,
    1_767_225_600,  # 2026-01-01
    4_102_444_800,  # 2100-01-01
)


def timestamp_fields() -> st.SearchStrategy[tuple[int, int]]:
    """(seconds, nanos) of a Timestamp, valid or not."""
    seconds = st.one_of(st.sampled_from(TIMESTAMP_SECONDS), int64s())
    nanos = st.one_of(st.sampled_from([0, 1, 999_999_999, 1_000_000_000, -1]), int32s())
    return st.tuples(seconds, nanos)


def duration_fields() -> st.SearchStrategy[tuple[int, int]]:
    """(seconds, nanos) of a Duration, valid or not (signs that disagree, past 10,000
    years, nanos past a second)."""
    seconds = st.one_of(
        st.sampled_from([0, 1, -1, 30, 3600, 2_592_000, 2_592_001, 315_576_000_000]),
        st.sampled_from([315_576_000_001, 10**12, 2**62]),
        int64s(),
    )
    nanos = st.one_of(st.sampled_from([0, 1, -1, 999_999_999, 1_000_000_000]), int32s())
    return st.tuples(seconds, nanos)


# ---------------------------------------------------------------- messages

_WELL_KNOWN = {"google.protobuf.Timestamp", "google.protobuf.Duration"}
#: Count of repeated elements past the usual limits (1000 tasks or ids per call).
_MANY = (1000, 1001)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return text()
    if kind == FieldDescriptor.TYPE_BYTES:
        return blobs()
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return floats()
    if kind == FieldDescriptor.TYPE_ENUM:
        # Proto3 enums are open: any int32 parses, the unknown ones included.
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-3, 40), int32s())
    if kind in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SFIXED32,
    ):
        return int32s()
    if kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _ints(32, False)
    if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _ints(64, False)
    return int64s()


#: The most bytes of copies a repeated or map field gets: past every message limit, not
#: so far past that building it costs seconds.
_COPIES_BYTES = 4 * 1024 * 1024


def _capped(n: int, item: Any) -> int:
    """``n``, or fewer when ``n`` copies of ``item`` would pass :data:`_COPIES_BYTES`."""
    size = (
        item.ByteSize()
        if isinstance(item, Message)
        else len(item)
        if isinstance(item, str | bytes)
        else 8
    )
    return max(1, min(n, _COPIES_BYTES // max(size, 1)))


def _map_value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[dict[Any, Any]]:
    entry = field.message_type
    assert entry is not None
    key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
    keys = st.one_of(names(), _scalar(key_field))
    values = _value(value_field, depth + 1)
    return st.one_of(
        st.dictionaries(keys, values, max_size=4),
        # Past a limit of 16 labels, 1000 queues...
        st.builds(
            lambda n, value: {f"fz{i}": value for i in range(_capped(n, value))},
            st.sampled_from([17, 1001]),
            values,
        ),
    )


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        assert field.message_type is not None
        return messages(field.message_type, depth + 1)
    return _scalar(field)


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return _map_value(field, depth)
    if field.is_repeated:
        one = _value(field, depth)
        return st.one_of(
            st.lists(one, max_size=4),
            st.builds(lambda n, item: [item] * _capped(n, item), st.sampled_from(_MANY), one),
        )
    return _value(field, depth)


def _build(descriptor: Descriptor, values: dict[str, Any]) -> Message:
    message = GetMessageClass(descriptor)()
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        target = getattr(message, name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            for key, item in value.items():
                if isinstance(item, Message):
                    target[key].CopyFrom(item)
                else:
                    target[key] = item
        elif field.is_repeated:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    target.add().CopyFrom(item)
            else:
                target.extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def _well_known(descriptor: Descriptor) -> st.SearchStrategy[Message]:
    cls = GetMessageClass(descriptor)
    fields = (
        timestamp_fields()
        if descriptor.full_name == "google.protobuf.Timestamp"
        else duration_fields()
    )
    return fields.map(lambda sn: cls(seconds=sn[0], nanos=sn[1]))


_CACHE: dict[tuple[str, int], st.SearchStrategy[Message]] = {}


M = TypeVar("M", bound=Message)


def messages_of(kind: type[M]) -> st.SearchStrategy[M]:
    """:func:`messages` of the message class ``kind``."""
    return cast("st.SearchStrategy[M]", messages(kind.DESCRIPTOR))


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type with every field present or not, each value
    hostile or plausible (nested messages up to a few levels deep)."""
    key = (descriptor.full_name, depth)
    if key in _CACHE:
        return _CACHE[key]
    if descriptor.full_name in _WELL_KNOWN:
        strategy = _well_known(descriptor)
    elif depth > 3:
        strategy = st.just(GetMessageClass(descriptor)())
    else:
        optional = {f.name: _field(f, depth) for f in descriptor.fields}
        strategy = st.fixed_dictionaries({}, optional=optional).map(
            lambda values: _build(descriptor, values)
        )
    _CACHE[key] = strategy
    return strategy


# ----------------------------------------------------------- wire mutations


def varint(n: int) -> bytes:
    """The protobuf varint of ``n`` (two's complement, 10 bytes, for a negative)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    """A field's key."""
    return varint((number << 3) | wire_type)


def _string_fields(descriptor: Descriptor) -> list[int]:
    return [
        f.number
        for f in descriptor.fields
        if f.type == FieldDescriptor.TYPE_STRING and not f.is_repeated
    ] or [1]


@st.composite
def _mutation(draw: st.DrawFn, descriptor: Descriptor) -> tuple[str, Any]:
    kind = draw(
        st.sampled_from(
            ["flip", "insert", "delete", "truncate", "unknown", "bad_utf8", "wrong_type", "dup"]
        )
    )
    if kind == "flip":
        return kind, (draw(st.integers(0, 1 << 20)), draw(st.integers(0, 7)))
    if kind == "insert":
        return kind, (draw(st.integers(0, 1 << 20)), draw(st.binary(min_size=1, max_size=8)))
    if kind == "delete":
        return kind, (draw(st.integers(0, 1 << 20)), draw(st.integers(1, 8)))
    if kind == "truncate":
        return kind, draw(st.integers(0, 1 << 20))
    if kind == "unknown":
        number = draw(st.sampled_from([15, 16, 99, 2047, 536_870_911]))
        wire_type = draw(st.sampled_from([0, 1, 2, 5]))
        body = {
            0: varint(draw(st.integers(0, 2**64 - 1))),
            1: draw(st.binary(min_size=8, max_size=8)),
            2: (lambda b: varint(len(b)) + b)(draw(st.binary(max_size=16))),
            5: draw(st.binary(min_size=4, max_size=4)),
        }[wire_type]
        return kind, tag(number, wire_type) + body
    if kind == "bad_utf8":
        number = draw(st.sampled_from(_string_fields(descriptor)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"a\x80b"]))
        return kind, tag(number, 2) + varint(len(bad)) + bad
    if kind == "wrong_type":
        numbers = [f.number for f in descriptor.fields] or [1]
        return kind, tag(draw(st.sampled_from(numbers)), draw(st.sampled_from([0, 1, 5]))) + (
            b"\x01" * 8
        )
    return kind, None


def _apply(data: bytes, mutations: list[tuple[str, Any]]) -> bytes:
    out = bytearray(data)
    for kind, arg in mutations:
        if kind == "flip" and out:
            pos, bit = arg
            out[pos % len(out)] ^= 1 << bit
        elif kind == "insert":
            pos, chunk = arg
            pos = pos % (len(out) + 1)
            out[pos:pos] = chunk
        elif kind == "delete" and out:
            pos, n = arg
            pos = pos % len(out)
            del out[pos : pos + n]
        elif kind == "truncate":
            del out[arg % (len(out) + 1) :]
        elif kind in ("unknown", "bad_utf8", "wrong_type"):
            out += arg
        elif kind == "dup":
            out += bytes(out)
    return bytes(out)


def serialized(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Valid encodings of hostile messages of ``descriptor``'s type."""
    return messages(descriptor).map(lambda m: m.SerializeToString())


def mutated(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Hostile messages of ``descriptor``'s type, encoded, then damaged a little (which
    may or may not still parse)."""
    return st.builds(
        _apply, serialized(descriptor), st.lists(_mutation(descriptor), min_size=1, max_size=3)
    )


#: A message size past the api's receive limit (1 MiB and 256 KiB).
PAST_LIMIT = 1024 * 1024 + 256 * 1024 + 1


def arbitrary_bytes() -> st.SearchStrategy[bytes]:
    """Any bytes at all (mostly short; now and then past a message limit)."""
    return st.one_of(
        st.binary(max_size=256),
        # Now and then (1 in 8 of these) past the api's receive limit.
        st.sampled_from([0, 1, 16, 255, 4097, 65_537, 1024 * 1024, PAST_LIMIT]).map(
            lambda n: b"\x0a" * n
        ),
    ).map(Blob)


def bodies_of(kind: type[Message]) -> st.SearchStrategy[bytes]:
    """:func:`bodies` of the message class ``kind``."""
    return bodies(kind.DESCRIPTOR)


def bodies(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """What a fuzzed request or frame of ``descriptor``'s type carries: a hostile
    message, encoded as it is or damaged."""
    return st.one_of(serialized(descriptor), mutated(descriptor)).map(Blob)
