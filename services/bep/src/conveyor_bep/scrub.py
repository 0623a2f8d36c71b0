"""Scrubbing: secrets are redacted from every event before anything is stored.

Bazel copies the client environment and every flag into the stream (``--client_env``,
``--remote_header``, URLs with credentials, tokens in query strings), so the ingest
redacts before a byte reaches a batch. Two passes:

1. **Field by field.** Every string field of the parsed message, at any depth, is run
   through :func:`scrub_text`; options whose *name* is sensitive (header flags,
   ``--client_env``/``--action_env``/``--test_env`` of a secret-looking variable, ...) have
   their value replaced whole, in the unstructured command line, ``options_parsed``, the
   structured command line's ``Option`` messages, action command lines and build metadata.
2. **Bytes.** Fields this version of the protos does not know (a newer Bazel's) survive
   parsing as unknown fields, which the first pass cannot see. The serialized message is
   therefore masked once more by :func:`mask_bytes`, which overwrites secrets with ``*``
   of the same length so that protobuf's length prefixes stay valid.

Both passes are pure functions, tested on their own and through the ingest (a stream full
of secrets leaves none in any table or segment).
"""

from __future__ import annotations

import re
from typing import Final

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

#: What a redacted value becomes in the normalized columns and the parsed message.
REDACTED: Final = "<redacted>"

#: Flags whose value is a header, whole.
HEADER_FLAGS: Final = (
    "remote_header",
    "remote_cache_header",
    "remote_exec_header",
    "remote_downloader_header",
    "bes_header",
)
#: Flags whose value is a header or credential, whole.
SECRET_FLAGS: Final = frozenset(
    (
        *HEADER_FLAGS,
        "google_credentials",
        "google_auth_scopes",
        "credential_helper",
        "tls_client_key",
        "project_id",
    )
)
# Flags whose value is an environment assignment NAME=VALUE.
_ENV_ASSIGNMENT_FLAGS: Final = (
    "client_env",
    "action_env",
    "test_env",
    "host_action_env",
    "repo_env",
)
#: Flags whose value is ``NAME=VALUE``: the value is redacted when NAME looks secret.
ENV_FLAGS: Final = frozenset((*_ENV_ASSIGNMENT_FLAGS, "build_metadata"))

# What makes a variable, metadata key or map key name secret, and a query parameter.
# Both passes are built from these, so the text and the byte patterns agree.
_SECRET_WORDS: Final = (
    r"token|secret|passw(?:or)?d|pwd|credential|api[_-]?key|apikey|auth|private[_-]?key|"
    r"access[_-]?key|session[_-]?key|cookie|signature"
)
_PARAM_WORDS: Final = r"token|secret|password|passwd|api[_-]?key|apikey|signature|sig"

_SECRET_NAME = re.compile(rf"(?i)({_SECRET_WORDS})")
# ://user:password@host  ->  ://<redacted>@host
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s:@]+:[^/\s@]*@")
# token=..., access_token=..., api_key=..., password=..., sig=... in query strings and flags
_TOKEN_PARAM = re.compile(rf"(?i)(?P<key>\b[a-z0-9_.-]*(?:{_PARAM_WORDS}))=(?P<value>[^&\s;,\"']+)")
# Authorization: Bearer xxx / Basic xxx, and a bare "Bearer xxx"
_BEARER = re.compile(r"(?i)\b(?P<kind>bearer|basic|token)\s+(?P<value>[A-Za-z0-9._~+/=-]{8,})")
# --flag=value / --flag value forms of the secret flags
_FLAG = re.compile(r"^(?P<dashes>--?)(?P<no>no)?(?P<name>[A-Za-z0-9_]+)(?:=(?P<value>.*))?$", re.S)
# Keys we issue ourselves: conveyor_<id>_<secret>
_OUR_KEY = re.compile(r"\bconveyor_[A-Za-z0-9]+_[A-Za-z0-9_-]{16,}")


def _env_value_is_secret(assignment: str) -> bool:
    name, _, _ = assignment.partition("=")
    return bool(_SECRET_NAME.search(name))


def scrub_text(text: str) -> str:
    """``text`` with credentials in URLs, ``token=``-style parameters, bearer tokens and
    our own API keys replaced by :data:`REDACTED`."""
    if not text:
        return text
    out = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)
    out = _TOKEN_PARAM.sub(lambda m: f"{m['key']}={REDACTED}", out)
    out = _BEARER.sub(lambda m: f"{m['kind']} {REDACTED}", out)
    return _OUR_KEY.sub(REDACTED, out)


def scrub_option(name: str, value: str) -> str:
    """The value to store for option ``name`` (no dashes) set to ``value``."""
    if name in SECRET_FLAGS:
        return REDACTED if value else value
    if name in ENV_FLAGS and _env_value_is_secret(value):
        key, sep, _ = value.partition("=")
        return f"{key}{sep}{REDACTED}" if sep else value
    return scrub_text(value)


def scrub_args(args: list[str]) -> list[str]:
    """A command line (one argument per item) with secret flags redacted, both in the
    ``--flag=value`` and the ``--flag value`` forms."""
    out: list[str] = []
    pending: str | None = None
    for arg in args:
        if pending is not None:
            out.append(scrub_option(pending, arg))
            pending = None
            continue
        match = _FLAG.match(arg)
        if match is None:
            out.append(scrub_text(arg))
            continue
        name = match["name"]
        value = match["value"]
        if value is None:
            if name in SECRET_FLAGS or name in ENV_FLAGS:
                pending = name
            out.append(arg)
            continue
        out.append(f"{match['dashes']}{match['no'] or ''}{name}={scrub_option(name, value)}")
    return out


# Repeated string fields that hold a command line (one argument per item), by message.
_ARG_LISTS: Final = {
    "build_event_stream.UnstructuredCommandLine": ("args",),
    "build_event_stream.OptionsParsed": (
        "startup_options",
        "explicit_startup_options",
        "cmd_line",
        "explicit_cmd_line",
    ),
    "build_event_stream.ActionExecuted": ("command_line",),
    "command_line.ChunkList": ("chunk",),
}


def scrub_message(message: Message) -> None:
    """Redact secrets in ``message`` in place, at every depth (pass 1)."""
    name = message.DESCRIPTOR.full_name
    if name == "command_line.Option":
        _scrub_structured_option(message)
    elif name == "build_event_stream.BuildMetadata":
        _scrub_metadata(message)
    elif name == "build_event_stream.WorkspaceStatus.Item":
        _scrub_pair(message, "key", "value")
    arg_fields = _ARG_LISTS.get(name, ())
    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                if field.message_type is not None and field.message_type.GetOptions().map_entry:
                    _scrub_map(value, field)
                else:
                    for item in value:
                        scrub_message(item)
            else:
                scrub_message(value)
        elif field.type == FieldDescriptor.TYPE_STRING:
            if field.is_repeated:
                cleaned = (
                    scrub_args(list(value))
                    if field.name in arg_fields
                    else [scrub_text(v) for v in value]
                )
                if cleaned != list(value):
                    del value[:]
                    value.extend(cleaned)
            else:
                cleaned_one = scrub_text(value)
                if cleaned_one != value:
                    setattr(message, field.name, cleaned_one)


def _scrub_map(value: object, field: FieldDescriptor) -> None:
    mapping = value  # a protobuf map container
    assert field.message_type is not None  # a map field's entry type
    value_field = field.message_type.fields_by_name["value"]
    if value_field.type != FieldDescriptor.TYPE_STRING:
        if value_field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in mapping.values():  # type: ignore[attr-defined]
                scrub_message(item)
        return
    for key in list(mapping):  # type: ignore[call-overload]
        original = mapping[key]  # type: ignore[index]
        cleaned = REDACTED if _SECRET_NAME.search(str(key)) else scrub_text(original)
        if cleaned != original:
            mapping[key] = cleaned  # type: ignore[index]


def _scrub_structured_option(option: Message) -> None:
    name: str = getattr(option, "option_name", "")
    value: str = getattr(option, "option_value", "")
    cleaned = scrub_option(name, value)
    if cleaned != value:
        option.option_value = cleaned  # type: ignore[attr-defined]
        combined: str = getattr(option, "combined_form", "")
        if combined:
            prefix = combined.split("=", 1)[0] if "=" in combined else combined
            option.combined_form = f"{prefix}={cleaned}"  # type: ignore[attr-defined]


def _scrub_metadata(metadata: Message) -> None:
    entries = metadata.metadata  # type: ignore[attr-defined]
    for key in list(entries):
        if _SECRET_NAME.search(key):
            entries[key] = REDACTED


def _scrub_pair(item: Message, key_field: str, value_field: str) -> None:
    if _SECRET_NAME.search(getattr(item, key_field, "")):
        setattr(item, value_field, REDACTED)


# Pass 2: byte-level masking of what pass 1 could not see. Patterns work on bytes and
# stop at bytes that cannot be part of a printable token, so they never run across a
# protobuf tag or length prefix.
_B_VALUE = rb"[\x21-\x7e]"
_B_URL_CREDENTIALS = re.compile(
    rb"[A-Za-z][A-Za-z0-9+.-]*://([^/\s:@\x00-\x1f\x7f-\xff]+:[^/\s@\x00-\x1f\x7f-\xff]*)@"
)
_B_TOKEN_PARAM = re.compile(
    rb"(?i)[a-z0-9_.-]*(?:" + _PARAM_WORDS.encode() + rb")=([^&\s;,\"'\x00-\x1f\x7f-\xff]+)"
)
_B_BEARER = re.compile(rb"(?i)\b(?:bearer|basic)\s+([A-Za-z0-9._~+/=-]{8,})")
_B_SECRET_FLAG = re.compile(
    rb"--(?:" + "|".join(sorted(SECRET_FLAGS)).encode() + rb")=(" + _B_VALUE + rb"+)"
)
_B_ENV = re.compile(
    rb"(?i)--(?:"
    + "|".join(_ENV_ASSIGNMENT_FLAGS).encode()
    + rb")=[A-Za-z0-9_]*(?:"
    + _SECRET_WORDS.encode()
    + rb")[A-Za-z0-9_]*=("
    + _B_VALUE
    + rb"+)"
)
_B_OUR_KEY = re.compile(rb"conveyor_[A-Za-z0-9]+_([A-Za-z0-9_-]{16,})")
_B_PATTERNS: Final = (
    _B_URL_CREDENTIALS,
    _B_TOKEN_PARAM,
    _B_BEARER,
    _B_SECRET_FLAG,
    _B_ENV,
    _B_OUR_KEY,
)
_MASKED_BYTE = ord("*")
# All of them in one case-insensitive pattern (a superset): most events hold none of
# them, and one pass over the bytes tells.
_B_ANY = re.compile(
    b"|".join(b"(?:" + p.pattern.replace(b"(?i)", b"") + b")" for p in _B_PATTERNS), re.I
)


# What every secret either pass redacts must contain: a flag name, a secret-looking word,
# credentials in a URL, a token parameter, a bearer token, our key prefix. The passes'
# case-insensitive str patterns also read four non-ASCII letters as ASCII ones (U+0130 and
# U+0131 as i, U+017F as s, U+212A as k; a test checks that these are all): their UTF-8
# bytes trigger the passes too.
_FOLDS_TO_ASCII: Final = ("\u0130", "\u0131", "\u017f", "\u212a")
# The secret-looking words as literals (every spelling _SECRET_WORDS and _PARAM_WORDS
# allow; a test checks the expansion), searched in the lowered bytes: a case-sensitive
# alternation of literals is many times faster than a case-insensitive pattern.
_TRIGGER_WORDS: Final = (
    "token", "secret", "passw", "pwd", "credential", "apikey", "api_key", "api-key",
    "auth", "privatekey", "private_key", "private-key", "accesskey", "access_key",
    "access-key", "sessionkey", "session_key", "session-key", "cookie", "signature",
    "sig=", "bearer", "basic", "conveyor_",
)  # fmt: skip
_B_TRIGGER = re.compile(
    b"|".join(
        re.escape(word.encode())
        for word in (*_TRIGGER_WORDS, *sorted(SECRET_FLAGS | ENV_FLAGS), *_FOLDS_TO_ASCII)
    )
)
_B_URL_AT = re.compile(rb"://[^/@\s]*@")


def may_hold_secret(data: bytes) -> bool:
    """False when neither pass could redact anything in ``data`` (a serialized message):
    it holds none of what they look for. Most build events do not, and then skip both."""
    if _B_TRIGGER.search(data.lower()) is not None:
        return True
    return b"@" in data and _B_URL_AT.search(data) is not None


def mask_bytes(data: bytes) -> bytes:
    """``data`` with every secret-looking value overwritten by ``*`` of the same length
    (pass 2). The length is unchanged, so a serialized protobuf stays parseable."""
    if _B_ANY.search(data) is None:
        return data
    spans: list[tuple[int, int]] = []
    for pattern in _B_PATTERNS:
        for match in pattern.finditer(data):
            start, end = match.span(1)
            if end > start and data[start:end].strip(b"*") and data[start:end] != b"<redacted>":
                spans.append((start, end))
    if not spans:
        return data
    out = bytearray(data)
    for start, end in spans:
        out[start:end] = bytes([_MASKED_BYTE]) * (end - start)
    return bytes(out)
