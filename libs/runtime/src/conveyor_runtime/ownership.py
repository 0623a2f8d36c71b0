"""Ownership through a JetStream key-value bucket whose entries expire.

A key (a queue name, or a singleton role) is owned by whoever created it last. The owner
claims it with a create (which fails while anyone holds it), keeps it with a
compare-and-set update on the revision it wrote (which fails once the key expired or
someone else took it), and gives it up with a compare-and-set delete. The bucket's TTL
(``max_age``) bounds how long a dead owner blocks everyone else.

Ownership is a hint too: two owners for a moment during a handover is harmless, because
the broker's leases prevent double delivery. What matters is that a loser notices fast,
which is what :class:`LeaseKeeper` is for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import StorageType
from nats.js.kv import KeyValue

from conveyor_runtime.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: Errors that mean "NATS did not answer", as opposed to "the key is someone else's".
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.Error,
    asyncio.TimeoutError,
    OSError,
)
#: Anything a best-effort KV operation may raise.
_KV_ERRORS: tuple[type[BaseException], ...] = (nats.js.errors.Error, *TRANSPORT_ERRORS)
_STREAM_NAME_IN_USE = 10058
_WRONG_LAST_SEQUENCE = 10071


async def open_lease_bucket(nc: NatsClient, bucket: str, ttl: float) -> KeyValue:
    """Create (or bind to) the KV bucket ``bucket`` whose entries live ``ttl`` seconds.

    The bucket keeps one revision per key in memory: ownership is rebuilt by the owners'
    refreshes if NATS restarts. When the bucket already exists with another TTL (another
    process configured differently), that bucket is used as it is, with a warning.
    """
    js = nc.jetstream(timeout=max(1.0, ttl / 3))
    try:
        return await js.create_key_value(
            bucket=bucket, ttl=ttl, history=1, storage=StorageType.MEMORY
        )
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != _STREAM_NAME_IN_USE:
            raise
        logger.warning("ownership.bucket_config_differs bucket=%s wanted_ttl=%s", bucket, ttl)
        return await js.key_value(bucket)


class KeyLease:
    """One key of a lease bucket, held (or not) by ``owner``."""

    def __init__(self, kv: KeyValue, key: str, owner: str) -> None:
        self.kv = kv
        self.key = key
        self.owner = owner
        self._revision: int | None = None

    @property
    def held(self) -> bool:
        """True after a successful claim, until a refresh fails or the key is released."""
        return self._revision is not None

    @property
    def revision(self) -> int | None:
        """The revision this owner last wrote, while held."""
        return self._revision

    async def claim(self) -> bool:
        """Take the key if nobody holds it. False when someone does.

        Raises a transport error (see TRANSPORT_ERRORS) when NATS does not answer.
        """
        for _ in range(2):
            try:
                self._revision = await self.kv.create(self.key, self.owner.encode())
            except nats.js.errors.KeyWrongLastSequenceError:
                self._revision = None
                return False
            except nats.js.errors.KeyNotFoundError:
                # The key existed when the create was refused and expired before the
                # client looked at why: it is free now, so try once more.
                self._revision = None
                continue
            except nats.js.errors.BadRequestError as exc:
                # The client re-creates a key it found deleted on that key's last
                # revision; when the key expires or is taken in between, the server
                # answers "wrong last sequence" as a plain bad request: not ours.
                if exc.err_code != _WRONG_LAST_SEQUENCE:
                    raise
                self._revision = None
                return False
            return True
        return False

    async def take_over(self, revision: int) -> bool:
        """Take the key from a holder known to be gone (it stopped beating) instead of
        waiting for the key to expire: a compare-and-set write on ``revision``, the one
        that holder wrote last. False when the key changed since (refreshed after all,
        given up, expired, or taken over by someone else first).

        Raises a transport error (see TRANSPORT_ERRORS) when NATS does not answer.
        """
        try:
            self._revision = await self.kv.update(self.key, self.owner.encode(), last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
            self._revision = None
            return False
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _WRONG_LAST_SEQUENCE:
                raise
            self._revision = None
            return False
        return True

    async def refresh(self) -> bool:
        """Rewrite the key on the revision we hold, which restarts its TTL.

        False (and no longer held) when the key expired or someone else wrote it since.
        Raises a transport error when NATS does not answer; the lease is then still held
        as far as we know.
        """
        if self._revision is None:
            return False
        try:
            self._revision = await self.kv.update(
                self.key, self.owner.encode(), last=self._revision
            )
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
            self._revision = None
            return False
        return True

    async def release(self) -> None:
        """Delete the key if it is still ours, so the next claimer need not wait for the TTL.

        Best effort: a failure is logged, and the key then simply expires.
        """
        revision, self._revision = self._revision, None
        if revision is None:
            return
        try:
            await self.kv.delete(self.key, last=revision)
        except _KV_ERRORS as exc:
            logger.info("ownership.release_failed key=%s error=%r", self.key, exc)

    async def holder(self) -> str | None:
        """Who holds the key right now (None: nobody)."""
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value.decode() if entry.value else None


#: Called with the key, at once, when a held key turns out to be lost.
LossCallback = Callable[[str], None]


class LeaseKeeper:
    """Holds many keys of one bucket for one owner, refreshing each every ``ttl / 3``.

    A key is reported lost through ``on_lost`` (and dropped) as soon as a refresh is
    refused, or when NATS has not answered for so long that the key may have expired
    before the next refresh could land.
    """

    def __init__(self, kv: KeyValue, owner: str, ttl: float, on_lost: LossCallback) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be > 0")
        self.kv = kv
        self.owner = owner
        self.ttl = ttl
        self.interval = ttl / 3
        self._on_lost = on_lost
        self._leases: dict[str, KeyLease] = {}
        # Monotonic time of each key's last confirmed write.
        self._confirmed: dict[str, float] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def held(self) -> frozenset[str]:
        """The keys held right now."""
        return frozenset(self._leases)

    def holds(self, key: str) -> bool:
        """True while ``key`` is held."""
        return key in self._leases

    async def start(self) -> None:
        """Start the refresh loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"lease-keeper-{self.owner}")

    async def stop(self, *, release: bool = True) -> None:
        """Stop refreshing; with ``release``, give every held key up at once."""
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if release:
            async with self._lock:
                leases = list(self._leases.values())
                self._leases.clear()
                self._confirmed.clear()
                await asyncio.gather(*(lease.release() for lease in leases))

    async def claim(self, key: str) -> bool:
        """Claim ``key``; True when it is (now or already) ours.

        False when someone else holds it or NATS does not answer (logged).
        """
        async with self._lock:
            if key in self._leases:
                return True
            lease = KeyLease(self.kv, key, self.owner)
            started = time.monotonic()
            try:
                claimed = await lease.claim()
            except TRANSPORT_ERRORS as exc:
                logger.warning("ownership.claim_failed key=%s error=%r", key, exc)
                return False
            if claimed:
                self._leases[key] = lease
                self._confirmed[key] = started
            return claimed

    async def take_over(self, key: str, revision: int) -> bool:
        """Take ``key`` from a holder known to be gone, whose last write was ``revision``
        (see :meth:`KeyLease.take_over`); True when it is (now or already) ours.

        False when the key changed since or NATS does not answer (logged).
        """
        async with self._lock:
            if key in self._leases:
                return True
            lease = KeyLease(self.kv, key, self.owner)
            started = time.monotonic()
            try:
                taken = await lease.take_over(revision)
            except TRANSPORT_ERRORS as exc:
                logger.warning("ownership.take_over_failed key=%s error=%r", key, exc)
                return False
            if taken:
                self._leases[key] = lease
                self._confirmed[key] = started
            return taken

    async def release(self, key: str) -> None:
        """Give ``key`` up (no loss is reported for it)."""
        # Forget it before waiting for the lock, so that a claim made meanwhile creates the
        # key anew instead of trusting a lease that is about to be deleted.
        lease = self._leases.pop(key, None)
        self._confirmed.pop(key, None)
        if lease is not None:
            async with self._lock:
                await lease.release()

    async def refresh_now(self) -> None:
        """Refresh every held key once (the loop does this every ``ttl / 3``)."""
        async with self._lock:
            leases = list(self._leases.values())
            results = await asyncio.gather(
                *(self._refresh(lease) for lease in leases), return_exceptions=True
            )
            lost = [
                lease
                for lease, ok in zip(leases, results, strict=True)
                if ok is not True and self._given_up(lease.key, ok)
            ]
            self._drop(lost)

    async def _refresh(self, lease: KeyLease) -> bool:
        started = time.monotonic()
        ok = await lease.refresh()
        if ok:
            self._confirmed[lease.key] = started
        return ok

    def _given_up(self, key: str, outcome: object) -> bool:
        if outcome is False:
            return True
        if isinstance(outcome, BaseException) and not isinstance(outcome, TRANSPORT_ERRORS):
            logger.error("ownership.refresh_error key=%s error=%r", key, outcome)
            return True
        # NATS did not answer. The key may still be ours; give it up only when it could
        # expire before the next refresh gets a chance.
        age = time.monotonic() - self._confirmed.get(key, 0.0)
        logger.warning("ownership.refresh_unanswered key=%s age=%.2f", key, age)
        return age + self.interval >= self.ttl

    def _drop(self, leases: Iterable[KeyLease]) -> None:
        for lease in leases:
            key = lease.key
            if self._leases.get(key) is not lease:
                continue  # released (or released and claimed again) during the refresh
            del self._leases[key]
            self._confirmed.pop(key, None)
            logger.warning("ownership.lost key=%s owner=%s", key, self.owner)
            try:
                self._on_lost(key)
            except Exception:
                logger.exception("ownership.on_lost_failed key=%s", key)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh_now()
            except Exception:
                logger.exception("ownership.refresh_pass_failed")


async def held_by(kv: KeyValue, owner: str, *, gap: float = 5.0) -> dict[str, int]:
    """The keys of ``kv`` that ``owner`` holds now, with the revision of each: one pass
    over the bucket's current entries (a watch of their last values, stopped at the end).
    For taking over from an owner that is gone. Raises a transport error (TimeoutError
    when no entry comes for ``gap`` seconds) when NATS does not answer."""
    # nats-py's watcher is untyped. Its consumer goes away soon after the pass.
    watcher: Any = await kv.watchall(ignore_deletes=True, inactive_threshold=10.0)
    held: dict[str, int] = {}
    try:
        while (entry := await watcher.updates(timeout=gap)) is not None:
            if entry.value is not None and entry.value.decode(errors="replace") == owner:
                held[entry.key] = entry.revision
    finally:
        await watcher.stop()
    return held
