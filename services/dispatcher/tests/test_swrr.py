"""Smooth weighted round-robin: proportions, interleaving, changing candidate sets."""

from __future__ import annotations

from collections import Counter

import pytest
from conveyor_dispatcher.swrr import SmoothWeightedRoundRobin


def test_picks_follow_the_weights_over_a_full_round() -> None:
    rr = SmoothWeightedRoundRobin()
    picks = Counter(rr.pick({"a": 5, "b": 1, "c": 1}) for _ in range(70))
    assert picks == {"a": 50, "b": 10, "c": 10}


def test_picks_are_interleaved_not_bunched() -> None:
    rr = SmoothWeightedRoundRobin()
    sequence = [rr.pick({"a": 5, "b": 1, "c": 1}) for _ in range(7)]
    # nginx's documented sequence for weights 5, 1, 1.
    assert sequence == ["a", "a", "b", "a", "c", "a", "a"]


def test_equal_weights_are_plain_round_robin() -> None:
    rr = SmoothWeightedRoundRobin()
    assert [rr.pick({"x": 1, "y": 1, "z": 1}) for _ in range(6)] == ["x", "y", "z"] * 2


def test_weights_below_one_count_as_one() -> None:
    rr = SmoothWeightedRoundRobin()
    picks = Counter(rr.pick({"a": 0, "b": -3}) for _ in range(10))
    assert picks == {"a": 5, "b": 5}


def test_a_candidate_that_sits_out_keeps_its_score() -> None:
    rr = SmoothWeightedRoundRobin()
    rr.pick({"a": 1, "b": 1})  # a wins, score a=-1, b=1
    assert rr.score("a") == -1
    assert rr.score("b") == 1
    rr.pick({"a": 1})  # b sits out
    assert rr.score("b") == 1
    # b's saved-up score makes it win the next shared step.
    assert rr.pick({"a": 1, "b": 1}) == "b"


def test_forget_drops_the_score() -> None:
    rr = SmoothWeightedRoundRobin()
    rr.pick({"a": 1, "b": 1})
    rr.forget("b")
    assert rr.score("b") == 0


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError, match="no candidates"):
        SmoothWeightedRoundRobin().pick({})
