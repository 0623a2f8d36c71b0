"""How a worker's concurrency is shared out across the queues it serves, and how a cap on
it (a circuit breaker's, say) shares out what is left."""

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


def capped_slots(
    cap: int | None,
    concurrency: int,
    weights: Mapping[str, int],
    kept: Mapping[str, int],
) -> tuple[int, dict[str, int]]:
    """The concurrency in force and the slots per queue of a worker of ``concurrency``
    whose queues have ``weights``, when it may hold at most ``cap`` tasks (None: no cap).

    ``kept`` counts, per queue, held tasks that keep their slots on top of ``cap``: each
    queue gets its kept tasks plus its share of ``cap``, never more than its uncapped
    split. A cap of 0 with nothing kept gives every queue 0 slots; a cap (plus the kept
    tasks) that reaches ``concurrency`` gives the uncapped split.
    """
    if cap is not None and cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    full = split_capacity(concurrency, weights)
    n_kept = sum(kept.values())
    if cap is None or min(cap + n_kept, concurrency) == concurrency:
        return concurrency, full
    if n_kept:
        share = split_capacity(cap, weights) if cap else {}
        slots = {q: min(full[q], kept.get(q, 0) + share.get(q, 0)) for q in full}
        return cap + n_kept, slots
    if cap == 0:
        return 0, dict.fromkeys(full, 0)
    return cap, split_capacity(cap, weights)
