"""Structured logging for every service: one event name per line, then ``key=value`` fields.

Code logs either ``logger.info("queue.claimed", extra={"queue": q})`` or the printf form
``logger.info("queue.claimed queue=%s", q)``; both come out as one line, in text
(``2030-01-01T00:00:00.000Z INFO conveyor_dispatcher queue.claimed queue=emails``) or as
JSON (``{"ts": ..., "level": "info", "logger": ..., "event": "queue.claimed", "queue": ...}``;
the ``key=value`` fields of a printf-style message become JSON fields too).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_FIELDS = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)

LogFormat = Literal["text", "json"]


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_FIELDS}


def _timestamp(record: logging.LogRecord) -> str:
    when = datetime.fromtimestamp(record.created, UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


#: `` key=`` boundaries in a printf-style message ("queue.claimed queue=emails n=3").
_FIELD_RE = re.compile(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_.]*)=")


def split_event(message: str) -> tuple[str, dict[str, str]]:
    """Split ``"event key=value key=value"`` into the event and its fields.

    A value runs until the next `` key=``, so values may contain spaces. A message that
    is not in this shape comes back whole, with no fields.
    """
    event, _, rest = message.partition(" ")
    matches = list(_FIELD_RE.finditer(rest))
    if not matches or matches[0].start() != 0:
        return message, {}
    fields: dict[str, str] = {}
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following is not None else len(rest)
        fields[match.group(1)] = rest[match.end() : end]
    return event, fields


#: Control characters (C0 but tab, DEL, C1). A text line shows them escaped ("\\n",
#: "\\x1b"): the text of a log line often comes from a peer (a queue name a worker sent,
#: a task id in a frame), and a raw newline would let it forge log lines, an escape
#: sequence drive the reader's terminal.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def _escape_controls(text: str) -> str:
    """``text`` with its control characters escaped (see :data:`_CONTROL_RE`)."""
    if text.isprintable():  # the common case, a C loop; tab and a few others fall through
        return text
    return _CONTROL_RE.sub(lambda found: found.group().encode("unicode_escape").decode(), text)


def _text_value(value: Any) -> str:
    text = str(value)
    # Quote values a key=value parser would otherwise split.
    if not text or any(c in text for c in ' "=\n'):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger> <event> key=value ...`` on one line (an exception's
    traceback on the lines after it); control characters in the line are escaped."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [_timestamp(record), record.levelname, record.name, record.getMessage()]
        parts.extend(f"{k}={_text_value(v)}" for k, v in _extra_fields(record).items())
        line = _escape_controls(" ".join(parts))
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, the extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        event, fields = split_event(record.getMessage())
        doc: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": event,
        }
        for key, value in [*fields.items(), *_extra_fields(record).items()]:
            doc.setdefault(key, value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(
    level: str = "info", fmt: LogFormat = "text", *, stream: TextIO | None = None
) -> None:
    """Send every log record to ``stream`` (stderr) as one structured line.

    Replaces the root logger's handlers, so calling it twice is harmless. Noisy
    third-party loggers (asyncio, nats) are held at WARNING unless ``level`` is debug.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    quiet = logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING
    for name in ("asyncio", "nats", "grpc"):
        logging.getLogger(name).setLevel(quiet)
