"""The metrics module: the label cap, and the /metrics server scraped over HTTP."""

from __future__ import annotations

import asyncio
import math
import random
import threading
from typing import Any

import httpx
import pytest
from conveyor_runtime import metrics
from conveyor_runtime.embedded_nats import free_port
from prometheus_client.parser import text_string_to_metric_families


def test_the_label_cap_keeps_the_first_values_and_reports_the_rest_as_other() -> None:
    cap = metrics.LabelCap(limit=3)
    assert [cap(v) for v in ("a", "b", "a", "c")] == ["a", "b", "a", "c"]
    assert cap("d") == metrics.OTHER
    assert cap("e") == metrics.OTHER
    assert cap("b") == "b"  # a kept value stays kept
    assert cap("") == "none"
    assert len(cap) == 3


def test_the_default_caps_hold_200_values() -> None:
    assert metrics.QUEUE.limit == metrics.TYPE.limit == metrics.LABEL_LIMIT == 200


def test_port_zero_is_no_server() -> None:
    assert metrics.start_metrics_server("127.0.0.1", 0) is None


async def test_the_server_serves_the_registry_and_stops() -> None:
    port = free_port()
    server = metrics.start_metrics_server("127.0.0.1", port)
    assert server is not None
    try:
        metrics.OFFERS.labels(metrics.QUEUE("metrics-test")).inc(2)
        metrics.CREDITS.labels("metrics-test").set(7)
        async with httpx.AsyncClient() as client:
            reply = await client.get(server.url)
        assert reply.status_code == 200
        families = {f.name: f for f in text_string_to_metric_families(reply.text)}
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in families.values()
            for s in family.samples
        }
        assert samples[("conveyor_dispatch_offers_total", (("queue", "metrics-test"),))] >= 2
        assert samples[("conveyor_dispatch_credits", (("queue", "metrics-test"),))] == 7
        assert families["conveyor_dispatch_offers"].documentation
        assert "conveyor_db_pool_size" in families
    finally:
        await asyncio.to_thread(server.stop)
    async with httpx.AsyncClient() as client:
        try:
            await client.get(server.url, timeout=1)
        except httpx.TransportError:
            pass
        else:
            raise AssertionError("the server still answers after stop()")


class _Pool:
    def pool_stats(self) -> tuple[int, int]:
        return 4, 3


class _Nats:
    is_connected = True


def test_the_pool_and_nats_state_are_read_at_scrape_time() -> None:
    from prometheus_client import REGISTRY

    unwatch = metrics.watch_runtime("metrics-svc", _Pool(), _Nats())
    try:
        labels = {"service": "metrics-svc"}
        assert REGISTRY.get_sample_value("conveyor_db_pool_size", labels) == 4
        assert REGISTRY.get_sample_value("conveyor_db_pool_free", labels) == 3
        assert REGISTRY.get_sample_value("conveyor_nats_connected", labels) == 1
    finally:
        unwatch()
    assert REGISTRY.get_sample_value("conveyor_nats_connected", {"service": "metrics-svc"}) is None


def test_bound_children_are_capped_once_and_kept() -> None:
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    counter = Counter("bound_test", "test", ["queue", "kind"], registry=registry)
    cap = metrics.LabelCap(limit=2)
    bound = metrics.Bound(counter, cap, None, limit=3)
    bound("a", "x").inc()
    bound("a", "x").inc(2)
    assert bound("a", "x") is bound("a", "x")  # kept: no labels() call again
    bound("b", "y").inc()
    bound("c", "x").inc()  # past the cap: "other"
    bound("d", "x").inc()  # past the cache's limit too: looked up each time, still "other"
    value = registry.get_sample_value
    assert value("bound_test_total", {"queue": "a", "kind": "x"}) == 3
    assert value("bound_test_total", {"queue": "b", "kind": "y"}) == 1
    assert value("bound_test_total", {"queue": metrics.OTHER, "kind": "x"}) == 2
    assert len(bound._children) == 3


def test_the_leases_held_gauge_reads_its_tally_at_scrape_time() -> None:
    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value("conveyor_leases_held")
    metrics.HELD.add(3)
    try:
        assert REGISTRY.get_sample_value("conveyor_leases_held") == (before or 0) + 3
    finally:
        metrics.HELD.add(-3)
    assert REGISTRY.get_sample_value("conveyor_leases_held") == before


def test_type_breaker_states_are_read_at_scrape_time_worst_first() -> None:
    from prometheus_client import REGISTRY

    rows = [
        ("brk-q", "t", metrics.BREAKER_HALF_OPEN),
        ("brk-q", "t", metrics.BREAKER_CLOSED),
        ("brk-q", "u", metrics.BREAKER_CLOSED),
    ]
    other = [("brk-q", "t", metrics.BREAKER_OPEN)]
    unwatch = [
        metrics.watch_type_breakers(lambda: rows),
        metrics.watch_type_breakers(lambda: other),
    ]
    value = REGISTRY.get_sample_value
    t, u = {"queue": "brk-q", "type": "t"}, {"queue": "brk-q", "type": "u"}
    try:
        assert value("conveyor_type_breaker_state", t) == metrics.BREAKER_OPEN
        assert value("conveyor_type_breakers_open", t) == 2
        assert value("conveyor_type_breaker_state", u) == metrics.BREAKER_CLOSED
        assert value("conveyor_type_breakers_open", u) == 0
    finally:
        for stop in unwatch:
            stop()
    assert value("conveyor_type_breaker_state", t) is None


# ---------------------------------------------- folded histograms: per-task observations


def _histograms(name: str) -> tuple[Any, Any, Any, metrics.FoldedHistogram]:
    """A stock prometheus_client Histogram and a FoldedHistogram of the same name, buckets
    and labels, each in a registry of its own: (stock registry, stock, folded registry,
    folded)."""
    from prometheus_client import CollectorRegistry, Histogram

    buckets = metrics._LATENCY_BUCKETS
    stock_registry, folded_registry = CollectorRegistry(), CollectorRegistry()
    stock = Histogram(name, "doc", ["queue"], buckets=buckets, registry=stock_registry)
    folded = metrics.FoldedHistogram(
        name, "doc", ["queue"], buckets=buckets, registry=folded_registry
    )
    return stock_registry, stock, folded_registry, folded


def _exposition(registry: Any) -> list[str]:
    """``registry``'s text exposition, less the ``_created`` samples (creation times)."""
    from prometheus_client import generate_latest

    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


def test_a_folded_histogram_exposes_what_a_histogram_observing_each_value_would() -> None:
    stock_registry, stock, folded_registry, folded = _histograms("fold_test_seconds")
    rng = random.Random(7)
    # Multiples of 1/1024 (their sums are exact whatever the order), the bucket bounds
    # themselves that are, and values past the last bound, below the first, negative.
    values = [rng.randrange(0, 4_000_000) / 1024 for _ in range(3 * metrics.FOLD_AT + 17)]
    values += [0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 1800.5, 1e9, 0.0, -1.0]
    values += [rng.randrange(0, 64) / 1024 for _ in range(2 * metrics.FOLD_AT)]
    rng.shuffle(values)
    for n, value in enumerate(values):
        queue = "a" if n % 3 else "b"
        stock.labels(queue).observe(value)
        if n % 5 == 0:
            folded.observations(queue).observe_many([value])
        else:
            folded.observations(queue).observe(value)
        if n in (1, 700, 2000):  # a scrape now and then folds what is listed
            assert _exposition(folded_registry) == _exposition(stock_registry)
    exposed = _exposition(folded_registry)
    assert exposed == _exposition(stock_registry)
    assert f'fold_test_seconds_count{{queue="a"}} {float(len(values) * 2 // 3)}' in exposed


def test_a_folded_histogram_puts_values_on_a_bound_in_its_bucket() -> None:
    stock_registry, stock, folded_registry, folded = _histograms("bounds_test_seconds")
    values = []
    for bound in metrics._LATENCY_BUCKETS:
        values += [bound, math.nextafter(bound, 0.0), math.nextafter(bound, math.inf)]
    for value in values:
        stock.labels("q").observe(value)
        folded.observations("q").observe(value)

    def samples(registry: Any) -> dict[tuple[str, str], float]:
        return {
            (sample.name, sample.labels.get("le", "")): sample.value
            for family in registry.collect()
            for sample in family.samples
            if not sample.name.endswith("_created")
        }

    got, want = samples(folded_registry), samples(stock_registry)
    assert got.keys() == want.keys()
    for key in want:
        if key[0].endswith("_sum"):  # added a batch at a time: equal up to rounding
            assert got[key] == pytest.approx(want[key], rel=1e-12)
        else:
            assert got[key] == want[key], key


def test_no_observation_is_lost_when_threads_observe_while_others_scrape() -> None:
    stock_registry, stock, folded_registry, folded = _histograms("threads_test_seconds")
    threads, each = 4, 5_000
    go = threading.Event()

    def observe(seed: int) -> None:
        rng = random.Random(seed)
        hot = folded.observations("q")
        go.wait()
        for _ in range(each):
            hot.observe(rng.randrange(0, 200_000) / 1024)

    def scrape() -> None:
        go.wait()
        for _ in range(200):
            folded_registry.collect()

    workers = [threading.Thread(target=observe, args=(n,)) for n in range(threads)]
    workers += [threading.Thread(target=scrape) for _ in range(2)]
    for worker in workers:
        worker.start()
    go.set()
    for worker in workers:
        worker.join()
    for n in range(threads):  # the same values, one observe() each
        rng = random.Random(n)
        for _ in range(each):
            stock.labels("q").observe(rng.randrange(0, 200_000) / 1024)
    count = folded_registry.get_sample_value("threads_test_seconds_count", {"queue": "q"})
    assert count == threads * each
    assert _exposition(folded_registry) == _exposition(stock_registry)


def test_the_hot_histograms_are_bound_to_their_observations() -> None:
    from prometheus_client import REGISTRY, CollectorRegistry

    registry = CollectorRegistry()
    folded = metrics.FoldedHistogram(
        "bound_fold_test_seconds", "doc", ["queue"], buckets=(1, 2), registry=registry
    )
    bound = metrics.Bound(folded, metrics.LabelCap(limit=1), limit=2)
    hot = bound("a")
    assert isinstance(hot, metrics.Observations)
    assert bound("a") is hot is folded.observations("a")
    assert bound("b") is bound("c") is folded.observations(metrics.OTHER)  # past the cap
    hot.observe(1.5)
    bound("b").observe(0.5)
    folded.labels("a").observe(3)  # the labels() child still observes as usual
    value = registry.get_sample_value
    assert value("bound_fold_test_seconds_bucket", {"queue": "a", "le": "2.0"}) == 1
    assert value("bound_fold_test_seconds_count", {"queue": "a"}) == 2
    assert value("bound_fold_test_seconds_sum", {"queue": "a"}) == 4.5
    assert value("bound_fold_test_seconds_count", {"queue": metrics.OTHER}) == 1
    # The services' own: read right after the observation, no scrape in between.
    runs = REGISTRY.get_sample_value("conveyor_task_run_seconds_count", {"queue": "fold-q"})
    metrics.run_time("fold-q").observe(0.2)
    now = REGISTRY.get_sample_value("conveyor_task_run_seconds_count", {"queue": "fold-q"})
    assert now == (runs or 0) + 1
    assert isinstance(metrics.enqueue_to_start("fold-q"), metrics.Observations)


def test_an_observations_list_folds_itself_in_past_fold_at() -> None:
    _, _, _, folded = _histograms("self_fold_test_seconds")
    hot = folded.observations("q")
    for _ in range(metrics.FOLD_AT - 1):
        hot.observe(1.0)
    assert len(hot._pending) == metrics.FOLD_AT - 1
    hot.observe(1.0)  # the FOLD_AT-th: folded in, nothing kept
    assert hot._pending == []
    hot.observe_many([2.0] * (2 * metrics.FOLD_AT))
    assert hot._pending == []
    assert folded.labels("q")._sum.get() == metrics.FOLD_AT + 4.0 * metrics.FOLD_AT


def test_record_enqueued_counts_the_created_tasks_by_queue_and_type() -> None:
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    def result(queue: str, type_: str, created: bool = True) -> Any:
        return SimpleNamespace(task=SimpleNamespace(queue=queue, type=type_), created=created)

    def value(queue: str, type_: str) -> float:
        labels = {"queue": queue, "type": type_}
        return REGISTRY.get_sample_value("conveyor_tasks_enqueued_total", labels) or 0.0

    pairs = [("enq-a", "t"), ("enq-a", "u"), ("enq-b", "t")]
    before = {pair: value(*pair) for pair in pairs}
    created = [result("enq-a", "t"), result("enq-b", "t"), result("enq-a", "t")]
    created.append(result("enq-a", "u"))
    # An existing id counts for nothing.
    metrics.record_enqueued([*created, result("enq-a", "t", created=False)])
    assert {pair: value(*pair) - before[pair] for pair in pairs} == {
        ("enq-a", "t"): 2,
        ("enq-a", "u"): 1,
        ("enq-b", "t"): 1,
    }
