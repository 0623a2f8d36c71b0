"""A first dashboard page, server-rendered (no build step): queues with their depth by
state, and a task's page. It calls the api with the caller's token, like the REST routes."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from conveyor_protos.v1 import service_pb2 as pb
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from google.protobuf import json_format

STATES = ("pending", "scheduled", "held", "active", "retry", "blocked", "archived", "completed")

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>{title} · Conveyor</title>
<style>body{{font:14px system-ui;margin:2rem}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.3rem .6rem;text-align:left}}pre{{background:#f5f5f5;padding:.5rem}}</style>
</head><body><h1><a href="/ui">Conveyor</a> · {title}</h1>{body}</body></html>"""


def add_dashboard(app: FastAPI, admin: Callable[[], Any]) -> None:
    """The ``/ui`` pages on ``app``; ``admin`` gives an AdminService stub."""

    def metadata(request: Request) -> list[tuple[str, str]]:
        auth = request.headers.get("authorization")
        token = request.cookies.get("conveyor_token")
        if not auth and token:
            auth = f"Bearer {token}"
        return [("authorization", auth)] if auth else []

    def page(title: str, body: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(PAGE.format(title=html.escape(title), body=body), status_code=status)

    def refused(exc: grpc.aio.AioRpcError) -> HTMLResponse:
        detail = html.escape(f"{exc.code().name}: {exc.details() or ''}")
        return page("error", f"<p>{detail}</p>", _status(exc.code()))

    @app.get("/ui", response_class=HTMLResponse, include_in_schema=False)
    async def queues(request: Request) -> HTMLResponse:
        try:
            listing = await admin().ListQueues(
                pb.ListQueuesRequest(), metadata=metadata(request), timeout=30
            )
            rows = []
            for stats in listing.queues:
                counts = dict(stats.counts)
                cells = "".join(f"<td>{counts.get(s, 0)}</td>" for s in STATES)
                paused = "paused" if stats.paused else ""
                name = html.escape(stats.queue)
                rows.append(f"<tr><th>{name}</th>{cells}<td>{paused}</td></tr>")
        except grpc.aio.AioRpcError as exc:
            return refused(exc)
        head = "".join(f"<th>{s}</th>" for s in STATES)
        table = f"<table><tr><th>queue</th>{head}<th></th></tr>{''.join(rows)}</table>"
        search = (
            '<form action="/ui/task"><input name="id" placeholder="task id">'
            "<button>open</button></form>"
        )
        return page("queues", table + search)

    @app.get("/ui/task", response_class=HTMLResponse, include_in_schema=False)
    async def task(request: Request, id: str = "") -> HTMLResponse:
        try:
            got = await admin().GetTask(
                pb.GetTaskRequest(id=id), metadata=metadata(request), timeout=30
            )
        except grpc.aio.AioRpcError as exc:
            return refused(exc)
        data = json_format.MessageToDict(got.task)
        body = f"<pre>{html.escape(json.dumps(data, indent=2))}</pre>"
        return page(f"task {id}", body)


def _status(code: grpc.StatusCode) -> int:
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return 403
    return 404 if code == grpc.StatusCode.NOT_FOUND else 400
