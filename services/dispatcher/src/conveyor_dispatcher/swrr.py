"""Smooth weighted round-robin (the nginx algorithm).

Each step, every candidate's running score grows by its weight, the highest score wins,
and the winner's score drops by the candidates' total weight. Over any window the picks
follow the weights, and they are interleaved (3:1 gives A A B A, not A A A B).
"""

from __future__ import annotations

from collections.abc import Mapping


class SmoothWeightedRoundRobin:
    """Picks among named candidates by weight; scores persist between picks.

    The candidate set may change from one pick to the next (a gateway runs out of
    credits, a new one registers): only the current candidates take part in a step, and
    a returning candidate keeps the score it had.
    """

    def __init__(self) -> None:
        self._scores: dict[str, int] = {}

    def pick(self, candidates: Mapping[str, int]) -> str:
        """One step over ``candidates`` (name -> weight, weights below 1 count as 1).

        Ties go to the candidate listed first. Raises ValueError when there is none.
        """
        if not candidates:
            raise ValueError("no candidates to pick from")
        total = 0
        best: str | None = None
        best_score = 0
        for name, raw_weight in candidates.items():
            weight = max(1, raw_weight)
            score = self._scores.get(name, 0) + weight
            self._scores[name] = score
            total += weight
            if best is None or score > best_score:
                best, best_score = name, score
        assert best is not None
        self._scores[best] -= total
        return best

    def forget(self, name: str) -> None:
        """Drop ``name``'s score (it left for good)."""
        self._scores.pop(name, None)

    def score(self, name: str) -> int:
        """``name``'s running score (0 when unknown)."""
        return self._scores.get(name, 0)
