"""The ingest as a real process (``conveyor-bep serve``) under the real Bazel (Debian's
bazel-bootstrap, Bazel 4.2.3) building the sample workspace ``examples/bazel``.

Each build also writes Bazel's own JSON file of the same stream, and the stored build is
checked against it. Also: ``kill -9`` of the ingest in the middle of a stream (Bazel
retries against the restarted process; nothing is lost or stored twice), two ingest
processes racing for one invocation (the fence), and a key revoked through the CLI that
stops working at once on a running node (NATS invalidation).

Bazel 4.2.3 sends no BES headers, so its builds carry the key in ``--project_id``.
Skipped where Bazel is missing, except under CI, where a missing Bazel fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from conveyor_bep.bazel.google.devtools.build.v1 import publish_build_event_pb2
from conveyor_bep.writer import decode_delimited, decompress
from conveyor_testkit.bazel import (
    bazel_available,
    bep_cli,
    remove_output_root,
    run_bazel,
    sample_workspace,
)
from conveyor_testkit.bep import publish, sample_stream
from conveyor_testkit.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

if not bazel_available() and os.environ.get("CI", "").lower() not in ("1", "true"):
    pytest.skip("bazel is not installed (scripts/install-bazel)", allow_module_level=True)

_LISTENING = re.compile(r"conveyor-bep listening on [^:]+:(\d+)")


def _env(dsn: str, nats_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(
        CONVEYOR_DSN=dsn,
        CONVEYOR_NATS_URL=nats_url,
        CONVEYOR_SUBJECT_PREFIX="beptest" + os.urandom(3).hex(),
        CONVEYOR_LOG_LEVEL="warning",
        CONVEYOR_BEP_COMMIT_INTERVAL="0.005",
    )
    return env


class Ingest:
    """One ``conveyor-bep serve`` process."""

    def __init__(self, env: dict[str, str], port: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor_bep", "serve", "--port", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = _LISTENING.search(line)
        if match is None:
            self.proc.kill()
            rest = self.proc.stdout.read()
            self.proc.stdout.close()
            raise AssertionError(f"ingest did not start: {line}{rest}")
        self.port = int(match[1])

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._close()

    def _close(self) -> None:
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._close()


@dataclass
class Site:
    dsn: str
    env: dict[str, str]
    key: str
    workspace: Path
    output_root: Path
    tmp: Path


@pytest.fixture
def site(fresh_pg_dsn: str, nats_url: str, tmp_path: Path) -> Iterator[Site]:
    env = _env(fresh_pg_dsn, nats_url)
    bep_cli(env, "migrate")
    bep_cli(env, "project", "create", "sample")
    key = bep_cli(env, "key", "create", "sample")
    assert key.startswith("conveyor_")
    output_root = tmp_path / "bazel-root"
    try:
        yield Site(fresh_pg_dsn, env, key, sample_workspace(tmp_path), output_root, tmp_path)
    finally:
        remove_output_root(output_root)


@pytest.fixture
def ingest(site: Site) -> Iterator[Ingest]:
    node = Ingest(site.env)
    try:
        yield node
    finally:
        node.stop()


def _bazel(
    site: Site, port: int, command: str, *targets: str, extra: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    json_file = site.tmp / f"events-{os.urandom(4).hex()}.json"
    done = run_bazel(
        site.workspace,
        command,
        *targets,
        f"--bes_backend=grpc://127.0.0.1:{port}",
        f"--project_id={site.key}",
        "--bes_timeout=120s",
        f"--build_event_json_file={json_file}",
        *extra,
        output_user_root=site.output_root,
    )
    events = [json.loads(line) for line in json_file.read_text().splitlines() if line]
    return done, events


async def _stored(dsn: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    try:
        inv = await conn.fetchrow("SELECT * FROM bep.invocations")
        seqs: list[int] = []
        bazel_events = 0
        for row in await conn.fetch("SELECT data FROM bep.event_segments ORDER BY first_seq"):
            for raw in decode_delimited(decompress(row["data"])):
                ordered = publish_build_event_pb2.OrderedBuildEvent.FromString(raw)
                seqs.append(ordered.sequence_number)
                if ordered.event.WhichOneof("event") == "bazel_event":
                    bazel_events += 1
        texts = []
        for table in ("invocations", "targets", "test_results", "actions", "named_sets"):
            texts += [str(dict(r)) for r in await conn.fetch(f"SELECT * FROM bep.{table}")]
        for table in ("event_segments", "log_segments"):
            texts += [
                decompress(r["data"]).decode(errors="replace")
                for r in await conn.fetch(f"SELECT data FROM bep.{table}")
            ]
        return {
            "invocation": dict(inv) if inv else None,
            "seqs": seqs,
            "bazel_events": bazel_events,
            "targets": {r["label"]: dict(r) for r in await conn.fetch("SELECT * FROM bep.targets")},
            "tests": [dict(r) for r in await conn.fetch("SELECT * FROM bep.test_results")],
            "text": "\n".join(texts),
        }
    finally:
        await conn.close()


def _labels(events: list[dict[str, Any]], kind: str) -> set[str]:
    return {e["id"][kind]["label"] for e in events if kind in e["id"]}


def _check_against_json(stored: dict[str, Any], events: list[dict[str, Any]], key: str) -> None:
    inv = stored["invocation"]
    assert inv is not None
    assert inv["finished"] is True
    assert stored["seqs"] == list(range(1, inv["last_event_seq"] + 1))  # each once, in order
    assert stored["bazel_events"] == len(events)  # every event of Bazel's own file
    completed = _labels(events, "targetCompleted")
    assert set(stored["targets"]) >= completed
    for label in completed:
        assert stored["targets"][label]["success"] is not None
    finished = next(e for e in events if "buildFinished" in e["id"])
    assert inv["exit_code"] == finished["finished"]["exitCode"].get("code", 0)
    assert key not in stored["text"]
    assert key.split("_", 2)[2] not in stored["text"]


async def test_a_real_build_is_stored_as_bazel_reports_it(site: Site, ingest: Ingest) -> None:
    done, events = await asyncio.to_thread(_bazel, site, ingest.port, "test", "//...")
    assert done.returncode == 0, done.stderr[-3000:]
    stored = await _stored(site.dsn)
    _check_against_json(stored, events, site.key)
    inv = stored["invocation"]
    assert inv["status"] == "success"
    assert inv["command"] == "test"
    assert inv["tests_total"] == inv["tests_passed"] == 1
    assert [t["label"] for t in stored["tests"]] == ["//:pass_test"]
    assert stored["tests"][0]["status"] == "PASSED"
    assert stored["targets"]["//:pass_test"]["test_status"] == "PASSED"
    assert stored["targets"]["//:hello"]["success"] is True
    assert inv["log_bytes"] > 0


async def test_failing_and_flaky_tests(site: Site, ingest: Ingest) -> None:
    flaky_dir = site.tmp / "flaky"
    flaky_dir.mkdir()
    done, events = await asyncio.to_thread(
        _bazel,
        site,
        ingest.port,
        "test",
        "//:fail_test",
        "//:flaky_test",
        extra=(f"--test_env=FLAKY_DIR={flaky_dir}",),
    )
    assert done.returncode == 3, done.stderr[-3000:]
    stored = await _stored(site.dsn)
    _check_against_json(stored, events, site.key)
    inv = stored["invocation"]
    assert inv["status"] == "failed"
    assert (inv["tests_total"], inv["tests_failed"], inv["tests_flaky"]) == (2, 1, 1)
    assert stored["targets"]["//:fail_test"]["test_status"] == "FAILED"
    assert stored["targets"]["//:flaky_test"]["test_status"] == "FLAKY"
    flaky = sorted(
        (t["attempt"], t["status"]) for t in stored["tests"] if t["label"] == "//:flaky_test"
    )
    assert flaky[0] == (1, "FAILED")
    assert flaky[-1][1] == "PASSED"


async def test_kill_9_mid_stream_loses_and_duplicates_nothing(site: Site) -> None:
    first = Ingest(site.env)
    port = first.port
    second: Ingest | None = None
    try:
        build = asyncio.ensure_future(
            asyncio.to_thread(_bazel, site, port, "build", "//:slow", "//:hello")
        )
        conn = await asyncpg.connect(site.dsn)
        try:

            async def streaming() -> bool:
                seq = await conn.fetchval(
                    "SELECT last_event_seq FROM bep.invocations WHERE NOT finished"
                )
                return bool(seq)

            await wait_until(streaming, within=60, message="the stream to be under way")
        finally:
            await conn.close()
        first.kill9()
        second = Ingest(site.env, port=port)
        done, events = await build
        assert done.returncode == 0, done.stderr[-3000:]
        stored = await _stored(site.dsn)
        _check_against_json(stored, events, site.key)
        assert stored["invocation"]["status"] == "success"
        assert stored["invocation"]["events"] == stored["invocation"]["last_event_seq"]
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def test_two_ingest_processes_racing_for_one_invocation(site: Site) -> None:
    nodes = [Ingest(site.env), Ingest(site.env)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{n.port}") for n in nodes]
    try:
        stream = sample_stream("raced", tests=200)
        outcomes = await asyncio.gather(*(publish(ch, stream, key=site.key) for ch in channels))
        codes = sorted(o.code.name for o in outcomes)
        # One lost its fence (UNAVAILABLE, which Bazel retries; gRPC's Python client may
        # report its own write failing first, INTERNAL) or they serialized cleanly.
        assert codes in (["OK", "OK"], ["OK", "UNAVAILABLE"], ["INTERNAL", "OK"]), [
            o.details for o in outcomes
        ]
        # The loser is Bazel retrying: it resumes from its first unacked event.
        for outcome in outcomes:
            if outcome.code != grpc.StatusCode.OK:
                rest = stream[len(outcome.acks) :]
                again = await publish(channels[0], rest, key=site.key)
                assert again.code == grpc.StatusCode.OK, again.details
        stored = await _stored(site.dsn)
        inv = stored["invocation"]
        assert stored["seqs"] == list(range(1, len(stream) + 1))
        assert inv["events"] == len(stream)
        assert inv["tests_total"] == 200
        assert len(stored["targets"]) == 200
    finally:
        for ch in channels:
            await ch.close()
        for node in nodes:
            node.stop()


@pytest.fixture
async def channel(ingest: Ingest) -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{ingest.port}")
    try:
        yield ch
    finally:
        await ch.close()


async def test_a_revoked_key_stops_at_once_on_a_running_node(
    site: Site, channel: grpc.aio.Channel
) -> None:
    assert (await publish(channel, sample_stream("k1"), key=site.key)).code == grpc.StatusCode.OK
    key_id = site.key.split("_")[1]
    assert await asyncio.to_thread(bep_cli, site.env, "key", "revoke", key_id) == "revoked"

    async def refused() -> bool:
        outcome = await publish(channel, sample_stream("k2")[:1], key=site.key)
        return outcome.code == grpc.StatusCode.UNAUTHENTICATED

    # Well inside the 300 s cache TTL: the NATS invalidation did it.
    await wait_until(refused, within=10, interval=0.2, message="the revoked key refused")
