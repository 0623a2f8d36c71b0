// The Conveyor dashboard's only script: login, who am I, confirmed actions, the queues
// page's refresh and the live events. Plain JavaScript, nothing to build.
"use strict";

const TOKEN_KEY = "conveyor_token";

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (token()) h.Authorization = "Bearer " + token();
  return h;
}

function setToken(value) {
  if (value) {
    sessionStorage.setItem(TOKEN_KEY, value);
    // A session cookie for the server-rendered pages only (they only read).
    document.cookie =
      TOKEN_KEY + "=" + encodeURIComponent(value) + "; path=/ui; SameSite=Strict";
  } else {
    sessionStorage.removeItem(TOKEN_KEY);
    document.cookie = TOKEN_KEY + "=; path=/ui; SameSite=Strict; max-age=0";
  }
}

function flash(text, kind) {
  const box = document.getElementById("flash");
  if (!box) return;
  box.textContent = text;
  box.className = kind || "";
}

async function problemText(response) {
  try {
    const body = await response.json();
    return (body.code || response.status) + ": " + (body.detail || body.title || "");
  } catch (_) {
    return String(response.status);
  }
}

async function whoami() {
  const who = document.getElementById("whoami");
  const response = await fetch("/v1/whoami", { headers: headers() });
  if (!response.ok) {
    // 501: an api older than WhoAmI (the actions stay hidden; the api decides anyway).
    if (who) who.textContent = response.status === 501 ? "role: unknown" : "not logged in";
    return;
  }
  const me = await response.json();
  if (who) who.textContent = "role: " + me.role;
  document.body.dataset.role = me.role;
  // Action buttons stay hidden (CSS) unless the token may mutate.
  document.body.classList.toggle("can-mutate", Boolean(me.can_mutate));
  if (token()) document.getElementById("logout").hidden = false;
}

async function act(button) {
  if (!window.confirm(button.dataset.confirm || "Are you sure?")) return;
  const init = { method: button.dataset.method || "POST", headers: headers() };
  if (button.dataset.body !== undefined) {
    const body = JSON.parse(button.dataset.body);
    const action = document.getElementById("batch-action");
    if (action) body.action = action.value;
    init.body = JSON.stringify(body);
    init.headers["content-type"] = "application/json";
  }
  button.disabled = true;
  try {
    const response = await fetch(button.dataset.url, init);
    if (!response.ok) {
      flash(await problemText(response), "error");
      return;
    }
    const reply = await response.json();
    if (reply.affected !== undefined) {
      const failed = Object.keys(reply.failures || {}).length;
      sessionStorage.setItem("conveyor_flash", reply.affected + " affected, " + failed + " failed");
    }
    if (button.dataset.then) window.location.assign(button.dataset.then);
    else window.location.reload();
  } finally {
    button.disabled = false;
  }
}

function refresh(live) {
  const every = Number(live.dataset.refresh || 5000);
  const tick = async () => {
    try {
      const response = await fetch("/ui?fragment=1", { headers: headers() });
      if (response.ok) live.innerHTML = await response.text();
    } catch (_) {
      // the next tick tries again
    }
    window.setTimeout(tick, every);
  };
  window.setTimeout(tick, every);
}

function stateName(value) {
  return String(value || "").replace(/^TASK_STATE_/, "").toLowerCase();
}

function cell(row, text, href) {
  const td = row.insertCell();
  if (href) {
    const a = document.createElement("a");
    a.href = href;
    a.textContent = text;
    td.appendChild(a);
  } else {
    td.textContent = text;
  }
}

async function watch(table) {
  const status = document.getElementById("events-status");
  const queue = table.dataset.queue;
  const url = "/v1/events" + (queue ? "?queue=" + encodeURIComponent(queue) : "");
  // fetch, not EventSource: an EventSource cannot send the Authorization header.
  const response = await fetch(url, { headers: headers() });
  if (!response.ok) {
    status.textContent = await problemText(response);
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const tbody = table.tBodies[0];
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (block.startsWith(": watching")) status.textContent = "watching";
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data: "))
        .map((line) => line.slice(6))
        .join("\n");
      if (!data) continue;
      const event = JSON.parse(data);
      if (block.startsWith("event: error")) {
        status.textContent = "stream ended: " + event.code + " " + (event.detail || "");
        continue;
      }
      const row = tbody.insertRow(0);
      row.className = "event";
      cell(row, event.at || "");
      cell(row, event.queue || "");
      cell(row, event.type || "");
      if (event.taskId) cell(row, event.taskId, "/ui/task?id=" + encodeURIComponent(event.taskId));
      else cell(row, "breaker");
      cell(row, event.breaker ? event.breaker.state : stateName(event.state));
      cell(row, event.error || "");
      while (tbody.rows.length > 500) tbody.deleteRow(-1);
    }
  }
  status.textContent = "stream ended";
}

document.addEventListener("DOMContentLoaded", () => {
  const login = document.getElementById("login");
  if (login) {
    login.addEventListener("submit", (e) => {
      e.preventDefault();
      setToken(document.getElementById("token").value.trim());
      if (window.location.pathname === "/ui/login") window.location.assign("/ui");
      else window.location.reload();
    });
  }
  document.getElementById("logout").addEventListener("click", () => {
    setToken("");
    window.location.assign("/ui/login");
  });
  document.addEventListener("click", (e) => {
    const button = e.target.closest("button.act");
    if (button) act(button);
  });
  const pending = sessionStorage.getItem("conveyor_flash");
  if (pending) {
    sessionStorage.removeItem("conveyor_flash");
    flash(pending, "ok");
  }
  const live = document.getElementById("live");
  if (live) refresh(live);
  const events = document.getElementById("events");
  if (events) watch(events);
  whoami();
});
