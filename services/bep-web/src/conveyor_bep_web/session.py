"""Signed cookies: the session of a signed-in user and the short-lived state of a sign-in
in progress (state, nonce, PKCE verifier).

A cookie is ``<payload>.<mac>``: base64url JSON with an expiry, and its HMAC-SHA256
under a key derived from the session secret and the cookie's purpose, so that one kind
of cookie can never pass for another. Nothing secret is inside; the MAC makes it
tamper-proof, and the server keeps what may end a session early
(``bep.users.session_generation``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from typing import Any

#: The session cookie of a signed-in user.
SESSION_COOKIE = "bep_web_session"
#: The cookie holding a sign-in in progress, between /auth/login and /auth/callback.
LOGIN_COOKIE = "bep_web_login"


def b64url(data: bytes) -> str:
    """Unpadded base64url, as JOSE and PKCE use it."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class CookieSigner:
    """Signs and verifies the web UI's cookies with the session secret."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a session secret is required")
        self._secret = secret.encode()

    def _mac(self, purpose: str, data: str) -> str:
        key = hmac.new(self._secret, f"conveyor-bep-web:{purpose}".encode(), hashlib.sha256)
        return b64url(hmac.new(key.digest(), data.encode(), hashlib.sha256).digest())

    def sign(
        self, purpose: str, payload: dict[str, Any], *, ttl: float, now: float | None = None
    ) -> str:
        """A cookie value carrying ``payload`` for ``ttl`` seconds."""
        issued = time.time() if now is None else now
        body = {**payload, "exp": int(issued + ttl)}
        data = b64url(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())
        return f"{data}.{self._mac(purpose, data)}"

    def verify(
        self, purpose: str, value: str, *, now: float | None = None
    ) -> dict[str, Any] | None:
        """The payload of a genuine, unexpired cookie of ``purpose``, else None."""
        data, sep, mac = value.partition(".")
        if not sep or not hmac.compare_digest(mac.encode(), self._mac(purpose, data).encode()):
            return None
        try:
            body = json.loads(_unb64url(data))
        except (ValueError, binascii.Error):
            return None
        if not isinstance(body, dict) or not isinstance(body.get("exp"), int):
            return None
        if body["exp"] <= (time.time() if now is None else now):
            return None
        return body
