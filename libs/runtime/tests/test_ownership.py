"""KeyLease and LeaseKeeper against a real nats-server: claim, refresh, loss, expiry."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import nats.js.errors
import nats.js.kv
import pytest
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_runtime.health import Health
from conveyor_runtime.nats_connect import NatsClient, close_nats, connect_nats
from conveyor_runtime.ownership import (
    HEALTH_TTLS,
    BucketError,
    KeyLease,
    LeaseKeeper,
    held_by,
    open_lease_bucket,
)
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.polling import wait_until

TIMEOUT = 10.0


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    """A connection to the session's private nats-server."""
    client = await connect_nats(nats_url, name="runtime-test")
    try:
        yield client
    finally:
        await close_nats(client)


@pytest.fixture
def subjects() -> Subjects:
    """Subjects and buckets no other test uses."""
    return Subjects(prefix=f"t{uuid.uuid4().hex[:12]}")


async def test_claim_is_exclusive_and_release_frees_the_key(
    nc: NatsClient, subjects: Subjects
) -> None:
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=30)
    first = KeyLease(kv, "emails", "node-a")
    second = KeyLease(kv, "emails", "node-b")
    assert await first.claim()
    assert first.held
    assert not await second.claim()
    assert not second.held
    assert await second.holder() == "node-a"
    # Another key is independent.
    assert await KeyLease(kv, "reports", "node-b").claim()

    await first.release()
    assert first.revision is None
    assert await first.holder() is None
    assert await second.claim()
    assert await second.holder() == "node-b"


async def test_refresh_needs_the_revision_we_wrote(nc: NatsClient, subjects: Subjects) -> None:
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=30)
    lease = KeyLease(kv, "q1", "node-a")
    assert await lease.claim()
    before = lease.revision
    assert await lease.refresh()
    assert (lease.revision or 0) > (before or 0) > 0

    # Someone overwrites the key: our compare-and-set must fail and we no longer hold it.
    await kv.put("q1", b"node-b")
    assert not await lease.refresh()
    assert not lease.held
    assert await lease.holder() == "node-b"
    # Releasing a lease we lost does not delete the other owner's key.
    await lease.release()
    assert await lease.holder() == "node-b"


async def test_an_unrefreshed_key_expires_and_can_be_claimed_by_another(
    nc: NatsClient, subjects: Subjects
) -> None:
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=1.0)
    dead = KeyLease(kv, "q", "dead-node")
    assert await dead.claim()
    taker = KeyLease(kv, "q", "live-node")
    assert not await taker.claim()

    await wait_until(taker.claim)
    assert await taker.holder() == "live-node"
    # The old owner finds out on its next refresh.
    assert not await dead.refresh()


async def test_the_keys_of_a_gone_owner_are_found_and_taken_over_once(
    nc: NatsClient, subjects: Subjects
) -> None:
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=30)
    assert await held_by(kv, "gone") == {}
    gone = {key: KeyLease(kv, key, "gone") for key in ("q1", "q2", "q3")}
    for lease in gone.values():
        assert await lease.claim()
    assert await KeyLease(kv, "q4", "alive").claim()
    released = KeyLease(kv, "q5", "gone")
    assert await released.claim()
    await released.release()
    assert await gone["q3"].refresh()  # its latest revision is the one found

    held = await held_by(kv, "gone")
    assert held == {key: lease.revision for key, lease in gone.items()}
    first = LeaseKeeper(kv, "taker-1", ttl=30, on_lost=lambda key: None)
    second = LeaseKeeper(kv, "taker-2", ttl=30, on_lost=lambda key: None)
    # Two survivors race for each key: exactly one gets it.
    assert await first.take_over("q1", held["q1"])
    assert not await second.take_over("q1", held["q1"])
    assert await first.take_over("q1", held["q1"])  # already ours
    assert await second.take_over("q2", held["q2"])
    assert first.held == {"q1"}
    assert second.held == {"q2"}
    assert await KeyLease(kv, "q1", "x").holder() == "taker-1"
    # The old owner finds out on its next refresh; one that refreshed in time keeps it.
    assert not await gone["q1"].refresh()
    assert await gone["q3"].refresh()
    assert not await first.take_over("q3", held["q3"])
    # A key that expired or was given up meanwhile is not taken over.
    assert not await first.take_over("q5", (await kv.get("q4")).revision or 0)
    assert await held_by(kv, "gone") == {"q3": gone["q3"].revision}
    await first.refresh_now()
    assert first.held == {"q1"}


async def test_keeper_refreshes_so_the_key_outlives_its_ttl(
    nc: NatsClient, subjects: Subjects
) -> None:
    ttl = 1.5
    kv = await open_lease_bucket(nc, subjects.leaders_bucket, ttl=ttl)
    lost: list[str] = []
    keeper = LeaseKeeper(kv, "node-a", ttl, lost.append)
    await keeper.start()
    try:
        assert await keeper.claim("reaper")
        assert await keeper.claim("reaper")  # claiming a held key is a no-op
        first_revision = (await kv.get("reaper")).revision or 0

        # Wait for enough refreshes to span more than one TTL (each is ttl/3 apart).
        async def refreshed_past_ttl() -> bool:
            return ((await kv.get("reaper")).revision or 0) >= first_revision + 4

        await wait_until(refreshed_past_ttl)
        assert keeper.holds("reaper")
        assert not await KeyLease(kv, "reaper", "node-b").claim()
        assert lost == []
    finally:
        await keeper.stop()
    # stop() released the key: the next claimer need not wait for the TTL.
    assert await KeyLease(kv, "reaper", "node-b").claim()


async def test_keeper_reports_a_lost_key_at_once(nc: NatsClient, subjects: Subjects) -> None:
    ttl = 1.5
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=ttl)
    lost = asyncio.Event()
    lost_keys: list[str] = []

    def on_lost(key: str) -> None:
        lost_keys.append(key)
        lost.set()

    keeper = LeaseKeeper(kv, "node-a", ttl, on_lost)
    await keeper.start()
    try:
        assert await keeper.claim("billing")
        assert await keeper.claim("emails")
        # Another node takes "billing" over (as if our key had expired in a partition).
        await kv.delete("billing")
        assert await KeyLease(kv, "billing", "node-b").claim()

        async with asyncio.timeout(TIMEOUT):
            await lost.wait()
        assert lost_keys == ["billing"]
        assert not keeper.holds("billing")
        assert keeper.holds("emails")
        assert keeper.held == frozenset({"emails"})
    finally:
        await keeper.stop()


async def test_keeper_release_gives_the_key_up_without_reporting_a_loss(
    nc: NatsClient, subjects: Subjects
) -> None:
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=30)
    lost: list[str] = []
    keeper = LeaseKeeper(kv, "node-a", 30, lost.append)
    other = LeaseKeeper(kv, "node-b", 30, lost.append)
    assert await keeper.claim("q")
    assert not await other.claim("q")
    await keeper.release("q")
    assert not keeper.holds("q")
    assert await other.claim("q")
    await keeper.refresh_now()
    await other.refresh_now()
    assert lost == []
    assert other.holds("q")
    await other.stop()


async def test_bucket_opens_again_with_another_ttl(nc: NatsClient, subjects: Subjects) -> None:
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=30)
    assert await KeyLease(kv, "q", "a").claim()
    again = await open_lease_bucket(nc, subjects.owners_bucket, ttl=60)
    assert await KeyLease(again, "q", "b").holder() == "a"


async def test_keeper_gives_keys_up_when_nats_stops_answering(nats_server: EmbeddedNats) -> None:
    nc = await connect_nats(nats_server.url, name="partitioned", reconnect_wait=0.2)
    try:
        ttl = 1.5
        kv = await open_lease_bucket(nc, "partition_owners", ttl=ttl)
        lost = asyncio.Event()
        keeper = LeaseKeeper(kv, "node-a", ttl, lambda _key: lost.set())
        await keeper.start()
        assert await keeper.claim("q")
        nats_server.kill()
        # No refresh can be confirmed, so the key could expire: it must be reported lost
        # within about one TTL, not kept forever.
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(TIMEOUT):
            await lost.wait()
        assert asyncio.get_running_loop().time() - started < 3 * ttl
        assert not keeper.holds("q")
        await keeper.stop(release=False)
    finally:
        await close_nats(nc, drain=False)


class _RacingKv:
    """A stand-in KeyValue whose create fails the ways a race with expiry makes it fail."""

    def __init__(self, *outcomes: BaseException | int) -> None:
        self.outcomes = list(outcomes)
        self.creates = 0

    async def create(self, key: str, value: bytes) -> int:
        self.creates += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _bad_request(err_code: int) -> nats.js.errors.BadRequestError:
    return nats.js.errors.BadRequestError(code=400, err_code=err_code, description="x")


async def test_claim_survives_the_key_expiring_while_the_client_checks_it() -> None:
    # Refused, then gone when the client looked why: the key is free, so claim again.
    kv = _RacingKv(nats.js.errors.KeyNotFoundError(), 7)
    lease = KeyLease(kv, "q", "me")  # type: ignore[arg-type]
    assert await lease.claim()
    assert (lease.revision, kv.creates) == (7, 2)

    # Re-created by someone else in between: not ours, and no exception.
    kv = _RacingKv(_bad_request(10071))
    lease = KeyLease(kv, "q", "me")  # type: ignore[arg-type]
    assert not await lease.claim()
    assert not lease.held

    # Any other bad request is a real error.
    kv = _RacingKv(_bad_request(10058))
    with pytest.raises(nats.js.errors.BadRequestError):
        await KeyLease(kv, "q", "me").claim()  # type: ignore[arg-type]


# ----------------------------------------------------------- nats-server restarts


async def _restarted(nc: NatsClient, server: EmbeddedNats, *, keep_store: bool) -> None:
    """Kill ``server`` and start it again on the same port, with its store or without;
    return once ``nc`` is connected again."""
    server.kill()
    if not keep_store:
        server.clear_store()
    await wait_until(lambda: not nc.is_connected, within=TIMEOUT)
    server.start()
    await wait_until(lambda: nc.is_connected, within=TIMEOUT)


@pytest.mark.parametrize("keep_store", [True, False], ids=["same-store", "empty-store"])
async def test_a_held_key_survives_a_nats_server_restart(
    nats_server: EmbeddedNats, keep_store: bool
) -> None:
    nc = await connect_nats(nats_server.url, name="restarted", reconnect_wait=0.1)
    other = None
    try:
        ttl = 30.0
        kv = await open_lease_bucket(nc, "restart_owners", ttl=ttl)
        lost: list[str] = []
        keeper = LeaseKeeper(kv, "node-a", ttl, lost.append)
        assert await keeper.claim("q")

        await _restarted(nc, nats_server, keep_store=keep_store)

        async def kept() -> bool:
            # JetStream may take a moment after the server listens: refresh until a
            # pass gets through (as the keeper's loop would).
            await keeper.refresh_now()
            return await KeyLease(kv, "q", "x").holder() == "node-a"

        await wait_until(kept, within=TIMEOUT)
        assert keeper.holds("q")
        assert lost == []
        # On disk, the bucket came back with the server; without its store, the first
        # call that missed it created it again.
        assert kv.recreated == (0 if keep_store else 1)
        # The key is really held: another process cannot claim it.
        other = await connect_nats(nats_server.url, name="other")
        again = await open_lease_bucket(other, "restart_owners", ttl=ttl)
        assert not await KeyLease(again, "q", "node-b").claim()
        # ... and new claims work as before.
        assert await keeper.claim("r")
        await keeper.stop()
        assert await KeyLease(again, "q", "node-b").claim()
    finally:
        if other is not None:
            await close_nats(other, drain=False)
        await close_nats(nc, drain=False)


async def test_a_bucket_lost_under_a_claim_is_created_again(nats_server: EmbeddedNats) -> None:
    nc = await connect_nats(nats_server.url, name="restarted", reconnect_wait=0.1)
    try:
        kv = await open_lease_bucket(nc, "restart_leaders", ttl=30)
        keeper = LeaseKeeper(kv, "node-a", 30, lambda _key: None)
        await _restarted(nc, nats_server, keep_store=False)

        async def claimed() -> bool:
            return await keeper.claim("reaper")

        await wait_until(claimed, within=TIMEOUT)
        assert kv.recreated == 1
        assert await KeyLease(kv, "reaper", "x").holder() == "node-a"
    finally:
        await close_nats(nc, drain=False)


async def test_a_refresh_whose_answer_was_lost_is_not_a_loss(
    nc: NatsClient, subjects: Subjects
) -> None:
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=30)
    lost: list[str] = []
    keeper = LeaseKeeper(kv, "node-a", 30, lost.append)
    assert await keeper.claim("q")
    # A write of ours the keeper never heard back from (it landed after a timeout): the
    # key has moved on to a revision the keeper does not know, but it is still ours.
    await kv.put("q", b"node-a")
    await keeper.refresh_now()
    assert keeper.holds("q")
    assert lost == []
    # Someone else's write is a loss, as before.
    await kv.put("q", b"node-b")
    await keeper.refresh_now()
    assert not keeper.holds("q")
    assert lost == ["q"]


class _Kv:
    """An in-memory stand-in for a lease bucket whose answers can be lost: the write
    lands, and the caller gets a timeout."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[bytes, int]] = {}
        self.seq = 0
        self.lose_answers = 0
        self.gets = 0

    def _write(self, key: str, value: bytes) -> int:
        self.seq += 1
        self.keys[key] = (value, self.seq)
        if self.lose_answers:
            self.lose_answers -= 1
            raise TimeoutError("answer lost")
        return self.seq

    async def create(self, key: str, value: bytes) -> int:
        if key in self.keys:
            raise nats.js.errors.KeyWrongLastSequenceError()
        return self._write(key, value)

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        if self.keys.get(key, (b"", 0))[1] != last:
            raise nats.js.errors.KeyWrongLastSequenceError()
        return self._write(key, value)

    async def get(self, key: str) -> nats.js.kv.KeyValue.Entry:
        self.gets += 1
        if key not in self.keys:
            raise nats.js.errors.KeyNotFoundError()
        value, revision = self.keys[key]
        return nats.js.kv.KeyValue.Entry("b", key, value, revision, None, None, None)


async def test_a_claim_whose_answer_was_lost_is_taken_on_the_next_claim() -> None:
    kv = _Kv()
    keeper = LeaseKeeper(kv, "node-a", 30, lambda _key: None)  # type: ignore[arg-type]
    kv.lose_answers = 1
    # NATS did not answer, but the key was written with our name.
    assert not await keeper.claim("q")
    assert kv.keys["q"][0] == b"node-a"
    # The next claim finds it ours and takes it instead of waiting for it to expire.
    assert await keeper.claim("q")
    assert keeper.holds("q")
    assert kv.keys["q"] == (b"node-a", 2)
    # A key someone else holds costs a refused create only (no look at who holds it).
    kv.keys["r"] = (b"node-b", 10)
    gets = kv.gets
    assert not await keeper.claim("r")
    assert kv.gets == gets
    assert kv.keys["r"] == (b"node-b", 10)


async def test_a_bucket_nats_cannot_serve_makes_the_process_unhealthy(
    nats_server: EmbeddedNats,
) -> None:
    nc = await connect_nats(nats_server.url, name="no-jetstream", reconnect_wait=0.1)
    now = [0.0]
    health = Health(now=lambda: now[0])
    ttl = 2.0
    try:
        kv = await open_lease_bucket(nc, "unhealthy_leaders", ttl=ttl, health=health)
        keeper = LeaseKeeper(kv, "node-a", ttl, lambda _key: None)
        assert await keeper.claim("reaper")
        # The server comes back without JetStream: connected, but no bucket can be made.
        nats_server.kill()
        await wait_until(lambda: not nc.is_connected, within=TIMEOUT)
        nats_server.jetstream = False
        nats_server.start()
        await wait_until(lambda: nc.is_connected, within=TIMEOUT)
        assert not await keeper.claim("scheduler")
        assert health.problems() == []  # one failure is no problem yet
        now[0] += HEALTH_TTLS * ttl
        assert not await keeper.claim("scheduler")
        (problem,) = health.problems()
        assert problem.startswith("kv bucket unhealthy_leaders failing for 6s")
        # JetStream back: the bucket is made again and the problem is gone.
        nats_server.kill()
        await wait_until(lambda: not nc.is_connected, within=TIMEOUT)
        nats_server.jetstream = True
        nats_server.start()
        await wait_until(lambda: nc.is_connected, within=TIMEOUT)

        async def claimed() -> bool:
            return await keeper.claim("scheduler")

        await wait_until(claimed, within=TIMEOUT)
        assert health.problems() == []
    finally:
        await close_nats(nc, drain=False)


async def test_a_bucket_nats_cannot_make_yet_is_made_on_first_use(
    nats_server: EmbeddedNats,
) -> None:
    # A service may start before JetStream can make buckets (a cluster still electing
    # its leader): it starts all the same, and the first claim that can makes the bucket.
    nats_server.kill()
    nats_server.jetstream = False
    nats_server.start()
    nc = await connect_nats(nats_server.url, name="early", reconnect_wait=0.1)
    try:
        kv = await open_lease_bucket(nc, "early_owners", ttl=30)
        keeper = LeaseKeeper(kv, "node-a", 30, lambda _key: None)
        assert not await keeper.claim("q")
        nats_server.kill()
        await wait_until(lambda: not nc.is_connected, within=TIMEOUT)
        nats_server.jetstream = True
        nats_server.start()
        await wait_until(lambda: nc.is_connected, within=TIMEOUT)

        async def claimed() -> bool:
            return await keeper.claim("q")

        await wait_until(claimed, within=TIMEOUT)
        assert await KeyLease(kv, "q", "x").holder() == "node-a"
    finally:
        await close_nats(nc, drain=False)


async def test_a_bucket_nats_refuses_is_a_clear_error_at_start(nc: NatsClient) -> None:
    # Three replicas on a single server: a configuration error, not something to wait out.
    with pytest.raises(BucketError, match=r"replicas > 1 not supported.*CONVEYOR_NATS_REPLICAS"):
        await open_lease_bucket(nc, f"r3_{uuid.uuid4().hex[:8]}", ttl=5, replicas=3)


async def test_a_write_nobody_answered_on_a_bucket_that_exists_creates_nothing(
    nc: NatsClient, subjects: Subjects
) -> None:
    # A replicated bucket between two leaders answers a write with "no responders",
    # the same as a bucket whose stream is gone: the stream is asked before it is made.
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=30)

    async def unanswered(_kv: nats.js.kv.KeyValue) -> int:
        raise nats.js.errors.NoStreamResponseError()

    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await kv.call(unanswered)
    assert kv.recreated == 0
    assert await KeyLease(kv, "reaper", "node-a").claim()


async def test_a_write_nobody_answered_on_a_deleted_bucket_makes_it_again(
    nc: NatsClient, subjects: Subjects
) -> None:
    kv = await open_lease_bucket(nc, subjects.owners_bucket, ttl=30)
    await nc.jetstream().delete_key_value(subjects.owners_bucket)
    assert await KeyLease(kv, "reaper", "node-a").claim()
    assert kv.recreated == 1
