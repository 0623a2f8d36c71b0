"""Which queues someone serves: the gateways' registrations, as a dispatcher or the reaper
hears them.

Every gateway announces its capacity on each of its queues (a ``Register``) at start and
every register tick, and says goodbye with a closing one. A queue is *served* while some
gateway's registration on it is younger than ``ttl`` (three register ticks: one or two
lost registrations do not make a queue look unserved). Work in a queue nobody serves
cannot go anywhere: its wakes need no dispatcher and no claim, and the reaper need not
wake it, however much is due. When a worker for it connects, its gateway's first
registration is what brings the queue a dispatcher.

Pure bookkeeping: "now" is passed in (the services use their event loop's monotonic
time), so the logic is tested without a clock.
"""

from __future__ import annotations

#: A registration not refreshed for this many register ticks is forgotten.
REGISTER_TICKS_TO_EXPIRE = 3


class Demand:
    """The gateways heard registering on each queue, each remembered for ``ttl`` seconds."""

    __slots__ = ("_gateways", "ttl")

    def __init__(self, ttl: float) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        self.ttl = ttl
        # queue -> gateway -> when its last registration was heard.
        self._gateways: dict[str, dict[str, float]] = {}

    def __len__(self) -> int:
        """Queues with a registration on record (expired ones until :meth:`expire`)."""
        return len(self._gateways)

    def heard(self, queue: str, gateway: str, *, closing: bool, now: float) -> None:
        """A registration of ``gateway`` on ``queue`` (a closing one: it stops serving)."""
        if closing:
            gateways = self._gateways.get(queue)
            if gateways is not None:
                gateways.pop(gateway, None)
                if not gateways:
                    del self._gateways[queue]
            return
        self._gateways.setdefault(queue, {})[gateway] = now

    def served(self, queue: str, now: float) -> bool:
        """True while some gateway's registration on ``queue`` is younger than ``ttl``."""
        gateways = self._gateways.get(queue)
        if not gateways:
            return False
        cutoff = now - self.ttl
        return any(seen > cutoff for seen in gateways.values())

    def queues(self, now: float) -> list[str]:
        """The queues served at ``now``, sorted by name."""
        cutoff = now - self.ttl
        return sorted(
            queue
            for queue, gateways in self._gateways.items()
            if any(seen > cutoff for seen in gateways.values())
        )

    def expire(self, now: float) -> None:
        """Forget registrations older than ``ttl`` (and queues left with none)."""
        cutoff = now - self.ttl
        for queue in list(self._gateways):
            gateways = self._gateways[queue]
            for gateway in [g for g, seen in gateways.items() if seen <= cutoff]:
                del gateways[gateway]
            if not gateways:
                del self._gateways[queue]
