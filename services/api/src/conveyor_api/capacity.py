"""How a worker's concurrency is shared out across the queues it serves."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction


def split_capacity(concurrency: int, weights: Mapping[str, int]) -> dict[str, int]:
    """Split ``concurrency`` slots across queues in proportion to their weights.

    Every queue gets at least one slot, so it can never be starved by a heavier
    neighbour. When ``concurrency >= len(weights)`` the slots add up to exactly
    ``concurrency``; with fewer slots than queues every queue gets one (the gateway's
    session-wide cap still keeps the worker at ``concurrency`` tasks in flight).

    Rounding uses largest remainders against the exact proportional share, ties broken
    by queue name, so the result is deterministic.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not weights:
        raise ValueError("at least one queue is needed")
    for queue, weight in weights.items():
        if weight < 1:
            raise ValueError(f"weight of queue {queue!r} must be >= 1, got {weight}")
    queues = sorted(weights)
    if concurrency <= len(queues):
        return dict.fromkeys(queues, 1)
    total_weight = sum(weights.values())
    ideal = {q: Fraction(concurrency * weights[q], total_weight) for q in queues}
    slots = {q: max(1, int(ideal[q])) for q in queues}
    # The floor may leave slots over; the floor-at-one may take too many. Both are
    # bounded by the number of queues, so these loops are short. ``max`` returns the
    # first of equal candidates, and ``queues`` is sorted: ties go to the first name.
    while sum(slots.values()) < concurrency:
        best = max(queues, key=lambda q: (ideal[q] - slots[q], weights[q]))
        slots[best] += 1
    while sum(slots.values()) > concurrency:
        candidates = [q for q in queues if slots[q] > 1]
        worst = max(candidates, key=lambda q: slots[q] - ideal[q])
        slots[worst] -= 1
    return slots
