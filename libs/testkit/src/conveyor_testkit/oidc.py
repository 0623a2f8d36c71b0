"""A local OpenID Connect issuer for tests: a real HTTP server on a free loopback port
(stdlib ``http.server`` in a thread) with discovery, JWKS, an authorization endpoint and a
token endpoint.

The authorization endpoint signs nobody in interactively: it redirects straight back with
a code for :attr:`LocalIssuer.user`, the test's user (subject, email, groups). The token
endpoint checks the code (once only), the client's secret (Basic or in the form), the
redirect URI and the PKCE verifier, and answers with an RS256 ID token carrying the nonce
of the authorization request. :attr:`LocalIssuer.claim_overrides` bends the next tokens
(a wrong nonce, an expired token, another audience), :attr:`LocalIssuer.rogue_key` signs
them with a key the JWKS does not list.

    with LocalIssuer(client_id="web", client_secret="s3cret") as issuer:
        issuer.user = IssuerUser("alice", groups=["ci"])
        ...  # settings: bep_web_oidc_issuer=issuer.url
        response = await sign_in(web_client)  # the browser's round trip, by hand
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote_plus, urlencode, urlsplit

import httpx
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _uint(number: int) -> str:
    return _b64url(number.to_bytes((number.bit_length() + 7) // 8, "big"))


_KEYS: list[rsa.RSAPrivateKey] = []


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def sign_jwt(claims: dict[str, Any], key: rsa.RSAPrivateKey, *, kid: str) -> str:
    """An RS256 JSON Web Token of ``claims`` signed by ``key``."""
    header = {"alg": "RS256", "typ": "JWT", "kid": kid}
    signing_input = ".".join(
        _b64url(json.dumps(part, separators=(",", ":")).encode()) for part in (header, claims)
    )
    signature = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing_input}.{_b64url(signature)}"


@dataclass
class IssuerUser:
    """The person the issuer signs in."""

    subject: str
    email: str | None = None
    name: str | None = None
    groups: list[str] = field(default_factory=list)


@dataclass
class _Grant:
    client_id: str
    redirect_uri: str
    challenge: str
    nonce: str | None
    user: IssuerUser
    issued: float


class LocalIssuer:
    """The issuer (a context manager: it serves from ``__enter__`` to ``__exit__``)."""

    def __init__(
        self,
        *,
        client_id: str = "conveyor-bep-web",
        client_secret: str | None = "test-client-secret",
        user: IssuerUser | None = None,
    ) -> None:
        self.client_id = client_id
        self.client_secret = client_secret
        self.user = user or IssuerUser("user-1", email="user-1@example.com")
        #: Claims to put into (or, with value None, remove from) the next ID tokens.
        self.claim_overrides: dict[str, Any] = {}
        #: Sign the next ID tokens with a key the JWKS does not list.
        self.rogue_key = False
        #: Every authorization request's query and token request's form, in order.
        self.authorize_requests: list[dict[str, str]] = []
        self.token_requests: list[dict[str, str]] = []
        if not _KEYS:
            _KEYS.extend([_new_key(), _new_key()])  # the issuer's, and a rogue one
        self._key, self._rogue = _KEYS
        self.kid = "test-key-1"
        self._grants: dict[str, _Grant] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The issuer identifier (and base URL)."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> LocalIssuer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="test-oidc-issuer", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # What the endpoints answer.

    def discovery(self) -> dict[str, Any]:
        """The ``/.well-known/openid-configuration`` document."""
        return {
            "issuer": self.url,
            "authorization_endpoint": f"{self.url}/authorize",
            "token_endpoint": f"{self.url}/token",
            "jwks_uri": f"{self.url}/jwks",
            "response_types_supported": ["code"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
            "scopes_supported": ["openid", "email", "profile", "groups"],
        }

    def jwks(self) -> dict[str, Any]:
        """The issuer's public signing key as a JWK set."""
        numbers = self._key.public_key().public_numbers()
        return {
            "keys": [
                {
                    "kty": "RSA",
                    "use": "sig",
                    "alg": "RS256",
                    "kid": self.kid,
                    "n": _uint(numbers.n),
                    "e": _uint(numbers.e),
                }
            ]
        }

    def id_token(self, user: IssuerUser, *, nonce: str | None, audience: str) -> str:
        """An ID token for ``user``, with :attr:`claim_overrides` applied."""
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.url,
            "sub": user.subject,
            "aud": audience,
            "iat": now,
            "exp": now + 300,
            "auth_time": now,
            "groups": list(user.groups),
        }
        if nonce is not None:
            claims["nonce"] = nonce
        if user.email is not None:
            claims["email"] = user.email
        if user.name is not None:
            claims["name"] = user.name
        for name, value in self.claim_overrides.items():
            if value is None:
                claims.pop(name, None)
            else:
                claims[name] = value
        key = self._rogue if self.rogue_key else self._key
        return sign_jwt(claims, key, kid=self.kid)

    def authorize(self, query: dict[str, str]) -> tuple[int, dict[str, str], dict[str, Any]]:
        """The answer to an authorization request: a redirect back with a code."""
        self.authorize_requests.append(query)
        redirect = query.get("redirect_uri", "")
        problems = [
            query.get("response_type") != "code" and "response_type",
            query.get("client_id") != self.client_id and "client_id",
            "openid" not in query.get("scope", "").split() and "scope",
            query.get("code_challenge_method") != "S256" and "code_challenge_method",
            not query.get("code_challenge") and "code_challenge",
            not redirect.startswith(("http://", "https://")) and "redirect_uri",
        ]
        bad = [p for p in problems if p]
        if bad:
            return 400, {}, {"error": "invalid_request", "error_description": ",".join(bad)}
        code = secrets.token_urlsafe(24)
        with self._lock:
            self._grants[code] = _Grant(
                client_id=self.client_id,
                redirect_uri=redirect,
                challenge=query["code_challenge"],
                nonce=query.get("nonce"),
                user=IssuerUser(
                    self.user.subject, self.user.email, self.user.name, list(self.user.groups)
                ),
                issued=time.time(),
            )
        back = {"code": code}
        if "state" in query:
            back["state"] = query["state"]
        separator = "&" if "?" in redirect else "?"
        return 302, {"Location": redirect + separator + urlencode(back)}, {}

    def token(
        self, form: dict[str, str], authorization: str | None
    ) -> tuple[int, dict[str, str], dict[str, Any]]:
        """The answer to a token request."""
        self.token_requests.append(dict(form))
        client_id, secret = form.get("client_id"), form.get("client_secret")
        if authorization and authorization.lower().startswith("basic "):
            pair = base64.b64decode(authorization[6:]).decode()
            raw_id, _, raw_secret = pair.partition(":")
            client_id, secret = unquote_plus(raw_id), unquote_plus(raw_secret)
        if client_id != self.client_id or (
            self.client_secret is not None
            and not hmac.compare_digest((secret or "").encode(), self.client_secret.encode())
        ):
            return 401, {"WWW-Authenticate": "Basic"}, {"error": "invalid_client"}
        if form.get("grant_type") != "authorization_code":
            return 400, {}, {"error": "unsupported_grant_type"}
        with self._lock:
            grant = self._grants.pop(form.get("code", ""), None)  # a code works once
        if grant is None or time.time() - grant.issued > 60:
            return 400, {}, {"error": "invalid_grant", "error_description": "unknown code"}
        if form.get("redirect_uri") != grant.redirect_uri:
            return 400, {}, {"error": "invalid_grant", "error_description": "redirect_uri"}
        verifier = form.get("code_verifier", "")
        if _b64url(hashlib.sha256(verifier.encode()).digest()) != grant.challenge:
            return 400, {}, {"error": "invalid_grant", "error_description": "PKCE verifier"}
        return (
            200,
            {"Cache-Control": "no-store"},
            {
                "access_token": secrets.token_urlsafe(24),
                "token_type": "Bearer",
                "expires_in": 300,
                "id_token": self.id_token(grant.user, nonce=grant.nonce, audience=client_id),
            },
        )


def _handler(issuer: LocalIssuer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _answer(self, status: int, headers: dict[str, str], body: dict[str, Any]) -> None:
            data = json.dumps(body).encode() if body or status != 302 else b""
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            if parts.path == "/.well-known/openid-configuration":
                self._answer(200, {}, issuer.discovery())
            elif parts.path == "/jwks":
                self._answer(200, {}, issuer.jwks())
            elif parts.path == "/authorize":
                self._answer(*issuer.authorize(query))
            else:
                self._answer(404, {}, {"error": "not_found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode()
            form = {k: v[0] for k, v in parse_qs(raw).items()}
            if urlsplit(self.path).path == "/token":
                self._answer(*issuer.token(form, self.headers.get("Authorization")))
            else:
                self._answer(404, {}, {"error": "not_found"})

    return Handler


async def sign_in(web: httpx.AsyncClient, *, next: str = "/") -> httpx.Response:
    """A browser's sign-in, redirects followed by hand: ``/auth/login`` on the web app
    (``web``, which keeps the cookies), the issuer's authorization endpoint (over real
    HTTP), and the callback on the web app, whose answer is returned."""
    login = await web.get("/auth/login", params={"next": next})
    if login.status_code != 303:
        raise AssertionError(f"/auth/login answered {login.status_code}: {login.text}")
    async with httpx.AsyncClient() as browser:
        authorized = await browser.get(login.headers["location"])
    if authorized.status_code != 302:
        raise AssertionError(f"the issuer answered {authorized.status_code}: {authorized.text}")
    return await web.get(authorized.headers["location"])
