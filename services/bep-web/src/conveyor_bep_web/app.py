"""The web process's FastAPI app: the JSON API (:mod:`conveyor_bep_web.api`), the pages
(:mod:`conveyor_bep_web.pages`) and their static files, over one asyncpg pool and, for
live updates, one NATS connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor_bep.stores import open_store
from conveyor_runtime.settings import BepWebSettings
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from conveyor_bep_web import admin, admin_pages, api, artifacts, oidc, pages
from conveyor_bep_web.search import BadInput

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient


async def _bad_input(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=400)


def create_app(settings: BepWebSettings, pool: Any, nc: NatsClient | None = None) -> FastAPI:
    """The app over ``pool`` (asyncpg) with ``settings``; ``nc``: the NATS connection
    live updates subscribe with (None: they poll Postgres). All three are on
    ``app.state``."""
    app = FastAPI(
        title="Conveyor builds",
        description="Builds that Bazel streamed to the build-event ingest: search, "
        "details, logs and live updates.",
        version="0.1.0",
        docs_url="/api/docs",
        openapi_url="/api/openapi.json",
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.pool = pool
    app.state.nc = nc
    # The CAS sink's blob store, for artifact downloads (None: no sink configured).
    app.state.blobs = open_store(settings)
    app.add_exception_handler(BadInput, _bad_input)
    app.include_router(api.router)
    app.include_router(artifacts.router)
    app.include_router(pages.router)
    app.include_router(oidc.router)
    app.include_router(admin.router)
    app.include_router(admin_pages.router)
    return app
