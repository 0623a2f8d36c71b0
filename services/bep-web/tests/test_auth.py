"""Who sees what: open mode, and signing in through OpenID Connect against a real local
issuer (:class:`conveyor_testkit.oidc.LocalIssuer`), the whole authorization code flow
with PKCE, state and nonce driven by hand; tokens and cookies that must be refused; the
project set a user's groups give, as the SQL restriction every read takes."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import httpx
import pytest
from conveyor_bep.keys import create_project
from conveyor_bep.store import BEP_MIGRATIONS
from conveyor_bep_web import oidc
from conveyor_bep_web.app import create_app
from conveyor_bep_web.session import LOGIN_COOKIE, SESSION_COOKIE, CookieSigner
from conveyor_runtime.settings import BepWebSettings
from conveyor_testkit.oidc import IssuerUser, LocalIssuer, sign_in
from fastapi import FastAPI
from pydantic import ValidationError

pytestmark = pytest.mark.postgres

ADMIN_TOKEN = "admin-token-0123456789"
SESSION_SECRET = "session-secret-0123456789abcdefghijklmnop"
PUBLIC = "http://testserver"


def oidc_settings(issuer: LocalIssuer, **overrides: Any) -> BepWebSettings:
    values: dict[str, Any] = {
        "bep_web_oidc_issuer": issuer.url,
        "bep_web_oidc_client_id": issuer.client_id,
        "bep_web_oidc_client_secret": issuer.client_secret,
        "bep_web_public_url": PUBLIC,
        "bep_web_session_secret": SESSION_SECRET,
        "bep_web_admin_groups": "platform, sre",
        "bep_web_admin_token": ADMIN_TOKEN,
    }
    return BepWebSettings(**(values | overrides))


@pytest.fixture
async def pool(fresh_pg_dsn: str) -> AsyncIterator[asyncpg.Pool[Any]]:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    async with asyncpg.create_pool(fresh_pg_dsn, min_size=1, max_size=4) as pool:
        yield pool


@pytest.fixture
def issuer() -> Iterator[LocalIssuer]:
    with LocalIssuer(client_id="bep-web", client_secret="client-secret-xyz") as running:
        yield running


def client(app: FastAPI, base: str = PUBLIC) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base)


async def projects(pool: Any, spec: dict[str, tuple[list[str], list[str]]]) -> dict[str, int]:
    """Projects by slug: (allowed groups, admin groups)."""
    ids = {}
    async with pool.acquire() as conn:
        for slug, (allowed, admins) in spec.items():
            ids[slug] = await create_project(conn, slug)
            await conn.execute(
                "UPDATE bep.projects SET allowed_groups = $2, admin_groups = $3 WHERE id = $1",
                ids[slug],
                allowed,
                admins,
            )
    return ids


async def test_open_mode_reads_freely_and_the_admin_token_is_the_admin(pool: Any) -> None:
    await projects(pool, {"a": ([], []), "b": (["x"], [])})
    app = create_app(BepWebSettings(bep_web_admin_token=ADMIN_TOKEN), pool)
    async with client(app) as web:
        me = (await web.get("/auth/me")).json()
        assert me == {
            "mode": "open",
            "subject": "anonymous",
            "admin": False,
            "projects": None,
            "admin_projects": [],
        }
        listed = (await web.get("/api/projects")).json()["projects"]
        assert {p["slug"] for p in listed} == {"a", "b"}
        page = await web.get("/")
        assert page.status_code == 200
        auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        assert (await web.get("/auth/me", headers=auth)).json()["admin"] is True
        wrong = {"authorization": "Bearer not-the-token"}
        assert (await web.get("/auth/me", headers=wrong)).json()["admin"] is False
        assert (await web.get("/auth/login")).status_code == 404
        assert (await web.get("/auth/callback?code=x&state=y")).status_code == 404


async def test_settings_need_client_public_url_and_a_long_session_secret() -> None:
    base: dict[str, Any] = {"bep_web_oidc_issuer": "https://idp.example.com"}
    with pytest.raises(ValidationError, match="bep_web_oidc_client_id"):
        BepWebSettings(**base)
    with pytest.raises(ValidationError, match="bep_web_public_url"):
        BepWebSettings(**base, bep_web_oidc_client_id="c")
    with pytest.raises(ValidationError, match="bep_web_session_secret"):
        BepWebSettings(
            **base,
            bep_web_oidc_client_id="c",
            bep_web_public_url=PUBLIC,
            bep_web_session_secret="short",
        )


async def test_sign_in_flow_gives_the_projects_of_the_users_groups(
    pool: Any, issuer: LocalIssuer
) -> None:
    ids = await projects(
        pool,
        {
            "allows-x": (["x"], []),
            "allows-y": (["y"], []),
            "admin-x": (["z"], ["x"]),
            "nobody": ([], []),
            "both": (["x", "y"], []),
        },
    )
    issuer.user = IssuerUser("alice-sub", email="alice@example.com", name="Alice", groups=["x"])
    app = create_app(oidc_settings(issuer), pool)
    async with client(app) as web:
        done = await sign_in(web, next="/p/allows-x?status=failed")
        assert done.status_code == 303, done.text
        assert done.headers["location"] == "/p/allows-x?status=failed"
        cookie = next(
            c for c in done.headers.get_list("set-cookie") if c.startswith(SESSION_COOKIE)
        )
        assert "HttpOnly" in cookie
        assert "SameSite=lax" in cookie
        assert "Secure" not in cookie  # http public URL

        # PKCE, state and nonce went the whole way.
        (authorize,) = issuer.authorize_requests
        (token_request,) = issuer.token_requests
        assert authorize["code_challenge"] == oidc.pkce_challenge(token_request["code_verifier"])
        assert authorize["nonce"]
        assert authorize["state"]
        assert authorize["redirect_uri"] == f"{PUBLIC}/auth/callback"
        assert "client_secret" not in token_request  # Basic auth

        me = (await web.get("/auth/me")).json()
        expected = sorted([ids["allows-x"], ids["admin-x"], ids["both"]])
        assert me["subject"] == "alice-sub"
        assert me["admin"] is False
        assert me["projects"] == expected
        assert me["admin_projects"] == [ids["admin-x"]]

        # The restriction every read takes, in SQL, and through the core's API.
        async with pool.acquire() as conn:
            visible = await conn.fetch(
                "SELECT slug FROM bep.projects WHERE $1::bigint[] IS NULL OR id = ANY($1)"
                " ORDER BY slug",
                me["projects"],
            )
        assert [r["slug"] for r in visible] == ["admin-x", "allows-x", "both"]
        listed = (await web.get("/api/projects")).json()["projects"]
        assert sorted(p["slug"] for p in listed) == ["admin-x", "allows-x", "both"]
        assert (await web.get("/api/projects/allows-y/builds")).status_code == 404

        # A project's groups take effect at once, without signing in again.
        await pool.execute("UPDATE bep.projects SET allowed_groups = '{x}' WHERE slug = 'nobody'")
        assert ids["nobody"] in (await web.get("/auth/me")).json()["projects"]

    user = await pool.fetchrow("SELECT * FROM bep.users")
    assert user["subject"] == "alice-sub"
    assert user["email"] == "alice@example.com"
    assert list(user["groups"]) == ["x"]


async def test_members_of_an_admin_group_are_global_admins(pool: Any, issuer: LocalIssuer) -> None:
    await projects(pool, {"a": (["x"], []), "b": ([], [])})
    issuer.user = IssuerUser("root-sub", groups=["sre", "other"])
    async with client(create_app(oidc_settings(issuer), pool)) as web:
        assert (await sign_in(web)).status_code == 303
        me = (await web.get("/auth/me")).json()
        assert me["admin"] is True
        assert me["projects"] is None
        assert (await web.get("/api/admin/projects")).status_code == 200


async def test_without_a_session_api_is_401_and_pages_redirect(
    pool: Any, issuer: LocalIssuer
) -> None:
    await projects(pool, {"a": ([], [])})
    async with client(create_app(oidc_settings(issuer), pool)) as web:
        for path in ("/auth/me", "/api/projects", "/api/admin/projects"):
            assert (await web.get(path)).status_code == 401, path
        page = await web.get("/p/a?status=failed")
        assert page.status_code == 303
        assert page.headers["location"] == "/auth/login?next=%2Fp%2Fa%3Fstatus%3Dfailed"
        assert (await web.get("/")).headers["location"] == "/auth/login?next=%2F"
        # The admin token keeps working for automation.
        auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        assert (await web.get("/auth/me", headers=auth)).json()["admin"] is True
        assert (await web.get("/api/projects", headers=auth)).status_code == 200
        wrong = {"authorization": "Bearer nope"}
        assert (await web.get("/api/projects", headers=wrong)).status_code == 401


def _reseal(value: str, change: dict[str, Any]) -> str:
    """``value`` with its payload changed and the old MAC kept (a forgery)."""
    data, _, mac = value.partition(".")
    body = json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
    forged = base64.urlsafe_b64encode(json.dumps(body | change).encode()).rstrip(b"=").decode()
    return f"{forged}.{mac}"


async def test_a_tampered_or_foreign_session_cookie_is_refused(
    pool: Any, issuer: LocalIssuer
) -> None:
    await projects(pool, {"a": (["x"], [])})
    async with pool.acquire() as conn:
        await conn.execute("INSERT INTO bep.users (subject, groups) VALUES ('boss', '{sre}')")
    issuer.user = IssuerUser("alice", groups=["x"])
    app = create_app(oidc_settings(issuer), pool)
    async with client(app) as web:
        await sign_in(web)
        genuine = web.cookies[SESSION_COOKIE]
        assert (await web.get("/auth/me")).status_code == 200
    signer = CookieSigner(SESSION_SECRET)
    assert signer.verify("session", genuine) is not None
    data, _, mac = genuine.partition(".")
    flipped = mac[:-2] + ("AA" if mac[-2:] != "AA" else "BB")
    forgeries = {
        "other subject, old MAC": _reseal(genuine, {"sub": "boss"}),
        "longer expiry, old MAC": _reseal(genuine, {"exp": int(time.time()) + 10**8}),
        "MAC altered": f"{data}.{flipped}",
        "no MAC": data,
        "another secret": CookieSigner("x" * 40).sign(
            "session", {"sub": "boss", "gen": 0}, ttl=600
        ),
        "a sign-in cookie as session": signer.sign("login", {"sub": "boss", "gen": 0}, ttl=600),
        "expired": signer.sign("session", {"sub": "alice", "gen": 0}, ttl=-1),
        "garbage": "....",
    }
    for what, value in forgeries.items():
        async with client(app) as web:
            web.cookies.set(SESSION_COOKIE, value)
            assert (await web.get("/auth/me")).status_code == 401, what
    # The genuine cookie, in a fresh client, still works; one sealed for the other
    # subject with the real secret would too (which is why the secret is a secret).
    async with client(app) as web:
        web.cookies.set(SESSION_COOKIE, genuine)
        assert (await web.get("/auth/me")).json()["subject"] == "alice"
        web.cookies.set(SESSION_COOKIE, signer.sign("session", {"sub": "boss", "gen": 0}, ttl=60))
        assert (await web.get("/auth/me")).json()["admin"] is True


@pytest.mark.parametrize(
    ("case", "overrides"),
    [
        ("wrong nonce", {"nonce": "not-the-nonce"}),
        ("no nonce", {"nonce": None}),
        ("expired", {"exp": int(time.time()) - 3600, "iat": int(time.time()) - 4000}),
        ("wrong audience", {"aud": "some-other-client"}),
        ("wrong issuer", {"iss": "http://127.0.0.1:1/evil"}),
        ("no subject", {"sub": None}),
        ("unknown key", {}),
    ],
)
async def test_a_bad_id_token_is_refused(
    pool: Any, issuer: LocalIssuer, case: str, overrides: dict[str, Any]
) -> None:
    issuer.claim_overrides = overrides
    issuer.rogue_key = case == "unknown key"
    async with client(create_app(oidc_settings(issuer), pool)) as web:
        done = await sign_in(web)
        assert done.status_code == 400, case
        assert "Sign-in failed" in done.text
        assert SESSION_COOKIE not in web.cookies
        assert (await web.get("/auth/me")).status_code == 401
    assert await pool.fetchval("SELECT count(*) FROM bep.users") == 0


async def test_state_mismatch_replay_and_issuer_errors_are_refused(
    pool: Any, issuer: LocalIssuer
) -> None:
    app = create_app(oidc_settings(issuer), pool)
    async with client(app) as web, httpx.AsyncClient() as browser:
        login = await web.get("/auth/login")
        back = (await browser.get(login.headers["location"])).headers["location"]
        tampered = back.replace("state=", "state=x")
        assert (await web.get(tampered)).status_code == 400
        # Without the sign-in cookie (another browser): refused.
        async with client(app) as other:
            assert (await other.get(back)).status_code == 400
        assert (await web.get(back)).status_code == 303
        # The same callback again: the sign-in cookie is gone, and the code used.
        web.cookies.delete(SESSION_COOKIE)
        assert (await web.get(back)).status_code == 400
        assert (await web.get("/auth/callback?error=access_denied")).status_code == 400


async def test_a_wrong_client_secret_is_refused_by_the_issuer(
    pool: Any, issuer: LocalIssuer
) -> None:
    settings = oidc_settings(issuer, bep_web_oidc_client_secret="wrong-secret")
    async with client(create_app(settings, pool)) as web:
        done = await sign_in(web)
        assert done.status_code == 400
        assert "invalid_client" in done.text


async def test_next_stays_on_this_site(pool: Any, issuer: LocalIssuer) -> None:
    async with client(create_app(oidc_settings(issuer), pool)) as web:
        for target in ("//evil.example.com/x", "https://evil.example.com/", "/\\evil"):
            done = await sign_in(web, next=target)
            assert done.headers["location"] == "/", target


async def test_cookies_are_secure_behind_https(pool: Any, issuer: LocalIssuer) -> None:
    https = "https://builds.example.com"
    app = create_app(oidc_settings(issuer, bep_web_public_url=https), pool)
    async with client(app, https) as web:
        login = await web.get("/auth/login")
        assert "Secure" in login.headers["set-cookie"]
        assert LOGIN_COOKIE in login.headers["set-cookie"]
        done = await sign_in(web)
        assert done.status_code == 303
        assert "Secure" in done.headers["set-cookie"]


async def test_sign_out_ends_every_session_of_the_user(pool: Any, issuer: LocalIssuer) -> None:
    issuer.user = IssuerUser("alice", groups=["x"])
    app = create_app(oidc_settings(issuer), pool)
    async with client(app) as laptop, client(app) as phone:
        await sign_in(laptop)
        await sign_in(phone)
        kept = laptop.cookies[SESSION_COOKIE]
        out = await phone.post("/auth/logout")
        assert out.status_code == 303
        assert SESSION_COOKIE not in phone.cookies
        assert (await laptop.get("/auth/me")).status_code == 401
        laptop.cookies.clear()
        laptop.cookies.set(SESSION_COOKIE, kept)
        assert (await laptop.get("/auth/me")).status_code == 401
        laptop.cookies.clear()
        await sign_in(laptop)  # signing in again works
        assert (await laptop.get("/auth/me")).json()["subject"] == "alice"


async def test_a_public_client_signs_in_with_pkce_alone(pool: Any) -> None:
    with LocalIssuer(client_id="public-web", client_secret=None) as public:
        settings = oidc_settings(public, bep_web_oidc_client_secret=None)
        async with client(create_app(settings, pool)) as web:
            assert (await sign_in(web)).status_code == 303
            (form,) = public.token_requests
            assert form["client_id"] == "public-web"
            assert "client_secret" not in form
            assert (await web.get("/auth/me")).json()["subject"] == public.user.subject
