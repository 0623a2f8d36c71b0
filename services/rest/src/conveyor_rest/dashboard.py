"""The web dashboard at ``/ui``: server-rendered HTML, one small script and one stylesheet
(``conveyor_rest/static``, served as text): nothing to build.

Pages: the queues (counts by state, paused, open breakers, throughput over the last hour,
pause/resume), a task search (queue, state, type; paged; a batch action on the
selection), a task's page, the webhook registrations, and a live view of the events.

Every page calls the api with the caller's token, like the REST routes. A browser cannot
put a header on a page it navigates to, so the login form stores the token in
``sessionStorage`` *and* in a session cookie (``conveyor_token``, path ``/ui``,
``SameSite=Strict``) that only these read-only pages accept; the actions (pause, cancel,
batch...) are ``fetch`` calls to the REST API with ``Authorization: Bearer``, which never
reads the cookie. The script asks ``/v1/whoami`` and shows the action buttons only to a
token that may mutate (the api refuses the others anyway).

Throughput: the api keeps no history, so this process keeps one (``Throughput``): at most
every ``SAMPLE_SECONDS`` a queues page (or its refresh, every few seconds while one is
open) records each queue's count of completed tasks, in a ring of an hour's samples. The
sparkline is the completions between samples; it is empty until a page has been open for
two samples, and starts again with each REST process.
"""

from __future__ import annotations

import base64
import contextlib
import html
import itertools
import json
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

import grpc
import grpc.aio
from conveyor_protos.v1 import service_pb2 as pb
from conveyor_protos.v1 import task_pb2 as task_pb
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from google.protobuf import json_format
from google.protobuf.message import Message

STATES = ("pending", "scheduled", "held", "active", "retry", "blocked", "archived", "completed")
#: The state filter's choices on the search page (the api's state names).
SEARCH_STATES = (*STATES, "canceled")
#: The batch actions the search page offers (the REST batch endpoint's names).
BATCH_ACTIONS = ("cancel", "run-now", "revive", "archive", "delete")
#: How often the queues page records a throughput sample, and how many it keeps (1 h).
SAMPLE_SECONDS = 10.0
SAMPLES = 360

STATIC = {"app.js": "text/javascript", "app.css": "text/css"}

PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · Conveyor</title><link rel="stylesheet" href="/ui/static/app.css">
<script src="/ui/static/app.js" defer></script></head>
<body data-page="{page}"><header><a class="brand" href="/ui">Conveyor</a><nav>
<a href="/ui">Queues</a><a href="/ui/tasks">Tasks</a><a href="/ui/webhooks">Webhooks</a>
<a href="/ui/events">Events</a></nav><span id="whoami"></span>
<button type="button" id="logout" hidden>log out</button></header>
<main><h1>{title}</h1><div id="flash" role="status"></div>{body}</main></body></html>"""

LOGIN = """<form id="login" class="login"><p>{why}</p>
<label>Token <input type="password" name="token" id="token" autocomplete="off"
 placeholder="the secret of a name:role:secret token" required></label>
<button>log in</button></form>"""


class Throughput:
    """Per queue, the count of completed tasks sampled at most every ``every`` seconds,
    the last ``keep`` samples (see the module's docstring)."""

    def __init__(
        self,
        every: float = SAMPLE_SECONDS,
        keep: int = SAMPLES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every = every
        self.clock = clock
        self.samples: deque[tuple[float, dict[str, int]]] = deque(maxlen=keep)

    def record(self, completed: Mapping[str, int]) -> None:
        """A sample of ``completed`` (queue -> count), unless the last is too recent."""
        now = self.clock()
        if self.samples and now - self.samples[-1][0] < self.every:
            return
        self.samples.append((now, dict(completed)))

    def series(self, queue: str) -> list[int]:
        """The completions of ``queue`` between consecutive samples, oldest first (a
        count that went down, as retention deletes, counts as none)."""
        counts = [sample.get(queue) for _, sample in self.samples]
        out = []
        for before, after in itertools.pairwise(counts):
            out.append(max(0, (after or 0) - (before or 0)) if before is not None else 0)
        return out


def sparkline(values: list[int], width: int = 120, height: int = 24) -> str:
    """An inline SVG polyline of ``values`` (empty: a dash), with the total as its title."""
    if not values:
        return '<span class="muted" title="no samples yet">—</span>'
    top = max(values) or 1
    step = width / max(1, len(values) - 1)
    points = " ".join(
        f"{i * step:.1f},{height - 1 - (v / top) * (height - 2):.1f}" for i, v in enumerate(values)
    )
    total = sum(values)
    return (
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{total} completed"><title>{total} completed in the last '
        f'{len(values)} samples</title><polyline fill="none" stroke="currentColor" '
        f'stroke-width="1.5" points="{points}"/></svg> <span class="muted">{total}</span>'
    )


def esc(value: object) -> str:
    """``value`` as HTML text (attribute-safe)."""
    return html.escape(str(value), quote=True)


def pretty(raw: bytes) -> str:
    """Stored bytes as readable text: pretty JSON, else UTF-8, else base64; escaped."""
    if not raw:
        return '<span class="muted">(empty)</span>'
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return f"<pre>{esc(base64.b64encode(raw).decode())}</pre> <span class=muted>(base64)</span>"
    with contextlib.suppress(ValueError):
        text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    return f"<pre>{esc(text)}</pre>"


def button(label: str, method: str, url: str, confirm: str, **data: str) -> str:
    """An action button: the script asks ``confirm``, then sends ``method url`` to the
    REST API (``data`` adds ``data-*`` attributes: ``body``, ``then``)."""
    extra = "".join(f' data-{k}="{esc(v)}"' for k, v in data.items())
    return (
        f'<button type="button" class="act" data-method="{method}" data-url="{esc(url)}" '
        f'data-confirm="{esc(confirm)}"{extra}>{esc(label)}</button>'
    )


def state_name(value: int) -> str:
    """A TaskState as its short name ("pending")."""
    return str(task_pb.TaskState.Name(value)).removeprefix("TASK_STATE_").lower()


def when(message: Message, field: str) -> str:
    """A timestamp field as RFC 3339, or empty when unset."""
    if not message.HasField(field):
        return ""
    stamp: Any = getattr(message, field)
    return str(stamp.ToJsonString())


def add_dashboard(app: FastAPI, admin: Callable[[], Any]) -> None:
    """The ``/ui`` pages on ``app``; ``admin`` gives an AdminService stub."""
    throughput = Throughput()
    static = {
        name: resources.files("conveyor_rest").joinpath("static", name).read_text()
        for name in STATIC
    }

    def metadata(request: Request) -> list[tuple[str, str]]:
        auth = request.headers.get("authorization")
        token = urllib.parse.unquote(request.cookies.get("conveyor_token", ""))
        if not auth and token:
            auth = f"Bearer {token}"
        return [("authorization", auth)] if auth else []

    def page(title: str, body: str, status: int = 200, name: str = "") -> HTMLResponse:
        return HTMLResponse(PAGE.format(title=esc(title), body=body, page=name), status_code=status)

    def refused(exc: grpc.aio.AioRpcError) -> HTMLResponse:
        code = exc.code()
        detail = esc(f"{code.name}: {exc.details() or ''}")
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return page("log in", LOGIN.format(why=detail), 401, "login")
        return page("error", f'<p class="error">{detail}</p>', _status(code))

    async def rpc(name: str, message: Message, request: Request) -> Any:
        return await getattr(admin(), name)(message, metadata=metadata(request), timeout=30)

    @app.get("/ui/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> Response:
        if name not in static:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(
            static[name], media_type=STATIC[name], headers={"cache-control": "no-cache"}
        )

    @app.get("/ui/login", response_class=HTMLResponse, include_in_schema=False)
    async def login() -> HTMLResponse:
        return page("log in", LOGIN.format(why="The api wants a token."), 200, "login")

    async def queues_table(request: Request) -> str:
        listing = await rpc("ListQueues", pb.ListQueuesRequest(), request)
        throughput.record({q.queue: int(q.counts.get("completed", 0)) for q in listing.queues})
        head = "".join(f"<th>{s}</th>" for s in STATES)
        rows = []
        for stats in listing.queues:
            name = esc(stats.queue)
            quoted = urllib.parse.quote(stats.queue, safe="")
            counts = dict(stats.counts)
            cells = "".join(
                f'<td class="num" data-state="{s}"><a href="/ui/tasks?queue={quoted}&amp;state={s}">'
                f"{counts.get(s, 0)}</a></td>"
                for s in STATES
            )
            breakers = (
                "".join(
                    f'<span class="badge {esc(b.state)}" title="{esc(b.worker_id or "queue")}">'
                    f"{esc(b.type or '*')}: {esc(b.state)}</span>"
                    for b in stats.breakers
                )
                or '<span class="muted">closed</span>'
            )
            url = f"/v1/queues/{quoted}"
            if stats.paused:
                status = '<span class="badge paused">paused</span>'
                action = button("resume", "POST", f"{url}/resume", f"Resume queue {stats.queue}?")
            else:
                status = '<span class="muted">running</span>'
                action = button("pause", "POST", f"{url}/pause", f"Pause queue {stats.queue}?")
            rows.append(
                f'<tr data-queue="{name}"><th><a href="/ui/tasks?queue={quoted}">{name}</a></th>'
                f'{cells}<td class="paused">{status}</td><td>{breakers}</td>'
                f"<td>{sparkline(throughput.series(stats.queue))}</td><td>{action}</td></tr>"
            )
        if not rows:
            rows.append(
                f'<tr><td colspan="{len(STATES) + 5}" class="muted">no queues yet</td></tr>'
            )
        return (
            f'<table id="queues"><thead><tr><th>queue</th>{head}<th>status</th><th>breakers</th>'
            f"<th>completed, last hour</th><th></th></tr></thead><tbody>{''.join(rows)}</tbody>"
            "</table>"
        )

    @app.get("/ui", response_class=HTMLResponse, include_in_schema=False)
    async def queues(request: Request, fragment: bool = False) -> HTMLResponse:
        try:
            table = await queues_table(request)
        except grpc.aio.AioRpcError as exc:
            return refused(exc)
        if fragment:
            return HTMLResponse(table)
        search = (
            '<form action="/ui/task" class="inline"><input name="id" placeholder="task id" '
            "required><button>open</button></form>"
        )
        note = (
            f'<p class="muted">Refreshed every 5 s. Throughput: completions per '
            f"{SAMPLE_SECONDS:g} s sample, over the samples this REST process took while a "
            "queues page was open (at most an hour).</p>"
        )
        return page(
            "queues",
            f'<div id="live" data-refresh="5000">{table}</div>{note}{search}',
            name="queues",
        )

    @app.get("/ui/tasks", response_class=HTMLResponse, include_in_schema=False)
    async def search(
        request: Request,
        id: str = "",
        queue: str = "",
        state: str = "",
        type: str = "",
        cursor: str = "",
        limit: int = 50,
    ) -> Response:
        if id.strip():
            return RedirectResponse(f"/ui/task?id={urllib.parse.quote(id.strip(), safe='')}", 303)
        limit = min(max(limit, 1), 1000)
        state = state.strip().lower()
        form = _search_form(queue, state, type, limit)
        if state and state not in SEARCH_STATES:
            return page("tasks", form + f'<p class="error">unknown state {esc(state)}</p>', 400)
        message = pb.ListTasksRequest(
            queue=queue,
            state=task_pb.TaskState.Value("TASK_STATE_" + state.upper()) if state else 0,  # type: ignore[arg-type]
            limit=limit,
            cursor=cursor,
            omit_payloads=True,
        )
        try:
            listing = await rpc("ListTasks", message, request)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return refused(exc)
            detail = esc(f"{exc.code().name}: {exc.details() or ''}")
            return page("tasks", form + f'<p class="error">{detail}</p>', _status(exc.code()))
        shown = [t for t in listing.tasks if not type or t.type == type]
        rows = (
            "".join(
                f'<tr data-id="{esc(t.id)}"><td><a href="/ui/task?id={urllib.parse.quote(t.id, safe="")}">'
                f"{esc(t.id)}</a></td><td>{esc(t.queue)}</td><td>{esc(t.type)}</td>"
                f'<td class="state">{state_name(t.state)}</td><td class="num">{t.retried}/{t.max_retry}</td>'
                f'<td>{esc(when(t, "created_at"))}</td><td class="error">{esc(t.last_error[:120])}</td></tr>'
                for t in shown
            )
            or '<tr><td colspan="7" class="muted">no tasks</td></tr>'
        )
        table = (
            '<table id="tasks"><thead><tr><th>id</th><th>queue</th><th>type</th><th>state</th>'
            "<th>retried</th><th>created</th><th>last error</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
        )
        nav = ""
        if listing.next_cursor:
            query = urllib.parse.urlencode(
                {
                    "queue": queue,
                    "state": state,
                    "type": type,
                    "limit": limit,
                    "cursor": listing.next_cursor,
                }
            )
            nav = f'<p><a id="next" href="/ui/tasks?{esc(query)}">next page →</a></p>'
        return page(
            "tasks", form + table + nav + _batch_form(queue, state, type, shown), name="tasks"
        )

    @app.get("/ui/task", response_class=HTMLResponse, include_in_schema=False)
    async def task(request: Request, id: str = "") -> HTMLResponse:
        try:
            got = await rpc("GetTask", pb.GetTaskRequest(id=id), request)
        except grpc.aio.AioRpcError as exc:
            return refused(exc)
        return page(f"task {id}", _task_body(got.task), name="task")

    @app.get("/ui/webhooks", response_class=HTMLResponse, include_in_schema=False)
    async def webhooks(request: Request) -> HTMLResponse:
        try:
            listing = await rpc("ListWebhookWorkers", pb.ListWebhookWorkersRequest(), request)
            breakers = (await rpc("ListBreakers", pb.ListBreakersRequest(), request)).breakers
        except grpc.aio.AioRpcError as exc:
            return refused(exc)
        rows = []
        for w in listing.workers:
            queues = ", ".join(f"{esc(q)}={n}" for q, n in sorted(w.queues.items()))
            mine = [
                b
                for b in breakers
                if b.queue in w.queues and (not b.worker_id or w.name in b.worker_id)
            ]
            state = (
                "".join(
                    f'<span class="badge {esc(b.state)}">{esc(b.queue)}/{esc(b.type or "*")}: '
                    f"{esc(b.state)} ({b.failures} failures)</span>"
                    for b in mine
                )
                or '<span class="muted">closed</span>'
            )
            url = f"/v1/webhooks/{urllib.parse.quote(w.name, safe='')}"
            action = (
                button("resume", "POST", f"{url}/resume", f"Resume webhook {w.name}?")
                if w.paused
                else button("pause", "POST", f"{url}/pause", f"Pause webhook {w.name}?")
            )
            timeout = w.timeout.ToJsonString() if w.HasField("timeout") else ""
            rows.append(
                f'<tr data-webhook="{esc(w.name)}"><th>{esc(w.name)}</th><td>{esc(w.url)}</td>'
                f'<td>{queues}</td><td class="num">{w.concurrency}</td><td>{esc(timeout)}</td>'
                f"<td>{'paused' if w.paused else 'active'}</td><td>{state}</td><td>{action}</td></tr>"
            )
        body = (
            "".join(rows) or '<tr><td colspan="8" class="muted">no webhook registrations</td></tr>'
        )
        table = (
            '<table id="webhooks"><thead><tr><th>name</th><th>url</th><th>queues</th>'
            "<th>concurrency</th><th>timeout</th><th>status</th><th>breakers</th><th></th></tr>"
            f"</thead><tbody>{body}</tbody></table>"
        )
        return page("webhooks", table, name="webhooks")

    @app.get("/ui/events", response_class=HTMLResponse, include_in_schema=False)
    async def events(queue: str = "") -> HTMLResponse:
        body = (
            f'<form class="inline"><input name="queue" value="{esc(queue)}" '
            'placeholder="queue (empty: all)"><button>watch</button></form>'
            f'<p id="events-status" class="muted">connecting…</p>'
            f'<table id="events" data-queue="{esc(queue)}"><thead><tr><th>at</th><th>queue</th>'
            "<th>type</th><th>task</th><th>state</th><th>error</th></tr></thead><tbody></tbody></table>"
        )
        return page("events", body, name="events")


def _search_form(queue: str, state: str, type_: str, limit: int) -> str:
    options = "".join(
        f'<option value="{s}"{" selected" if s == state else ""}>{s}</option>'
        for s in SEARCH_STATES
    )
    return (
        '<form id="search" class="inline" action="/ui/tasks">'
        '<input name="id" placeholder="task id">'
        f'<input name="queue" value="{esc(queue)}" placeholder="queue">'
        f'<select name="state"><option value="">any state</option>{options}</select>'
        f'<input name="type" value="{esc(type_)}" placeholder="type">'
        f'<input name="limit" type="number" min="1" max="1000" value="{limit}">'
        "<button>search</button></form>"
    )


def _batch_form(queue: str, state: str, type_: str, shown: list[Any]) -> str:
    """The batch action on the selection: every task of the queue and state filter (the
    batch endpoint's own selector), or, with a type filter (which the api's selector
    does not have) or no filter at all, the tasks on this page by id."""
    if (queue or state) and not type_:
        selector: dict[str, Any] = {"queue": queue, "state": state}
        what = f"every task{' in queue ' + queue if queue else ''}{' in state ' + state if state else ''}"
    else:
        selector = {"ids": [t.id for t in shown]}
        what = f"the {len(shown)} tasks on this page"
        if not shown:
            return ""
    options = "".join(f'<option value="{a}">{a}</option>' for a in BATCH_ACTIONS)
    return (
        f'<div id="batch" class="act-box"><label>Batch on {esc(what)}: '
        f'<select id="batch-action">{options}</select></label> '
        f'<button type="button" class="act batch" data-method="POST" data-url="/v1/tasks:batch" '
        f'data-body="{esc(json.dumps(selector))}" data-confirm="{esc("Apply to " + what + "?")}">'
        "apply</button></div>"
    )


def _task_body(task: Any) -> str:
    quoted = urllib.parse.quote(task.id, safe="")
    url = f"/v1/tasks/{quoted}"
    actions = " ".join(
        (
            button("cancel", "POST", f"{url}/cancel", f"Cancel task {task.id}?"),
            button("run now", "POST", f"{url}/run-now", f"Run task {task.id} now?"),
            button("revive (retry)", "POST", f"{url}/revive", f"Revive task {task.id}?"),
            button("archive", "POST", f"{url}/archive", f"Archive task {task.id}?"),
            button(
                "delete",
                "DELETE",
                url,
                f"Delete task {task.id}? This cannot be undone.",
                then=f"/ui/tasks?queue={urllib.parse.quote(task.queue, safe='')}",
            ),
        )
    )
    fields = [
        ("id", esc(task.id)),
        (
            "queue",
            f'<a href="/ui/tasks?queue={urllib.parse.quote(task.queue, safe="")}">{esc(task.queue)}</a>',
        ),
        ("type", esc(task.type)),
        ("state", f'<span id="task-state">{state_name(task.state)}</span>'),
        ("attempts", f"{task.retried} retried of {task.max_retry} retries allowed"),
    ]
    for label, field in (
        ("created", "created_at"),
        ("updated", "updated_at"),
        ("started", "started_at"),
        ("completed", "completed_at"),
        ("next process at", "next_process_at"),
        ("lease expires", "lease_expires_at"),
    ):
        fields.append((label, esc(when(task, field)) or '<span class="muted">—</span>'))
    options = json_format.MessageToDict(task.options) if task.HasField("options") else {}
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in fields)
    sections = (
        ("payload", pretty(task.payload)),
        ("headers", f"<pre>{esc(json.dumps(dict(task.headers), indent=2))}</pre>"),
        ("options", f"<pre>{esc(json.dumps(options, indent=2))}</pre>"),
        ("result", pretty(task.result)),
        ("progress", pretty(task.progress)),
        (
            "last error",
            f'<pre class="error">{esc(task.last_error)}</pre>'
            if task.last_error
            else '<span class="muted">none</span>',
        ),
    )
    parts = "".join(
        f'<section id="{k.replace(" ", "-")}"><h2>{k}</h2>{v}</section>' for k, v in sections
    )
    return f'<div class="actions">{actions}</div><table id="task">{table}</table>{parts}'


def _status(code: grpc.StatusCode) -> int:
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return 401
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return 403
    return 404 if code == grpc.StatusCode.NOT_FOUND else 400
