"""Signing in through OpenID Connect: the authorization code flow with PKCE, state and
nonce, and the ``/auth`` routes.

``/auth/login`` keeps a fresh state, nonce and PKCE verifier in a signed cookie (ten
minutes, path ``/auth``) and redirects to the issuer's authorization endpoint (from its
``/.well-known/openid-configuration``). ``/auth/callback`` checks the state, exchanges
the code and the verifier at the token endpoint, verifies the ID token (RS256 with the
issuer's JWKS; issuer, audience = the client id, expiry, nonce), records the user and
their groups in ``bep.users`` and sets the session cookie. ``/auth/logout`` ends every
session of the user. ``/auth/me`` says who the caller is and what they may see.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, Any
from urllib.parse import quote_plus, urlencode

import httpx
import jwt
from conveyor_runtime.settings import BepWebSettings
from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import PlainTextResponse, RedirectResponse

from conveyor_bep_web.auth import (
    Viewer,
    cookie_signer,
    current_viewer,
    oidc_enabled,
    secure_cookies,
    session_viewer,
)
from conveyor_bep_web.session import LOGIN_COOKIE, SESSION_COOKIE, b64url

logger = logging.getLogger(__name__)

#: Seconds a sign-in may take between /auth/login and /auth/callback.
LOGIN_TTL = 600.0
#: Seconds of clock skew allowed on the ID token's times.
LEEWAY = 30.0
#: Seconds the discovery document and the keys are kept, and the shortest time between
#: two key refetches for an unknown key id.
METADATA_TTL = 3600.0
REFETCH_INTERVAL = 60.0


class SignInError(Exception):
    """A sign-in that cannot complete; the message is safe to show."""


@dataclass
class OidcProvider:
    """The issuer's discovery document and signing keys: fetched on first use, again
    after :data:`METADATA_TTL`, and again (at most every :data:`REFETCH_INTERVAL`) when
    a token names a key not seen yet (the issuer rotated its keys)."""

    issuer: str
    timeout: float = 10.0
    _metadata: dict[str, Any] | None = None
    _keys: dict[str, Any] = field(default_factory=dict)
    _fetched_at: float = 0.0
    _keys_fetched_at: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def client(self) -> httpx.AsyncClient:
        """An HTTP client for one exchange with the issuer."""
        return httpx.AsyncClient(timeout=self.timeout, follow_redirects=False)

    async def metadata(self, http: httpx.AsyncClient) -> dict[str, Any]:
        """The discovery document (its ``issuer`` must be exactly the configured one)."""
        async with self._lock:
            if self._metadata is None or time.monotonic() - self._fetched_at > METADATA_TTL:
                url = self.issuer.rstrip("/") + "/.well-known/openid-configuration"
                doc = await _get_json(http, url)
                if doc.get("issuer") != self.issuer:
                    raise SignInError("the issuer's discovery document names another issuer")
                for name in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
                    if not isinstance(doc.get(name), str):
                        raise SignInError(f"the issuer's discovery document lacks {name}")
                self._metadata, self._fetched_at = doc, time.monotonic()
                self._keys, self._keys_fetched_at = {}, 0.0
            return self._metadata

    async def signing_key(self, http: httpx.AsyncClient, kid: str | None) -> Any:
        """The public key that signed a token whose header names ``kid``."""
        metadata = await self.metadata(http)
        async with self._lock:
            key = self._pick(kid)
            if key is None and time.monotonic() - self._keys_fetched_at > REFETCH_INTERVAL:
                jwks = await _get_json(http, metadata["jwks_uri"])
                keys: dict[str, Any] = {}
                for jwk in jwt.PyJWKSet.from_dict(jwks).keys:
                    if jwk.key_type == "RSA" and jwk.public_key_use in (None, "sig"):
                        keys[jwk.key_id or ""] = jwk.key
                self._keys, self._keys_fetched_at = keys, time.monotonic()
                key = self._pick(kid)
            if key is None:
                raise SignInError("the ID token is signed with a key the issuer does not list")
            return key

    def _pick(self, kid: str | None) -> Any:
        if kid is not None:
            return self._keys.get(kid)
        return next(iter(self._keys.values())) if len(self._keys) == 1 else None


async def _get_json(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    try:
        response = await http.get(url)
    except httpx.HTTPError as error:
        raise SignInError(f"the issuer is unreachable ({type(error).__name__})") from None
    if response.status_code != 200:
        raise SignInError(f"the issuer answered {response.status_code} for {url}")
    try:
        body = response.json()
    except ValueError:
        raise SignInError(f"the issuer sent no JSON for {url}") from None
    if not isinstance(body, dict):
        raise SignInError(f"the issuer sent no JSON object for {url}")
    return body


def provider(request: Request) -> OidcProvider:
    """The app's :class:`OidcProvider` (made on first use, kept in ``app.state``)."""
    settings: BepWebSettings = request.app.state.settings
    issuer = settings.bep_web_oidc_issuer
    if not issuer:
        raise HTTPException(404, "OpenID Connect is not configured (open mode)")
    current: OidcProvider | None = getattr(request.app.state, "oidc_provider", None)
    if current is None or current.issuer != issuer:
        current = OidcProvider(issuer)
        request.app.state.oidc_provider = current
    return current


def redirect_uri(settings: BepWebSettings) -> str:
    """The callback the issuer sends the browser back to."""
    return (settings.bep_web_public_url or "").rstrip("/") + "/auth/callback"


def pkce_challenge(verifier: str) -> str:
    """The S256 code challenge of a PKCE verifier."""
    return b64url(hashlib.sha256(verifier.encode()).digest())


def verify_id_token(
    token: str,
    key: Any,
    *,
    issuer: str,
    client_id: str,
    nonce: str,
) -> dict[str, Any]:
    """The claims of an ID token that is RS256-signed by ``key``, from ``issuer``, for
    ``client_id``, unexpired and carrying ``nonce``; else :class:`SignInError`."""
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key,
            algorithms=["RS256"],
            audience=client_id,
            issuer=issuer,
            leeway=LEEWAY,
            options={"require": ["exp", "iat", "iss", "aud", "sub"]},
        )
    except jwt.PyJWTError as error:
        raise SignInError(f"the ID token is not valid: {error}") from None
    audience = claims["aud"]
    if isinstance(audience, list) and len(audience) > 1 and claims.get("azp") != client_id:
        raise SignInError("the ID token is not valid: it was issued to another party")
    token_nonce = claims.get("nonce")
    if not isinstance(token_nonce, str) or not hmac.compare_digest(
        token_nonce.encode(), nonce.encode()
    ):
        raise SignInError("the ID token is not valid: wrong nonce")
    if not isinstance(claims["sub"], str) or not claims["sub"]:
        raise SignInError("the ID token is not valid: no subject")
    return claims


def groups_of(claims: dict[str, Any], claim: str) -> list[str]:
    """The groups in ``claims[claim]`` (a dotted name reaches into nested objects; a
    single string is one group)."""
    value: Any = claims
    for part in claim.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        return []
    return sorted({g for g in value if isinstance(g, str) and g})


def _safe_next(target: str | None) -> str:
    # Only a path on this site: never another host (an open redirect).
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    return target


def _fail(message: str) -> PlainTextResponse:
    logger.warning("bep_web.sign_in_failed reason=%r", message)
    return PlainTextResponse(
        f"Sign-in failed: {message}.\nStart again at /auth/login.\n", status_code=400
    )


router = APIRouter(prefix="/auth", tags=["auth"])


@router.get("/login")
async def login(request: Request, next: str | None = None) -> Response:
    """Start a sign-in: redirect to the issuer's authorization endpoint."""
    settings: BepWebSettings = request.app.state.settings
    oidc = provider(request)
    try:
        async with oidc.client() as http:
            metadata = await oidc.metadata(http)
    except SignInError as error:
        logger.warning("bep_web.oidc_unavailable reason=%r", str(error))
        raise HTTPException(502, f"the identity provider is unavailable: {error}") from None
    state, nonce = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    verifier = secrets.token_urlsafe(48)
    query = urlencode(
        {
            "response_type": "code",
            "client_id": settings.bep_web_oidc_client_id or "",
            "redirect_uri": redirect_uri(settings),
            "scope": settings.bep_web_oidc_scopes,
            "state": state,
            "nonce": nonce,
            "code_challenge": pkce_challenge(verifier),
            "code_challenge_method": "S256",
        }
    )
    endpoint: str = metadata["authorization_endpoint"]
    response = RedirectResponse(
        endpoint + ("&" if "?" in endpoint else "?") + query, status_code=303
    )
    pending = {"state": state, "nonce": nonce, "verifier": verifier, "next": _safe_next(next)}
    response.set_cookie(
        LOGIN_COOKIE,
        cookie_signer(settings).sign("login", pending, ttl=LOGIN_TTL),
        max_age=int(LOGIN_TTL),
        path="/auth",
        httponly=True,
        secure=secure_cookies(settings),
        samesite="lax",
    )
    return response


async def _exchange(
    http: httpx.AsyncClient,
    settings: BepWebSettings,
    metadata: dict[str, Any],
    code: str,
    verifier: str,
) -> str:
    client_id = settings.bep_web_oidc_client_id or ""
    form = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": redirect_uri(settings),
        "code_verifier": verifier,
    }
    headers = {"accept": "application/json"}
    secret = settings.bep_web_oidc_client_secret
    methods = metadata.get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]
    if secret is None:
        form["client_id"] = client_id
    elif "client_secret_basic" in methods:
        # RFC 6749 2.3.1: both parts form-encoded before the Basic encoding.
        pair = f"{quote_plus(client_id)}:{quote_plus(secret.get_secret_value())}"
        headers["authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    else:
        form |= {"client_id": client_id, "client_secret": secret.get_secret_value()}
    try:
        response = await http.post(metadata["token_endpoint"], data=form, headers=headers)
    except httpx.HTTPError as failure:
        raise SignInError(f"the token endpoint is unreachable ({type(failure).__name__})") from None
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code != 200 or not isinstance(body, dict):
        code_name = body.get("error", "") if isinstance(body, dict) else ""
        raise SignInError(
            f"the token endpoint refused the code ({response.status_code} {code_name})"
        )
    id_token = body.get("id_token")
    if not isinstance(id_token, str):
        raise SignInError("the token endpoint sent no ID token")
    return id_token


_UPSERT_USER = """
INSERT INTO bep.users (subject, email, name, groups) VALUES ($1, $2, $3, $4)
ON CONFLICT (subject) DO UPDATE
SET email = EXCLUDED.email, name = EXCLUDED.name, groups = EXCLUDED.groups,
    last_login_at = now()
RETURNING session_generation
"""


@router.get("/callback")
async def callback(
    request: Request,
    code: str | None = None,
    state: str | None = None,
    error: str | None = None,
) -> Response:
    """Finish a sign-in: check the state, exchange the code, verify the ID token, record
    the user and set the session cookie."""
    settings: BepWebSettings = request.app.state.settings
    oidc = provider(request)
    if error:
        return _fail(f"the identity provider refused: {error[:200]}")
    signer = cookie_signer(settings)
    pending = signer.verify("login", request.cookies.get(LOGIN_COOKIE, ""))
    if pending is None:
        return _fail("the sign-in expired or was started in another browser")
    if not state or not hmac.compare_digest(state.encode(), str(pending["state"]).encode()):
        return _fail("the state does not match")
    if not code:
        return _fail("no authorization code")
    try:
        async with oidc.client() as http:
            metadata = await oidc.metadata(http)
            id_token = await _exchange(http, settings, metadata, code, str(pending["verifier"]))
            try:
                kid = jwt.get_unverified_header(id_token).get("kid")
            except jwt.PyJWTError:
                raise SignInError("the ID token is malformed") from None
            key = await oidc.signing_key(http, kid if isinstance(kid, str) else None)
        claims = verify_id_token(
            id_token,
            key,
            issuer=metadata["issuer"],
            client_id=settings.bep_web_oidc_client_id or "",
            nonce=str(pending["nonce"]),
        )
    except SignInError as failure:
        return _fail(str(failure))
    subject = claims["sub"]
    groups = groups_of(claims, settings.bep_web_oidc_groups_claim)
    email, name = claims.get("email"), claims.get("name")
    generation = await request.app.state.pool.fetchval(
        _UPSERT_USER,
        subject,
        email if isinstance(email, str) else None,
        name if isinstance(name, str) else None,
        groups,
    )
    logger.info("bep_web.signed_in subject=%s groups=%d", subject, len(groups))
    response = RedirectResponse(_safe_next(str(pending.get("next"))), status_code=303)
    ttl = settings.bep_web_session_ttl
    response.set_cookie(
        SESSION_COOKIE,
        signer.sign("session", {"sub": subject, "gen": generation}, ttl=ttl),
        max_age=int(ttl),
        path="/",
        httponly=True,
        secure=secure_cookies(settings),
        samesite="lax",
    )
    response.delete_cookie(LOGIN_COOKIE, path="/auth")
    return response


@router.api_route("/logout", methods=["GET", "POST"])
async def logout(request: Request) -> Response:
    """Sign out: every session of the user ends (here and in other browsers)."""
    settings: BepWebSettings = request.app.state.settings
    if oidc_enabled(settings):
        viewer = await session_viewer(request)
        if viewer is not None:
            await request.app.state.pool.execute(
                "UPDATE bep.users SET session_generation = session_generation + 1"
                " WHERE subject = $1",
                viewer.subject,
            )
            logger.info("bep_web.signed_out subject=%s", viewer.subject)
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(
        SESSION_COOKIE, path="/", httponly=True, secure=secure_cookies(settings), samesite="lax"
    )
    return response


@router.get("/me")
async def me(
    request: Request, viewer: Annotated[Viewer, Depends(current_viewer)]
) -> dict[str, Any]:
    """Who the caller is: subject, global admin or not, the projects they read (null:
    all) and those they administer."""
    settings: BepWebSettings = request.app.state.settings
    return {
        "mode": "oidc" if oidc_enabled(settings) else "open",
        "subject": viewer.subject,
        "admin": viewer.admin,
        "projects": viewer.project_ids(),
        "admin_projects": sorted(viewer.admin_projects),
    }
