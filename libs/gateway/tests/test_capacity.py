"""How a worker's concurrency is split across its queues, and capped (pure logic)."""

from __future__ import annotations

import pytest
from conveyor_gateway.capacity import capped_slots, split_capacity
from hypothesis import given
from hypothesis import strategies as st


def test_split_capacity_follows_weights() -> None:
    assert split_capacity(10, {"a": 1, "b": 1}) == {"a": 5, "b": 5}
    assert split_capacity(10, {"a": 9, "b": 1}) == {"a": 9, "b": 1}
    assert split_capacity(4, {"a": 3, "b": 1}) == {"a": 3, "b": 1}
    assert split_capacity(7, {"only": 5}) == {"only": 7}


def test_split_capacity_gives_every_queue_a_slot() -> None:
    assert split_capacity(3, {"big": 100, "x": 1, "y": 1}) == {"big": 1, "x": 1, "y": 1}
    assert split_capacity(10, {"big": 1000, "small": 1}) == {"big": 9, "small": 1}
    # Fewer slots than queues: one each; the gateway's session cap keeps the total.
    assert split_capacity(2, {"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}


def test_split_capacity_breaks_ties_deterministically() -> None:
    assert split_capacity(3, {"b": 1, "a": 1}) == {"a": 2, "b": 1}


@pytest.mark.parametrize(
    ("concurrency", "weights"),
    [(0, {"a": 1}), (1, {}), (3, {"a": 0}), (3, {"a": -1})],
)
def test_split_capacity_rejects_bad_input(concurrency: int, weights: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=r"."):
        split_capacity(concurrency, weights)


@given(
    st.integers(min_value=1, max_value=500),
    st.dictionaries(
        st.text(alphabet="abcdefgh", min_size=1, max_size=4),
        st.integers(min_value=1, max_value=50),
        min_size=1,
        max_size=8,
    ),
)
def test_split_capacity_properties(concurrency: int, weights: dict[str, int]) -> None:
    slots = split_capacity(concurrency, weights)
    assert set(slots) == set(weights)
    assert all(n >= 1 for n in slots.values())
    if concurrency >= len(weights):
        assert sum(slots.values()) == concurrency
        total = sum(weights.values())
        ideal = {q: concurrency * w / total for q, w in weights.items()}
        if all(share >= 1 for share in ideal.values()):
            # No floor-at-one lift needed: every queue is within one slot of its share.
            assert all(abs(slots[q] - ideal[q]) < 1 for q in weights)
    else:
        assert sum(slots.values()) == len(weights)


WEIGHTS = {"a": 3, "b": 1}


def test_no_cap_or_a_cap_at_the_concurrency_is_the_full_split() -> None:
    full = split_capacity(8, WEIGHTS)
    assert capped_slots(None, 8, WEIGHTS, {}) == (8, full)
    assert capped_slots(8, 8, WEIGHTS, {}) == (8, full)
    assert capped_slots(20, 8, WEIGHTS, {}) == (8, full)
    # Kept tasks that bring the cap up to the concurrency: the full split too.
    assert capped_slots(6, 8, WEIGHTS, {"a": 2}) == (8, full)


def test_a_cap_is_split_like_a_smaller_worker() -> None:
    assert capped_slots(0, 8, WEIGHTS, {}) == (0, {"a": 0, "b": 0})
    assert capped_slots(1, 8, WEIGHTS, {}) == (1, {"a": 1, "b": 1})
    assert capped_slots(4, 8, WEIGHTS, {}) == (4, {"a": 3, "b": 1})


def test_kept_tasks_keep_their_slots_on_top_of_the_cap() -> None:
    # Nothing but the kept ones while the cap is 0.
    assert capped_slots(0, 8, WEIGHTS, {"b": 2}) == (2, {"a": 0, "b": 2})
    # Each queue gets its kept ones plus its share of the cap...
    assert capped_slots(1, 8, WEIGHTS, {"a": 2}) == (3, {"a": 3, "b": 1})
    assert capped_slots(4, 8, WEIGHTS, {"a": 2}) == (6, {"a": 5, "b": 1})
    # ...but never more than its own split (b's is 2).
    assert capped_slots(1, 8, WEIGHTS, {"b": 2}) == (3, {"a": 1, "b": 2})
    assert capped_slots(5, 8, WEIGHTS, {"b": 2}) == (7, {"a": 4, "b": 2})


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="cap must be >= 0"):
        capped_slots(-1, 8, WEIGHTS, {})
