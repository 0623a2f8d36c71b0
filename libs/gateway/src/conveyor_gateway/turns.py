"""Fair slots: whose turn it is when a worker serves more queues than it has slots.

A worker of concurrency 2 serving 10 queues gives each queue one slot (see
:func:`~conveyor_gateway.capacity.split_capacity`) and caps the whole session at 2. The
slots per queue then add up to more than the concurrency, and a slot freed on one queue
would be announced on that queue only: its dispatcher offers at once and takes the slot
back, while the others wait for the next registration and then race for it. The busiest
few queues would get nearly everything.

So a queue that wants work the gateway has no room for *waits*: its offer was refused or
accepted only in part for want of overall room, or it was served and its dispatcher said
it has more. Each slot the gateway frees goes to one waiting queue, picked by smooth
weighted round-robin on the queues' weights, and only that queue hears of it (a ``Done``).
The slot is *reserved* for that queue until its dispatcher offers, or until
``timeout`` seconds pass (its dispatcher had nothing after all, or the Done was lost);
then the queue stops waiting and the slot goes to the next waiting queue.

Every waiting queue gains its weight at each pick, the picked one loses the total, and a
waiting queue that cannot take the slot (its own slots are full) keeps what it gained, so
over time the starts follow the weights although a queue that holds a slot is skipped
(scores are capped at the total weight, so a long task does not buy a long burst later).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable, Mapping
from functools import partial
from typing import Protocol


class _Handle(Protocol):
    def cancel(self) -> None: ...


#: Schedules a call in so many seconds (``loop.call_later`` in production).
CallLater = Callable[[float, Callable[[], None]], _Handle]


class Turns:
    """The waiting queues of one gateway, their scores, and the slots reserved for them.

    ``weights`` are the queues' weights; ``on_lapse`` is called (with the queue) when a
    reservation lapses unused, after it is dropped, so the caller can pass the slot on;
    ``call_later`` schedules the lapses (the running loop's, by default).
    """

    def __init__(
        self,
        weights: Mapping[str, int],
        *,
        timeout: float,
        on_lapse: Callable[[str], None],
        call_later: CallLater | None = None,
    ) -> None:
        self._weights = {q: max(1, w) for q, w in weights.items()}
        self._timeout = timeout
        self._on_lapse = on_lapse
        self._call_later = call_later
        #: Queues waiting for a slot, oldest first.
        self.waiting: dict[str, None] = {}
        #: Slots reserved per queue and not yet taken.
        self.reserved: Counter[str] = Counter()
        #: Slots reserved across every queue.
        self.total_reserved = 0
        self._timers: dict[str, deque[_Handle]] = {}
        self._scores: Counter[str] = Counter()
        #: Turns given and turns that lapsed unused (for tests and metrics).
        self.given = 0
        self.lapsed = 0

    def wait(self, queue: str) -> None:
        """``queue`` wants a slot the gateway has no room for."""
        if queue in self._weights:
            self.waiting.setdefault(queue, None)

    def stop_waiting(self, queue: str) -> None:
        """``queue`` wants nothing more for now (its score is kept for its next wait)."""
        self.waiting.pop(queue, None)

    def take(self, queue: str, n: int) -> int:
        """``queue`` took ``n`` slots: its reservations are used first. Returns how many
        reservations that used."""
        used = min(n, self.reserved[queue])
        if used <= 0:
            return 0
        self.reserved[queue] -= used
        self.total_reserved -= used
        timers = self._timers[queue]
        for _ in range(used):
            timers.popleft().cancel()
        return used

    def give(self, room: Callable[[str], int]) -> str | None:
        """Reserve a freed slot for the next waiting queue that has ``room`` on its own
        slots beyond what is reserved for it already; returns that queue (None: nobody
        waits who could take it, the slot stays free for whoever comes first)."""
        waiting = self.waiting
        if not waiting:
            return None
        weights, scores = self._weights, self._scores
        total = 0
        best: str | None = None
        for queue in waiting:
            weight = weights[queue]
            total += weight
            scores[queue] += weight
            if room(queue) - self.reserved[queue] <= 0:
                continue
            if best is None or scores[queue] > scores[best]:
                best = queue
        for queue in waiting:
            scores[queue] = min(scores[queue], total)
        if best is None:
            return None
        scores[best] -= total
        self.reserved[best] += 1
        self.total_reserved += 1
        call_later = self._call_later or asyncio.get_running_loop().call_later
        handle = call_later(self._timeout, partial(self._lapse, best))
        self._timers.setdefault(best, deque()).append(handle)
        self.given += 1
        return best

    def _lapse(self, queue: str) -> None:
        timers = self._timers.get(queue)
        if not timers or self.reserved[queue] <= 0:
            return
        timers.popleft()
        self.reserved[queue] -= 1
        self.total_reserved -= 1
        self.lapsed += 1
        self.stop_waiting(queue)
        self._on_lapse(queue)

    def clear(self) -> None:
        """Forget every wait and reservation (the gateway closes or takes no work)."""
        for timers in self._timers.values():
            for handle in timers:
                handle.cancel()
        self._timers.clear()
        self.reserved.clear()
        self.total_reserved = 0
        self.waiting.clear()
