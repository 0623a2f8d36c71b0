"""Per-queue credit accounting: which gateways serve a queue and how many tasks each can take.

Credits are a gateway's free slots on the queue. The gateway is the authority: a
``Register`` sets them to ``capacity - in_flight`` and a ``DispatchReply`` sets them to its
``credits``; between those, a dispatch takes one credit per task and a ``Done{n}`` gives
``n`` back. Being wrong is harmless either way: too many and the gateway refuses the
surplus (the dispatcher releases it at once), too few and the next register heals it.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor_dispatcher.swrr import SmoothWeightedRoundRobin


@dataclass(slots=True)
class GatewayCredits:
    """What the dispatcher knows about one gateway on one queue."""

    gateway: str
    capacity: int
    weight: int
    credits: int
    #: Monotonic time of the gateway's last Register.
    seen_at: float


class CreditBook:
    """The gateways registered on one queue, their credits, and the SWRR between them."""

    def __init__(self) -> None:
        self._gateways: dict[str, GatewayCredits] = {}
        self._rr = SmoothWeightedRoundRobin()

    def __len__(self) -> int:
        return len(self._gateways)

    def __contains__(self, gateway: object) -> bool:
        return gateway in self._gateways

    def get(self, gateway: str) -> GatewayCredits | None:
        """The entry of ``gateway``, if registered."""
        return self._gateways.get(gateway)

    @property
    def total(self) -> int:
        """Free slots across every gateway."""
        return sum(g.credits for g in self._gateways.values())

    def register(
        self, gateway: str, *, capacity: int, weight: int, in_flight: int, now: float
    ) -> GatewayCredits:
        """Record (or refresh) a registration: credits = capacity - in_flight (at least 0)."""
        capacity = max(0, capacity)
        entry = GatewayCredits(
            gateway=gateway,
            capacity=capacity,
            weight=max(1, weight),
            credits=min(capacity, max(0, capacity - max(0, in_flight))),
            seen_at=now,
        )
        self._gateways[gateway] = entry
        return entry

    def forget(self, gateway: str) -> bool:
        """Drop ``gateway`` (it closed or stopped answering); True when it was known."""
        self._rr.forget(gateway)
        return self._gateways.pop(gateway, None) is not None

    def refill(self, gateway: str, n: int) -> bool:
        """``n`` completions freed slots (capped at capacity); False for an unknown gateway."""
        entry = self._gateways.get(gateway)
        if entry is None:
            return False
        entry.credits = min(entry.capacity, entry.credits + max(0, n))
        return True

    def set_credits(self, gateway: str, credits: int) -> None:
        """The gateway said how many slots it has free (clamped to 0..capacity)."""
        entry = self._gateways.get(gateway)
        if entry is not None:
            entry.credits = min(entry.capacity, max(0, credits))

    def expire(self, now: float, max_age: float) -> list[str]:
        """Forget gateways not registered for ``max_age`` seconds; return their names."""
        stale = [g.gateway for g in self._gateways.values() if now - g.seen_at >= max_age]
        for gateway in stale:
            self.forget(gateway)
        return stale

    def take(self, n: int) -> dict[str, int]:
        """Hand out up to ``n`` slots by smooth weighted round-robin over the gateways that
        still have credits, taking one credit per slot. Returns gateway -> slots, in the
        order each gateway was first picked; fewer than ``n`` in total when credits run out.
        """
        shares: dict[str, int] = {}
        candidates = {g.gateway: g.weight for g in self._gateways.values() if g.credits > 0}
        for _ in range(n):
            if not candidates:
                break
            gateway = self._rr.pick(candidates)
            entry = self._gateways[gateway]
            entry.credits -= 1
            shares[gateway] = shares.get(gateway, 0) + 1
            if entry.credits <= 0:
                del candidates[gateway]
        return shares
