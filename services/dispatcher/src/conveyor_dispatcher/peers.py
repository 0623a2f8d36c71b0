"""PeerWatch: which other dispatchers are alive, from their beats on NATS.

Every dispatcher publishes a ``DispatcherBeat`` every ``beat`` seconds and hears everyone
else's (its own come back too: NATS echoes them). A peer not heard from for ``silence``
seconds is dead: ``on_dead(peer)`` is called once, and the dispatcher takes its queues
over at once rather than when their ownership keys expire. A peer that stops gracefully
says so (``leaving``) and is simply forgotten: it has given its queues up already.

A dispatcher that does not hear its own beats judges nobody: its own link (or its event
loop) is what is slow, and everyone would look dead. After a gap in its own beats (of
more than two beats, or half the silence) it waits ``silence`` of hearing itself again
before it judges anyone, so a peer whose beats have not caught up yet (both of them just
reconnected to NATS after a blip, say) is not taken for dead.

The cost is bounded by the number of dispatchers: one small message per dispatcher per
``beat``, heard by every dispatcher, whatever the number of queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.tasks import cancel_and_wait
from nats.aio.subscription import Subscription

logger = logging.getLogger(__name__)


class PeerWatch:
    """Beats for ``instance`` on ``bus`` and tells of peers gone silent (``on_dead``)."""

    def __init__(
        self,
        bus: Bus,
        instance: str,
        *,
        beat: float,
        silence: float,
        on_dead: Callable[[str], None],
    ) -> None:
        if not 0 < beat < silence:
            raise ValueError("need 0 < beat < silence")
        self._bus = bus
        self.instance = instance
        self._beat = beat
        self._silence = silence
        #: A gap this long in this instance's own beats starts its silence over.
        self._gap = max(2 * beat, silence / 2)
        self._on_dead = on_dead
        #: Peer -> when its last beat arrived (loop time).
        self._peers: dict[str, float] = {}
        self._self_heard = 0.0
        #: Since when this instance hears itself without a gap.
        self._self_since = 0.0
        self._deaf = False
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        #: Peers found dead so far (for logs and tests).
        self.deaths = 0

    @property
    def peers(self) -> frozenset[str]:
        """The peers alive as far as this instance knows."""
        return frozenset(self._peers)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    async def start(self) -> None:
        """Listen, then beat every ``beat`` seconds and check the peers as often."""
        if self._task is not None:
            return
        now = self._now()
        self._self_heard = self._self_since = now
        self._sub = await self._bus.subscribe(cluster_pb2.DispatcherBeat, self._on_beat)
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"peer-watch-{self.instance}"
        )

    async def stop(self) -> None:
        """Stop beating and listening, and say goodbye (a ``leaving`` beat)."""
        await cancel_and_wait([self._task])
        self._task = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        with contextlib.suppress(Exception):
            await self._bus.publish(
                cluster_pb2.DispatcherBeat(instance=self.instance, leaving=True)
            )

    def _on_beat(self, beat: cluster_pb2.DispatcherBeat) -> None:
        now = self._now()
        if beat.instance == self.instance:
            if now - self._self_heard > self._gap:
                self._self_since = now  # heard again after a gap: start over
            self._self_heard = now
        elif beat.leaving:
            if self._peers.pop(beat.instance, None) is not None:
                logger.info("dispatcher.peer_left peer=%s", beat.instance)
        elif beat.instance:
            if beat.instance not in self._peers:
                logger.info("dispatcher.peer_seen peer=%s", beat.instance)
            self._peers[beat.instance] = now

    async def _run(self) -> None:
        beat = cluster_pb2.DispatcherBeat(instance=self.instance)
        while True:
            try:
                await self._bus.publish(beat)
            except Exception as exc:
                logger.debug("dispatcher.beat_failed error=%r", exc)
            try:
                self.check()
            except Exception:
                logger.exception("dispatcher.peer_check_failed")
            await asyncio.sleep(self._beat)

    def check(self) -> list[str]:
        """Find the peers silent for ``silence`` (each reported once, then forgotten);
        nobody while this instance does not hear itself. Returns them."""
        now = self._now()
        if now - self._self_heard >= self._silence:
            if not self._deaf:
                logger.warning(
                    "dispatcher.beats_unheard instance=%s seconds=%.1f: judging no peer",
                    self.instance,
                    now - self._self_heard,
                )
            self._deaf = True
            return []
        self._deaf = False
        dead = [
            peer
            for peer, at in self._peers.items()
            if now - max(at, self._self_since) >= self._silence
        ]
        for peer in dead:
            silent = now - self._peers.pop(peer)
            self.deaths += 1
            logger.warning("dispatcher.peer_dead peer=%s silent=%.2f", peer, silent)
            try:
                self._on_dead(peer)
            except Exception:
                logger.exception("dispatcher.on_peer_dead_failed peer=%s", peer)
        return dead
