"""The web dashboard at ``/ui``: server-rendered HTML, one small script and one stylesheet
(``conveyor_rest/static``, served as text): nothing to build.

Pages: the queues (counts by state, paused, open breakers, charts of throughput and
latency over the last hour, pause/resume), a task search (queue, state, type; paged; a
batch action on the selection), a task's page, the webhook registrations, and a live
view of the events.

Every page calls the api with the caller's token, like the REST routes. A browser cannot
put a header on a page it navigates to, so the login form stores the token in
``sessionStorage`` *and* in a session cookie (``conveyor_token``, path ``/ui``,
``SameSite=Strict``) that only these read-only pages accept; the actions (pause, cancel,
batch...) are ``fetch`` calls to the REST API with ``Authorization: Bearer``, which never
reads the cookie. The script asks ``/v1/whoami`` and shows the action buttons only to a
token that may mutate (the api refuses the others anyway).

Charts: the api keeps no history, so this process keeps one
(:mod:`conveyor_rest.history`): a background sampler records every queue's counts and
latency every ``CONVEYOR_SAMPLE_INTERVAL`` seconds, whether or not a page is open, in a
ring of the last hour; the queues page draws each queue's completions per minute and its
latency from it (so a page opened later shows the hour before), for the queues the
caller's own token may list.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import urllib.parse
from collections.abc import Callable, Sequence
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

from conveyor_rest.history import QueueHistory

STATES = ("pending", "scheduled", "held", "active", "retry", "blocked", "archived", "completed")
#: The state filter's choices on the search page (the api's state names).
SEARCH_STATES = (*STATES, "canceled")
#: The batch actions the search page offers (the REST batch endpoint's names).
BATCH_ACTIONS = ("cancel", "run-now", "revive", "archive", "delete")

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


def chart(
    points: Sequence[tuple[float, float | None]],
    *,
    now: float,
    span: float,
    kind: str,
    label: str,
    show: Callable[[float], str],
    width: int = 160,
    height: int = 28,
) -> str:
    """An inline SVG line chart of ``points`` (time, value; None: not measured, a gap)
    over the ``span`` seconds up to ``now``, scaled to its peak, then its latest value;
    its title says the latest and the peak (``show`` writes a value). No value: a dash."""
    valued = [v for _, v in points if v is not None]
    if not valued:
        return '<span class="muted" title="no samples yet">—</span>'
    top = max(valued) or 1.0
    start = now - span
    # Runs of consecutive values; a value alone between gaps is a dot.
    runs: list[list[tuple[float, float]]] = [[]]
    for at, value in points:
        if value is None:
            if runs[-1]:
                runs.append([])
            continue
        x = max(0.0, min(width, (at - start) / span * width))
        runs[-1].append((x, height - 1 - (value / top) * (height - 2)))
    shapes = []
    for run in runs:
        if len(run) == 1:
            (x, y), *_ = run
            shapes.append(f'<circle r="1.5" fill="currentColor" cx="{x:.1f}" cy="{y:.1f}"/>')
        elif run:
            line = " ".join(f"{x:.1f},{y:.1f}" for x, y in run)
            shapes.append(
                f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{line}"/>'
            )
    latest, peak = show(valued[-1]), show(max(valued))
    about = f"{label}: {latest} now, {peak} at most in the last {_minutes(span)}"
    return (
        f'<svg class="chart {kind}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(about)}" '
        f'data-points="{len(valued)}"><title>{esc(about)}</title>{"".join(shapes)}</svg> '
        f'<span class="muted">{esc(latest)}</span>'
    )


def _minutes(span: float) -> str:
    return f"{span / 60:.0f} min" if span >= 120 else f"{span:.0f} s"


def per_minute(value: float) -> str:
    """A rate as the throughput chart writes it."""
    return f"{value:.0f}/min" if value >= 10 or value == 0 else f"{value:.1f}/min"


def seconds(value: float) -> str:
    """A latency as the latency chart writes it."""
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"


def queue_charts(history: QueueHistory, queue: str) -> tuple[str, str]:
    """``queue``'s throughput chart (completions per minute) and latency chart, over the
    hour, or over the time sampled so far when that is shorter (at least ten samples'
    worth): a fresh REST process's first minutes are not squeezed into the right edge."""
    now = history.last_at
    points = history.points(queue)
    if now is None or not points:
        dash = '<span class="muted" title="no samples yet">—</span>'
        return dash, dash
    least = 10 * (history.interval or 1.0)
    span = min(history.window, max(now - points[0].sample.at, least))
    rate = chart(
        [(p.sample.at, p.per_minute) for p in points],
        now=now,
        span=span,
        kind="throughput",
        label="completed per minute",
        show=per_minute,
    )
    latency = chart(
        [(p.sample.at, p.sample.latency) for p in points],
        now=now,
        span=span,
        kind="latency",
        label="oldest pending task waited",
        show=seconds,
    )
    return rate, latency


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


def add_dashboard(app: FastAPI, admin: Callable[[], Any], history: QueueHistory) -> None:
    """The ``/ui`` pages on ``app``; ``admin`` gives an AdminService stub, ``history``
    the samples the charts draw."""
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
            rate, latency = queue_charts(history, stats.queue)
            rows.append(
                f'<tr data-queue="{name}"><th><a href="/ui/tasks?queue={quoted}">{name}</a></th>'
                f'{cells}<td class="paused">{status}</td><td>{breakers}</td>'
                f'<td class="throughput">{rate}</td><td class="latency">{latency}</td>'
                f"<td>{action}</td></tr>"
            )
        if not rows:
            rows.append(
                f'<tr><td colspan="{len(STATES) + 6}" class="muted">no queues yet</td></tr>'
            )
        return (
            f'<table id="queues"><thead><tr><th>queue</th>{head}<th>status</th><th>breakers</th>'
            "<th>completed per minute, last hour</th><th>latency, last hour</th><th></th></tr>"
            f"</thead><tbody>{''.join(rows)}</tbody></table>"
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
        if history.interval > 0:
            sampled = (
                f"sampled by this REST process every {history.interval:g} s, whether or not "
                "a page is open: completions per minute, and how long each queue's oldest "
                "pending task had waited"
            )
        else:
            sampled = "not sampled: this REST process runs with CONVEYOR_SAMPLE_INTERVAL=0"
        note = (
            f'<p class="muted">Refreshed every 5 s. Charts: up to the last '
            f"{history.window / 60:g} min, {sampled} (kept in memory: a restarted REST "
            "process starts them again).</p>"
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
