"""Ownership through a JetStream key-value bucket whose entries expire.

A key (a queue name, or a singleton role) is owned by whoever created it last. The owner
claims it with a create (which fails while anyone holds it), keeps it with a
compare-and-set update on the revision it wrote (which fails once the key expired or
someone else took it), and gives it up with a compare-and-set delete. The bucket's TTL
(``max_age``) bounds how long a dead owner blocks everyone else.

Ownership is a hint too: two owners for a moment during a handover is harmless, because
the broker's leases prevent double delivery. What matters is that a loser notices fast,
which is what :class:`LeaseKeeper` is for.

The bucket outlives a nats-server restart: it is kept on disk, and when it is gone anyway
(a store lost) the next call that misses it creates it again (:class:`LeaseBucket`) and
the holders take their keys back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE
from nats.js.kv import KeyValue

from conveyor_runtime.health import Health
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


#: Keep the buckets on disk (see :func:`open_lease_bucket`).
STORAGE = StorageType.FILE
#: A service is unhealthy once its bucket's calls have gone unanswered this many TTLs.
HEALTH_TTLS = 3.0
#: Least seconds between two attempts to create a missing bucket again.
RECREATE_GAP = 0.5
#: Seconds a service waits at start for NATS to create (or find) its bucket: making a
#: file-backed stream, replicated on a cluster, may take longer than a key operation.
OPEN_TIMEOUT = 5.0
#: Seconds between two log lines about failing claims of one keeper (the next line
#: counts those in between): a NATS without JetStream must not flood the logs.
FAILURE_LOG_PERIOD = 5.0
_STREAM_NOT_FOUND = 10059

T = TypeVar("T")


class BucketError(RuntimeError):
    """NATS refused to create a lease bucket (at start): a configuration problem that
    waiting will not heal."""


def bucket_missing(exc: BaseException) -> bool:
    """True when ``exc`` says the bucket's stream is not there: nats-server restarted
    without it (an empty store, or a bucket kept in memory) or someone deleted it."""
    if isinstance(exc, nats.js.errors.NoStreamResponseError | nats.js.errors.BucketNotFoundError):
        return True
    # KeyNotFoundError is a NotFoundError without the attributes of one.
    code = getattr(exc, "err_code", None)
    return isinstance(exc, nats.js.errors.NotFoundError) and code == _STREAM_NOT_FOUND


def answered(exc: BaseException) -> bool:
    """True when ``exc`` is NATS's answer about a key (taken, wrong revision, not found),
    as opposed to no answer: a timeout, a lost connection, JetStream unavailable, a
    missing bucket."""
    return (
        isinstance(exc, nats.js.errors.APIError)
        and not isinstance(exc, nats.js.errors.ServiceUnavailableError)
        and not bucket_missing(exc)
    )


class LeaseBucket:
    """A KV bucket of leases that is created again when NATS lost it.

    It offers what :class:`KeyLease` uses of a ``KeyValue`` (``create``, ``update``,
    ``delete``, ``get``, ``put``). A call that finds the bucket's stream gone creates the
    bucket again (once for all the calls that found it gone together, and at most every
    :data:`RECREATE_GAP` seconds) and is tried once more. With ``health``, the bucket
    keeps a :class:`~conveyor_runtime.health.Streak`: calls NATS did not answer for
    :data:`HEALTH_TTLS` TTLs in a row make the process unhealthy.
    """

    def __init__(
        self,
        nc: NatsClient,
        bucket: str,
        ttl: float,
        *,
        replicas: int = 1,
        health: Health | None = None,
    ) -> None:
        self.name = bucket
        self.ttl = ttl
        self.replicas = replicas
        self._js = nc.jetstream(timeout=max(1.0, ttl / 3))
        self._js_open = nc.jetstream(timeout=max(OPEN_TIMEOUT, ttl / 3))
        self._kv: KeyValue | None = None
        self._lock = asyncio.Lock()
        self._last_attempt = -math.inf
        # True from a failed attempt to create the bucket to the next that succeeds.
        self._create_failing = False
        #: How many times the bucket was found missing and created again.
        self.recreated = 0
        self.streak = (
            health.streak(f"kv bucket {bucket}", HEALTH_TTLS * ttl) if health is not None else None
        )

    async def open(self) -> None:
        """Create the bucket, or bind to it when it exists.

        When NATS does not answer (JetStream still starting, a cluster still electing
        its leader), the bucket is created by the first call that needs it, and the
        failure counts toward the health signal; an answer that refuses the bucket (a
        replica count the cluster cannot hold, say) is raised.
        """
        async with self._lock:
            try:
                self._kv = await self._create(self._js_open)
            except Exception as exc:
                self._last_attempt = time.monotonic()
                self._note(exc)
                if answered(exc):
                    why = getattr(exc, "description", None) or repr(exc)
                    raise BucketError(
                        f"cannot create the KV bucket {self.name} ({self.replicas} "
                        f"replica(s), {STORAGE.value} storage): {why} (check "
                        "CONVEYOR_NATS_REPLICAS against the NATS cluster, and the "
                        "service's NATS permissions)"
                    ) from exc
                self._create_failing = True
                logger.warning(
                    "ownership.bucket_unavailable bucket=%s error=%r: created on first use",
                    self.name,
                    exc,
                )
                return
            self._note(None)

    async def _create(self, js: JetStreamContext) -> KeyValue:
        """Create or find the bucket through ``js``; the handle for key operations, which
        always go through ``self._js`` (its timeout) and plain (not direct) gets."""
        await self._make(js)
        return KeyValue(
            name=self.name,
            stream=KV_STREAM_TEMPLATE.format(bucket=self.name),
            pre=KV_PRE_TEMPLATE.format(bucket=self.name),
            js=self._js,
            direct=False,
        )

    async def _make(self, js: JetStreamContext) -> None:
        try:
            await js.create_key_value(
                bucket=self.name,
                ttl=self.ttl,
                history=1,
                storage=STORAGE,
                replicas=self.replicas,
            )
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:
                raise
            logger.warning(
                "ownership.bucket_config_differs bucket=%s wanted_ttl=%s wanted_replicas=%s "
                "wanted_storage=%s",
                self.name,
                self.ttl,
                self.replicas,
                STORAGE.value,
            )
            await js.key_value(self.name)

    async def _recreate(self, failed: KeyValue | None, exc: BaseException) -> KeyValue:
        """The bucket after a call through ``failed`` found it missing (``exc``)."""
        async with self._lock:
            if self._kv is not None and self._kv is not failed:
                return self._kv  # another call created it again meanwhile
            if time.monotonic() - self._last_attempt < RECREATE_GAP:
                raise exc
            if isinstance(exc, nats.js.errors.NoStreamResponseError) and await self._stream_there():
                # Nobody answered a write, yet the stream is there: a replicated
                # bucket between two leaders. The caller tries again; nothing to create.
                raise exc
            if not self._create_failing:
                logger.warning("ownership.bucket_missing bucket=%s error=%r", self.name, exc)
            self._last_attempt = time.monotonic()
            try:
                self._kv = await self._create(self._js)
            except Exception as failure:
                if not self._create_failing:
                    # Logged once until it works: the health check says how long.
                    logger.warning(
                        "ownership.bucket_create_failed bucket=%s error=%r: retrying",
                        self.name,
                        failure,
                    )
                self._create_failing = True
                raise
            self._create_failing = False
            self.recreated += 1
            logger.info("ownership.bucket_recreated bucket=%s", self.name)
            return self._kv

    async def _stream_there(self) -> bool:
        """True unless NATS says the bucket's stream does not exist: a write that no one
        answered means a missing stream on a single node, but only a stream between two
        leaders in a cluster. No answer to the question counts as "there" (the caller
        tries again, and asks again)."""
        try:
            await self._js.stream_info(KV_STREAM_TEMPLATE.format(bucket=self.name))
        except Exception as exc:
            return not bucket_missing(exc)
        return True

    async def call(self, op: Callable[[KeyValue], Awaitable[T]]) -> T:
        """``op`` on the bucket, which is created again (once) when ``op`` finds it gone."""
        kv = self._kv
        try:
            if kv is None:
                kv = await self._recreate(None, nats.js.errors.BucketNotFoundError())
            try:
                result = await op(kv)
            except Exception as exc:
                if not bucket_missing(exc):
                    raise
                result = await op(await self._recreate(kv, exc))
        except Exception as exc:
            self._note(exc)
            raise
        self._note(None)
        return result

    def _note(self, exc: BaseException | None) -> None:
        if self.streak is None:
            return
        if exc is None or answered(exc):
            self.streak.succeeded()
        else:
            self.streak.failed(exc)

    async def create(self, key: str, value: bytes) -> int:
        """``KeyValue.create``: write ``key`` unless it exists; its revision."""
        return await self.call(lambda kv: kv.create(key, value))

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        """``KeyValue.update``: write ``key`` if its revision is ``last``; the new one."""
        return await self.call(lambda kv: kv.update(key, value, last=last))

    async def put(self, key: str, value: bytes) -> int:
        """``KeyValue.put``: write ``key`` whatever it holds; its revision."""
        return await self.call(lambda kv: kv.put(key, value))

    async def delete(self, key: str, last: int | None = None) -> bool:
        """``KeyValue.delete``: delete ``key`` (if its revision is ``last``, when given)."""
        return await self.call(lambda kv: kv.delete(key, last=last))

    async def get(self, key: str) -> KeyValue.Entry:
        """``KeyValue.get``: the latest entry of ``key`` (KeyNotFoundError: none)."""
        return await self.call(lambda kv: kv.get(key))


async def open_lease_bucket(
    nc: NatsClient,
    bucket: str,
    ttl: float,
    *,
    replicas: int = 1,
    health: Health | None = None,
) -> LeaseBucket:
    """Create (or bind to) the KV bucket ``bucket`` whose entries live ``ttl`` seconds.

    The bucket keeps one revision per key, on disk (file storage) in ``replicas``
    copies: a nats-server that restarts with its store keeps every lease as it was, so
    holders go on refreshing theirs and nobody waits for a claim. A bucket that is gone
    anyway (a store lost, a new cluster) is created again by the next call that misses it
    (see :class:`LeaseBucket`), and holders claim their keys again. When the bucket
    already exists with another configuration (a TTL, storage or replica count set
    differently elsewhere, or by an older release), that bucket is used as it is, with a
    warning.
    """
    leases = LeaseBucket(nc, bucket, ttl, replicas=replicas, health=health)
    await leases.open()
    return leases


class KeyLease:
    """One key of a lease bucket, held (or not) by ``owner``."""

    def __init__(self, kv: LeaseBucket, key: str, owner: str) -> None:
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

    async def adopt(self) -> bool:
        """Hold the key again after our revision of it turned out stale: take it back when
        it still holds our name (a write of ours whose answer was lost still landed), or
        claim it when it is free (it expired, or its bucket was created anew). False when
        someone else holds it.

        Raises a transport error when NATS does not answer.
        """
        self._revision = None
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            return await self.claim()
        if entry.value != self.owner.encode() or entry.revision is None:
            return False
        try:
            self._revision = await self.kv.update(
                self.key, self.owner.encode(), last=entry.revision
            )
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
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
    refused and the key turns out to be someone else's, or when NATS has not answered for
    so long that the key may have expired before the next refresh could land.

    A refused refresh is not always a loss: a refresh whose answer was lost may still
    have landed (the key then holds a newer revision of ours), and a nats-server that
    restarted without its store comes back with an empty bucket. The keeper takes such a
    key back (:meth:`KeyLease.adopt`) instead of reporting it lost. Likewise a claim that
    finds a key holding our own name (a claim, or a key dropped while NATS did not
    answer, whose write landed after all) takes it, instead of waiting for it to expire.
    """

    def __init__(self, kv: LeaseBucket, owner: str, ttl: float, on_lost: LossCallback) -> None:
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
        # Keys whose last write of ours may have landed unanswered (a claim or refresh
        # NATS did not answer): monotonic time of that write. Past a TTL it has expired.
        self._uncertain: dict[str, float] = {}
        # Claims NATS did not answer since the last line logged about them, and when.
        self._claims_failed = 0
        self._claim_failure_logged = -math.inf
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
                if not claimed and self._may_be_ours(key):
                    claimed = await lease.adopt()
            except TRANSPORT_ERRORS as exc:
                self._claim_failed(key, exc)
                self._uncertain[key] = started
                return False
            self._uncertain.pop(key, None)
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

    def _claim_failed(self, key: str, exc: BaseException) -> None:
        self._claims_failed += 1
        now = time.monotonic()
        if now - self._claim_failure_logged < FAILURE_LOG_PERIOD:
            return
        logger.warning(
            "ownership.claim_failed key=%s error=%r count=%d", key, exc, self._claims_failed
        )
        self._claims_failed = 0
        self._claim_failure_logged = now

    def _may_be_ours(self, key: str) -> bool:
        since = self._uncertain.get(key)
        return since is not None and time.monotonic() - since < self.ttl

    async def _refresh(self, lease: KeyLease) -> bool:
        started = time.monotonic()
        try:
            ok = await lease.refresh() or await self._adopt(lease)
        except TRANSPORT_ERRORS:
            self._uncertain[lease.key] = started
            raise
        self._uncertain.pop(lease.key, None)
        if ok:
            self._confirmed[lease.key] = started
        return ok

    async def _adopt(self, lease: KeyLease) -> bool:
        if not await lease.adopt():
            return False
        logger.info("ownership.kept key=%s owner=%s", lease.key, self.owner)
        return True

    def _given_up(self, key: str, outcome: object) -> bool:
        if outcome is False:
            return True
        if isinstance(outcome, BaseException) and not isinstance(outcome, TRANSPORT_ERRORS):
            logger.error("ownership.refresh_error key=%s error=%r", key, outcome)
            return True
        # NATS did not answer. The key may still be ours; give it up only when it could
        # expire before the next refresh gets a chance.
        age = time.monotonic() - self._confirmed.get(key, 0.0)
        logger.warning("ownership.refresh_unanswered key=%s age=%.2f error=%r", key, age, outcome)
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
            now = time.monotonic()
            for key, since in list(self._uncertain.items()):
                if now - since >= self.ttl:
                    del self._uncertain[key]
            try:
                await self.refresh_now()
            except Exception:
                logger.exception("ownership.refresh_pass_failed")


async def held_by(kv: LeaseBucket, owner: str, *, gap: float = 5.0) -> dict[str, int]:
    """The keys of ``kv`` that ``owner`` holds now, with the revision of each: one pass
    over the bucket's current entries (a watch of their last values, stopped at the end).
    For taking over from an owner that is gone. Raises a transport error (TimeoutError
    when no entry comes for ``gap`` seconds) when NATS does not answer. A bucket found
    missing is created again first, like any other call (see :class:`LeaseBucket`)."""
    return await kv.call(lambda bucket: _held_by(bucket, owner, gap))


async def _held_by(kv: KeyValue, owner: str, gap: float) -> dict[str, int]:
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
