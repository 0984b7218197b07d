// The live view's script. The page is rendered on the server and works
// without it; this adds live refresh (from /events), loading a collapsed
// subtree when it is opened, and a confirmation before every action.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];

// Live refresh: a change the page shows re-renders it as the server sees
// it, at most once a second, keeping opened subtrees open. A change it
// does not show costs the server nothing: the page tells from the change
// itself (its task, the status it had, the top of its tree) and moves its
// counts on by itself.
let timer = 0, inflight = false, again = false;
function schedule() {
  const html = document.documentElement; // counts the refreshes asked for: what a test reads
  html.dataset.asked = String(Number(html.dataset.asked || 0) + 1);
  if (timer || inflight) { again = true; return; }
  timer = setTimeout(refresh, 1000);
}
async function refresh() {
  timer = 0;
  if ($("#confirm").open) { schedule(); return; }
  inflight = true; again = false;
  try {
    const r = await fetch(location.href, { headers: { "Accept": "text/html" } });
    if (r.ok) {
      const doc = new DOMParser().parseFromString(await r.text(), "text/html");
      const open = $$("details.sub[open]").map(d => d.dataset.lazy);
      $("#counts").replaceWith($("#counts", doc));
      $("#main").replaceWith($("#main", doc));
      // The changes that came while it was rendered, or after: the new
      // counts are as of the render's seq.
      const seq = Number($("#main").dataset.seq);
      for (const m of moves) { if (m.seq > seq) move(m.was, m.status); }
      serverClock();
      for (const id of open) {
        const d = $(`details.sub[data-lazy="${CSS.escape(id)}"]`);
        if (d) { d.open = true; }
      }
    }
  } catch (e) { /* the next change tries again */ }
  inflight = false;
  if (again) { again = false; schedule(); }
}

// counted moves the header's counts on by one change the page was not
// rendered with: the status its task left, and the one it took. The
// latest moves are kept, for a render that comes back older than they
// are (refresh).
const moves = [];
function counted(c, t) {
  const main = $("#main");
  if (!main || c.was === t.status) return;
  moves.push({ seq: c.seq, was: c.was, status: t.status });
  if (moves.length > 2000) moves.shift();
  if (c.seq > Number(main.dataset.seq)) move(c.was, t.status);
}

function move(was, status) {
  const bump = (s, by) => {
    const b = s && $(`#counts a.count.${CSS.escape(s)} b`);
    if (b) { b.textContent = String(Number(b.textContent) + by); }
  };
  bump(was, -1);
  bump(status, 1);
  const total = $("#counts .total");
  if (!was && total) { total.textContent = `${parseInt(total.textContent, 10) + 1} tasks`; }
}

// shows says whether the page shows a task of this id (a row), or one
// whose session is this one.
const shows = id => !!id && !!$(`[data-id="${CSS.escape(id)}"]`);
const showsSession = s => !!s && !!$(`li.task[data-session="${CSS.escape(s)}"]`);
let chartsAt = 0, chartsLater = 0;

// concerns says whether a change may show on this page. The tree: a
// change of a task it shows, of one launched from a session it shows, of
// one in the tree of a top row it shows; a new top row (or one whose
// status changed: the order is by status); with filters, a task entering
// or leaving them. A task's detail page: the task's own changes and those
// of the tasks its sessions launched (it may read the whole journal: it is
// not refreshed for others). The table: a row it shows, a new task, a
// status changed, any change when sorted by a figure a run moves, one
// that matches its model or agent filter. The charts: at most every ten
// seconds.
function concerns(e) {
  const main = $("#main");
  if (!main) return false;
  let c, t;
  try { c = JSON.parse(e.data); t = c.task || {}; } catch (err) { return true; }
  counted(c, t);
  if (main.dataset.task) {
    return t.id === main.dataset.task || (main.dataset.sessions || "").split(" ").includes(t.parentSessionID);
  }
  switch (main.dataset.mode) {
    case "charts": { // at most every ten seconds, and the last change drawn too
      const wait = 10000 - (Date.now() - chartsAt);
      if (wait <= 0) { chartsAt = Date.now(); return true; }
      if (!chartsLater) {
        chartsLater = setTimeout(() => { chartsLater = 0; chartsAt = Date.now(); schedule(); }, wait);
      }
      return false;
    }
    case "table": {
      if (shows(t.id) || !c.was || c.was !== t.status) return true;
      const d = main.dataset;
      if (["tokens", "cost", "duration"].includes(d.sort)) return true; // a live task's figures move it
      const has = (s, q) => (s || "").toLowerCase().includes(q.toLowerCase());
      return (!!d.model && has(`${(t.model || {}).providerID}/${(t.model || {}).modelID}`, d.model)) ||
        (!!d.agent && has(t.agent, d.agent)); // it may have entered them
    }
    case "tree":
      break;
    default:
      return true;
  }
  if (shows(t.id) || shows(c.top) || showsSession(t.parentSessionID)) return true;
  const d = main.dataset;
  if (d.parent) {
    return t.parentSessionID === d.parent || t.id === d.parent || (d.parentSessions || "").split(" ").includes(t.parentSessionID);
  }
  if (d.statuses || d.q) { // what matches moves only as a task comes, or changes status
    if (c.was === t.status) return false;
    const st = (d.statuses || "").split(" ");
    if (d.statuses && !st.includes(t.status) && !st.includes(c.was)) return false;
    return !d.q || matches(t, d.q);
  }
  return (t.depth || 1) <= 1 && c.was !== t.status; // a new top row, or one that moves
}

// matches is the search's test (the server's filter.matches): an id or
// its prefix, or the text in the description or a metadata value.
function matches(t, q) {
  const l = q.toLowerCase(), has = s => (s || "").toLowerCase().includes(l);
  return (t.id || "").toLowerCase().startsWith(l) || has(t.description) || has(t.agent) ||
    Object.entries(t.metadata || {}).some(([k, v]) => has(k) || has(v) || `${k}=${v}`.toLowerCase() === l);
}

// The header says how the page follows the service: "connecting…" until
// the stream opens, "live" while it is open, "reconnecting…" while the
// browser opens it again, "disconnected" between refusals, and "static"
// once it cannot follow: no EventSource here, or the service refused the
// stream refusalsForGood times in a row. The page's HTML says "static":
// what a page whose script does not run is.
const refusalsForGood = 3;
let refusals = 0;

function connState(text, cls, title) {
  const conn = $("#conn");
  if (!conn) return;
  conn.textContent = text;
  conn.className = cls;
  conn.title = title;
}

function follow() {
  const main = $("#main");
  if (!main || !window.EventSource) {
    connState("static", "static", "live updates off: this browser cannot follow the event stream");
    return;
  }
  connState("connecting…", "connecting", "live updates: connecting to the service's event stream");
  const es = new EventSource(`/events?lastEventId=${encodeURIComponent(main.dataset.epoch + ":" + main.dataset.seq)}`);
  es.addEventListener("open", () => { refusals = 0; connState("live", "live", "live updates: on"); });
  es.addEventListener("error", () => {
    if (es.readyState === EventSource.CLOSED) { // refused (too many streams, shut down, not authorised)
      es.close();
      if (++refusals >= refusalsForGood) {
        connState("static", "static", `live updates off: the service refused the event stream ${refusals} times in a row; reload the page to try again`);
        return;
      }
      connState("disconnected", "down", "live updates: the service refused the event stream; trying again");
      setTimeout(follow, 1000 * 2 ** (refusals - 1));
      return;
    }
    connState("reconnecting…", "down", "live updates: the connection dropped; the browser reconnects");
  });
  es.addEventListener("snapshot", schedule);
  es.addEventListener("change", (e) => { if (concerns(e)) schedule(); });
}

// Relative times move on between refreshes: each <time class="rel"> is
// said again from its datetime every 15 s, as the server said it when it
// rendered the page (span in view.go), from the server's clock (the
// render's time, data-now on #main, against the browser's then).
let skew = 0; // the server's clock less the browser's

function serverClock() {
  const main = $("#main");
  const now = main ? Date.parse(main.dataset.now || "") : NaN;
  if (!isNaN(now)) { skew = now - Date.now(); }
}

function span(ms) {
  const s = Math.floor(ms / 1000), m = Math.floor(s / 60), h = Math.floor(m / 60), d = Math.floor(h / 24);
  const two = (a, an, b, bn) => b === 0 ? `${a} ${an}` : `${a} ${an} ${b} ${bn}`;
  if (s < 60) return `${s} s`;
  if (m < 60) return `${m} min`;
  if (h < 24) return two(h, "h", m % 60, "min");
  return two(d, "d", h % 24, "h");
}

function ago(ms) {
  if (ms <= -1000) return `in ${span(-ms)}`;
  if (ms < 1000) return "just now";
  return `${span(ms)} ago`;
}

function relTimes() {
  const now = Date.now() + skew;
  for (const el of $$("time.rel")) {
    const t = Date.parse(el.getAttribute("datetime") || "");
    if (isNaN(t)) continue;
    el.textContent = el.dataset.form === "for" ? span(Math.max(now - t, 0)) : ago(now - t);
  }
}

// A collapsed subtree is loaded when it is opened.
document.addEventListener("toggle", async (e) => {
  const d = e.target;
  if (!(d instanceof HTMLDetailsElement) || !d.open || !d.dataset.lazy || d.dataset.loaded) return;
  d.dataset.loaded = "1";
  try {
    const r = await fetch(`/view/children?id=${encodeURIComponent(d.dataset.lazy)}`);
    if (r.ok) {
      const kids = document.createElement("ul");
      kids.className = "kids";
      kids.innerHTML = await r.text();
      ($("a.more", d) || $("ul.kids", d) || d.lastChild).replaceWith(kids);
    }
    else { delete d.dataset.loaded; }
  } catch (err) { delete d.dataset.loaded; }
}, true);

// Actions ask first, in the page's own dialog, and say what failed.
const asks = {
  cancel: id => `Cancel task ${id}? Its child session is aborted; the task shows cancelled once the child has stopped.`,
  close: id => `Close the branch of task ${id}? The task and every task it launched, at any depth, are stopped, and no new task may start in it while it closes.`,
  extend: id => `Send task ${id} another prompt? Its answer is delivered once, in order.`,
  reset: key => `End the cooldown of ${key} by hand? Tasks waiting for it look again at once; the reset is recorded.`,
  "bulk-cancel": (q, n) => `Cancel ${n} live task${n === "1" ? "" : "s"}, every one the filters select? Each child session is aborted; a task shows cancelled once its child has stopped.`,
  "bulk-close": (q, n) => `Close the branches of ${n} task${n === "1" ? "" : "s"}, every one the filters select? Each task and every task it launched, at any depth, are stopped.`,
};
const paths = { cancel: "cancel", close: "close", extend: "extend" };
let pending = null;

document.addEventListener("click", (e) => {
  const b = e.target.closest("button[data-action]");
  if (!b) return;
  // A row's buttons name no task: theirs is the row's.
  const id = b.dataset.id ?? b.closest("li.task")?.dataset.id;
  pending = { action: b.dataset.action, id, count: b.dataset.count };
  const dlg = $("#confirm");
  $(".ask", dlg).textContent = asks[pending.action](pending.id, pending.count);
  $(".answer", dlg).textContent = "";
  const prompt = $("textarea", dlg);
  prompt.value = "";
  prompt.hidden = pending.action !== "extend";
  dlg.dataset.action = pending.action;
  dlg.showModal();
});

document.addEventListener("DOMContentLoaded", () => {
  const dlg = $("#confirm");
  if (!dlg) return;
  $(".yes", dlg).addEventListener("click", async (e) => {
    e.preventDefault();
    if (!pending) { dlg.close(); return; }
    const { action, id, count } = pending;
    const init = { method: "POST", headers: {} };
    let url = `/tasks/${encodeURIComponent(id)}/${paths[action]}`;
    if (action === "bulk-cancel" || action === "bulk-close") {
      // the count confirmed goes with it: a selection that changed meanwhile is refused
      url = `/tasks/${action === "bulk-cancel" ? "cancel" : "close"}?${id}${id ? "&" : ""}expect=${encodeURIComponent(count)}`;
    } else if (action === "extend") {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify({ prompt: $("textarea", dlg).value });
    } else if (action === "reset") {
      url = "/health/reset";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify({ key: id });
    }
    $(".answer", dlg).textContent = "working…";
    try {
      const r = await fetch(url, init);
      if (r.ok && action.startsWith("bulk-")) {
        const rep = await r.json();
        if (rep.refused && rep.refused.length) {
          $(".answer", dlg).textContent = `${rep.asked.length} asked; ${rep.refused.length} refused: ` +
            rep.refused.slice(0, 5).map(x => `${x.taskID}: ${x.error}`).join("; ");
          pending = null;
          schedule();
          return;
        }
      }
      if (r.ok) {
        pending = null;
        dlg.close();
        schedule();
        return;
      }
      let msg = `${r.status}`;
      try { const body = await r.json(); msg = body.error || msg; } catch (err) { /* not JSON */ }
      $(".answer", dlg).textContent = `refused: ${msg}`;
    } catch (err) {
      $(".answer", dlg).textContent = `failed: ${err}`;
    }
  });
  $(".no", dlg).addEventListener("click", () => { pending = null; });
  serverClock();
  setInterval(relTimes, 15000);
  follow();
});
