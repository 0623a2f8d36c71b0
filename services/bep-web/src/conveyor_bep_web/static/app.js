/* Conveyor builds: the pages' one script (no build step).

   - Build list (/p/<slug>): follows /api/projects/<slug>/live and updates the rows shown
     (status, counters); builds not on the page are announced, not inserted.
   - Build page (/b/<id>): follows /api/builds/<id>/live (one event per digest interval
     at most): the status badge, counters and times; targets, tests and failed actions
     are re-fetched when their counts move; the log's new tail is fetched from the last
     offset.
   - The log viewer: a Web Worker (this same file, started with new Worker(src)) fetches
     the log as a stream, keeps its bytes in chunks and indexes line starts; the page
     asks it for the lines in view only. The viewport holds a spacer as tall as all the
     lines and a window of absolutely positioned .log-line elements, re-rendered on
     scroll: a 100 MB log costs its bytes and an index, never 100 MB of DOM. ANSI
     escapes are removed; SGR colours and bold become classes. Everything a build sent
     is set as text (textContent), never as HTML.
*/
"use strict";

/* ---- The log engine: runs in the worker (or on the page when workers fail). ---- */

const ANSI = /\x1b\[([0-9;?]*)([ -\/]*[@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[PX^_][^\x1b]*(?:\x1b\\)?|\x1b[()*+][0-9A-Za-z]|\x1b[@-Z\\-_]|[\x00-\x08\x0b-\x1f\x7f]/g;

/* One line's text as [text, classes] runs: SGR codes become classes, every other escape
   and control character goes; a carriage return keeps what was written after it. */
function ansiRuns(line) {
  const cr = line.replace(/\r+$/, "").lastIndexOf("\r");
  if (cr >= 0) line = line.slice(cr + 1);
  if (line.indexOf("\x1b") < 0 && !/[\x00-\x08\x0b-\x1f\x7f]/.test(line)) return [[line, ""]];
  const runs = [];
  let fg = -1, bg = -1, bold = false, dim = false, italic = false, under = false;
  let last = 0;
  const classes = () => [fg >= 0 ? "fg" + fg : "", bg >= 0 ? "bg" + bg : "", bold ? "b" : "",
    dim ? "dim" : "", italic ? "i" : "", under ? "u" : ""].filter(Boolean).join(" ");
  const push = (text) => { if (text) runs.push([text, classes()]); };
  ANSI.lastIndex = 0;
  let m;
  while ((m = ANSI.exec(line)) !== null) {
    push(line.slice(last, m.index));
    last = ANSI.lastIndex;
    if (m[2] !== "m" || m[0][1] !== "[") continue;
    const codes = (m[1] || "0").split(";").map((c) => (c === "" ? 0 : Number(c)));
    for (let k = 0; k < codes.length; k++) {
      const c = codes[k];
      if (c === 0) { fg = bg = -1; bold = dim = italic = under = false; }
      else if (c === 1) bold = true;
      else if (c === 2) dim = true;
      else if (c === 3) italic = true;
      else if (c === 4) under = true;
      else if (c === 22) bold = dim = false;
      else if (c === 23) italic = false;
      else if (c === 24) under = false;
      else if (c >= 30 && c <= 37) fg = c - 30;
      else if (c >= 90 && c <= 97) fg = c - 90 + 8;
      else if (c === 39) fg = -1;
      else if (c >= 40 && c <= 47) bg = c - 40;
      else if (c >= 100 && c <= 107) bg = c - 100 + 8;
      else if (c === 49) bg = -1;
      else if (c === 38 || c === 48) {
        // 256 colours (5;n: the first 16 kept) or true colour (2;r;g;b): the colours
        // not kept show as the default one.
        let n = -1;
        if (codes[k + 1] === 5) { n = codes[k + 2] < 16 ? codes[k + 2] : -1; k += 2; }
        else if (codes[k + 1] === 2) k += 4;
        if (c === 38) fg = n; else bg = n;
      }
    }
  }
  push(line.slice(last));
  return runs.length ? runs : [["", ""]];
}

class LogEngine {
  constructor(post) {
    this.post = post;
    this.chunks = [];        // Uint8Array chunks as they arrived
    this.chunkStarts = [];   // byte offset of each chunk
    this.length = 0;         // bytes held
    this.starts = new Float64Array(1024); // byte offset of each line's start
    this.count = 1;          // entries in starts (starts[0] = 0)
    this.url = null;
    this.busy = false;
    this.again = false;
    this.decoder = new TextDecoder("utf-8");
    this.lastPost = 0;
  }

  /* Lines as shown: a log that ends with a newline has no empty last line. */
  lines() {
    return this.starts[this.count - 1] === this.length ? this.count - 1 : this.count;
  }

  append(chunk) {
    this.chunks.push(chunk);
    this.chunkStarts.push(this.length);
    for (let i = 0; i < chunk.length; i++) {
      if (chunk[i] === 10) {
        if (this.count === this.starts.length) {
          const grown = new Float64Array(this.starts.length * 2);
          grown.set(this.starts);
          this.starts = grown;
        }
        this.starts[this.count++] = this.length + i + 1;
      }
    }
    this.length += chunk.length;
  }

  slice(from, to) {
    const out = new Uint8Array(to - from);
    let lo = 0, hi = this.chunkStarts.length - 1;
    while (lo < hi) { // the last chunk starting at or before `from`
      const mid = (lo + hi + 1) >> 1;
      if (this.chunkStarts[mid] <= from) lo = mid; else hi = mid - 1;
    }
    let at = 0;
    for (let c = lo; c < this.chunks.length && at < out.length; c++) {
      const chunk = this.chunks[c];
      const begin = Math.max(0, from - this.chunkStarts[c]);
      const end = Math.min(chunk.length, to - this.chunkStarts[c]);
      if (end > begin) { out.set(chunk.subarray(begin, end), at); at += end - begin; }
    }
    return out;
  }

  progress(done) {
    this.lastPost = Date.now();
    this.post({ type: "progress", bytes: this.length, lines: this.lines(), done: done });
  }

  async fetchFrom() {
    if (this.busy) { this.again = true; return; }
    this.busy = true;
    try {
      do {
        this.again = false;
        const offset = this.length;
        const response = await fetch(this.url + "?offset=" + offset, { credentials: "same-origin" });
        if (!response.ok) throw new Error("log: HTTP " + response.status);
        const reader = response.body.getReader();
        for (;;) {
          const { done, value } = await reader.read();
          if (done) break;
          if (value && value.length) this.append(value);
          if (Date.now() - this.lastPost > 100) this.progress(false);
        }
        this.progress(true);
      } while (this.again);
    } catch (err) {
      this.post({ type: "error", message: String(err && err.message || err) });
    } finally {
      this.busy = false;
    }
  }

  linesAt(from, to) {
    const total = this.lines();
    from = Math.max(0, Math.min(from, total));
    to = Math.max(from, Math.min(to, total));
    const out = [];
    if (to > from) {
      const begin = this.starts[from];
      const end = to < this.count ? this.starts[to] : this.length;
      const text = this.decoder.decode(this.slice(begin, end));
      const parts = text.split("\n");
      for (let i = 0; i < to - from; i++) out.push(ansiRuns(parts[i] || ""));
    }
    return out;
  }

  handle(msg) {
    if (msg.type === "load") { this.url = msg.url; this.fetchFrom(); }
    else if (msg.type === "tail") { if (this.url) this.fetchFrom(); }
    else if (msg.type === "lines") {
      this.post({ type: "lines", id: msg.id, from: msg.from, lines: this.linesAt(msg.from, msg.to),
        total: this.lines() });
    }
  }
}

if (typeof document === "undefined") {
  /* ---- In the worker. ---- */
  const engine = new LogEngine((m) => self.postMessage(m));
  self.onmessage = (e) => engine.handle(e.data);
} else {
  /* ---- On the page. ---- */
  const SCRIPT = document.currentScript ? document.currentScript.src : "/static/app.js";

  const el = (tag, attrs, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v; else node.setAttribute(k, v);
    }
    for (const child of children) {
      if (child === null || child === undefined || child === "") continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  };
  const dash = (v) => (v === null || v === undefined || v === "" ? el("span", { class: "muted" }, "—") : String(v));
  const duration = (ms) => {
    if (ms === null || ms === undefined) return "";
    if (ms < 1000) return ms + " ms";
    const s = ms / 1000;
    if (s < 60) return s.toFixed(1) + " s";
    const min = Math.floor(s / 60), rest = Math.floor(s) % 60;
    return min < 60 ? min + " min " + rest + " s" : Math.floor(min / 60) + " h " + (min % 60) + " min";
  };
  const badge = (status, id) => {
    const value = String(status || "unknown").toLowerCase();
    return el("span", { id: id, class: "badge s-" + value, "data-status": value }, value);
  };
  const setBadge = (node, status) => {
    const value = String(status || "unknown").toLowerCase();
    node.className = "badge s-" + value;
    node.dataset.status = value;
    node.textContent = value;
  };
  const getJSON = async (url) => {
    const response = await fetch(url, { credentials: "same-origin" });
    if (!response.ok) throw new Error(url + ": HTTP " + response.status);
    return response.json();
  };

  /* Rows, as pages.py renders them. */
  const targetRow = (t) => {
    let state = t.success === false ? "failed" : (t.success ? "success" : "running");
    if (t.test_status) state = t.test_status;
    return el("tr", { "data-label": t.label }, el("td", {}, badge(state)),
      el("td", {}, el("code", {}, t.label), t.aspect ? el("span", { class: "muted" }, " " + t.aspect) : null),
      el("td", {}, dash(t.kind)), el("td", {}, dash(t.test_size)),
      el("td", { class: "num" }, duration(t.test_duration_ms)),
      el("td", { class: "error" }, t.failure || ""));
  };
  const testRow = (r) => {
    const cached = r.cached_remotely ? "remote" : (r.cached_locally ? "local" : "");
    const outputs = (r.outputs || []).length ? el("ul", { class: "outputs" }, ...r.outputs.map((o) =>
      el("li", {}, el("span", { class: "name" }, o.name || ""), " ", el("code", { class: "muted" }, o.uri || "")))) : null;
    return el("tr", { "data-label": r.label }, el("td", {}, badge(r.status)),
      el("td", {}, el("code", {}, r.label),
        el("div", { class: "muted" }, "run " + r.run + " · shard " + r.shard + " · attempt " + r.attempt),
        r.status_details ? el("pre", { class: "details" }, r.status_details) : null, outputs),
      el("td", { class: "num" }, duration(r.duration_ms)), el("td", {}, cached), el("td", {}, dash(r.strategy)));
  };
  const actionRow = (a) => {
    const line = (a.command_line || []).join(" ");
    return el("tr", { "data-seq": String(a.seq) }, el("td", {}, badge(a.success ? "success" : "failed")),
      el("td", {}, dash(a.mnemonic)),
      el("td", {}, el("code", {}, a.label || ""), el("div", { class: "muted" }, a.primary_output || "")),
      el("td", { class: "num" }, dash(a.exit_code)),
      el("td", {}, el("div", { class: "error" }, a.failure || ""), line ? el("pre", {}, line) : null,
        a.stderr_uri ? el("div", { class: "muted" }, "stderr " + a.stderr_uri) : null));
  };
  const fillTable = (id, rows, empty) => {
    const table = document.getElementById(id);
    if (!table) return;
    const body = table.tBodies[0];
    const cols = table.tHead ? table.tHead.rows[0].cells.length : 1;
    body.replaceChildren(...(rows.length ? rows : [el("tr", { class: "empty" }, el("td", { colspan: String(cols) }, empty))]));
  };

  /* ---- The log viewer. ---- */
  class LogView {
    constructor(viewport, url) {
      this.viewport = viewport;
      this.spacer = viewport.querySelector("#log-spacer");
      this.window = viewport.querySelector("#log-window");
      this.count = document.getElementById("log-count");
      this.follow = document.getElementById("log-follow");
      this.total = 0;
      this.bytes = 0;
      this.cache = new Map();
      this.nextId = 1;
      this.wanted = null;
      this.maxHeight = 8000000; // px: browsers cap an element's height
      const probe = el("div", { class: "log-line" }, "x");
      this.window.append(probe);
      this.lineHeight = probe.getBoundingClientRect().height || 18;
      probe.remove();
      this.worker = this.startWorker();
      this.viewport.addEventListener("scroll", () => this.render(), { passive: true });
      // Scrolling up by hand stops following the end.
      const unfollow = () => { if (this.follow) this.follow.checked = false; };
      this.viewport.addEventListener("wheel", (e) => { if (e.deltaY < 0) unfollow(); }, { passive: true });
      this.viewport.addEventListener("keydown", (e) => {
        if (["ArrowUp", "PageUp", "Home"].includes(e.key)) unfollow();
      });
      window.addEventListener("resize", () => this.render());
      this.worker.postMessage({ type: "load", url: url });
    }

    startWorker() {
      const onmessage = (e) => this.message(e.data);
      try {
        const worker = new Worker(SCRIPT);
        worker.onmessage = onmessage;
        worker.onerror = () => { this.viewport.dataset.worker = "failed"; };
        this.viewport.dataset.worker = "on";
        return worker;
      } catch (err) {
        // No workers (a policy, an old browser): the same engine on the page.
        this.viewport.dataset.worker = "off";
        const engine = new LogEngine((m) => setTimeout(() => onmessage({ data: m }), 0));
        return { postMessage: (m) => engine.handle(m) };
      }
    }

    tail() { this.worker.postMessage({ type: "tail" }); }

    message(m) {
      if (m.type === "progress") {
        const before = this.total;
        this.total = m.lines;
        this.bytes = m.bytes;
        // The last line may have grown: forget it.
        for (let i = Math.max(0, before - 1); i < before + 1; i++) this.cache.delete(i);
        this.viewport.dataset.loadedBytes = String(m.bytes);
        this.viewport.dataset.lines = String(m.lines);
        if (m.done) this.viewport.dataset.state = "loaded";
        if (this.count) this.count.textContent = m.lines + " lines";
        this.layout();
        if (this.follow && this.follow.checked) this.viewport.scrollTop = this.viewport.scrollHeight;
        this.render();
      } else if (m.type === "lines") {
        m.lines.forEach((runs, i) => this.cache.set(m.from + i, runs));
        if (this.cache.size > 5000) {
          const keep = this.range();
          for (const key of this.cache.keys()) if (key < keep.from - 500 || key > keep.to + 500) this.cache.delete(key);
        }
        if (this.wanted === m.id) this.wanted = null;
        this.render();
      } else if (m.type === "error") {
        this.viewport.dataset.error = m.message;
      }
    }

    layout() {
      const full = this.total * this.lineHeight;
      this.height = Math.min(full, this.maxHeight);
      this.spacer.style.height = this.height + "px";
    }

    /* The first line in view and how many fit, for the scroll position. */
    range() {
      const view = this.viewport.clientHeight || 400;
      const full = this.total * this.lineHeight;
      const top = this.viewport.scrollTop;
      const room = Math.max(1, (this.height || 0) - view);
      const ratio = full > this.maxHeight ? (full - view) / room : 1;
      const virtual = top * ratio;
      const first = Math.max(0, Math.floor(virtual / this.lineHeight));
      const shown = Math.ceil(view / this.lineHeight) + 2;
      return { from: first, to: Math.min(this.total, first + shown),
        top: top - (virtual - first * this.lineHeight) };
    }

    render() {
      const r = this.range();
      let missing = -1;
      for (let i = r.from; i < r.to; i++) if (!this.cache.has(i)) { missing = i; break; }
      if (missing >= 0 && this.wanted === null) {
        this.wanted = this.nextId++;
        this.worker.postMessage({ type: "lines", id: this.wanted, from: Math.max(0, r.from - 100), to: r.to + 100 });
      }
      this.window.style.transform = "translateY(" + r.top + "px)";
      const rows = [];
      for (let i = r.from; i < r.to; i++) {
        const runs = this.cache.get(i);
        const line = el("div", { class: "log-line", "data-line": String(i + 1) }, el("span", { class: "ln" }, String(i + 1)));
        if (runs) for (const [text, cls] of runs) line.append(cls ? el("span", { class: cls }, text) : document.createTextNode(text));
        else line.classList.add("pending");
        rows.push(line);
      }
      this.window.replaceChildren(...rows);
    }
  }

  /* ---- The build page. ---- */
  function buildPage() {
    const body = document.body;
    const id = body.dataset.invocation;
    const base = "/api/builds/" + encodeURIComponent(id);
    const viewport = document.getElementById("log-viewport");
    const log = viewport ? new LogView(viewport, base + "/log") : null;
    const seen = { targets: body.dataset.targets, tests: body.dataset.tests, actions: body.dataset.actions };
    let refreshing = false;

    async function refetch(what) {
      if (what.targets) {
        const data = await getJSON(base + "/targets?limit=1000");
        fillTable("targets", data.targets.map(targetRow), "no targets yet");
      }
      if (what.tests) {
        const data = await getJSON(base + "/tests?limit=1000");
        fillTable("tests", data.tests.map(testRow), "no test results yet");
      }
      if (what.actions) {
        const data = await getJSON(base + "/actions?limit=1000");
        fillTable("actions", data.actions.map(actionRow), "no failed actions");
      }
    }

    function update(s) {
      const status = document.getElementById("status");
      if (status) setBadge(status, s.status);
      for (const node of document.querySelectorAll("[data-counter]")) {
        const value = s.counters[node.dataset.counter];
        if (value !== undefined) node.textContent = String(value);
      }
      const text = (sel, value) => { const n = document.getElementById(sel); if (n) n.replaceChildren(dash(value)); };
      text("exit", s.exit_code === null ? "" : (s.exit_name || "") + " (" + s.exit_code + ")");
      text("finished-at", s.timing.finished_at);
      text("took", duration(s.timing.duration_ms));
      text("updated-at", s.timing.updated_at);
      body.dataset.finished = s.finished ? "1" : "0";
      body.dataset.lastSeq = String(s.counters.last_event_seq);
      if (log && s.log.bytes > log.bytes) log.tail();
      const now = {
        targets: String(s.counters.targets_configured + s.counters.targets_completed),
        tests: String(s.cache.test_results),
        actions: String(s.counters.actions_failed),
      };
      const changed = {};
      for (const k of Object.keys(now)) if (now[k] !== seen[k]) { changed[k] = true; seen[k] = now[k]; }
      if (Object.keys(changed).length && !refreshing) {
        refreshing = true;
        refetch(changed).catch(() => {}).finally(() => { refreshing = false; });
      }
    }

    if (body.dataset.finished === "1" || !window.EventSource) return;
    const source = new EventSource(base + "/live");
    body.dataset.live = "connecting";
    source.onopen = () => { body.dataset.live = "on"; };
    source.addEventListener("build", (e) => {
      body.dataset.live = "on";
      body.dataset.liveEvents = String(Number(body.dataset.liveEvents || 0) + 1);
      update(JSON.parse(e.data));
    });
    source.addEventListener("end", () => { source.close(); body.dataset.live = "ended"; });
    source.addEventListener("gone", () => { source.close(); body.dataset.live = "gone"; });
  }

  /* ---- A project's build list. ---- */
  function buildsPage() {
    const body = document.body;
    const slug = body.dataset.project;
    if (!slug || !window.EventSource) return;
    const notice = document.getElementById("new-builds");
    const fresh = new Set();
    const source = new EventSource("/api/projects/" + encodeURIComponent(slug) + "/live");
    source.addEventListener("ready", () => { body.dataset.live = "on"; });
    source.addEventListener("builds", (e) => {
      for (const b of JSON.parse(e.data).builds) {
        const row = document.querySelector('tr.build[data-invocation="' + CSS.escape(b.invocation_id) + '"]');
        if (!row) {
          if (body.dataset.firstPage === "1") fresh.add(b.invocation_id);
          continue;
        }
        const status = row.querySelector(".badge");
        if (status) setBadge(status, b.status);
        const targets = row.querySelector('[data-field="targets"]');
        if (targets) targets.textContent = b.targets_completed + "/" + b.targets_configured;
        const tests = row.querySelector('[data-field="tests"]');
        if (tests) tests.textContent = b.tests_total ? b.tests_passed + "/" + b.tests_total : "";
      }
      if (notice && fresh.size) {
        notice.hidden = false;
        notice.replaceChildren(fresh.size + " new build" + (fresh.size > 1 ? "s" : "") + " · ",
          el("a", { href: location.href }, "show"));
      }
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    const name = document.body.dataset.page;
    if (name === "build") buildPage();
    else if (name === "builds") buildsPage();
  });
}
