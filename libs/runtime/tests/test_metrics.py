"""The metrics module: the label cap, and the /metrics server scraped over HTTP."""

from __future__ import annotations

import asyncio

import httpx
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
