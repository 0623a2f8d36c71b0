"""A holder's liveness: the beats that keep the leases of a process's gateways its own.

A *holder* is a process whose gateways hold leases (an api process). The dispatcher
names the holder of every task it leases for one of its gateways (``Register.holder``),
and :class:`HolderBeat` tells the cluster the holder lives, two ways at once: a row in the
broker (``Broker.beat_holder``) and a ``HolderBeat`` message on NATS. The reaper releases
the tasks of a holder silent both ways for a few seconds (it died, or it can reach
neither the database nor NATS), so that its workers' tasks run again within seconds
instead of at lease expiry. Either way alone keeps it alive: a database link that is cut
for a moment (its outcomes are being retried meanwhile) or a NATS outage costs it nothing.

The two beats run apart: a database call that hangs (up to the command timeout) never
holds up the NATS beats.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from conveyor_broker import Broker
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


def holder_name(instance_id: str) -> str:
    """A holder name for a process named ``instance_id``: unique to this run of it, so
    that a process restarted under the same instance id is a new holder (the tasks the
    previous run held are still found dead)."""
    return f"{instance_id}~{secrets.token_hex(4)}"


class HolderBeat:
    """Beats for ``holder`` every ``tick`` seconds: in ``broker`` and on ``bus``."""

    def __init__(self, holder: str, *, broker: Broker, bus: Bus, tick: float) -> None:
        if tick <= 0:
            raise ValueError("tick must be > 0")
        self.holder = holder
        self._broker = broker
        self._bus = bus
        self._tick = tick
        self._loop: asyncio.Task[None] | None = None
        self._stored: asyncio.Task[None] | None = None
        #: Whether the last beat of each kind failed (a change is logged, not each one).
        self._failing = {"broker": False, "nats": False}
        #: Beats stored in the broker and sent on NATS (for tests and metrics).
        self.stored = 0
        self.sent = 0

    def start(self) -> None:
        """Beat now and every tick from now on, in the background (a failure is logged,
        and the next tick tries again). Until the first beat is stored the holder is
        unknown to the broker, which is not dead: its tasks would wait for lease expiry."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop().create_task(
            self._run(), name=f"holder-beat-{self.holder}"
        )
        logger.info("holder.beating holder=%s tick=%s", self.holder, self._tick)

    async def stop(self) -> None:
        """Stop beating (the holder's row stays: the reaper forgets it once it is silent
        and holds nothing)."""
        await cancel_and_wait([self._loop, self._stored])
        self._loop = self._stored = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._stored is None or self._stored.done():
                self._stored = loop.create_task(self._store())
            await self._send()
            await asyncio.sleep(self._tick)

    async def _store(self) -> None:
        try:
            await self._broker.beat_holder(self.holder)
        except Exception as exc:
            self._failed("broker", exc)
        else:
            self.stored += 1
            self._recovered("broker")

    async def _send(self) -> None:
        try:
            await self._bus.publish(cluster_pb2.HolderBeat(holder=self.holder))
        except Exception as exc:
            self._failed("nats", exc)
        else:
            self.sent += 1
            self._recovered("nats")

    def _failed(self, way: str, exc: BaseException) -> None:
        if not self._failing[way]:
            logger.warning("holder.beat_failed holder=%s way=%s error=%r", self.holder, way, exc)
        self._failing[way] = True

    def _recovered(self, way: str) -> None:
        if self._failing[way]:
            logger.info("holder.beat_recovered holder=%s way=%s", self.holder, way)
        self._failing[way] = False
