"""Task ids a producer makes itself: ULIDs, for tasks that others name before they exist
(a pipeline enqueued in one ``enqueue_tx``), or for idempotent enqueues."""

from __future__ import annotations

import os
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# A random byte's low five bits pick a character (uniform: 32 divides 256).
_BYTE_TO_CROCKFORD = bytes(ord(_CROCKFORD[b & 31]) for b in range(256))


def new_task_id() -> str:
    """A new task id: a ULID (26 characters, the time in milliseconds then 80 random
    bits), so ids made later sort later (within a millisecond, in no particular order).

    Name it in another task's ``depends_on`` in the same ``enqueue_tx`` to enqueue a
    whole pipeline at once::

        fetch, build = new_task_id(), new_task_id()
        client.enqueue_tx([
            spec("fetch", {...}, id=fetch),
            spec("build", {...}, id=build, depends_on=[fetch]),
        ])
    """
    millis = time.time_ns() // 1_000_000
    stamp = "".join(_CROCKFORD[(millis >> shift) & 31] for shift in range(45, -5, -5))
    return stamp + os.urandom(16).translate(_BYTE_TO_CROCKFORD).decode("ascii")
