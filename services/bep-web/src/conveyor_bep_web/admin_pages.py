"""The admin pages: ``/admin`` (projects, a new project, the audit log) and
``/p/{slug}/settings`` (a project's name, groups, keys and audit log).

Both are shells in the common layout whose small script works the admin API
(:mod:`conveyor_bep_web.admin`) and renders what it answers as text (never as HTML). With
OpenID Connect the browser's session cookie authenticates the calls; in open mode the page
asks for the admin token and keeps it in the tab's ``sessionStorage``.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from conveyor_runtime.settings import BepWebSettings
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse

from conveyor_bep_web.auth import Viewer, current_viewer, oidc_enabled
from conveyor_bep_web.pages import esc, page

router = APIRouter(include_in_schema=False)
ViewerDep = Annotated[Viewer, Depends(current_viewer)]

_SCRIPT = r"""<script>
(() => {
  const body = document.body;
  const slug = body.dataset.slug ? encodeURIComponent(body.dataset.slug) : null;
  const $ = (id) => document.getElementById(id);
  const say = (text, bad) => { const s = $("admin-status"); s.textContent = text;
    s.className = bad ? "error" : "muted"; };
  async function call(method, path, payload) {
    const headers = {"content-type": "application/json"};
    const token = sessionStorage.getItem("bepAdminToken");
    if (token) headers.authorization = "Bearer " + token;
    const r = await fetch("/api/admin" + path, {method, headers, credentials: "same-origin",
      body: payload === undefined ? undefined : JSON.stringify(payload)});
    const data = await r.json().catch(() => ({}));
    if (!r.ok) {
      const d = data.detail;
      throw new Error(typeof d === "string" ? d : d ? JSON.stringify(d) : "HTTP " + r.status);
    }
    return data;
  }
  function table(id, head, rows) {
    const t = $(id); t.replaceChildren();
    const tr = t.insertRow(); for (const h of head) {
      const th = document.createElement("th"); th.textContent = h; tr.append(th); }
    for (const row of rows) { const r = t.insertRow();
      for (const cell of row) { const c = r.insertCell();
        if (cell instanceof Node) c.append(cell); else c.textContent = cell ?? "—"; } }
  }
  const groups = (text) => text.split(",").map((g) => g.trim()).filter(Boolean);
  const link = (text, href) => { const a = document.createElement("a");
    a.textContent = text; a.href = href; return a; };
  async function audit() {
    const q = slug ? "?project=" + slug : "";
    const {entries} = await call("GET", "/audit" + q);
    table("audit", ["when", "who", "action", "project", "target", "details"],
      entries.map((e) => [e.at, e.actor_email || e.actor, e.action, e.project, e.target,
        JSON.stringify(e.details)]));
  }
  async function keys() {
    const {keys} = await call("GET", "/projects/" + slug + "/keys");
    table("keys", ["id", "name", "created", "revoked", ""], keys.map((k) => {
      let action = "";
      if (!k.revoked_at) { action = document.createElement("button"); action.textContent = "Revoke";
        action.onclick = () => run(async () => {
          if (!confirm("Revoke key " + k.id + "? Builds using it fail at once.")) return;
          await call("POST", "/projects/" + slug + "/keys/" + k.id + "/revoke"); }); }
      return [k.id, k.name, k.created_at, k.revoked_at, action]; }));
  }
  async function load() {
    if (slug) {
      const p = await call("GET", "/projects/" + slug);
      $("name").value = p.name; $("allowed").value = p.allowed_groups.join(", ");
      $("admins").value = p.admin_groups.join(", ");
      $("limits").textContent = p.max_streams + " streams, " + p.max_unacked + " unacked events";
      await keys();
    } else {
      const {projects} = await call("GET", "/projects");
      table("projects", ["project", "name", "allowed groups", "admin groups", "live keys"],
        projects.map((p) => [link(p.slug, "/p/" + encodeURIComponent(p.slug) + "/settings"),
          p.name, p.allowed_groups.join(", "), p.admin_groups.join(", "), String(p.live_keys)]));
    }
    await audit(); say("");
  }
  async function run(action) { try { await action(); await load(); } catch (e) { say(e.message, true); } }
  const on = (id, handler) => { const f = $(id); if (f) f.onsubmit = (ev) => {
    ev.preventDefault(); run(handler); }; };
  on("token-form", async () => { sessionStorage.setItem("bepAdminToken", $("token").value); });
  on("create-form", async () => { await call("POST", "/projects", {slug: $("new-slug").value,
    allowed_groups: groups($("new-allowed").value), admin_groups: groups($("new-admins").value)});
    $("new-slug").value = ""; });
  on("project-form", async () => { await call("PATCH", "/projects/" + slug, {name: $("name").value,
    allowed_groups: groups($("allowed").value), admin_groups: groups($("admins").value)}); });
  on("key-form", async () => { const k = await call("POST", "/projects/" + slug + "/keys",
    {name: $("key-name").value}); $("new-key").textContent = k.key;
    $("new-key-box").hidden = false; });
  run(async () => {});
})();
</script>"""


def _token_form(settings: BepWebSettings) -> str:
    if oidc_enabled(settings):
        return ""
    return (
        '<form id="token-form"><label>Admin token <input id="token" type="password" '
        'autocomplete="off" required></label> <button>Use</button> '
        '<span class="muted">kept in this tab only</span></form>'
    )


_AUDIT = '<section><h2>Audit log</h2><table id="audit"></table></section>'


@router.get("/admin", response_class=HTMLResponse)
async def admin_page(request: Request, viewer: ViewerDep) -> HTMLResponse:
    """Projects, a new project and the audit log."""
    settings: BepWebSettings = request.app.state.settings
    body = (
        _token_form(settings)
        + '<p id="admin-status" class="muted">loading…</p>'
        + '<section><h2>Projects</h2><table id="projects"></table></section>'
        + '<section><h2>New project</h2><form id="create-form">'
        + '<label>Slug <input id="new-slug" required pattern="[a-z0-9][a-z0-9\\-]{0,62}"></label> '
        + '<label>Allowed groups <input id="new-allowed" placeholder="a, b"></label> '
        + '<label>Admin groups <input id="new-admins" placeholder="a, b"></label> '
        + "<button>Create</button></form></section>"
        + _AUDIT
        + _SCRIPT
    )
    return page("Admin", body, name="admin", crumbs=[("Admin", "/admin")])


@router.get("/p/{slug}/settings", response_class=HTMLResponse)
async def project_settings_page(request: Request, viewer: ViewerDep, slug: str) -> HTMLResponse:
    """A project's name, groups, keys and audit log."""
    settings: BepWebSettings = request.app.state.settings
    body = (
        _token_form(settings)
        + '<p id="admin-status" class="muted">loading…</p>'
        + '<section><h2>Project</h2><form id="project-form">'
        + '<label>Name <input id="name" required></label> '
        + '<label>Allowed groups <input id="allowed" placeholder="a, b"></label> '
        + '<label>Admin groups <input id="admins" placeholder="a, b"></label> '
        + '<button>Save</button></form><p>Limits: <span id="limits"></span></p></section>'
        + '<section><h2>API keys</h2><form id="key-form"><label>Name '
        + '<input id="key-name" placeholder="where it is used"></label> <button>New key</button>'
        + '</form><p id="new-key-box" hidden>The new key, shown this once: '
        + '<code id="new-key"></code></p><table id="keys"></table></section>'
        + _AUDIT
        + _SCRIPT
    )
    return page(
        f"{slug} settings",
        body,
        name="settings",
        crumbs=[(slug, f"/p/{quote(slug, safe='')}"), ("Settings", request.url.path)],
        data={"slug": slug},
        heading=f"{esc(slug)} · settings",
    )
