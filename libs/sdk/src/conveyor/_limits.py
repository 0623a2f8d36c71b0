"""The server's input rules that the SDK checks before sending anything: names, text
fields and the worker's Hello. The server checks everything again; checking here only
makes the error come sooner, from the line that caused it. A test keeps these equal to
the server's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from conveyor._errors import InvalidArgument

#: Queue names (and webhook worker names) are single NATS subject tokens: 1-128 ASCII
#: letters, digits, '_' and '-', starting with a letter or digit. Matched whole.
QUEUE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
#: What no text field may hold: C0 and C1 control characters, DEL, lone surrogates.
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
MAX_TYPE_LEN = 256
MAX_KEY_LEN = 256

#: Hello: the most queues one worker serves, the largest weight and concurrency, and the
#: bounds of its labels, worker id and versions.
MAX_HELLO_QUEUES = 1000
MAX_QUEUE_WEIGHT = 1000
MAX_CONCURRENCY = 10_000
MAX_LABELS = 16
MAX_LABEL_KEY_LEN = 64
MAX_LABEL_VALUE_LEN = 256
MAX_WORKER_ID_LEN = 256
MAX_VERSION_LEN = 64
#: Hello: the most task types one worker takes as aggregation-group batches.
MAX_BATCH_TYPES = 100


def is_queue_name(name: object) -> bool:
    """True when ``name`` is a valid queue name (see :data:`QUEUE_RE`)."""
    return isinstance(name, str) and QUEUE_RE.fullmatch(name) is not None


def check_text(name: str, value: str) -> None:
    """Raise InvalidArgument when the text field ``name`` holds a control character."""
    if value.isprintable():  # the fast path; a few allowed characters are unprintable too
        return
    found = CONTROL_RE.search(value)
    if found is not None:
        raise InvalidArgument(
            f"{name} contains the control character {found.group()!r} at index "
            f"{found.start()}: text fields may not hold U+0000-U+001F or U+007F-U+009F"
        )


def check_labels(labels: Mapping[str, str]) -> None:
    """Raise InvalidArgument unless ``labels`` fit a Hello (see the MAX_LABEL* bounds)."""
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels, got {len(labels)}")
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgument("labels must map strings to strings")
        if not 0 < len(key) <= MAX_LABEL_KEY_LEN:
            raise InvalidArgument(f"label key {key!r} must be 1-{MAX_LABEL_KEY_LEN} characters")
        if len(value) > MAX_LABEL_VALUE_LEN:
            raise InvalidArgument(f"label {key!r} is longer than {MAX_LABEL_VALUE_LEN} characters")
        check_text("a label key", key)
        check_text(f"label {key!r}", value)
