"""Artifact downloads: the files a build's events reference that the CAS sink holds are
listed on the build and streamed from the blob store, only to a viewer of the build's
project, only for digests the build references, text as plain text and the rest as
attachments."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_bep.blobs import DiskStore, blob_path, commit_blob
from conveyor_bep.stores import ConfiguredStore
from conveyor_bep_web.auth import Viewer, current_viewer
from conveyor_testkit.bep import request, sample_events
from conveyor_testkit.bep_web import (  # noqa: F401  (pytest fixtures)
    WebRig,
    web_rig_fixture,
)

pytestmark = [pytest.mark.postgres, pytest.mark.nats]

LOG = b"PASS: everything\n"
PROFILE = b"\x1f\x8b\x08 a gzipped profile"
STRAY = b"uploaded, never referenced"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _uri(data: bytes) -> str:
    return f"bytestream://cache.example.com/blobs/{_sha(data)}/{len(data)}"


def _build() -> list[bes.BuildEvent]:
    events = sample_events(tests=1)
    result = next(e for e in events if e.WhichOneof("payload") == "test_result")
    result.test_result.test_action_output.add(name="test.log", uri=_uri(LOG))
    logs = bes.BuildEvent(
        build_tool_logs=bes.BuildToolLogs(
            log=[bes.File(name="command.profile.gz", uri=_uri(PROFILE))]
        )
    )
    logs.id.build_tool_logs.SetInParent()
    return [*events[:-1], logs, events[-1]]


async def _stored(rig: WebRig, root: Path) -> None:
    """The blobs in the sink (as the CAS would have stored them) and a build that
    references two of them."""
    store = DiskStore(root)
    rig.web.app.state.blobs = ConfiguredStore(root, store)
    async with rig.pool.acquire() as conn:
        for data in (LOG, PROFILE, STRAY):
            await commit_blob(
                conn,
                store,
                project_id=rig.project_ids["acme"],
                key_prefix="acme",
                digest=_sha(data),
                size=len(data),
                temp=data,
                now=datetime.now(UTC),
                ttl=timedelta(hours=1),
            )
    events = _build()
    stream = [request("art-1", i + 1, bazel=e) for i, e in enumerate(events)]
    stream.append(request("art-1", len(events) + 1, finished=True))
    await rig.publish(stream)


async def test_a_builds_artifacts_are_listed_and_downloaded(
    web_rig: WebRig, tmp_path: Path
) -> None:
    await _stored(web_rig, tmp_path)
    listed = (await web_rig.client.get("/api/builds/art-1/artifacts")).json()["artifacts"]
    assert {(a["kind"], a["name"], a["size"], a["stored"]) for a in listed} == {
        ("test_output", "test.log", len(LOG), True),
        ("build_tool_log", "command.profile.gz", len(PROFILE), True),
    }
    log = next(a for a in listed if a["name"] == "test.log")
    got = await web_rig.client.get(log["href"])
    assert got.status_code == 200
    assert got.content == LOG
    assert got.headers["content-type"].startswith("text/plain")
    assert got.headers["x-content-type-options"] == "nosniff"
    profile = await web_rig.client.get(f"/api/builds/art-1/artifacts/{_sha(PROFILE)}")
    assert profile.content == PROFILE
    assert profile.headers["content-disposition"].startswith("attachment;")
    page = await web_rig.client.get("/b/art-1")
    assert log["href"] in page.text

    # A digest the build does not reference opens nothing, even one the sink holds.
    assert (
        await web_rig.client.get(f"/api/builds/art-1/artifacts/{_sha(STRAY)}")
    ).status_code == 404
    bad = await web_rig.client.get("/api/builds/art-1/artifacts/not-a-digest")
    assert bad.status_code == 400
    assert "SHA-256" in bad.json()["detail"]
    # Bytes gone from the store (pruned): 404, not an error.
    blob_path(tmp_path, "acme", _sha(LOG)).unlink()
    assert (await web_rig.client.get(log["href"])).status_code == 404


async def test_another_projects_viewer_gets_nothing(web_rig: WebRig, tmp_path: Path) -> None:
    await _stored(web_rig, tmp_path)
    allowed = frozenset({web_rig.project_ids["beta"]})
    web_rig.web.app.dependency_overrides[current_viewer] = lambda: Viewer("eve", allowed)
    assert (await web_rig.client.get("/api/builds/art-1/artifacts")).status_code == 404
    got = await web_rig.client.get(f"/api/builds/art-1/artifacts/{_sha(LOG)}")
    assert got.status_code == 404
    assert LOG not in got.content


async def test_without_a_blob_store_downloads_are_404(web_rig: WebRig, tmp_path: Path) -> None:
    await _stored(web_rig, tmp_path)
    web_rig.web.app.state.blobs = None
    got = await web_rig.client.get(f"/api/builds/art-1/artifacts/{_sha(LOG)}")
    assert got.status_code == 404
    assert "blob store" in got.json()["detail"]
