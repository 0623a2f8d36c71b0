"""The server-rendered pages: the project list (``/``), a project's builds with search
and facets (``/p/{slug}``) and a build (``/b/{invocation_id}``), plus one script and one
stylesheet (``conveyor_bep_web/static``, package resources): nothing to build.

Everything a build sent is HTML-escaped here (and set as text by the script). The build
page renders its rows once on the server; ``app.js`` then follows the build live
(``/api/builds/{id}/live``), re-fetches targets and tests when their counts move, and
runs the log viewer (see the script's header).
"""

from __future__ import annotations

import html
import json
import urllib.parse
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, Response

from conveyor_bep_web import artifacts, reads
from conveyor_bep_web.auth import Viewer, current_viewer
from conveyor_bep_web.search import (
    BUILD_STATUSES,
    DEFAULT_LIMIT,
    MAX_LIMIT,
    BadInput,
    BuildSearch,
    build_search,
)

router = APIRouter(include_in_schema=False)
ViewerDep = Annotated[Viewer, Depends(current_viewer)]

STATIC = {"app.js": "text/javascript", "app.css": "text/css"}
#: Rows of each table the build page renders (the API pages through the rest).
PAGE_ROWS = 1000

PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · Conveyor builds</title><link rel="stylesheet" href="/static/app.css">
<script src="/static/app.js" defer></script></head>
<body data-page="{page}"{data}><header><a class="brand" href="/">Conveyor builds</a>
<nav><a href="/">Projects</a>{crumbs}</nav></header>
<main><h1>{heading}</h1>{body}</main></body></html>"""


def esc(value: object) -> str:
    """``value`` as HTML text (attribute-safe); None as empty."""
    return "" if value is None else html.escape(str(value), quote=True)


def _dash(value: object) -> str:
    return esc(value) if value not in (None, "", []) else '<span class="muted">—</span>'


def page(
    title: str,
    body: str,
    *,
    name: str,
    heading: str | None = None,
    crumbs: Sequence[tuple[str, str]] = (),
    data: dict[str, str] | None = None,
    status: int = 200,
) -> HTMLResponse:
    """A whole page: ``heading`` is HTML (default: ``title`` escaped), ``data`` the
    body's ``data-*`` attributes."""
    attrs = "".join(f' data-{k}="{esc(v)}"' for k, v in (data or {}).items())
    links = "".join(f'<a href="{esc(href)}">{esc(label)}</a>' for label, href in crumbs)
    return HTMLResponse(
        PAGE.format(
            title=esc(title),
            heading=heading if heading is not None else esc(title),
            body=body,
            page=name,
            data=attrs,
            crumbs=links,
        ),
        status_code=status,
    )


def _quote(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def build_href(invocation_id: str) -> str:
    """The build page's path."""
    return f"/b/{_quote(invocation_id)}"


def badge(status: str | None, *, element_id: str | None = None) -> str:
    """A build or test status as a coloured badge."""
    value = (status or "unknown").lower()
    ident = f' id="{element_id}"' if element_id else ""
    return (
        f'<span{ident} class="badge s-{esc(value)}" data-status="{esc(value)}">{esc(value)}</span>'
    )


def duration(ms: int | None) -> str:
    """Milliseconds as a short duration (``1.2 s``, ``3 min 4 s``)."""
    if ms is None:
        return ""
    if ms < 1000:
        return f"{ms} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def _table(element_id: str, head: Iterable[str], rows: Iterable[str], empty: str) -> str:
    cells = "".join(f"<th>{esc(h)}</th>" for h in head)
    body = (
        "".join(rows)
        or f'<tr class="empty"><td colspan="{len(list(head)) or 1}">{esc(empty)}</td></tr>'
    )
    return f'<table id="{element_id}"><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>'


# The project list.


def projects_body(projects: list[dict[str, Any]]) -> str:
    """The project list's table."""
    rows = [
        f'<tr data-project="{esc(p["slug"])}"><td><a href="/p/{_quote(p["slug"])}">'
        f"{esc(p['slug'])}</a></td><td>{esc(p['name'])}</td>"
        f'<td class="num">{p["builds"]}</td><td class="num">{p["running"]}</td>'
        f'<td class="num">{p["failed"]}</td><td>{_dash(p["last_build_at"])}</td></tr>'
        for p in projects
    ]
    return _table(
        "projects",
        ("project", "name", "builds", "running", "failed", "last build"),
        rows,
        "no projects you may read",
    )


# A project's builds.


def _search_href(slug: str, params: list[tuple[str, str]]) -> str:
    query = urllib.parse.urlencode(params)
    return f"/p/{_quote(slug)}" + (f"?{query}" if query else "")


def build_list_row(build: dict[str, Any]) -> str:
    """One build of the list (the script updates it live by ``data-invocation``)."""
    what = " ".join([build["command"] or "", *(build["patterns"] or [])]).strip()
    tests = f"{build['tests_passed']}/{build['tests_total']}" if build["tests_total"] else ""
    return (
        f'<tr class="build" data-invocation="{esc(build["invocation_id"])}">'
        f"<td>{badge(build['status'])}</td>"
        f'<td><a href="{esc(build_href(build["invocation_id"]))}">'
        f"{esc(build['invocation_id'])}</a></td>"
        f"<td>{_dash(what)}</td><td>{_dash(build['user_name'])}</td>"
        f"<td>{_dash(build['branch'])}</td><td><code>{esc((build['commit_sha'] or '')[:12])}</code></td>"
        f"<td>{_dash(build['started_at'] or build['created_at'])}</td>"
        f'<td class="num">{esc(duration(build["duration_ms"]))}</td>'
        f'<td class="num" data-field="targets">{build["targets_completed"]}/'
        f"{build['targets_configured']}</td>"
        f'<td class="num" data-field="tests">{esc(tests)}</td></tr>'
    )


def _facet_links(slug: str, search: BuildSearch, name: str, values: list[dict[str, Any]]) -> str:
    current = getattr(search, name)
    base = [(k, v) for k, v in search.query_string() if k != name]
    items = []
    for item in values:
        chosen = item["value"] == current
        params = base if chosen else [*base, (name, item["value"])]
        items.append(
            f'<li class="{"chosen" if chosen else ""}"><a href="{esc(_search_href(slug, params))}">'
            f'{esc(item["value"])}</a> <span class="muted">{item["count"]}</span></li>'
        )
    return f'<div class="facet" data-facet="{name}"><h3>{name}</h3><ul>{"".join(items)}</ul></div>'


def _tag_facets(slug: str, search: BuildSearch, tags: dict[str, list[dict[str, Any]]]) -> str:
    parts = []
    for key, values in tags.items():
        items = []
        for item in values:
            pair = (key, item["value"])
            chosen = pair in search.tags
            rest = [t for t in search.tags if t != pair]
            tags_after = rest if chosen else [*search.tags, pair]
            params = [(k, v) for k, v in search.query_string() if k != "tag"]
            params += [("tag", f"{k}:{v}") for k, v in tags_after]
            items.append(
                f'<li class="{"chosen" if chosen else ""}"><a href="{esc(_search_href(slug, params))}">'
                f'{esc(item["value"])}</a> <span class="muted">{item["count"]}</span></li>'
            )
        parts.append(
            f'<div class="facet" data-facet="tag:{esc(key)}"><h3>{esc(key)}</h3>'
            f"<ul>{''.join(items)}</ul></div>"
        )
    return "".join(parts)


def builds_body(
    slug: str,
    search: BuildSearch,
    builds: list[dict[str, Any]],
    following: str | None,
    facets: dict[str, Any],
    limit: int,
) -> str:
    """The search form, the facets and a page of builds."""
    options = "".join(
        f'<option value="{s}"{" selected" if s == search.status else ""}>{s}</option>'
        for s in ("", *BUILD_STATUSES)
    )
    tags = " ".join(f"{k}:{v}" for k, v in search.tags)
    form = (
        '<form id="search" class="inline" method="get">'
        f'<label>status <select name="status">{options}</select></label>'
        f'<label>user <input name="user" value="{esc(search.user)}"></label>'
        f'<label>branch <input name="branch" value="{esc(search.branch)}"></label>'
        f'<label>tags <input name="tags" value="{esc(tags)}" placeholder="key:value …"></label>'
        f'<label>text <input name="q" value="{esc(search.text)}" placeholder="id, commit, target…"></label>'
        "<button>search</button></form>"
    )
    counted = facets["counted"]
    note = f"{counted}{'+' if facets['capped'] else ''} builds match"
    side = (
        f'<aside id="facets"><p class="muted" id="match-count">{esc(note)}</p>'
        + "".join(
            _facet_links(slug, search, name, facets[name]) for name in ("status", "user", "branch")
        )
        + _tag_facets(slug, search, facets["tags"])
        + "</aside>"
    )
    table = _table(
        "builds",
        (
            "status",
            "invocation",
            "command",
            "user",
            "branch",
            "commit",
            "started",
            "took",
            "targets",
            "tests",
        ),
        [build_list_row(b) for b in builds],
        "no builds match",
    )
    more = ""
    if following is not None:
        params = [*search.query_string(), ("before", following)]
        if limit != DEFAULT_LIMIT:
            params.append(("limit", str(limit)))
        more = f'<p><a id="older" href="{esc(_search_href(slug, params))}">older builds →</a></p>'
    live = '<p id="new-builds" class="notice" hidden></p>'
    return (
        f'{form}<div class="split">{side}<section class="list">{live}{table}{more}</section></div>'
    )


# A build.


def _kv(rows: Sequence[tuple[str, str]], element_id: str) -> str:
    body = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv" id="{element_id}">{body}</table>'


def target_row(t: dict[str, Any]) -> str:
    """One target of the build page (``app.js`` renders the same row)."""
    state = "failed" if t["success"] is False else ("success" if t["success"] else "running")
    if t["test_status"]:
        state = t["test_status"]
    return (
        f'<tr data-label="{esc(t["label"])}"><td>{badge(state)}</td><td><code>{esc(t["label"])}'
        f"</code>{' <span class=muted>' + esc(t['aspect']) + '</span>' if t['aspect'] else ''}</td>"
        f"<td>{_dash(t['kind'])}</td><td>{_dash(t['test_size'])}</td>"
        f'<td class="num">{esc(duration(t["test_duration_ms"]))}</td>'
        f'<td class="error">{esc(t["failure"])}</td></tr>'
    )


def _outputs(outputs: list[dict[str, Any]]) -> str:
    if not outputs:
        return ""
    items = "".join(
        f'<li><span class="name">{esc(o.get("name"))}</span> '
        f'<code class="muted">{esc(o.get("uri", ""))}</code></li>'
        for o in outputs
    )
    return f'<ul class="outputs">{items}</ul>'


def test_row(r: dict[str, Any]) -> str:
    """One test result of the build page: status, details, cache, timing, outputs."""
    cached = "remote" if r["cached_remotely"] else ("local" if r["cached_locally"] else "")
    attempt = f"run {r['run']} · shard {r['shard']} · attempt {r['attempt']}"
    return (
        f'<tr data-label="{esc(r["label"])}"><td>{badge(r["status"])}</td>'
        f'<td><code>{esc(r["label"])}</code><div class="muted">{esc(attempt)}</div>'
        f"{'<pre class=details>' + esc(r['status_details']) + '</pre>' if r['status_details'] else ''}"
        f"{_outputs(r['outputs'])}</td>"
        f'<td class="num">{esc(duration(r["duration_ms"]))}</td><td>{esc(cached)}</td>'
        f"<td>{_dash(r['strategy'])}</td></tr>"
    )


def action_row(a: dict[str, Any]) -> str:
    """One action of the build page (Bazel reports the failed ones)."""
    line = " ".join(a["command_line"] or [])
    return (
        f'<tr data-seq="{a["seq"]}"><td>{badge("success" if a["success"] else "failed")}</td>'
        f"<td>{_dash(a['mnemonic'])}</td><td><code>{esc(a['label'])}</code>"
        f'<div class="muted">{esc(a["primary_output"])}</div></td>'
        f'<td class="num">{_dash(a["exit_code"])}</td>'
        f'<td><div class="error">{esc(a["failure"])}</div>'
        f"{'<pre>' + esc(line) + '</pre>' if line else ''}"
        f"{'<div class=muted>stderr ' + esc(a['stderr_uri']) + '</div>' if a['stderr_uri'] else ''}"
        "</td></tr>"
    )


TARGET_HEAD = ("status", "target", "kind", "size", "test time", "failure")
TEST_HEAD = ("status", "test", "took", "cached", "strategy")
ACTION_HEAD = ("status", "mnemonic", "target", "exit", "failure")


def _counters(summary: dict[str, Any]) -> str:
    c = summary["counters"]
    items = (
        ("targets_configured", "targets configured"),
        ("targets_completed", "completed"),
        ("targets_failed", "failed"),
        ("tests_total", "tests"),
        ("tests_passed", "passed"),
        ("tests_failed", "failed"),
        ("tests_flaky", "flaky"),
        ("actions_failed", "failed actions"),
        ("events", "events"),
    )
    return (
        '<ul id="counters" class="counters">'
        + "".join(
            f'<li><span class="n" data-counter="{key}">{c[key]}</span> {esc(label)}</li>'
            for key, label in items
        )
        + "</ul>"
    )


ARTIFACT_HEAD = ("kind", "target", "file", "size")


def artifact_row(artifact: dict[str, Any]) -> str:
    """One artifact of the build page: a download link when the sink holds its bytes."""
    name = esc(artifact["name"])
    link = f'<a href="{esc(artifact["href"])}">{name}</a>' if artifact["stored"] else name
    return (
        f'<tr data-digest="{esc(artifact["digest"])}"><td>{esc(artifact["kind"])}</td>'
        f"<td>{_dash(artifact['label'])}</td><td>{link}</td>"
        f'<td class="num">{artifact["size"]}</td></tr>'
    )


def build_body(
    summary: dict[str, Any],
    targets: list[dict[str, Any]],
    tests: list[dict[str, Any]],
    actions: list[dict[str, Any]],
    artifacts: list[dict[str, Any]] | None = None,
) -> str:
    """The build page below its heading (``artifacts``: as
    :func:`conveyor_bep_web.artifacts.describe` gives them)."""
    t = summary["timing"]
    tags = " ".join(
        f'<span class="tag">{esc(k)}={esc(v)}</span>' for k, v in sorted(summary["tags"].items())
    )
    exit_text = (
        f"{summary['exit_name']} ({summary['exit_code']})"
        if summary["exit_code"] is not None
        else ""
    )
    facts = _kv(
        [
            ("invocation", f"<code>{esc(summary['invocation_id'])}</code>"),
            ("build id", _dash(summary["build_id"])),
            (
                "project",
                f'<a href="/p/{_quote(summary["project"]["slug"])}">{esc(summary["project"]["name"])}</a>',
            ),
            ("user", _dash(summary["user"])),
            ("host", _dash(summary["host"])),
            ("branch", _dash(summary["branch"])),
            ("commit", f"<code>{_dash(summary['commit'])}</code>"),
            ("bazel", _dash(summary["tool_version"])),
            ("exit", f'<span id="exit">{_dash(exit_text)}</span>'),
            ("tags", tags or _dash(None)),
        ],
        "summary",
    )
    timing = _kv(
        [
            ("started", _dash(t["started_at"])),
            ("finished", f'<span id="finished-at">{_dash(t["finished_at"])}</span>'),
            ("took", f'<span id="took">{_dash(duration(t["duration_ms"]))}</span>'),
            ("received", _dash(t["created_at"])),
            ("last update", f'<span id="updated-at">{_dash(t["updated_at"])}</span>'),
        ],
        "timing",
    )
    cache = summary["cache"]
    cache_rows = [
        ("actions created", _dash(cache["actions_created"])),
        ("actions executed", _dash(cache["actions_executed"])),
        ("cache hits", _dash(cache["cache_hits"])),
        ("test results cached", f"{cache['test_results_cached']} of {cache['test_results']}"),
    ]
    if cache["action_cache"]:
        cache_rows.append(
            ("action cache", f"<pre>{esc(json.dumps(cache['action_cache'], indent=1))}</pre>")
        )
    log = (
        '<section id="log"><h2>Log</h2><div class="log-bar">'
        f'<span id="log-count" class="muted">{summary["log"]["lines"]} lines</span> '
        f'<a id="log-download" href="/api/builds/{_quote(summary["invocation_id"])}/log?download=1">download</a> '
        '<label><input type="checkbox" id="log-follow" checked> follow</label></div>'
        '<div id="log-viewport" tabindex="0" data-loaded-bytes="0" data-lines="0">'
        '<div id="log-spacer"></div><div id="log-window"></div></div></section>'
    )
    options = summary["options"] or {}
    option_parts = "".join(
        f"<h3>{esc(k)}</h3><pre>{esc(' '.join(v))}</pre>"
        for k, v in options.items()
        if isinstance(v, list) and v
    )
    line = " ".join(summary["command_line"])
    metrics = (
        f'<details><summary>metrics</summary><pre id="metrics">{esc(json.dumps(summary["metrics"], indent=1))}</pre></details>'
        if summary["metrics"]
        else ""
    )
    more = f'<p class="muted">first {PAGE_ROWS} shown; the API pages through all</p>'
    return (
        f'<div class="top">{_counters(summary)}</div><div class="cols">{facts}{timing}'
        f"{_kv(cache_rows, 'cache')}</div>{log}"
        "<section><h2>Targets</h2>"
        + _table("targets", TARGET_HEAD, [target_row(x) for x in targets], "no targets yet")
        + (more if len(targets) >= PAGE_ROWS else "")
        + "</section><section><h2>Tests</h2>"
        + _table("tests", TEST_HEAD, [test_row(x) for x in tests], "no test results yet")
        + (more if len(tests) >= PAGE_ROWS else "")
        + "</section><section><h2>Failed actions</h2>"
        + _table("actions", ACTION_HEAD, [action_row(x) for x in actions], "no failed actions")
        + "</section><section><h2>Artifacts</h2>"
        + _table(
            "artifacts",
            ARTIFACT_HEAD,
            [artifact_row(x) for x in artifacts or []],
            "no artifacts in the CAS sink",
        )
        + '</section><section id="options"><h2>Options</h2>'
        + f'<h3>command line</h3><pre id="command-line">{_dash(line)}</pre>{option_parts}{metrics}'
        + "</section>"
    )


def _not_found(what: str) -> HTMLResponse:
    return page("not found", f'<p class="error">No such {esc(what)}.</p>', name="error", status=404)


def _bad(message: str) -> HTMLResponse:
    return page("bad request", f'<p class="error">{esc(message)}</p>', name="error", status=400)


@router.get("/static/{name}")
async def static_file(name: str) -> Response:
    """The script and the stylesheet."""
    if name not in STATIC:
        return Response("not found", status_code=404, media_type="text/plain")
    text = resources.files("conveyor_bep_web").joinpath("static", name).read_text()
    return Response(text, media_type=STATIC[name], headers={"cache-control": "no-cache"})


@router.get("/", response_class=HTMLResponse)
async def projects_page(request: Request, viewer: ViewerDep) -> HTMLResponse:
    """The projects the viewer may read."""
    async with request.app.state.pool.acquire() as conn:
        projects = await reads.list_projects(conn, viewer.project_ids())
    return page("Projects", projects_body(projects), name="projects")


@router.get("/p/{slug}", response_class=HTMLResponse)
async def builds_page(
    request: Request,
    viewer: ViewerDep,
    slug: str,
    status: str | None = None,
    user: str | None = None,
    branch: str | None = None,
    tag: Annotated[list[str] | None, Query()] = None,
    tags: str | None = None,
    q: str | None = None,
    before: str | None = None,
    limit: int = DEFAULT_LIMIT,
) -> HTMLResponse:
    """A project's builds: the search form, the facets and a page of builds."""
    allowed = viewer.project_ids()
    try:
        every_tag = [*(tag or []), *(tags or "").split()]
        search = build_search(status=status, user=user, branch=branch, tag=every_tag, q=q)
        if not 1 <= limit <= MAX_LIMIT:
            raise BadInput(f"limit must be between 1 and {MAX_LIMIT}")
        async with request.app.state.pool.acquire() as conn:
            project = await reads.project_by_slug(conn, allowed, slug)
            if project is None:
                return _not_found("project")
            builds, following = await reads.search_builds(
                conn, allowed, project, search, before=before, limit=limit
            )
            facets = await reads.build_facets(conn, allowed, project, search)
    except BadInput as exc:
        return _bad(str(exc))
    return page(
        project.name,
        builds_body(project.slug, search, builds, following, facets, limit),
        name="builds",
        crumbs=[(project.slug, f"/p/{_quote(project.slug)}")],
        data={"project": project.slug, "first-page": "0" if before else "1"},
    )


@router.get("/b/{invocation_id}", response_class=HTMLResponse)
async def build_page(request: Request, viewer: ViewerDep, invocation_id: str) -> HTMLResponse:
    """One build: summary, counters, log, targets, tests, failed actions, options."""
    allowed = viewer.project_ids()
    async with request.app.state.pool.acquire() as conn:
        summary = await reads.build_summary(conn, allowed, invocation_id)
        if summary is None:
            return _not_found("build")
        targets, _ = await reads.build_targets(
            conn, allowed, invocation_id, after=None, failed=False, limit=PAGE_ROWS
        )
        tests, _ = await reads.build_tests(
            conn, allowed, invocation_id, after=None, failed=False, limit=PAGE_ROWS
        )
        actions, _ = await reads.build_actions(
            conn, allowed, invocation_id, after=None, limit=PAGE_ROWS
        )
    found = await artifacts.visible_artifacts(request, summary["project"]["id"], invocation_id)
    what = " ".join([summary["command"] or "build", *summary["patterns"]])
    c = summary["counters"]
    heading = f"{badge(summary['status'], element_id='status')} {esc(what)}"
    return page(
        what,
        build_body(summary, targets, tests, actions, [artifacts.describe(a) for a in found]),
        name="build",
        heading=heading,
        crumbs=[
            (summary["project"]["slug"], f"/p/{_quote(summary['project']['slug'])}"),
            (invocation_id[:13], build_href(invocation_id)),
        ],
        data={
            "invocation": invocation_id,
            "finished": "1" if summary["finished"] else "0",
            "targets": str(c["targets_configured"] + c["targets_completed"]),
            "tests": str(summary["cache"]["test_results"]),
            "actions": str(c["actions_failed"]),
        },
    )
