"""The web UI's JSON API and pages over builds a real ingest stored: projects, the build
search (filters, facets, keyset pages), a build and its targets, tests and actions, the
project boundary (a viewer of one project never sees another's builds: 404, absent from
lists), bad input, HTML escaping, and the ``conveyor-bep-web serve`` process.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_bep_web.auth import Viewer, current_viewer
from conveyor_runtime.embedded_nats import EmbeddedNats, free_port
from conveyor_testkit.bep import Request, request, sample_events
from conveyor_testkit.bep_web import (  # noqa: F401  (pytest fixtures)
    WebRig,
    web_rig_fixture,
)

pytestmark = [pytest.mark.postgres, pytest.mark.nats]


def build_stream(
    invocation_id: str,
    *,
    user: str = "alice",
    branch: str = "main",
    tags: dict[str, str] | None = None,
    failing: bool = False,
    tests: int = 2,
    action: bool = False,
) -> list[Request]:
    """A whole build (``sample_events``) by ``user`` on ``branch`` with build metadata
    ``tags``; ``action``: one failed action; test results carry an output file."""
    events = sample_events(tests=tests, failing=failing)
    for event in events:
        kind = event.WhichOneof("payload")
        if kind == "build_metadata":
            event.build_metadata.metadata.clear()
            event.build_metadata.metadata.update({"BRANCH": branch, **(tags or {})})
        elif kind == "workspace_status":
            event.workspace_status.item[0].value = user
        elif kind == "test_result":
            label = event.id.test_result.label
            event.test_result.test_action_output.append(
                bes.File(name="test.log", uri=f"bytestream://cache/blobs/{label[-1]}abc/12")
            )
            if event.test_result.status == bes.FAILED:
                event.test_result.status_details = "assertion failed: 1 != 2"
    if action:
        executed = bes.BuildEvent(
            action=bes.ActionExecuted(
                success=False,
                type="CppCompile",
                exit_code=1,
                command_line=["gcc", "-c", "lib.c"],
                stderr=bes.File(name="stderr", uri="bytestream://cache/blobs/err/3"),
            )
        )
        executed.id.action_completed.label = "//pkg:lib"
        executed.id.action_completed.primary_output = "bazel-out/k8/bin/pkg/lib.o"
        events.insert(6, executed)
    requests = [request(invocation_id, i + 1, bazel=e) for i, e in enumerate(events)]
    requests.append(request(invocation_id, len(events) + 1, finished=True))
    return requests


def restrict(rig: WebRig, *projects: str) -> None:
    """Every request of the rig's app is from a viewer of ``projects`` only."""
    allowed = frozenset(rig.project_ids[p] for p in projects)
    rig.web.app.dependency_overrides[current_viewer] = lambda: Viewer("alice", allowed)


async def test_projects_list_with_build_counts(web_rig: WebRig) -> None:
    await web_rig.publish(build_stream("a-1"))
    await web_rig.publish(build_stream("a-2", failing=True))
    await web_rig.publish(build_stream("b-1"), project="beta")
    response = await web_rig.client.get("/api/projects")
    assert response.status_code == 200
    projects = {p["slug"]: p for p in response.json()["projects"]}
    assert set(projects) == {"acme", "beta"}
    assert (projects["acme"]["builds"], projects["acme"]["failed"]) == (2, 1)
    assert projects["acme"]["name"] == "Acme"
    assert projects["acme"]["id"] == web_rig.project_ids["acme"]
    assert (projects["beta"]["builds"], projects["beta"]["running"]) == (1, 0)

    page = await web_rig.client.get("/")
    assert page.status_code == 200
    assert 'data-project="acme"' in page.text
    assert 'data-project="beta"' in page.text


async def test_the_build_search_filters_counts_facets_and_pages(web_rig: WebRig) -> None:
    specs = [
        ("s-1", "alice", "main", {"ROLE": "CI"}, False),
        ("s-2", "bob", "main", {"ROLE": "CI"}, True),
        ("s-3", "alice", "dev", {"ROLE": "dev", "ARCH": "arm"}, False),
        ("s-4", "carol", "main", {"ROLE": "CI"}, False),
        ("s-5", "alice", "main", {"ROLE": "CI", "ARCH": "x86"}, True),
    ]
    for inv, user, branch, tags, failing in specs:
        await web_rig.publish(
            build_stream(inv, user=user, branch=branch, tags=tags, failing=failing)
        )
    await web_rig.publish(build_stream("other-project"), project="beta")

    async def search(**params: Any) -> dict[str, Any]:
        response = await web_rig.client.get("/api/projects/acme/builds", params=params)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    everything = await search()
    assert [b["invocation_id"] for b in everything["builds"]] == ["s-5", "s-4", "s-3", "s-2", "s-1"]
    assert everything["next"] is None
    facets = everything["facets"]
    assert {f["value"]: f["count"] for f in facets["status"]} == {"success": 3, "failed": 2}
    assert facets["user"][0] == {"value": "alice", "count": 3}
    assert {f["value"]: f["count"] for f in facets["branch"]} == {"main": 4, "dev": 1}
    assert {v["value"]: v["count"] for v in facets["tags"]["ROLE"]} == {"CI": 4, "dev": 1}
    assert {v["value"] for v in facets["tags"]["ARCH"]} == {"arm", "x86"}
    assert "BRANCH" in facets["tags"]
    assert facets["counted"] == 5
    assert facets["capped"] is False

    def ids(body: dict[str, Any]) -> list[str]:
        return [b["invocation_id"] for b in body["builds"]]

    assert ids(await search(status="failed")) == ["s-5", "s-2"]
    assert ids(await search(user="alice")) == ["s-5", "s-3", "s-1"]
    assert ids(await search(branch="dev")) == ["s-3"]
    assert ids(await search(tag="ROLE:CI")) == ["s-5", "s-4", "s-2", "s-1"]
    assert ids(await search(tag=["ROLE:CI", "ARCH:x86"])) == ["s-5"]
    assert ids(await search(user="alice", status="success")) == ["s-3", "s-1"]
    assert ids(await search(q="S-4")) == ["s-4"]  # free text, case-insensitive
    assert ids(await search(q="carol")) == ["s-4"]
    assert ids(await search(q="%")) == []  # a LIKE wildcard matches itself only
    # The facets count the filtered set.
    alice = await search(user="alice")
    assert {f["value"]: f["count"] for f in alice["facets"]["status"]} == {
        "success": 2,
        "failed": 1,
    }
    assert alice["facets"]["counted"] == 3

    # Keyset pages: newest first, no build twice, none missing, filters kept.
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 2, "facets": "false"}
        if cursor:
            params["before"] = cursor
        body = await search(**params)
        assert body["facets"] is None
        assert len(body["builds"]) <= 2
        seen += ids(body)
        pages += 1
        cursor = body["next"]
        if cursor is None:
            break
    assert seen == ["s-5", "s-4", "s-3", "s-2", "s-1"]
    assert pages == 3
    first = await search(user="alice", limit=1)
    second = await search(user="alice", limit=1, before=first["next"])
    assert (ids(first), ids(second)) == (["s-5"], ["s-3"])
    # A build row says what the list shows.
    row = everything["builds"][0]
    assert row["status"] == "failed"
    assert row["user_name"] == "alice"
    assert row["tags"] == {"BRANCH": "main", "ROLE": "CI", "ARCH": "x86"}
    assert (row["tests_total"], row["tests_failed"]) == (2, 1)
    assert row["duration_ms"] == 5000

    # The page: the form, the facets (links that add a filter), the rows, the next page.
    page = await web_rig.client.get("/p/acme", params={"user": "alice", "limit": 2})
    assert page.status_code == 200
    assert page.text.count('class="build"') == 2
    assert 'id="facets"' in page.text
    assert 'data-facet="tag:ROLE"' in page.text
    assert 'id="older"' in page.text
    tagged = await web_rig.client.get("/p/acme", params={"tags": "ROLE:dev"})
    assert 'data-invocation="s-3"' in tagged.text
    assert tagged.text.count('class="build"') == 1


async def test_a_build_its_targets_tests_and_actions(web_rig: WebRig) -> None:
    await web_rig.publish(build_stream("d-1", failing=True, tests=3, action=True))
    response = await web_rig.client.get("/api/builds/d-1")
    assert response.status_code == 200
    build = response.json()
    assert build["status"] == "failed"
    assert build["finished"] is True
    assert (build["exit_code"], build["exit_name"]) == (3, "TESTS_FAILED")
    assert build["command"] == "test"
    assert build["tool_version"] == "4.2.3"
    assert (build["user"], build["host"], build["branch"]) == ("alice", "ci-1", "main")
    assert build["project"] == {"id": web_rig.project_ids["acme"], "slug": "acme", "name": "Acme"}
    assert build["counters"]["targets_failed"] == 1
    assert build["counters"]["tests_total"] == 3
    assert build["counters"]["actions_failed"] == 1
    assert build["cache"]["actions_created"] == 7
    assert build["cache"]["test_results"] == 3
    assert build["timing"]["duration_ms"] == 5000
    assert build["command_line"] == ["bazel", "test", "//..."]
    assert build["options"]["cmd_line"] == ["//..."]
    assert build["metrics"]["action_summary"]["actions_executed"] == "5"
    assert build["log"]["bytes"] > 0

    targets = (await web_rig.client.get("/api/builds/d-1/targets")).json()
    assert [t["label"] for t in targets["targets"]] == [
        "//pkg:test_0",
        "//pkg:test_1",
        "//pkg:test_2",
    ]
    assert targets["targets"][0]["test_status"] == "FAILED"
    assert targets["targets"][0]["kind"] == "my_test rule"
    failed = (await web_rig.client.get("/api/builds/d-1/targets", params={"failed": 1})).json()
    assert [t["label"] for t in failed["targets"]] == ["//pkg:test_0"]
    paged = (await web_rig.client.get("/api/builds/d-1/targets", params={"limit": 2})).json()
    rest = (
        await web_rig.client.get("/api/builds/d-1/targets", params={"after": paged["next"]})
    ).json()
    assert [t["label"] for t in paged["targets"] + rest["targets"]] == [
        t["label"] for t in targets["targets"]
    ]
    assert rest["next"] is None

    tests = (await web_rig.client.get("/api/builds/d-1/tests")).json()["tests"]
    assert [(t["label"], t["status"]) for t in tests] == [
        ("//pkg:test_0", "FAILED"),
        ("//pkg:test_1", "PASSED"),
        ("//pkg:test_2", "PASSED"),
    ]
    assert tests[0]["status_details"] == "assertion failed: 1 != 2"
    assert tests[0]["outputs"] == [{"name": "test.log", "uri": "bytestream://cache/blobs/0abc/12"}]
    assert tests[0]["duration_ms"] == 12
    one = (await web_rig.client.get("/api/builds/d-1/tests", params={"limit": 1})).json()
    after = (
        await web_rig.client.get("/api/builds/d-1/tests", params={"after": one["next"], "limit": 5})
    ).json()
    assert [t["label"] for t in one["tests"] + after["tests"]] == [t["label"] for t in tests]

    actions = (await web_rig.client.get("/api/builds/d-1/actions")).json()["actions"]
    assert len(actions) == 1
    assert actions[0]["mnemonic"] == "CppCompile"
    assert actions[0]["success"] is False
    assert actions[0]["label"] == "//pkg:lib"
    assert actions[0]["exit_code"] == 1
    assert actions[0]["command_line"] == ["gcc", "-c", "lib.c"]

    page = await web_rig.client.get("/b/d-1")
    assert page.status_code == 200
    html = page.text
    for marker in (
        'id="status"',
        'data-status="failed"',
        'id="targets"',
        'id="tests"',
        'id="log-viewport"',
        'id="actions"',
        'id="options"',
        'id="counters"',
    ):
        assert marker in html, marker
    assert "//pkg:test_2" in html
    assert "assertion failed: 1 != 2" in html
    assert "bytestream://cache/blobs/0abc/12" in html
    assert "CppCompile" in html
    assert 'data-finished="1"' in html


async def test_everything_a_build_sent_is_escaped_in_the_pages(web_rig: WebRig) -> None:
    evil = "<script>alert(1)</script>"
    await web_rig.publish(build_stream("x-1", branch='<b onmouseover="x">', tags={"NOTE": evil}))
    for url in ("/b/x-1", "/p/acme"):
        html = (await web_rig.client.get(url)).text
        assert evil not in html, url
        assert "<b onmouseover" not in html, url
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, url
    js = await web_rig.client.get("/static/app.js")
    css = await web_rig.client.get("/static/app.css")
    assert js.status_code == css.status_code == 200
    assert js.headers["content-type"].startswith("text/javascript")
    assert "class LogEngine" in js.text
    assert "#log-window" in css.text
    assert (await web_rig.client.get("/static/nope.js")).status_code == 404


async def test_a_viewer_of_one_project_never_sees_another(web_rig: WebRig) -> None:
    await web_rig.publish(build_stream("mine-1"))
    await web_rig.publish(build_stream("theirs-1"), project="beta")
    restrict(web_rig, "acme")
    client = web_rig.client
    projects = (await client.get("/api/projects")).json()["projects"]
    assert [p["slug"] for p in projects] == ["acme"]
    assert (await client.get("/api/builds/mine-1")).status_code == 200
    # Another project's build is not found, on every route: exactly like a missing one.
    for path in ("", "/targets", "/tests", "/actions", "/log", "/log?download=1", "/live"):
        theirs = await client.get(f"/api/builds/theirs-1{path}")
        missing = await client.get(f"/api/builds/no-such-build{path}")
        assert theirs.status_code == missing.status_code == 404, path
        assert theirs.json() == missing.json() == {"detail": "no such build"}
    for path in ("/builds", "/live"):
        assert (await client.get(f"/api/projects/beta{path}")).status_code == 404
    assert (await client.get("/b/theirs-1")).status_code == 404
    assert (await client.get("/p/beta")).status_code == 404
    home = (await client.get("/")).text
    assert "beta" not in home
    assert "acme" in home
    # A search of one's own project never reaches into another (even by free text).
    found = (await client.get("/api/projects/acme/builds", params={"q": "theirs"})).json()
    assert found["builds"] == []
    assert found["facets"]["counted"] == 0
    # A viewer of no project sees nothing at all.
    restrict(web_rig)
    assert (await client.get("/api/projects")).json()["projects"] == []
    assert (await client.get("/api/builds/mine-1")).status_code == 404
    web_rig.web.app.dependency_overrides.clear()
    assert (await client.get("/api/builds/theirs-1")).status_code == 200


async def test_bad_input_is_refused_with_a_clear_message(web_rig: WebRig) -> None:
    await web_rig.publish(build_stream("bad-1"))
    client = web_rig.client
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        ("/api/projects/acme/builds", {"before": "not-a-cursor"}, 400, "bad cursor"),
        ("/api/projects/acme/builds", {"before": "W10"}, 400, "bad cursor"),  # "[]"
        ("/api/projects/acme/builds", {"before": "WyJ4IiwiMSJd"}, 400, "bad cursor"),
        ("/api/projects/acme/builds", {"limit": 0}, 422, "greater than or equal to 1"),
        ("/api/projects/acme/builds", {"limit": 100000}, 422, "less than or equal to 500"),
        ("/api/projects/acme/builds", {"limit": "many"}, 422, "valid integer"),
        ("/api/projects/acme/builds", {"tag": "no-colon"}, 400, "key:value"),
        ("/api/projects/acme/builds", {"tag": ":value"}, 400, "key:value"),
        ("/api/projects/acme/builds", {"status": "great"}, 400, "unknown status"),
        ("/api/builds/bad-1/log", {"offset": -1}, 422, "greater than or equal to 0"),
        ("/api/builds/bad-1/targets", {"after": "%%%"}, 400, "bad cursor"),
        ("/api/builds/bad-1/tests", {"after": "WyJ4Il0"}, 400, "bad cursor"),
        ("/api/builds/bad-1/actions", {"limit": 0}, 422, "greater than or equal to 1"),
        ("/api/projects/nope/builds", {}, 404, "no such project"),
    ]
    for path, params, status, message in cases:
        response = await client.get(path, params=params)
        assert response.status_code == status, (path, params, response.text)
        assert message in response.text, (path, params, response.text)
    page = await client.get("/p/acme", params={"before": "garbage"})
    assert page.status_code == 400
    assert "bad cursor" in page.text


@pytest.mark.e2e
async def test_the_serve_command_migrates_and_listens(fresh_pg_dsn: str, tmp_path: Path) -> None:
    port = free_port()
    errors = tmp_path / "stderr.txt"
    with EmbeddedNats() as nats, errors.open("w") as stderr:
        env = dict(
            os.environ,
            CONVEYOR_DSN=fresh_pg_dsn,
            CONVEYOR_NATS_URL=nats.url,
            CONVEYOR_LOG_LEVEL="warning",
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "conveyor_bep_web",
            "serve",
            "--port",
            str(port),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
        try:
            assert process.stdout is not None
            line = await asyncio.wait_for(process.stdout.readline(), 60)
            expected = f"conveyor-bep-web listening on http://127.0.0.1:{port}"
            assert line.decode().strip() == expected, errors.read_text()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                response = await client.get("/api/projects")
                assert response.status_code == 200
                assert response.json() == {"projects": []}
                assert (await client.get("/")).status_code == 200
        finally:
            if process.returncode is None:
                process.terminate()
            try:
                code = await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
                raise
    assert code == 0, errors.read_text()
