"""The build log read back through the API, and live updates: a build's and a project's
Server-Sent Events while a real ingest commits more of the build, over NATS digests and,
without NATS, by polling Postgres.

Builds unfold request by request (each sent once the previous one is acked, so each is
its own batch, its own commit, its own log segment and its own digest); every wait is a
condition with a timeout.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import pytest
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_bep_web import logs
from conveyor_testkit.bep import request, sample_events
from conveyor_testkit.bep_web import (  # noqa: F401  (pytest fixtures)
    WebRig,
    web_rig_fixture,
    web_without_nats_fixture,
)
from conveyor_testkit.polling import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.nats]


INTERVAL = 0.2  # conftest.INTERVAL: the rig's digest interval


def started() -> bes.BuildEvent:
    """The first event of a build."""
    return sample_events()[0]


def progress(text: str) -> bes.BuildEvent:
    """A progress event carrying ``text`` on stderr."""
    return bes.BuildEvent(progress=bes.Progress(stderr=text))


def configured(label: str) -> bes.BuildEvent:
    """A target configured."""
    event = bes.BuildEvent(configured=bes.TargetConfigured(target_kind="sh_test rule"))
    event.id.target_configured.label = label
    return event


def finished(code: int = 0) -> bes.BuildEvent:
    """The build's last Bazel event."""
    event = bes.BuildEvent(
        finished=bes.BuildFinished(
            exit_code=bes.BuildFinished.ExitCode(
                name="SUCCESS" if code == 0 else "FAILED", code=code
            )
        )
    )
    event.last_message = True
    return event


def line(i: int) -> str:
    """A log line with colour, a carriage return and characters of several UTF-8 sizes."""
    return f"\x1b[32mINFO:\x1b[0m step {i} é✓ {'x' * (i % 7)}\r\x1b[K[{i}/∞] done\n"


async def test_the_log_reads_back_whole_and_from_any_offset(
    web_rig: WebRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs, "PAGE", 4)  # several pages of segments per read
    feed = web_rig.feed()
    inv = "log-1"
    seq = 1
    await feed.send(request(inv, seq, bazel=started()))
    expected = b""
    for i in range(30):
        seq += 1
        if i % 5 == 4:  # console output (Bazel's BES console events) joins the log too
            text = f"console {i}\n"
            await feed.send(request(inv, seq, console=text))
        else:
            text = line(i)
            await feed.send(request(inv, seq, bazel=progress(text)))
        expected += text.encode()
        if i == 14:
            # Mid-build: the log so far, then (below) the rest from where it stopped.
            halfway = (await web_rig.client.get(f"/api/builds/{inv}/log")).content
            assert halfway == expected
    await feed.send(request(inv, seq + 1, bazel=finished()))
    await feed.send(request(inv, seq + 2, finished=True))

    rows = await web_rig.pool.fetch(
        "SELECT byte_offset, bytes FROM bep.log_segments WHERE invocation_id = $1"
        " ORDER BY byte_offset",
        inv,
    )
    assert len(rows) >= 20  # one segment per batch: a multi-segment log
    assert rows[-1]["byte_offset"] + rows[-1]["bytes"] == len(expected)

    response = await web_rig.client.get(f"/api/builds/{inv}/log")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    assert "content-disposition" not in response.headers
    assert response.content == expected
    rest = await web_rig.client.get(f"/api/builds/{inv}/log", params={"offset": len(halfway)})
    assert halfway + rest.content == expected

    boundaries = [r["byte_offset"] for r in rows]
    offsets = {0, 1, len(expected) // 2, len(expected) - 1, len(expected), len(expected) + 99}
    offsets |= {b + d for b in boundaries for d in (-1, 0, 1) if b + d >= 0}
    for offset in sorted(offsets):
        part = await web_rig.client.get(f"/api/builds/{inv}/log", params={"offset": offset})
        assert part.status_code == 200
        assert part.content == expected[offset:], offset
        assert part.headers["x-log-offset"] == str(offset)

    download = await web_rig.client.get(f"/api/builds/{inv}/log", params={"download": 1})
    assert download.headers["content-disposition"] == 'attachment; filename="log-1.log"'
    assert download.content == expected
    summary = (await web_rig.client.get(f"/api/builds/{inv}")).json()
    assert summary["log"] == {"bytes": len(expected), "lines": expected.count(b"\n")}


async def test_a_build_page_gets_coalesced_live_updates_until_it_ends(web_rig: WebRig) -> None:
    feed = web_rig.feed()
    inv = "live-1"
    await feed.send(request(inv, 1, bazel=started()))
    sse = web_rig.sse(f"/api/builds/{inv}/live")
    try:
        await wait_until(
            lambda: bool(sse.named("build")), within=10, message="the event at connect"
        )
        first = sse.named("build")[0].data
        assert first["invocation_id"] == inv
        assert first["status"] == "running"
        assert first["finished"] is False
        assert first["counters"]["last_event_seq"] == 1

        published_before = web_rig.live.published
        seq = 1
        log = 0
        began = time.monotonic()
        # Commit after commit for 1.5 s (each request waits for its ack): many digests.
        while time.monotonic() - began < 1.5:
            seq += 1
            text = line(seq)
            event = configured(f"//t:{seq}") if seq % 10 == 0 else progress(text)
            await feed.send(request(inv, seq, bazel=event))
            if event.WhichOneof("payload") == "progress":
                log += len(text.encode())
        feeding = time.monotonic() - began
        last_seq = seq

        def caught_up() -> bool:
            builds = sse.named("build")
            return bool(builds) and builds[-1].data["counters"]["last_event_seq"] == last_seq

        await wait_until(caught_up, within=10, message="an event with the last commit")
        during = list(sse.named("build")[1:])
        digests = web_rig.live.published - published_before
        assert digests >= last_seq - 1  # one per commit...
        assert 3 <= len(during) <= feeding / INTERVAL + 2  # ...coalesced to one per interval
        assert len(during) < digests / 2
        stamps = [e.data["sent_at"] for e in sse.named("build")]
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        assert min(gaps) >= INTERVAL * 0.95, gaps
        # Each event is the summary as re-read: counters, and the log's size to fetch
        # the tail from (it grows, and ends where the log ends).
        sizes = [e.data["log"]["bytes"] for e in sse.named("build")]
        assert sizes == sorted(sizes)
        assert sizes[-1] == log
        assert sse.named("build")[-1].data["counters"]["targets_configured"] == last_seq // 10
        assert sse.named("end") == []
        assert not sse.done.is_set()

        await feed.send(request(inv, last_seq + 1, bazel=finished(code=1)))
        await feed.send(request(inv, last_seq + 2, finished=True))
        await wait_until(sse.done.is_set, within=10, message="the stream ends with the build")
        assert sse.events[-1].event == "end"
        assert sse.events[-1].data["status"] == "failed"
        final = sse.named("build")[-1].data
        assert final["finished"] is True
        assert final["exit_code"] == 1
    finally:
        await sse.close()

    # A finished build's stream: one event, then its end.
    again = web_rig.sse(f"/api/builds/{inv}/live")
    try:
        await wait_until(again.done.is_set, within=10, message="a finished build's stream ends")
        assert [e.event for e in again.events] == ["build", "end"]
    finally:
        await again.close()


async def test_without_nats_the_build_stream_polls(web_rig: WebRig, web_without_nats: Any) -> None:
    server, client = await web_without_nats()
    assert server.app.state.nc is None
    feed = web_rig.feed()
    inv = "poll-1"
    await feed.send(request(inv, 1, bazel=started()))
    sse = web_rig.sse(f"/api/builds/{inv}/live", client=client)
    try:
        await wait_until(
            lambda: bool(sse.named("build")), within=10, message="the event at connect"
        )
        await feed.send(request(inv, 2, bazel=progress("hello\n")))
        await wait_until(
            lambda: sse.named("build")[-1].data["log"]["bytes"] == 6,
            within=10,
            message="the poll sees the new commit",
        )
        await feed.send(request(inv, 3, bazel=finished()))
        await feed.send(request(inv, 4, finished=True))
        await wait_until(sse.done.is_set, within=10, message="the stream ends with the build")
        assert sse.events[-1].event == "end"
        assert sse.events[-1].data["status"] == "success"
    finally:
        await sse.close()


async def test_a_project_stream_carries_its_builds_only(
    web_rig: WebRig, web_without_nats: Any
) -> None:
    _, polling_client = await web_without_nats()
    streams = {
        "nats": web_rig.sse("/api/projects/acme/live"),
        "poll": web_rig.sse("/api/projects/acme/live", client=polling_client),
    }
    try:
        for sse in streams.values():
            await wait_until(functools.partial(_named, sse, "ready"), within=10, message="ready")
        stream = [request("p-beta", 1, bazel=started()), request("p-beta", 2, finished=True)]
        await web_rig.publish(stream, project="beta")
        feed = web_rig.feed()
        await feed.send(request("p-acme", 1, bazel=started()))
        await feed.send(request("p-acme", 2, bazel=progress("one\n")))
        await feed.send(request("p-acme", 3, bazel=finished()))
        await feed.send(request("p-acme", 4, finished=True))

        for name, sse in streams.items():

            def finished_row(s: Any = sse) -> bool:
                return any(
                    b["invocation_id"] == "p-acme" and b["finished"]
                    for e in s.named("builds")
                    for b in e.data["builds"]
                )

            await wait_until(finished_row, within=10, message=f"the finished build ({name})")
            ids = {b["invocation_id"] for e in sse.named("builds") for b in e.data["builds"]}
            assert ids == {"p-acme"}, name
            stamps = [e.data["sent_at"] for e in sse.named("builds")]
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            assert all(g >= INTERVAL * 0.95 for g in gaps), (name, gaps)
    finally:
        for sse in streams.values():
            await sse.close()


def _named(sse: Any, event: str) -> bool:
    """Whether ``sse`` has received an event named ``event``."""
    return bool(sse.named(event))
