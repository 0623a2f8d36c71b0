"""Conformance: webhook worker registrations (upsert, get, list, pause, delete)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import BrokerClosed, InvalidTask, WebhookWorkerNotFound
from conveyor_broker.interface import Broker
from conveyor_broker.types import WebhookWorker, WebhookWorkerSpec
from conveyor_broker.validation import (
    MAX_QUEUE_WEIGHT,
    MAX_STORED_SECRET_LEN,
    MAX_TYPE_LEN,
    MAX_WEBHOOK_BATCH_TYPES,
    MAX_WEBHOOK_CONCURRENCY,
    MAX_WEBHOOK_SECRETS,
    MAX_WEBHOOK_TIMEOUT,
    MAX_WEBHOOK_URL_LEN,
    unique_batch_types,
)

NAME = "billing"
URL = "https://hooks.example.com/conveyor"
#: Moves the clock by an odd number of microseconds so that stored timestamps must keep them.
STEP = timedelta(seconds=7, microseconds=123457)


def webhook_spec(name: str = NAME, **options: object) -> WebhookWorkerSpec:
    """A valid registration named ``name`` with ``options`` (url, queues and secrets
    default to something valid)."""
    options.setdefault("url", URL)
    options.setdefault("queues", {"default": 1})
    options.setdefault("secrets", ("s3cret-new", "s3cret-old"))
    return WebhookWorkerSpec(name=name, **options)  # type: ignore[arg-type]


def assert_matches(worker: WebhookWorker, spec: WebhookWorkerSpec) -> None:
    """The operator-written fields of ``worker`` are those of ``spec`` (secrets aside)."""
    assert worker.name == spec.name
    assert worker.url == spec.url
    assert dict(worker.queues) == dict(spec.queues)
    assert worker.concurrency == spec.concurrency
    assert worker.timeout == spec.timeout
    assert worker.paused == spec.paused
    assert worker.batch_types == unique_batch_types(spec.batch_types)


_Bad = Callable[[WebhookWorkerSpec], WebhookWorkerSpec]

#: One spec edit per validation rule; each turns a valid spec into one InvalidTask rejects.
BAD_SPECS: dict[str, _Bad] = {
    "empty-name": lambda s: replace(s, name=""),
    "name-with-dot": lambda s: replace(s, name="a.b"),
    "name-with-space": lambda s: replace(s, name="a b"),
    "name-leading-dash": lambda s: replace(s, name="-billing"),
    "name-too-long": lambda s: replace(s, name="n" * 129),
    "url-ftp-scheme": lambda s: replace(s, url="ftp://hooks.example.com/x"),
    "url-no-scheme": lambda s: replace(s, url="hooks.example.com/x"),
    "url-no-host": lambda s: replace(s, url="https:///path"),
    "url-empty": lambda s: replace(s, url=""),
    "url-too-long": lambda s: replace(
        s, url="https://hooks.example.com/" + "x" * MAX_WEBHOOK_URL_LEN
    ),
    "no-queues": lambda s: replace(s, queues={}),
    "bad-queue-name": lambda s: replace(s, queues={"default": 1, "a.b": 1}),
    "weight-zero": lambda s: replace(s, queues={"default": 0}),
    "weight-negative": lambda s: replace(s, queues={"default": -1}),
    "weight-too-big": lambda s: replace(s, queues={"default": MAX_QUEUE_WEIGHT + 1}),
    "concurrency-zero": lambda s: replace(s, concurrency=0),
    "concurrency-too-big": lambda s: replace(s, concurrency=MAX_WEBHOOK_CONCURRENCY + 1),
    "timeout-zero": lambda s: replace(s, timeout=timedelta(0)),
    "timeout-negative": lambda s: replace(s, timeout=timedelta(seconds=-1)),
    "timeout-too-long": lambda s: replace(
        s, timeout=MAX_WEBHOOK_TIMEOUT + timedelta(microseconds=1)
    ),
    "too-many-secrets": lambda s: replace(
        s, secrets=tuple(f"secret-{i}" for i in range(MAX_WEBHOOK_SECRETS + 1))
    ),
    "empty-secret": lambda s: replace(s, secrets=("s3cret", "")),
    "secret-too-long": lambda s: replace(s, secrets=("x" * (MAX_STORED_SECRET_LEN + 1),)),
    "empty-batch-type": lambda s: replace(s, batch_types=("digest.send", "")),
    "batch-type-too-long": lambda s: replace(s, batch_types=("t" * (MAX_TYPE_LEN + 1),)),
    "batch-type-control": lambda s: replace(s, batch_types=("digest\nsend",)),
    "batch-type-nul": lambda s: replace(s, batch_types=("digest\x00",)),
    "too-many-batch-types": lambda s: replace(
        s, batch_types=tuple(f"t{i}" for i in range(MAX_WEBHOOK_BATCH_TYPES + 1))
    ),
}


class WebhookTests:
    """upsert_webhook_worker, get_webhook_worker, list_webhook_workers,
    set_webhook_worker_paused and delete_webhook_worker."""

    async def test_create_then_get(self, broker: Broker, clock: FakeClock) -> None:
        now = clock.advance(STEP)
        spec = webhook_spec(
            queues={"default": 3, "emails": 1},
            concurrency=25,
            timeout=timedelta(seconds=12, microseconds=345678),
        )
        created = await broker.upsert_webhook_worker(spec)
        assert_matches(created, spec)
        assert created.secrets == ("s3cret-new", "s3cret-old")
        assert created.created_at == now
        assert created.updated_at == now
        assert await broker.get_webhook_worker(NAME) == created

    async def test_create_with_defaults_and_no_secrets(self, broker: Broker) -> None:
        spec = WebhookWorkerSpec(name=NAME, url="http://10.0.0.7:8080/hook", queues={"q": 1})
        created = await broker.upsert_webhook_worker(spec)
        assert_matches(created, spec)
        assert created.concurrency == 10
        assert created.timeout == timedelta(seconds=30)
        assert created.paused is False
        assert created.secrets == ()
        assert await broker.get_webhook_worker(NAME) == created

    async def test_batch_types_round_trip(self, broker: Broker, clock: FakeClock) -> None:
        spec = webhook_spec(batch_types=("digest.send", "report.build"))
        created = await broker.upsert_webhook_worker(spec)
        assert created.batch_types == ("digest.send", "report.build")
        assert await broker.get_webhook_worker(NAME) == created
        assert await broker.list_webhook_workers() == [created]
        # Pausing keeps them; an upsert replaces them (none: none).
        clock.advance(STEP)
        paused = await broker.set_webhook_worker_paused(NAME, True)
        assert paused.batch_types == created.batch_types
        replaced = await broker.upsert_webhook_worker(webhook_spec(batch_types=("other",)))
        assert replaced.batch_types == ("other",)
        cleared = await broker.upsert_webhook_worker(webhook_spec(secrets=()))
        assert cleared.batch_types == ()
        assert (await broker.get_webhook_worker(NAME)).batch_types == ()

    async def test_batch_types_are_stored_once_in_order(self, broker: Broker) -> None:
        spec = webhook_spec(batch_types=("b.t", "a.t", "b.t", "c.t", "a.t"))
        created = await broker.upsert_webhook_worker(spec)
        assert created.batch_types == ("b.t", "a.t", "c.t")
        assert (await broker.get_webhook_worker(NAME)).batch_types == ("b.t", "a.t", "c.t")

    async def test_extreme_batch_types_are_stored(self, broker: Broker) -> None:
        types = tuple(f"{i:03d}" + "é" * (MAX_TYPE_LEN - 3) for i in range(MAX_WEBHOOK_BATCH_TYPES))
        created = await broker.upsert_webhook_worker(webhook_spec(batch_types=types))
        assert created.batch_types == types
        assert (await broker.get_webhook_worker(NAME)).batch_types == types

    async def test_create_paused(self, broker: Broker) -> None:
        created = await broker.upsert_webhook_worker(webhook_spec(paused=True))
        assert created.paused is True
        assert (await broker.get_webhook_worker(NAME)).paused is True

    async def test_list_is_sorted_by_name(self, broker: Broker, clock: FakeClock) -> None:
        assert await broker.list_webhook_workers() == []
        names = ["beta", "Zeta", "alpha", "a_1", "a-1", "A9", "b"]
        stored: dict[str, WebhookWorker] = {}
        for name in names:
            clock.advance(STEP)
            stored[name] = await broker.upsert_webhook_worker(webhook_spec(name))
        listed = await broker.list_webhook_workers()
        # Plain code point order (uppercase before lowercase), whatever the DB locale.
        assert [w.name for w in listed] == sorted(names)
        assert listed == [stored[name] for name in sorted(names)]

    async def test_extreme_valid_values_are_stored(self, broker: Broker) -> None:
        name = "n" * 128
        spec = webhook_spec(
            name,
            url="https://hooks.example.com/" + "p" * (MAX_WEBHOOK_URL_LEN - 26),
            queues={"q" * 128: MAX_QUEUE_WEIGHT, "x": 1},
            concurrency=MAX_WEBHOOK_CONCURRENCY,
            timeout=MAX_WEBHOOK_TIMEOUT,
            secrets=tuple(f"{i}" * MAX_STORED_SECRET_LEN for i in range(MAX_WEBHOOK_SECRETS)),
        )
        assert len(spec.url) == MAX_WEBHOOK_URL_LEN
        created = await broker.upsert_webhook_worker(spec)
        assert_matches(created, spec)
        assert created.secrets == spec.secrets
        assert await broker.get_webhook_worker(name) == created

    async def test_replace_keeps_created_at_and_bumps_updated_at(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        created_at = clock.advance(STEP)
        await broker.upsert_webhook_worker(webhook_spec())
        updated_at = clock.advance(STEP)
        spec = webhook_spec(
            url="http://other.example.com:9000/v2",
            queues={"reports": 5},
            concurrency=3,
            timeout=timedelta(minutes=2),
            paused=True,
        )
        replaced = await broker.upsert_webhook_worker(spec)
        assert_matches(replaced, spec)
        assert replaced.created_at == created_at
        assert replaced.updated_at == updated_at
        # The queue set is replaced, not merged.
        assert dict(replaced.queues) == {"reports": 5}
        assert await broker.get_webhook_worker(NAME) == replaced
        assert await broker.list_webhook_workers() == [replaced]

    async def test_replace_without_secrets_keeps_stored_secrets(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.upsert_webhook_worker(webhook_spec(secrets=("one", "two")))
        clock.advance(STEP)
        replaced = await broker.upsert_webhook_worker(webhook_spec(concurrency=7, secrets=()))
        assert replaced.secrets == ("one", "two")
        assert replaced.concurrency == 7
        assert (await broker.get_webhook_worker(NAME)).secrets == ("one", "two")

    async def test_replace_with_secrets_replaces_them(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.upsert_webhook_worker(webhook_spec(secrets=("one", "two")))
        clock.advance(STEP)
        replaced = await broker.upsert_webhook_worker(webhook_spec(secrets=("three",)))
        assert replaced.secrets == ("three",)
        assert (await broker.get_webhook_worker(NAME)).secrets == ("three",)
        # Rotation: newest first, order kept as given.
        rotated = await broker.upsert_webhook_worker(webhook_spec(secrets=("four", "three")))
        assert rotated.secrets == ("four", "three")
        assert (await broker.get_webhook_worker(NAME)).secrets == ("four", "three")

    async def test_replace_only_touches_its_own_name(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        other = await broker.upsert_webhook_worker(webhook_spec("other"))
        await broker.upsert_webhook_worker(webhook_spec())
        clock.advance(STEP)
        await broker.upsert_webhook_worker(webhook_spec(concurrency=99, secrets=("new",)))
        assert await broker.get_webhook_worker("other") == other

    async def test_stored_queues_do_not_alias_the_callers_mapping(self, broker: Broker) -> None:
        queues = {"default": 2}
        created = await broker.upsert_webhook_worker(webhook_spec(queues=queues))
        queues["sneaky"] = 1
        queues["default"] = 9
        assert dict(created.queues) == {"default": 2}
        assert dict((await broker.get_webhook_worker(NAME)).queues) == {"default": 2}

    async def test_pause_and_resume(self, broker: Broker, clock: FakeClock) -> None:
        created = await broker.upsert_webhook_worker(webhook_spec())
        paused_at = clock.advance(STEP)
        paused = await broker.set_webhook_worker_paused(NAME, True)
        assert paused == replace(created, paused=True, updated_at=paused_at)
        assert await broker.get_webhook_worker(NAME) == paused
        resumed_at = clock.advance(STEP)
        resumed = await broker.set_webhook_worker_paused(NAME, False)
        assert resumed == replace(created, paused=False, updated_at=resumed_at)
        assert await broker.get_webhook_worker(NAME) == resumed

    async def test_pause_twice_is_harmless(self, broker: Broker, clock: FakeClock) -> None:
        await broker.upsert_webhook_worker(webhook_spec())
        await broker.set_webhook_worker_paused(NAME, True)
        again_at = clock.advance(STEP)
        again = await broker.set_webhook_worker_paused(NAME, True)
        assert again.paused is True
        assert again.updated_at == again_at

    async def test_upsert_sets_paused_from_the_spec(self, broker: Broker) -> None:
        await broker.upsert_webhook_worker(webhook_spec())
        await broker.set_webhook_worker_paused(NAME, True)
        replaced = await broker.upsert_webhook_worker(webhook_spec(paused=False))
        assert replaced.paused is False
        assert (await broker.get_webhook_worker(NAME)).paused is False

    async def test_delete(self, broker: Broker, clock: FakeClock) -> None:
        await broker.upsert_webhook_worker(webhook_spec())
        kept = await broker.upsert_webhook_worker(webhook_spec("kept"))
        await broker.delete_webhook_worker(NAME)
        with pytest.raises(WebhookWorkerNotFound):
            await broker.get_webhook_worker(NAME)
        assert await broker.list_webhook_workers() == [kept]
        with pytest.raises(WebhookWorkerNotFound):
            await broker.delete_webhook_worker(NAME)

    async def test_recreate_after_delete_is_new(self, broker: Broker, clock: FakeClock) -> None:
        await broker.upsert_webhook_worker(webhook_spec(secrets=("old",)))
        await broker.delete_webhook_worker(NAME)
        again_at = clock.advance(STEP)
        again = await broker.upsert_webhook_worker(webhook_spec(secrets=()))
        assert again.created_at == again_at
        assert again.secrets == ()

    async def test_replace_secrets_is_a_compare_and_set(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        created = await broker.upsert_webhook_worker(webhook_spec(secrets=("one", "two")))
        clock.advance(STEP)
        assert await broker.replace_webhook_secrets(NAME, ("one", "two"), ("1", "2"))
        # Only the secrets change: updated_at too stays (no operator edited anything).
        assert await broker.get_webhook_worker(NAME) == replace(created, secrets=("1", "2"))
        # Stale expectations (an operator's upsert came first) change nothing.
        assert not await broker.replace_webhook_secrets(NAME, ("one", "two"), ("x",))
        assert not await broker.replace_webhook_secrets(NAME, ("1",), ("x",))
        assert (await broker.get_webhook_worker(NAME)).secrets == ("1", "2")
        assert not await broker.replace_webhook_secrets("missing", ("1", "2"), ("x",))

    @pytest.mark.parametrize(
        "secrets",
        [(), ("",), ("x" * (MAX_STORED_SECRET_LEN + 1),), ("a\nb",)],
        ids=["none", "empty", "too-long", "control"],
    )
    async def test_replace_secrets_checks_what_it_stores(
        self, broker: Broker, secrets: tuple[str, ...]
    ) -> None:
        await broker.upsert_webhook_worker(webhook_spec(secrets=("one",)))
        with pytest.raises(InvalidTask):
            await broker.replace_webhook_secrets(NAME, ("one",), secrets)
        with pytest.raises(InvalidTask):
            await broker.replace_webhook_secrets("bad name", ("one",), ("x",))
        assert (await broker.get_webhook_worker(NAME)).secrets == ("one",)

    async def test_unknown_name_is_not_found(self, broker: Broker) -> None:
        await broker.upsert_webhook_worker(webhook_spec("present"))
        with pytest.raises(WebhookWorkerNotFound):
            await broker.get_webhook_worker("missing")
        with pytest.raises(WebhookWorkerNotFound):
            await broker.set_webhook_worker_paused("missing", True)
        with pytest.raises(WebhookWorkerNotFound):
            await broker.delete_webhook_worker("missing")
        assert [w.name for w in await broker.list_webhook_workers()] == ["present"]

    @pytest.mark.parametrize("name", ["", "a.b", "a b", "-x", "n" * 129])
    async def test_malformed_name_is_invalid(self, broker: Broker, name: str) -> None:
        with pytest.raises(InvalidTask):
            await broker.get_webhook_worker(name)
        with pytest.raises(InvalidTask):
            await broker.set_webhook_worker_paused(name, True)
        with pytest.raises(InvalidTask):
            await broker.delete_webhook_worker(name)

    @pytest.mark.parametrize("edit", list(BAD_SPECS.values()), ids=list(BAD_SPECS))
    async def test_bad_spec_on_create_stores_nothing(self, broker: Broker, edit: _Bad) -> None:
        with pytest.raises(InvalidTask):
            await broker.upsert_webhook_worker(edit(webhook_spec()))
        assert await broker.list_webhook_workers() == []

    @pytest.mark.parametrize("edit", list(BAD_SPECS.values()), ids=list(BAD_SPECS))
    async def test_bad_spec_on_replace_changes_nothing(
        self, broker: Broker, clock: FakeClock, edit: _Bad
    ) -> None:
        stored = await broker.upsert_webhook_worker(webhook_spec())
        clock.advance(STEP)
        bad = edit(webhook_spec(concurrency=42, paused=True, secrets=("other",)))
        with pytest.raises(InvalidTask):
            await broker.upsert_webhook_worker(bad)
        assert await broker.list_webhook_workers() == [stored]

    async def test_times_and_timeouts_round_trip_exactly(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        created_at = clock.advance(timedelta(days=400, microseconds=999999))
        timeout = timedelta(minutes=59, seconds=59, microseconds=999999)
        created = await broker.upsert_webhook_worker(webhook_spec(timeout=timeout))
        updated_at = clock.advance(timedelta(microseconds=1))
        paused = await broker.set_webhook_worker_paused(NAME, True)
        for worker in (await broker.get_webhook_worker(NAME), paused):
            assert worker.timeout == timeout
            assert worker.created_at == created_at == created.created_at
            assert worker.updated_at == updated_at
            for at in (worker.created_at, worker.updated_at):
                assert at.tzinfo is not None
                assert at.utcoffset() == timedelta(0)
                assert at.astimezone(UTC) == at
        small = await broker.upsert_webhook_worker(
            webhook_spec("tiny", timeout=timedelta(microseconds=1))
        )
        assert small.timeout == timedelta(microseconds=1)
        assert (await broker.get_webhook_worker("tiny")).timeout == timedelta(microseconds=1)

    async def test_webhook_calls_after_close_raise(self, broker: Broker) -> None:
        await broker.upsert_webhook_worker(webhook_spec())
        await broker.close()
        with pytest.raises(BrokerClosed):
            await broker.upsert_webhook_worker(webhook_spec("other"))
        with pytest.raises(BrokerClosed):
            await broker.get_webhook_worker(NAME)
        with pytest.raises(BrokerClosed):
            await broker.list_webhook_workers()
        with pytest.raises(BrokerClosed):
            await broker.set_webhook_worker_paused(NAME, True)
        with pytest.raises(BrokerClosed):
            await broker.delete_webhook_worker(NAME)
        with pytest.raises(BrokerClosed):
            await broker.replace_webhook_secrets(NAME, ("a",), ("b",))
