"""Who is asking: the viewer of a request, and which projects they may read.

Every read of the web process is restricted in SQL by :attr:`Viewer.projects` (None: every
project); admin routes need :attr:`Viewer.admin`, or for one project's keys and settings
that project in :attr:`Viewer.admin_projects`.

Open mode (no OpenID Connect issuer configured): every request is an anonymous viewer
of every project; a request bearing ``Authorization: Bearer <CONVEYOR_BEP_WEB_ADMIN_TOKEN>``
is the admin.

With an issuer (``CONVEYOR_BEP_WEB_OIDC_ISSUER``, see :mod:`conveyor_bep_web.oidc`) a
request needs a session cookie: without one, ``/api`` and ``/auth`` routes answer 401 and
pages redirect to ``/auth/login``. A signed-in user reads the projects whose
``allowed_groups`` or ``admin_groups`` share a group with theirs (computed in SQL on every
request, so a project's groups take effect at once), administers those whose
``admin_groups`` do, and is a global admin when in ``CONVEYOR_BEP_WEB_ADMIN_GROUPS``. The
admin token keeps working as a bearer token, for automation.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from conveyor_runtime.settings import BepWebSettings
from fastapi import HTTPException, Request

from conveyor_bep_web.session import SESSION_COOKIE, CookieSigner


@dataclass(frozen=True, slots=True)
class Viewer:
    """A request's caller: ``subject`` (who, for the audit log), ``projects`` (the ids
    they may read; None: all), ``admin`` (a global admin) and ``admin_projects`` (the
    projects whose keys and settings they manage besides)."""

    subject: str
    projects: frozenset[int] | None
    admin: bool = False
    admin_projects: frozenset[int] = frozenset()

    def project_ids(self) -> list[int] | None:
        """``projects`` as a SQL parameter (``$n::bigint[]``; NULL: no restriction)."""
        return None if self.projects is None else sorted(self.projects)

    def may_read(self, project_id: int) -> bool:
        """Whether the viewer sees the project."""
        return self.projects is None or project_id in self.projects

    def may_admin(self, project_id: int) -> bool:
        """Whether the viewer manages the project's keys and settings."""
        return self.admin or project_id in self.admin_projects

    @property
    def manages_any(self) -> bool:
        """Whether the viewer administers anything at all."""
        return self.admin or bool(self.admin_projects)


ANONYMOUS = Viewer("anonymous", None)
#: The bearer of the admin token.
ADMIN = Viewer("admin", None, admin=True)

#: What a viewer may read and administer, from the user row of a live session: the
#: projects sharing a group with the user's, those among them whose admin groups do, and
#: whether the user is a global admin ($3, the admin groups). A session of an earlier
#: generation ($2: the user signed out since) finds no row.
_USER_ACCESS = """
SELECT u.groups && $3::text[] AS admin,
       coalesce(array_agg(p.id) FILTER (WHERE p.id IS NOT NULL), '{}') AS projects,
       coalesce(array_agg(p.id) FILTER (WHERE p.admin_groups && u.groups), '{}')
           AS admin_projects
FROM bep.users u
LEFT JOIN bep.projects p ON p.allowed_groups && u.groups OR p.admin_groups && u.groups
WHERE u.subject = $1 AND u.session_generation = $2
GROUP BY u.subject
"""


def _settings(request: Request) -> BepWebSettings:
    settings: BepWebSettings = request.app.state.settings
    return settings


def oidc_enabled(settings: BepWebSettings) -> bool:
    """Whether people sign in (an OpenID Connect issuer is set), rather than open mode."""
    return bool(settings.bep_web_oidc_issuer)


def admin_groups(settings: BepWebSettings) -> list[str]:
    """The global admin groups (``CONVEYOR_BEP_WEB_ADMIN_GROUPS``, comma-separated)."""
    return sorted({g.strip() for g in settings.bep_web_admin_groups.split(",") if g.strip()})


def cookie_signer(settings: BepWebSettings) -> CookieSigner:
    """The signer of the session and sign-in cookies (needs the session secret)."""
    secret = settings.bep_web_session_secret
    if secret is None:
        raise RuntimeError("bep_web_session_secret is not set")
    return CookieSigner(secret.get_secret_value())


def secure_cookies(settings: BepWebSettings) -> bool:
    """Whether cookies are ``Secure`` (the public URL is https)."""
    return (settings.bep_web_public_url or "").startswith("https://")


def bearer(request: Request) -> str | None:
    """The request's bearer token, if any."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip()
    return None


def is_admin_token(token: str | None, admin_token: str | None) -> bool:
    """Whether ``token`` is the configured admin token (constant-time)."""
    if not token or not admin_token:
        return False
    return hmac.compare_digest(token.encode(), admin_token.encode())


def login_url(request: Request) -> str:
    """Where to send a browser that must sign in first: ``/auth/login``, coming back to
    the page it asked for."""
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return f"/auth/login?next={quote(here, safe='')}"


def _is_api(request: Request) -> bool:
    path = request.url.path
    return path in ("/api", "/auth") or path.startswith(("/api/", "/auth/"))


def sign_in_required(request: Request) -> HTTPException:
    """The answer to a request without a session: a redirect to ``/auth/login`` for a
    page a browser navigates to, else 401."""
    navigates = request.method in ("GET", "HEAD") and (
        "text/event-stream" not in request.headers.get("accept", "")
    )
    if navigates and not _is_api(request):
        return HTTPException(303, "sign-in required", headers={"Location": login_url(request)})
    return HTTPException(401, "sign-in required", headers={"WWW-Authenticate": "Bearer"})


def _claim_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    return value if isinstance(value, str) and value else None


async def session_viewer(request: Request) -> Viewer | None:
    """The viewer of the request's session cookie, or None when it has none, or one that
    is forged, expired, or ended by a sign-out."""
    settings = _settings(request)
    cookie = request.cookies.get(SESSION_COOKIE)
    if not cookie or settings.bep_web_session_secret is None:
        return None
    body = cookie_signer(settings).verify("session", cookie)
    if body is None:
        return None
    subject, generation = _claim_str(body, "sub"), body.get("gen")
    if subject is None or type(generation) is not int:
        return None
    row = await request.app.state.pool.fetchrow(
        _USER_ACCESS, subject, generation, admin_groups(settings)
    )
    if row is None:
        return None
    if row["admin"]:
        return Viewer(subject, None, admin=True)
    return Viewer(
        subject,
        frozenset(row["projects"]),
        admin_projects=frozenset(row["admin_projects"]),
    )


async def current_viewer(request: Request) -> Viewer:
    """The FastAPI dependency every route takes: the request's :class:`Viewer` (with an
    issuer configured, 401 or a redirect to sign in when there is no session)."""
    settings = _settings(request)
    if is_admin_token(bearer(request), settings.bep_web_admin_token):
        return ADMIN
    if not oidc_enabled(settings):
        return ANONYMOUS
    viewer = await session_viewer(request)
    if viewer is None:
        raise sign_in_required(request)
    return viewer


def _refusal(request: Request, viewer: Viewer) -> HTTPException:
    if viewer is ANONYMOUS and bearer(request) is None:
        return HTTPException(401, "admin credentials required")
    return HTTPException(403, "not an admin")


async def admin_viewer(request: Request) -> Viewer:
    """The dependency of admin routes: 401 without credentials, 403 for a non-admin."""
    viewer = await current_viewer(request)
    if not viewer.admin:
        raise _refusal(request, viewer)
    return viewer


async def manager_viewer(request: Request) -> Viewer:
    """The dependency of routes a project admin may use too (each route then checks
    :meth:`Viewer.may_admin` for its project): 401/403 for who administers nothing."""
    viewer = await current_viewer(request)
    if not viewer.manages_any:
        raise _refusal(request, viewer)
    return viewer


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


async def same_origin(request: Request) -> None:
    """Refuse (403) a state-changing request authenticated by the session cookie that
    does not come from the web UI's own origin (cross-site request forgery). The admin
    token, sent as a header, needs no such check."""
    if request.method in ("GET", "HEAD", "OPTIONS"):
        return
    settings = _settings(request)
    if not oidc_enabled(settings) or is_admin_token(bearer(request), settings.bep_web_admin_token):
        return
    origin = request.headers.get("origin")
    if origin is None or _origin(origin) != _origin(settings.bep_web_public_url or ""):
        raise HTTPException(403, "cross-origin request refused")
