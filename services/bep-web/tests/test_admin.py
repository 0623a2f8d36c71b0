"""The admin API: who may use it, projects and their validation, keys issued once and
listed without secrets, revocation reaching an ingest node's key cache over NATS at once,
project admins confined to their projects, and an audit entry, secret-free, for every
change."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest
from conveyor_bep.keys import KeyCache, create_project
from conveyor_bep.store import BEP_MIGRATIONS
from conveyor_bep_web.app import create_app
from conveyor_runtime.settings import BepWebSettings
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.oidc import IssuerUser, LocalIssuer, sign_in
from conveyor_testkit.polling import wait_until
from fastapi import FastAPI
from nats.aio.client import Client as NatsClient

pytestmark = pytest.mark.postgres

ADMIN_TOKEN = "admin-token-0123456789"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
PUBLIC = "http://testserver"


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=PUBLIC)


@pytest.fixture
async def pool(fresh_pg_dsn: str) -> AsyncIterator[asyncpg.Pool[Any]]:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    async with asyncpg.create_pool(fresh_pg_dsn, min_size=1, max_size=4) as pool:
        yield pool


@pytest.fixture
def settings(subjects: Subjects) -> BepWebSettings:
    return BepWebSettings(bep_web_admin_token=ADMIN_TOKEN, subject_prefix=subjects.prefix)


async def audit_rows(pool: Any) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        "SELECT actor, action, project_id, target, details::text AS details"
        " FROM bep.audit_log ORDER BY id"
    )
    return [dict(r) for r in rows]


async def test_admin_routes_need_the_admin_token(pool: Any, settings: BepWebSettings) -> None:
    async with pool.acquire() as conn:
        await create_project(conn, "p")
    calls = [
        ("GET", "/api/admin/projects", None),
        ("POST", "/api/admin/projects", {"slug": "q"}),
        ("GET", "/api/admin/projects/p", None),
        ("PATCH", "/api/admin/projects/p", {"name": "P"}),
        ("GET", "/api/admin/projects/p/keys", None),
        ("POST", "/api/admin/projects/p/keys", {"name": "ci"}),
        ("POST", "/api/admin/projects/p/keys/0123456789abcdef/revoke", None),
        ("GET", "/api/admin/audit", None),
        ("GET", "/api/admin/users", None),
    ]
    async with client(create_app(settings, pool)) as web:
        for method, path, body in calls:
            anonymous = await web.request(method, path, json=body)
            assert anonymous.status_code == 401, (method, path)
            wrong = await web.request(
                method, path, json=body, headers={"authorization": "Bearer guess"}
            )
            assert wrong.status_code == 403, (method, path)
        assert (await web.get("/api/admin/projects", headers=AUTH)).status_code == 200
    # No admin token configured: nobody is the admin, whatever they send.
    async with client(create_app(BepWebSettings(), pool)) as web:
        assert (await web.get("/api/admin/projects", headers=AUTH)).status_code == 403
    assert await audit_rows(pool) == []


async def test_project_slugs_are_validated_and_unique(pool: Any, settings: BepWebSettings) -> None:
    async with client(create_app(settings, pool)) as web:
        for slug in ("Bad_Slug", "-lead", "", "x" * 64, "a b"):
            bad = await web.post("/api/admin/projects", json={"slug": slug}, headers=AUTH)
            assert bad.status_code == 422, slug
            assert "invalid project slug" in bad.json()["detail"]
        limits = await web.post(
            "/api/admin/projects", json={"slug": "ok", "max_streams": 0}, headers=AUTH
        )
        assert limits.status_code == 422
        groups = await web.post(
            "/api/admin/projects", json={"slug": "ok", "allowed_groups": [" "]}, headers=AUTH
        )
        assert groups.status_code == 422
        made = await web.post(
            "/api/admin/projects",
            json={"slug": "ok", "name": "OK", "allowed_groups": ["dev", " dev", "qa"]},
            headers=AUTH,
        )
        assert made.status_code == 201, made.text
        assert made.json()["allowed_groups"] == ["dev", "qa"]
        again = await web.post("/api/admin/projects", json={"slug": "ok"}, headers=AUTH)
        assert again.status_code == 409
        assert "exists" in again.json()["detail"]
    assert [r["action"] for r in await audit_rows(pool)] == ["project.create"]


async def test_every_change_is_audited_and_no_secret_is(
    pool: Any, settings: BepWebSettings
) -> None:
    async with client(create_app(settings, pool)) as web:
        made = await web.post(
            "/api/admin/projects",
            json={"slug": "app", "admin_groups": ["app-admins"]},
            headers=AUTH,
        )
        project_id = made.json()["id"]
        changed = await web.patch(
            "/api/admin/projects/app",
            json={"name": "The app", "max_streams": 10, "allowed_groups": ["dev"]},
            headers=AUTH,
        )
        assert changed.status_code == 200, changed.text
        assert changed.json()["max_streams"] == 10
        unchanged = await web.patch(
            "/api/admin/projects/app", json={"name": "The app"}, headers=AUTH
        )
        assert unchanged.status_code == 200
        issued = await web.post("/api/admin/projects/app/keys", json={"name": "ci"}, headers=AUTH)
        assert issued.status_code == 201
        key = issued.json()["key"]
        key_id = issued.json()["id"]
        assert key.startswith(f"conveyor_{key_id}_")
        secret = key.rsplit("_", 1)[1]

        listed = await web.get("/api/admin/projects/app/keys", headers=AUTH)
        assert [k["id"] for k in listed.json()["keys"]] == [key_id]
        assert secret not in listed.text
        revoked = await web.post(f"/api/admin/projects/app/keys/{key_id}/revoke", headers=AUTH)
        assert revoked.json() == {"id": key_id, "revoked": True, "announced": False}
        twice = await web.post(f"/api/admin/projects/app/keys/{key_id}/revoke", headers=AUTH)
        assert twice.json()["revoked"] is False
        missing = await web.post("/api/admin/projects/app/keys/nokey/revoke", headers=AUTH)
        assert missing.status_code == 404

        log = await web.get("/api/admin/audit", params={"limit": 3}, headers=AUTH)
        first = log.json()
        assert [e["action"] for e in first["entries"]] == ["key.revoke", "key.revoke", "key.create"]
        rest = await web.get(
            "/api/admin/audit", params={"before": first["next_before"]}, headers=AUTH
        )
        assert [e["action"] for e in rest.json()["entries"]] == ["project.update", "project.create"]
        assert rest.json()["next_before"] is None
        only = await web.get("/api/admin/audit", params={"project": "app"}, headers=AUTH)
        assert len(only.json()["entries"]) == 5
        assert secret not in log.text + rest.text

    rows = await audit_rows(pool)
    assert [(r["actor"], r["action"], r["project_id"], r["target"]) for r in rows] == [
        ("admin", "project.create", project_id, "app"),
        ("admin", "project.update", project_id, "app"),
        ("admin", "key.create", project_id, key_id),
        ("admin", "key.revoke", project_id, key_id),
        ("admin", "key.revoke", project_id, key_id),
    ]
    update = json.loads(rows[1]["details"])["changes"]
    assert update == {
        "name": {"from": "app", "to": "The app"},
        "max_streams": {"from": 200, "to": 10},
        "allowed_groups": {"from": [], "to": ["dev"]},
    }
    assert json.loads(rows[3]["details"]) == {"name": "ci", "was_live": True}
    for row in rows:
        assert secret not in json.dumps(row)
    # Nor anywhere else in the database but as its digest.
    dumped = await pool.fetchval(
        "SELECT string_agg(t::text, ' ') FROM (SELECT * FROM bep.api_keys) t"
    )
    assert secret not in dumped


async def test_a_revoked_key_stops_working_on_ingest_nodes_at_once(
    pool: Any, settings: BepWebSettings, nc: NatsClient
) -> None:
    node = KeyCache(pool, ttl=3600.0)  # an ingest node that would trust it for an hour
    await node.subscribe(nc, settings.subject_prefix)
    async with client(create_app(settings, pool, nc)) as web:
        await web.post("/api/admin/projects", json={"slug": "ci"}, headers=AUTH)
        key = (await web.post("/api/admin/projects/ci/keys", headers=AUTH, json={})).json()["key"]
        project = await node.authenticate(key)
        assert project is not None
        assert project.slug == "ci"
        revoked = await web.post(
            f"/api/admin/projects/ci/keys/{key.split('_')[1]}/revoke", headers=AUTH
        )
        assert revoked.json()["announced"] is True

        async def refused() -> bool:
            return await node.authenticate(key) is None

        await wait_until(refused, within=5, message="the node drops the revoked key")
    # A node that never saw the key refuses it too (the row is revoked).
    assert await KeyCache(pool).authenticate(key) is None


@pytest.fixture
def issuer() -> Iterator[LocalIssuer]:
    with LocalIssuer() as running:
        yield running


async def test_project_admins_manage_their_own_projects_only(
    pool: Any, issuer: LocalIssuer, subjects: Subjects
) -> None:
    async with pool.acquire() as conn:
        for slug, allowed, admins in (
            ("mine", [], ["team-x"]),
            ("seen", ["team-x"], []),
            ("hidden", [], []),
        ):
            project_id = await create_project(conn, slug)
            await conn.execute(
                "UPDATE bep.projects SET allowed_groups = $2, admin_groups = $3 WHERE id = $1",
                project_id,
                allowed,
                admins,
            )
    settings = BepWebSettings(
        bep_web_oidc_issuer=issuer.url,
        bep_web_oidc_client_id=issuer.client_id,
        bep_web_oidc_client_secret=issuer.client_secret,
        bep_web_public_url=PUBLIC,
        bep_web_session_secret="s" * 40,
        bep_web_admin_token=ADMIN_TOKEN,
        subject_prefix=subjects.prefix,
    )
    issuer.user = IssuerUser("bob-sub", email="bob@example.com", groups=["team-x"])
    same = {"origin": PUBLIC}
    async with client(create_app(settings, pool)) as web:
        await sign_in(web)
        listed = (await web.get("/api/admin/projects")).json()["projects"]
        assert [p["slug"] for p in listed] == ["mine"]
        key = await web.post("/api/admin/projects/mine/keys", json={"name": "bob"}, headers=same)
        assert key.status_code == 201, key.text
        renamed = await web.patch(
            "/api/admin/projects/mine",
            json={"name": "Mine", "allowed_groups": ["team-y"]},
            headers=same,
        )
        assert renamed.status_code == 200, renamed.text
        limits = await web.patch("/api/admin/projects/mine", json={"max_streams": 5}, headers=same)
        assert limits.status_code == 403
        assert (await web.get("/api/admin/projects/seen/keys")).status_code == 403
        assert (await web.get("/api/admin/projects/hidden/keys")).status_code == 404
        assert (await web.get("/api/admin/projects/none/keys")).status_code == 404
        created = await web.post("/api/admin/projects", json={"slug": "new"}, headers=same)
        assert created.status_code == 403
        assert (await web.get("/api/admin/users")).status_code == 403
        # Cross-site request forgery: a cookie-authenticated change from elsewhere.
        for headers in ({}, {"origin": "https://evil.example.com"}):
            forged = await web.post(
                "/api/admin/projects/mine/keys", json={"name": "x"}, headers=headers
            )
            assert forged.status_code == 403, headers
        log = (await web.get("/api/admin/audit")).json()["entries"]
        assert [(e["action"], e["actor"], e["actor_email"]) for e in log] == [
            ("project.update", "bob-sub", "bob@example.com"),
            ("key.create", "bob-sub", "bob@example.com"),
        ]
        assert (await web.get("/api/admin/audit?project=seen")).status_code == 403
        revoke = await web.post(
            f"/api/admin/projects/mine/keys/{key.json()['id']}/revoke", headers=same
        )
        assert revoke.json()["revoked"] is True
    async with client(create_app(settings, pool)) as web:
        # A reader of the project (its allowed groups, now team-y) administers nothing.
        issuer.user = IssuerUser("carol", groups=["team-y"])
        await sign_in(web)
        assert (await web.get("/auth/me")).json()["projects"] == [listed[0]["id"]]
        assert (await web.get("/api/admin/projects")).status_code == 403
        assert (await web.get("/api/admin/projects/mine/keys")).status_code == 403


async def test_admin_pages_are_shells_in_the_layout(pool: Any, settings: BepWebSettings) -> None:
    async with pool.acquire() as conn:
        await create_project(conn, "app")
    async with client(create_app(settings, pool)) as web:
        for path in ("/admin", "/p/app/settings"):
            shown = await web.get(path)
            assert shown.status_code == 200, path
            assert "/static/app.css" in shown.text
            assert 'id="token-form"' in shown.text  # open mode: the token is asked for
        settings_page = (await web.get("/p/app/settings")).text
        assert 'data-slug="app"' in settings_page
        assert 'id="keys"' in settings_page
        hostile = await web.get("/p/%3Cscript%3Ex/settings")
        assert "<script>x" not in hostile.text


async def test_admin_pages_need_a_session_with_oidc(pool: Any, issuer: LocalIssuer) -> None:
    settings = BepWebSettings(
        bep_web_oidc_issuer=issuer.url,
        bep_web_oidc_client_id=issuer.client_id,
        bep_web_oidc_client_secret=issuer.client_secret,
        bep_web_public_url=PUBLIC,
        bep_web_session_secret="s" * 40,
    )
    async with client(create_app(settings, pool)) as web:
        shown = await web.get("/p/app/settings")
        assert shown.status_code == 303
        assert shown.headers["location"] == "/auth/login?next=%2Fp%2Fapp%2Fsettings"
        await sign_in(web)
        signed_in = await web.get("/admin")
        assert signed_in.status_code == 200
        assert 'id="token-form"' not in signed_in.text
