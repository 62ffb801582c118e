// psflow's dashboard: a page over the HTTP API (/api/...). A run's page is kept live by Server-Sent
// Events (/api/runs/ID/stream), falling back to polling where they fail; other pages poll. No build step,
// no CDN: uPlot is served from vendor/. Routes: #/ (runs), #/run/ID (one run), #/new (start form).
"use strict";

const POLL_MS = 1500;
const CHARTS = [["loss", "loss"], ["accuracy", "accuracy"], ["examples_per_sec", "examples/sec"]];
let timer = null;
let stream = null;  // the run page's EventSource, while it is open
let view = null;  // the current page's state (its polling reads it)

// -- the token: from the URL's #token=... once (never sent as part of a URL), kept in localStorage --
(function takeToken() {
  const m = location.hash.match(/[#&]token=([^&]+)/);
  if (m) {
    localStorage.setItem("psflow-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + "#/");
  }
})();
const tokenInput = document.getElementById("token-input");
tokenInput.value = localStorage.getItem("psflow-token") || "";
tokenInput.addEventListener("change", () => localStorage.setItem("psflow-token", tokenInput.value.trim()));

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const t = localStorage.getItem("psflow-token");
  if (t) h["Authorization"] = "Bearer " + t;
  return h;
}

async function api(path, opts) {
  let r;
  try { r = await fetch(path, Object.assign({}, opts || {}, {headers: headers((opts || {}).headers)})); }
  catch (e) { const err = new Error("The dashboard cannot be reached: " + e.message); err.status = 0; throw err; }
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) {
    const err = new Error(message(body) || r.statusText);
    err.status = r.status; err.body = body;
    throw err;
  }
  return body;
}

function message(body) {
  if (!body || body.detail === undefined) return "";
  if (typeof body.detail === "string") return body.detail;
  return body.detail.map(d => (d.loc ? d.loc.filter(x => x !== "body").join(".") + ": " : "") + d.msg).join("\n");
}

function esc(s) {
  return String(s === null || s === undefined ? "" : s).replace(/[&<>"']/g,
    c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function num(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "";
  return Number(v).toLocaleString(undefined, {maximumFractionDigits: digits === undefined ? 0 : digits});
}
function when(unix) { return unix ? new Date(unix * 1000).toLocaleString() : ""; }
function badge(state) { return `<span class="state ${esc(state)}">${esc(state)}</span>`; }
// A run's state as shown: a running run's phase once its training is over or it is being stopped
// (draining, stopping: its launcher's controller), as psflow status says it (launch.status.shown_state).
function runState(r) { return r.state === "running" && (r.phase === "draining" || r.phase === "stopping") ? r.phase : r.state; }
// An error said to the user; one that is not the API's answer (no status) is a bug of this page: the console says it too.
function report(e) {
  if (e.status === undefined) console.error(e);
  toast(e.message);
}
function toast(text) {
  const t = document.getElementById("toast");
  t.textContent = text; t.classList.add("show");
  clearTimeout(t._hide); t._hide = setTimeout(() => t.classList.remove("show"), 4000);
}
const app = document.getElementById("app");

// -- routing -----------------------------------------------------------------------------------
function route() {
  clearInterval(timer); timer = null;
  if (stream) { stream.close(); stream = null; }
  view = null;
  const h = location.hash || "#/";
  let m;
  if ((m = h.match(/^#\/run\/([^/?]+)/))) return runPage(decodeURIComponent(m[1]));
  if (h.startsWith("#/new")) return startPage();
  if ((m = h.match(/^#\/compare\/(.+)$/))) return comparePage(m[1].split(",").map(decodeURIComponent));
  return runsPage();
}
window.addEventListener("hashchange", route);

function every(fn) {
  fn();
  timer = setInterval(fn, POLL_MS);
}

async function storeSummary() {
  try {
    const s = await api("/api/summary");
    const by = Object.entries(s.by_state).filter(([, n]) => n).map(([k, n]) => `${n} ${k}`).join(", ");
    document.getElementById("store-summary").textContent = `${s.runs} run${s.runs === 1 ? "" : "s"}${by ? ": " + by : ""}`;
  } catch (e) { /* the header figure only */ }
}

// -- the runs list ---------------------------------------------------------------------------------
function runsPage() {
  app.innerHTML = `
    <h1>Runs</h1>
    <div class="toolbar">
      <select id="state-filter" aria-label="state">
        <option value="">every state</option>
        ${["pending", "running", "succeeded", "failed", "stopped", "abandoned"].map(s => `<option>${s}</option>`).join("")}
      </select>
      <input id="search" type="search" placeholder="search id, script, args" aria-label="search">
      <span id="runs-count" class="muted"></span>
      <button id="newer-btn" disabled>Newer</button> <button id="older-btn" disabled>Older</button>
      <button id="compare-btn" disabled>Compare selected</button>
    </div>
    <div class="card table-wrap"><table id="runs-table">
      <thead><tr><th></th><th>run</th><th>state</th><th>progress</th><th class="num">examples/s</th><th class="num">loss</th>
        <th>started</th><th>script</th></tr></thead><tbody></tbody></table></div>`;
  const state = document.getElementById("state-filter");
  const search = document.getElementById("search");
  const PAGE = 100;
  // the page shown: the newest (key null), or the one older ("before") or newer ("after") than a key the
  // last answer gave (keyset pages: each costs the same however deep)
  let key = null, older = null, newer = null;
  const load = async () => {
    const mine = view;
    const q = new URLSearchParams({limit: String(PAGE)});
    if (key) q.set(key[0], key[1]);
    if (state.value) q.set("state", state.value);
    if (search.value.trim()) q.set("q", search.value.trim());
    try {
      const page = await api("/api/runs?" + q);
      if (view !== mine) return;  // the page was left while the answer came
      if (key && !page.runs.length) { key = null; return load(); }  // its runs are gone: the newest page
      older = page.older; newer = page.newer;
      const shown = page.runs.length ? `${page.offset + 1}-${page.offset + page.runs.length} of ` : "";
      document.getElementById("runs-count").textContent = `${shown}${page.total} run${page.total === 1 ? "" : "s"}`;
      document.getElementById("newer-btn").disabled = !newer;
      document.getElementById("older-btn").disabled = !older;
      document.querySelector("#runs-table tbody").innerHTML = page.runs.map(runRow).join("") ||
        `<tr><td colspan="8" class="muted">No runs${state.value || search.value ? " match" : " yet: start one"}.</td></tr>`;
    } catch (e) { if (view === mine) report(e); }
    storeSummary();
  };
  const picked = new Set();
  const compare = document.getElementById("compare-btn");
  document.querySelector("#runs-table tbody").addEventListener("change", ev => {
    if (!ev.target.matches("input[data-pick]")) return;
    if (ev.target.checked) picked.add(ev.target.dataset.pick); else picked.delete(ev.target.dataset.pick);
    compare.disabled = picked.size < 2;
  });
  compare.onclick = () => { location.hash = "#/compare/" + [...picked].map(encodeURIComponent).join(","); };
  view = {picked};
  document.getElementById("newer-btn").onclick = () => { if (newer) { key = ["after", newer]; load(); } };
  document.getElementById("older-btn").onclick = () => { if (older) { key = ["before", older]; load(); } };
  state.addEventListener("change", () => { key = null; load(); });
  search.addEventListener("input", () => { key = null; load(); });
  every(load);
}

function runRow(r) {
  const tasks = Object.values(r.tasks);
  const up = tasks.filter(t => t.state === "running").length;
  const progress = `step ${num(r.global_step)}` + (r.state === "running" ? `, ${up}/${tasks.length} up` : "");
  const restarts = tasks.reduce((n, t) => n + (t.attempt || 0), 0);
  const checked = view && view.picked && view.picked.has(r.id) ? " checked" : "";
  return `<tr data-run="${esc(r.id)}">
    <td><input type="checkbox" data-pick="${esc(r.id)}" aria-label="compare ${esc(r.id)}"${checked}></td>
    <td><a href="#/run/${encodeURIComponent(r.id)}">${esc(r.id)}</a>${r.restarted_from ? `<div class="muted">restarts ${esc(r.restarted_from)}</div>` : ""}</td>
    <td>${badge(runState(r))}</td>
    <td>${esc(progress)}${restarts ? `<div class="muted">${restarts} restart${restarts > 1 ? "s" : ""}</div>` : ""}</td>
    <td class="num">${num(r.examples_per_sec)}</td>
    <td class="num">${num(r.loss, 4)}</td>
    <td>${esc(when(r.started_unix || r.created_unix))}</td>
    <td>${esc([r.script.split("/").pop()].concat(r.args || []).join(" "))}<div class="muted">${esc(r.mode || "")} · ${esc(r.backend || "")}</div></td>
  </tr>`;
}

// -- one run -----------------------------------------------------------------------------------------
function runPage(runId) {
  view = {runId, series: {}, cursor: null, zoom: {}, charts: {}, logTask: null, logOffset: null, logText: "", lastEvent: 0,
          metrics: CHARTS.map(([key]) => key), known: new Set(), touched: new Set(), chartSettings: chartSettings()};
  app.innerHTML = `
    <div class="toolbar">
      <h1 id="run-title" style="margin:0">${esc(runId)}</h1> <span id="run-state"></span>
      <span style="flex:1"></span>
      <span id="scale-controls"><label class="muted">workers <input id="scale-n" type="number" min="1" max="256" style="width:4.5em"></label>
      <button id="scale-btn">Scale</button></span><span id="scale-why" class="muted" hidden></span>
      <button id="restart-btn">Restart</button>
      <button id="stop-btn" class="danger">Stop</button>
    </div>
    <div id="run-headline" class="muted" style="margin-bottom:.8rem"></div>
    <div class="grid">
      <section class="card"><h2>Cluster</h2><div id="cluster"></div></section>
      <section class="card"><h2>Attempts and restarts</h2><div id="timeline" class="timeline"></div></section>
      <section class="card wide"><h2>Metrics</h2><div class="toolbar" id="chart-controls">
        <label>x <select id="chart-x"><option value="time">time</option><option value="step">step</option></select></label>
        <label>smoothing <input id="chart-smoothing" type="range" min="0" max="0.99" step="0.01"></label>
        <span id="chart-smoothing-value" class="muted"></span>
        <label><input type="checkbox" id="chart-log"> log y</label></div>
        <div id="metric-picker" class="toolbar picker"></div></section>
      <div id="charts" class="grid wide"></div>
      <section class="card"><h2>Summary</h2><div id="summary"></div></section>
      <section class="card"><h2>Stragglers</h2><div id="stragglers"></div></section>
      <section class="card wide"><h2>Stacks</h2><div class="toolbar"><button id="dump-btn">Dump all tasks</button>
        <span class="muted">every running task writes its threads' stacks into its log; grouped here</span></div>
        <div id="stacks"></div></section>
      <section class="card wide"><h2>Log <span id="log-task" class="muted"></span></h2>
        <div class="toolbar"><label><input type="checkbox" id="log-follow" checked> follow</label>
          <span class="muted">click a task above to read its log</span></div>
        <pre id="log-view" class="log"></pre></section>
      <section class="card"><h2>Checkpoints</h2><div id="checkpoints" class="table-wrap"></div></section>
      <section class="card"><h2>Placement</h2><div id="placement" class="table-wrap"></div></section>
      <section class="card"><h2>Parameter servers</h2><div id="ps-health" class="table-wrap"></div></section>
      <section class="card"><h2>Events</h2><div id="events" class="table-wrap" style="max-height:320px;overflow:auto"></div></section>
    </div>`;
  document.getElementById("stop-btn").onclick = () => control(runId, "stop");
  document.getElementById("restart-btn").onclick = () => control(runId, "restart");
  document.getElementById("dump-btn").onclick = () => dumpAll(runId);
  document.getElementById("scale-btn").onclick = () => scaleRun(runId);
  chartControls();
  drawCharts();
  firstLook(runId);
}

// The run read once before its live stream opens, so that the stream asks for every metric its tasks
// report from the start: one stream, not one reopened as soon as the script's own metrics are seen.
async function firstLook(runId) {
  const mine = view;
  try {
    const page = await api(`/api/runs/${encodeURIComponent(runId)}`);
    if (view === mine) learnMetrics(runId, page.run, false);
  } catch (e) { /* the stream, or the polling after it, says what is wrong */ }
  if (view === mine) liveRun(runId);
}

// The charts' settings (x, smoothing, log y): every chart is redrawn from the points it has.
function chartControls() {
  const s = view.chartSettings;
  const x = document.getElementById("chart-x"), sm = document.getElementById("chart-smoothing");
  const log = document.getElementById("chart-log"), shown = document.getElementById("chart-smoothing-value");
  x.value = s.x; sm.value = String(s.smoothing); log.checked = s.log; shown.textContent = s.smoothing.toFixed(2);
  const changed = () => {
    if (x.value !== view.chartSettings.x) view.zoom = {};  // a zoom is a range of the x it was asked on
    view.chartSettings = {x: x.value, smoothing: Number(sm.value), log: log.checked};
    shown.textContent = view.chartSettings.smoothing.toFixed(2);
    saveChartSettings(view.chartSettings);
    drawCharts();
  };
  x.onchange = changed; sm.oninput = changed; log.onchange = changed;
}

// Every metric the run's tasks report (their latest metrics name them), offered in the picker; one
// not seen before is drawn if it is the script's own (or the basics). A change of the drawn set
// reopens the live stream for those names (its first message carries their history).
function learnMetrics(runId, run, reopen = true) {
  const names = new Set(Object.values(run.tasks).flatMap(t => Object.keys(t.metrics || {})));
  const fresh = [...names].filter(n => !view.known.has(n));
  if (!fresh.length) return;
  for (const n of fresh) view.known.add(n);
  const added = fresh.filter(n => drawnByDefault(n) && !view.touched.has(n) && !view.metrics.includes(n));
  view.metrics = view.metrics.concat(added);
  drawPicker(runId);
  if (added.length && reopen) relive(runId);
}

function drawPicker(runId) {
  const names = [...new Set([...view.known, ...view.metrics])].sort((a, b) => (COUNTERS.includes(a) - COUNTERS.includes(b)) || a.localeCompare(b));
  const el = document.getElementById("metric-picker");
  el.innerHTML = names.map(n => `<label><input type="checkbox" data-metric="${esc(n)}" ${view.metrics.includes(n) ? "checked" : ""}>
    ${esc(metricLabel(n))}</label>`).join("");
  for (const box of el.querySelectorAll("input[data-metric]")) {
    box.onchange = () => {
      const n = box.dataset.metric;
      view.touched.add(n);
      view.metrics = box.checked ? view.metrics.concat([n]) : view.metrics.filter(m => m !== n);
      relive(runId);
    };
  }
}

// The live updates again, for the metrics now drawn (their points from the start).
function relive(runId) {
  if (stream) { stream.close(); stream = null; }
  clearInterval(timer); timer = null;
  view.series = {}; view.cursor = null;
  drawCharts();
  liveRun(runId);
}

// The run page's live updates: the run and new metric points pushed by the server; polling where
// EventSource is missing or its stream cannot be opened (e.g. a dashboard that needs the token for reads:
// EventSource cannot send it). document.body.dataset.live says which ("sse" or "poll").
function liveRun(runId) {
  const poll = () => { document.body.dataset.live = "poll"; every(() => refreshRun(runId)); };
  if (!window.EventSource) return poll();
  const q = new URLSearchParams();
  for (const key of view.metrics) q.append("name", key);
  const es = new EventSource(`/api/runs/${encodeURIComponent(runId)}/stream?${q}`);
  stream = es;
  let opened = false;
  const page0 = view;  // this page: a new route replaces it (and closes the stream); `end` closes the stream only
  const mine = () => view === page0;
  es.onopen = () => { opened = true; document.body.dataset.live = "sse"; };
  // one page drawn at a time (its log and cards are fetched): a message that comes meanwhile waits, the newest wins
  let next = null, drawing = false;
  const draw = async () => {
    drawing = true;
    try { while (next && mine()) { const page = next; next = null; await showRun(runId, page, false); } }
    finally { drawing = false; }
  };
  es.addEventListener("run", ev => { if (!mine()) return; next = JSON.parse(ev.data); if (!drawing) draw(); });
  es.addEventListener("metrics", ev => {  // the history (bounded) first, then only what is new
    if (!mine()) return;
    const m = JSON.parse(ev.data);
    addPoints(m.series);
    view.cursor = m.cursor;
    drawCharts();
  });
  es.addEventListener("end", () => { es.close(); if (stream === es) stream = null; });
  es.onerror = () => {
    // a stream that never opened, or one the browser gave up on: poll instead (it reconnects by itself otherwise)
    if (opened && es.readyState !== EventSource.CLOSED) return;
    es.close();
    if (stream === es) stream = null;
    if (mine()) poll();
  };
}

// Workers join or leave the running run (POST /api/runs/{run}/scale; the launcher answers in the events).
async function scaleRun(runId) {
  const workers = Number(document.getElementById("scale-n").value);
  try {
    const r = await api(`/api/runs/${encodeURIComponent(runId)}/scale`, {method: "POST",
      headers: {"Content-Type": "application/json"}, body: JSON.stringify({workers})});
    toast(`scale to ${r.workers} workers requested (request ${r.request_id})`);
  } catch (e) { report(e); }
}

async function control(runId, what) {
  if (!confirm(`${what === "stop" ? "Stop" : "Restart"} run ${runId}?`)) return;
  try {
    const r = await api(`/api/runs/${encodeURIComponent(runId)}/${what}`, {method: "POST"});
    if (what === "restart") { toast(`restarting as ${r.run_id}`); location.hash = `#/run/${encodeURIComponent(r.run_id)}`; }
    else toast(`stop requested (request ${r.request_id})`);
  } catch (e) { report(e); }
}

async function refreshRun(runId) {
  if (!view || view.runId !== runId) return;
  const mine = view;
  let page;
  try { page = await api(`/api/runs/${encodeURIComponent(runId)}`); }
  catch (e) { if (view === mine) document.getElementById("run-headline").textContent = e.message; return; }
  if (view === mine) await showRun(runId, page, true);
}

// Draw a run page (GET /api/runs/ID's answer, polled or pushed); the charts' points come with it when polled.
async function showRun(runId, page, withMetrics) {
  const run = page.run;
  // recorded by the dashboard, its launcher not up yet: "starting" (launch_requested, no run_started yet)
  const asked = (page.events || []).find(e => e.kind === "launch_requested");
  const starting = run.state === "pending" && asked && !(page.events || []).some(e => e.kind === "run_started");
  document.getElementById("run-state").innerHTML = badge(starting ? "starting" : runState(run));
  const live = run.state === "running" || run.state === "pending";
  document.getElementById("stop-btn").disabled = !live;
  document.getElementById("scale-btn").disabled = !live;
  // a backend (or strategy) whose workers cannot join or leave: the page says why instead of offering the control
  document.getElementById("scale-controls").hidden = !!run.scale_refusal;
  const why = document.getElementById("scale-why");
  why.hidden = !run.scale_refusal || !live;
  why.textContent = run.scale_refusal ? `cannot scale: ${run.scale_refusal}` : "";
  const scaleN = document.getElementById("scale-n");
  if (!scaleN.value) scaleN.value = Object.entries(run.tasks).filter(([n, t]) => n.startsWith("worker:") && t.state !== "retired").length;
  document.getElementById("run-headline").innerHTML =
    `${esc(run.script)} ${esc((run.args || []).join(" "))} · ${esc(run.mode)} · ${esc(run.strategy)} · ${esc(run.backend)}` +
    ` · step ${num(run.global_step)} · ${num(run.examples_per_sec)} examples/s` +
    `<div id="run-logdir">logdir ${esc(run.logdir)}</div>` +
    (run.restarted_from ? ` · restarts <a href="#/run/${encodeURIComponent(run.restarted_from)}">${esc(run.restarted_from)}</a>` : "") +
    (run.note ? `<div>${esc(run.note)}</div>` : "") +
    (starting ? `<div id="run-starting">starting: its launcher (pid ${esc(asked.data.launcher_pid)}) is setting the run up` +
      `${asked.data.after_run ? ", once run " + esc(asked.data.after_run) + " has stopped" : ""}</div>` : "") + rootCause(run);
  for (const a of document.querySelectorAll("#run-headline a.root-task")) a.onclick = ev => { ev.preventDefault(); openLog(a.dataset.task); };
  storeSummary();
  learnMetrics(runId, run);
  const shown = logTaskOf(run);
  if (shown !== view.logTask) { view.logTask = shown; view.logOffset = null; view.logText = ""; }
  drawCluster(run);
  drawTimeline(run, page.attempts);
  drawEvents(page.events);
  drawSummary(run);
  await Promise.all([withMetrics ? refreshMetrics(runId) : null, refreshLog(runId), refreshCheckpoints(runId, run), refreshStragglers(runId, run),
    refreshPs(runId)]);
}

// A failed run's root cause in words (run.failure: the exception, its message, its traceback's tail);
// its task is a link that opens its log.
function rootCause(run) {
  const f = run.failure;
  if (!f) return run.root_cause ? `<div id="root-cause" class="errors">root cause: ${esc(run.root_cause)}</div>` : "";
  const what = f.exception ? `<b>${esc(f.exception)}</b>: ${esc(f.message)}` : esc(f.message);
  return `<div id="root-cause" class="root-cause" data-task="${esc(f.task || "")}"><span class="errors">root cause:</span> ` +
    (f.task ? `<a href="#" class="root-task" data-task="${esc(f.task)}">${esc(f.task)}</a>: ` : "") + what +
    (f.traceback_tail ? `<pre class="log traceback">${esc(f.traceback_tail)}</pre>` : "") + `</div>`;
}

// The task whose log the panel shows: the one the user clicked; else a failed run's root cause; else the first worker.
function logTaskOf(run) {
  const names = Object.keys(run.tasks);
  if (view.logChosen && names.includes(view.logTask)) return view.logTask;
  const root = run.failure && run.failure.task;
  return names.includes(root) ? root : names.find(t => t.startsWith("worker")) || names[0];
}

function openLog(task) {
  view.logTask = task; view.logChosen = true; view.logOffset = null; view.logText = "";
  refreshLog(view.runId);
  for (const b of document.querySelectorAll("#cluster .task")) b.classList.toggle("selected", b.dataset.task === task);
}

// The cluster's task cards are drawn once per set of tasks and updated in place on every live update:
// a card replaced between a press and its release would lose the click (and the keyboard focus).
function drawCluster(run) {
  const jobs = {};
  for (const [name, t] of Object.entries(run.tasks)) (jobs[name.split(":")[0]] = jobs[name.split(":")[0]] || []).push([name, t]);
  const el = document.getElementById("cluster");
  const layout = JSON.stringify(Object.entries(jobs).map(([job, tasks]) => [job, tasks.map(([name]) => name)]));
  if (el.dataset.layout !== layout) {
    el.innerHTML = Object.entries(jobs).map(([job, tasks]) => `
      <div class="job"><div class="job-name">${esc(job)}</div><div class="tasks">${tasks.map(([name]) => `
        <button class="task" data-task="${esc(name)}"><div class="name">${esc(name)}</div><div class="detail"></div>` +
        `<div class="detail"></div><div class="detail"></div></button>`).join("")}</div></div>`).join("");
    el.dataset.layout = layout;
    for (const b of el.querySelectorAll(".task")) b.onclick = () => openLog(b.dataset.task);
  }
  for (const b of el.querySelectorAll(".task")) {
    const name = b.dataset.task, t = run.tasks[name];
    b.className = `task ${t.exit_code && t.state !== "retired" ? "failed-exit" : ""} ${name === view.logTask ? "selected" : ""}`;
    b.dataset.state = t.state;
    const lines = [`${t.state} · attempt ${t.attempt}`,
      `${t.address || ""}${t.pid ? " · pid " + t.pid : ""}${t.scheduler_id ? " · " + t.scheduler_id : ""}`,
      `${t.metrics && t.metrics.global_step !== undefined ? "step " + num(t.metrics.global_step) : ""} ${t.exit_cause || ""}`.trim()];
    b.querySelectorAll(".detail").forEach((d, i) => { if (d.textContent !== lines[i]) d.textContent = lines[i]; });
  }
}

function drawTimeline(run, attempts) {
  const now = Date.now() / 1000;
  const t0 = run.started_unix || run.created_unix;
  const t1 = Math.max(run.ended_unix || now, t0 + 1);
  const lanes = {};
  for (const a of attempts) (lanes[a.task] = lanes[a.task] || []).push(a);
  document.getElementById("timeline").innerHTML = Object.keys(run.tasks).map(task => `
    <div class="lane" data-lane="${esc(task)}"><span class="lane-name">${esc(task)}</span><div class="track">${(lanes[task] || []).map(a => {
      const left = 100 * (a.started_unix - t0) / (t1 - t0);
      const width = Math.max(0.8, 100 * ((a.exited_unix || now) - a.started_unix) / (t1 - t0));
      const retired = run.tasks[task].state === "retired" && a.attempt === run.tasks[task].attempt;  // psflow scale: an expected end
      const cls = a.exited_unix === null ? "" : a.exit_code === 0 ? "ok" : ((run.state === "stopped" || retired) && !a.restart_reason ? "stop" : "bad");
      const tip = `attempt ${a.attempt}: ${a.exit_cause || "running"}${a.restart_reason ? "; restarted: " + a.restart_reason : ""}`;
      return `<div class="bar ${cls}" style="left:${left}%;width:${Math.min(width, 100 - left)}%" title="${esc(tip)}"></div>`;
    }).join("")}</div><span class="muted">${(lanes[task] || []).length}</span></div>`).join("");
}

function drawEvents(events) {
  const shown = events.slice(-200).reverse();
  document.getElementById("events").innerHTML = `<table><tbody>${shown.map(e => `<tr>
    <td class="muted">${esc(new Date(e.time_unix * 1000).toLocaleTimeString())}</td><td>${esc(e.kind)}</td><td>${esc(e.task || "")}</td>
    <td class="muted">${esc(eventNote(e.data))}</td></tr>`).join("")}</tbody></table>`;
}

// An event's one-line note; a scheduler's (scheduler_* events: Slurm's job id, queue state, pending reason, nodes).
function eventNote(d) {
  if (d.job_id !== undefined) return [`job ${d.job_id}`, d.state, d.reason, d.nodes].filter(x => x !== undefined && x !== "").join(" · ");
  return d.reason || d.cause || d.answer || d.status || "";
}

function drawSummary(run) {
  const s = run.summary;
  const el = document.getElementById("summary");
  if (!s) { el.innerHTML = `<p class="muted">The summary is written when the run ends.</p>`; return; }
  const rows = [["status", s.status], ["global step", num(s.global_step)], ["examples/sec", num(s.examples_per_sec)],
    ["wall", s.wall_s !== undefined ? num(s.wall_s, 1) + " s" : ""], ["root cause", s.root_cause || ""]]
    .concat(Object.entries(s.metrics || {}).map(([k, v]) => [k, typeof v === "number" ? num(v, 4) : v]));
  el.innerHTML = `<dl class="kv">${rows.filter(([, v]) => v !== "").map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("")}</dl>`;
}

// Polled: the charts' history once (a bounded number of points per series), then from its cursor only
// the points written since.
async function refreshMetrics(runId) {
  const mine = view;
  const q = new URLSearchParams();
  if (view.cursor !== null) q.set("cursor", String(view.cursor));
  for (const key of view.metrics) q.append("name", key);
  let m;
  try { m = await api(`/api/runs/${encodeURIComponent(runId)}/metrics?${q}`); } catch (e) { return; }
  if (view !== mine) return;
  addPoints(m.series);
  view.cursor = m.cursor;
  drawCharts();
}

function addPoints(series) {
  for (const [task, per] of Object.entries(series)) {
    for (const [name, points] of Object.entries(per)) {
      const s = ((view.series[name] = view.series[name] || {})[task] = view.series[name][task] || []);
      for (const p of points) s.push(p);
    }
  }
}

// A range chosen on a chart (dragged over it) is asked for at full resolution, up to the bound; a
// double click goes back to the whole run.
async function zoomChart(key, lo, hi) {
  const mine = view;
  if (lo === null) { delete view.zoom[key]; drawCharts(); return; }
  const q = new URLSearchParams({name: key, x: view.chartSettings.x, lo: String(lo), hi: String(hi)});
  let m;
  try { m = await api(`/api/runs/${encodeURIComponent(view.runId)}/metrics?${q}`); } catch (e) { report(e); return; }
  if (view !== mine) return;
  const per = {};
  for (const [task, series] of Object.entries(m.series)) if (series[key]) per[task] = series[key];
  view.zoom[key] = per;
  drawCharts();
}

// A card per drawn metric (in the order drawn), each chart redrawn from view.series.
function drawCharts() {
  const box = document.getElementById("charts");
  if (!box) return;
  const want = view.metrics;
  for (const card of [...box.children]) {
    if (!want.includes(card.dataset.metric)) {
      if (view.charts[card.dataset.metric]) { view.charts[card.dataset.metric].destroy(); delete view.charts[card.dataset.metric]; }
      card.remove();
    }
  }
  for (const key of want) {
    let card = [...box.children].find(c => c.dataset.metric === key);
    if (!card) {
      card = document.createElement("section");
      card.className = "card";
      card.dataset.metric = key;
      card.innerHTML = `<h2>${esc(metricLabel(key))}</h2><div class="chart" data-points="0"></div>`;
      card.querySelector(".chart").id = "chart-" + key;
      box.appendChild(card);
    }
    const el = card.querySelector(".chart");
    el.dataset.zoomed = view.zoom[key] ? "1" : "0";
    view.charts[key] = drawMetricChart(el, key, view.zoom[key] || view.series[key], view.chartSettings, view.charts[key],
      (lo, hi) => zoomChart(key, lo, hi));
  }
}

async function refreshLog(runId) {
  const mine = view;
  const task = view.logTask;
  if (!task) return;
  document.getElementById("log-task").textContent = task;
  const follow = document.getElementById("log-follow").checked;
  if (view.logOffset !== null && !follow) return;
  const q = new URLSearchParams({max_bytes: String(256 * 1024)});
  if (view.logOffset !== null) q.set("offset", String(view.logOffset));
  let chunk;
  try { chunk = await api(`/api/runs/${encodeURIComponent(runId)}/tasks/${encodeURIComponent(task)}/log?${q}`); }
  catch (e) { if (view === mine) document.getElementById("log-view").textContent = e.message; return; }
  if (view !== mine || task !== view.logTask) return;
  if (view.logOffset !== null && chunk.offset !== view.logOffset) view.logText = "";  // rotated
  view.logText = (view.logText + chunk.text).slice(-400000);
  view.logOffset = chunk.next_offset;
  const pre = document.getElementById("log-view");
  const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 20;
  pre.textContent = view.logText;
  pre.dataset.task = task;
  if (atBottom || follow) pre.scrollTop = pre.scrollHeight;
}

async function dumpAll(runId) {
  const mine = view;
  const el = document.getElementById("stacks");
  let asked;
  try { asked = await api(`/api/runs/${encodeURIComponent(runId)}/dump`, {method: "POST"}); }
  catch (e) { el.textContent = e.message; return; }
  el.innerHTML = `<p class="muted">asked (request ${asked.request_id}); waiting for the launcher…</p>`;
  for (let i = 0; i < 60; i++) {  // about 30 s, then whatever has come
    await new Promise(r => setTimeout(r, 500));
    let s;
    if (view !== mine) return;  // the page was left
    try { s = await api(`/api/runs/${encodeURIComponent(runId)}/stacks?request=${asked.request_id}`); } catch (e) { continue; }
    if (view !== mine) return;
    drawStacks(s);
    if ((s.state === "done" || s.state === "refused") && s.waiting_for.length === 0 && Object.keys(s.tasks).length) return;
    if (s.state === "refused") return;
  }
}

function drawStacks(s) {
  const el = document.getElementById("stacks");
  el.dataset.request = String(s.request_id);
  el.dataset.tasks = String(Object.values(s.tasks).filter(t => t.threads.length).length);
  // red only for a task blamed (odd, and not making progress); one that moves is said, in grey
  const odd = s.odd_ones_out.map(o => `<p class="${o.blamed ? "errors" : "muted"} odd-one" data-task="${esc(o.task)}"
    data-blamed="${o.blamed ? "1" : "0"}">${esc(o.task)}: ${esc(o.why)}</p>`).join("");
  el.innerHTML = `<p class="muted">request ${esc(s.request_id)}: ${esc(s.answer || s.state)}${s.waiting_for.length ?
      "; not in the logs yet: " + esc(s.waiting_for.join(", ")) : ""}</p>${odd}` +
    s.groups.map(g => `<div class="stack-group" data-tasks="${esc(g.tasks.join(","))}"><h2>${esc(g.tasks.join(", "))}
      <span class="muted">(${g.tasks.length} task${g.tasks.length > 1 ? "s" : ""}, main thread)</span></h2>
      <pre class="log">${esc(g.frames.map(f => `${f.function}  ${f.file}:${f.line}`).join("\n"))}</pre></div>`).join("");
}

async function refreshPs(runId) {
  const el = document.getElementById("ps-health");
  let h;
  try { h = await api(`/api/runs/${encodeURIComponent(runId)}/ps`); } catch (e) { el.textContent = e.message; return; }
  const ps = Object.entries(h.ps);
  if (!ps.length) { el.innerHTML = `<p class="muted">No parameter servers (all-reduce).</p>`; return; }
  const stat = (s, k) => s && s[k] !== undefined ? num(s[k]) : "";
  el.innerHTML = `<p class="muted">newest version ${num(h.version)}${h.final ? "; the ps's own counts, from the run's end" : "; the ps count pushes at the run's end"}</p>
    <table><thead><tr><th>ps</th><th>state</th><th class="num">version</th><th class="num">pushes</th><th class="num">applied</th>
      <th class="num">stale dropped</th><th class="num">duplicates</th></tr></thead><tbody>${ps.map(([name, p]) => `<tr data-ps="${esc(name)}">
      <td>${esc(name)}</td><td>${esc(p.state)}${p.attempt ? " (attempt " + esc(p.attempt) + ")" : ""}</td><td class="num">${num(p.version)}</td>
      <td class="num">${stat(p.stats, "pushes")}</td><td class="num">${stat(p.stats, "applied_updates")}</td>
      <td class="num">${stat(p.stats, "stale_dropped")}</td><td class="num">${stat(p.stats, "duplicates")}</td></tr>`).join("")}</tbody></table>
    ${psRequestsTable(ps, h.skew || {})}
    <table><thead><tr><th>worker</th><th class="num">version</th><th class="num">lag</th><th class="num">pushes</th><th class="num">stale pushes</th></tr></thead>
    <tbody>${Object.entries(h.workers).map(([name, w]) => `<tr><td>${esc(name)}</td><td class="num">${num(w.version)}</td>
      <td class="num">${w.lag === null ? "" : num(w.lag)}</td><td class="num">${w.pushes === null ? "" : num(w.pushes)}</td>
      <td class="num">${w.stale_pushes === null ? "" : num(w.stale_pushes)}</td></tr>`).join("")}</tbody></table>`;
}

// Each ps's push and pull requests over its last report window (about a second): rate, p50, p99; and the skew across shards.
function psRequestsTable(ps, skew) {
  const ms = v => v === null || v === undefined ? "" : Number(v).toFixed(2);
  const rate = v => v === null || v === undefined ? "" : Number(v).toFixed(1);
  const skewed = Object.entries(skew).filter(([, s]) => s.ratio !== null)
    .map(([k, s]) => `${esc(k.replace(/_/g, " "))} ${Number(s.ratio).toFixed(2)}x (${esc(s.max_ps)})`);
  return `<table class="ps-requests"><thead><tr><th>ps</th><th class="num">push/s</th><th class="num">push p50 ms</th>
      <th class="num">push p99 ms</th><th class="num">pull/s</th><th class="num">pull p50 ms</th><th class="num">pull p99 ms</th></tr></thead>
    <tbody>${ps.map(([name, p]) => `<tr data-ps-requests="${esc(name)}"><td>${esc(name)}</td><td class="num">${rate(p.push_rate)}</td>
      <td class="num">${ms(p.push_p50_ms)}</td><td class="num">${ms(p.push_p99_ms)}</td><td class="num">${rate(p.pull_rate)}</td>
      <td class="num">${ms(p.pull_p50_ms)}</td><td class="num">${ms(p.pull_p99_ms)}</td></tr>`).join("")}</tbody></table>
    <p class="muted ps-skew">${skewed.length ? "skew across shards (highest / lowest): " + skewed.join("; ") : "skew across shards: needs two ps reporting"}</p>`;
}

async function refreshStragglers(runId, run) {
  if (view._stragAt && Date.now() - view._stragAt < 5000 && view._stragState === run.state) return;
  view._stragAt = Date.now(); view._stragState = run.state;
  const el = document.getElementById("stragglers");
  let s;
  try { s = await api(`/api/runs/${encodeURIComponent(runId)}/stragglers`); } catch (e) { el.textContent = e.message; return; }
  const rows = Object.entries(s.workers);
  el.dataset.slowest = s.slowest || "";
  el.dataset.kind = s.kind || "";
  const red = s.kind === "persistent";  // a warning only for a worker clearly and lastingly slower
  el.innerHTML = `<p class="${red ? "errors" : "muted"}" id="straggler-verdict">${esc(s.verdict)}</p>` + (rows.length ? `
    <table><thead><tr><th>worker</th><th class="num">steps/s</th><th class="num">step time</th><th class="num">vs median</th><th class="num">slow windows</th></tr></thead>
    <tbody>${rows.map(([w, r]) => `<tr data-worker="${esc(w)}"${red && w === s.slowest ? ' class="errors"' : ""}><td>${esc(w)}</td><td class="num">${num(r.steps_per_sec, 1)}</td>
      <td class="num">${r.step_time_s === null ? "" : num(r.step_time_s * 1000, 1) + " ms"}</td><td class="num">${num(r.vs_median, 2)}x</td>
      <td class="num">${r.slow_windows} / ${r.windows}</td></tr>`).join("")}</tbody></table>` : "");
}

async function refreshCheckpoints(runId, run) {
  const el = document.getElementById("checkpoints");
  if (view._ckptState === run.state && view._ckptAt && Date.now() - view._ckptAt < 10000) return;
  view._ckptState = run.state; view._ckptAt = Date.now();
  let c;
  const mine = view;
  try { c = await api(`/api/runs/${encodeURIComponent(runId)}/checkpoints`); } catch (e) { el.textContent = e.message; return; }
  if (view !== mine) return;  // the page was left while the answer came
  el.innerHTML = c.checkpoints.length ? `<table><thead><tr><th>checkpoint</th><th class="num">step</th><th class="num">bytes</th><th></th></tr></thead><tbody>${
    c.checkpoints.map(k => `<tr><td>${esc(k.name)}<div class="muted">${k.ok ? esc(Object.entries(k.data_position || {}).map(([w, p]) =>
        `${w}: epoch ${p.epoch}, batch ${p.batch_index}`).join("; ")) : ""}</div></td><td class="num">${k.ok ? num(k.step) : "corrupt"}</td>
      <td class="num">${k.ok ? num(k.size_bytes) : ""}</td>
      <td>${k.ok ? `<button data-ckpt="${esc(k.name)}">export</button> <button data-restore="${esc(k.name)}">restore here</button>` : esc(k.error)}</td></tr>`).join("")}</tbody></table>`
    : `<p class="muted">No checkpoints yet.</p>`;
  for (const b of el.querySelectorAll("button[data-ckpt]")) b.onclick = () => download(runId, b.dataset.ckpt);
  for (const b of el.querySelectorAll("button[data-restore]")) b.onclick = () => restoreHere(runId, b.dataset.restore);
  const pl = document.getElementById("placement");
  if (!c.checkpoints.some(k => k.ok)) { pl.innerHTML = `<p class="muted">The placement is read from the newest checkpoint: none yet.</p>`; return; }
  let p;
  try { p = await api(`/api/runs/${encodeURIComponent(runId)}/placement`); }
  catch (e) { pl.innerHTML = `<p class="muted">${esc(e.message)}</p>`; return; }
  if (view !== mine) return;
  pl.dataset.rows = String(p.rows.length);
  pl.innerHTML = `<p class="muted">from ${esc(p.checkpoint)} (step ${num(p.step)}): ${p.shards.map(s =>
      `shard ${s.shard} ${num(s.bytes)} B (${num(s.share * 100, 1)}%)`).join(", ")}</p>
    <table><thead><tr><th>parameter</th><th>shape</th><th>rows</th><th class="num">shard</th><th class="num">bytes</th></tr></thead><tbody>${
      p.rows.map(r => `<tr><td>${esc(r.param)}</td><td>${esc(JSON.stringify(r.shape))}</td><td>${r.rows ? esc(r.rows.join("-")) : "all"}</td>
        <td class="num">${r.shard}</td><td class="num">${num(r.bytes)}</td></tr>`).join("")}</tbody></table>`;
}

async function restoreHere(runId, name) {
  if (!confirm(`Start run ${runId}'s plan again as a new run from ${name}?`)) return;
  try {
    const r = await api(`/api/runs/${encodeURIComponent(runId)}/checkpoints/${encodeURIComponent(name)}/restore`, {method: "POST"});
    location.hash = `#/run/${encodeURIComponent(r.run_id)}`;
  } catch (e) { report(e); }
}

async function download(runId, name) {
  const r = await fetch(`/api/runs/${encodeURIComponent(runId)}/checkpoints/${encodeURIComponent(name)}/export`, {headers: headers()});
  if (!r.ok) { toast(message(await r.json().catch(() => null)) || r.statusText); return; }
  const a = document.createElement("a");
  a.href = URL.createObjectURL(await r.blob());
  a.download = `${runId}-${name}.safetensors`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

// -- compare runs: their curves overlaid, by global step ----------------------------------------------
function comparePage(ids) {
  view = {compare: ids};
  app.innerHTML = `<h1>Compare ${ids.length} runs</h1>
    <div class="card table-wrap"><table id="compare-table"><thead><tr><th>run</th><th>state</th><th>script</th>
      <th class="num">global step</th><th class="num">examples/s</th><th>final metrics</th></tr></thead><tbody></tbody></table></div>
    <div class="grid">${CHARTS.map(([key, label]) =>
      `<section class="card"><h2>${esc(label)} by global step</h2><div id="cmp-${key}" class="chart" data-points="0"></div></section>`).join("")}</div>`;
  const load = async () => {
    const mine = view;
    const runs = await Promise.all(ids.map(id => api(`/api/runs/${encodeURIComponent(id)}`).catch(e => ({error: e.message, id}))));
    if (view !== mine) return;  // the page was left while the answers came
    document.querySelector("#compare-table tbody").innerHTML = runs.map(p => p.error ? `<tr><td>${esc(p.id)}</td><td colspan="5">${esc(p.error)}</td></tr>` : `
      <tr><td><a href="#/run/${encodeURIComponent(p.run.id)}">${esc(p.run.id)}</a></td><td>${badge(p.run.state)}</td>
      <td>${esc([p.run.script.split("/").pop()].concat(p.run.args || []).join(" "))}</td><td class="num">${num(p.run.global_step)}</td>
      <td class="num">${num(p.run.examples_per_sec)}</td>
      <td>${esc(Object.entries(p.run.metrics || {}).map(([k, v]) => `${k}=${typeof v === "number" ? num(v, 4) : v}`).join(" "))}</td></tr>`).join("");
    const series = await Promise.all(ids.map(id => api(`/api/runs/${encodeURIComponent(id)}/metrics?` +
      CHARTS.map(([k]) => "name=" + k).join("&")).catch(() => ({series: {}}))));
    if (view !== mine) return;
    for (const [key, label] of CHARTS) {
      // one curve per run: its workers' points merged, by global step (the mean where several share one)
      const curves = series.map(m => {
        const byStep = new Map();
        for (const per of Object.values(m.series)) for (const p of (per[key] || [])) {
          if (p[1] === null) continue;
          const e = byStep.get(p[1]) || [0, 0]; e[0] += p[2]; e[1] += 1; byStep.set(p[1], e);
        }
        return byStep;
      });
      drawCompare(`cmp-${key}`, label, ids, curves);
    }
  };
  every(load);
}

function drawCompare(elId, label, ids, curves) {
  const el = document.getElementById(elId);
  if (!el) return;
  const steps = [...new Set(curves.flatMap(c => [...c.keys()]))].sort((a, b) => a - b);
  el.dataset.points = String(curves.reduce((n, c) => n + c.size, 0));
  el.dataset.series = String(curves.filter(c => c.size).length);
  if (!steps.length) { el.innerHTML = `<p class="muted">No ${esc(label)} reported.</p>`; return; }
  const data = [steps].concat(curves.map(c => steps.map(st => c.has(st) ? c.get(st)[0] / c.get(st)[1] : null)));
  const colors = ["#1f7ae0", "#d0312d", "#1a9a4b", "#e07b1f", "#7a3fb0", "#008b8b"];
  const width = Math.max(240, el.clientWidth || 400);
  if (el._chart && el._chart.series.length === ids.length + 1 && Math.abs(el._chart.width - width) < 2) { el._chart.setData(data); return; }
  if (el._chart) el._chart.destroy();
  el.innerHTML = "";
  el._chart = new uPlot({width, height: 220, scales: {x: {time: false}}, axes: [{label: "global step"}, {size: 60}],
    series: [{label: "step"}].concat(ids.map((id, i) => ({label: id, stroke: colors[i % colors.length], width: 1.5, spanGaps: true})))},
    data, el);
}

// -- the start form ----------------------------------------------------------------------------------
function startPage() {
  app.innerHTML = `
    <h1>Start a run</h1>
    <div class="card"><form class="start" id="start-form" novalidate>
      <label for="f-script">script</label><div><input id="f-script" name="script" type="text" required placeholder="mnist_softmax.py" style="width:100%">
        <div class="muted">a .py file under the directories psflow ui allows (--scripts)</div><div class="field-error" data-for="script"></div></div>
      <label for="f-args">arguments</label><div><input id="f-args" name="args" type="text" placeholder="--epochs 5 --init zeros" style="width:100%">
        <div class="muted">split on spaces into a list; never run by a shell</div><div class="field-error" data-for="args"></div></div>
      <label for="f-ps">parameter servers</label><div><input id="f-ps" name="ps" type="number" min="0" value="1"><div class="field-error" data-for="ps"></div></div>
      <label for="f-workers">workers</label><div><input id="f-workers" name="workers" type="number" min="0" value="2"><div class="field-error" data-for="workers"></div></div>
      <label for="f-gpus" data-backends="local k8s">GPUs per worker</label><div data-backends="local k8s"><input id="f-gpus" name="gpus_per_worker" type="number" min="0" value="0">
        <div class="muted">each chief and worker sees its own; 0 trains on the CPU</div><div class="field-error" data-for="gpus_per_worker"></div></div>
      <label>tasks</label><div><label><input type="checkbox" name="chief"> separate chief</label>
        <label><input type="checkbox" name="evaluator"> evaluator</label></div>
      <label for="f-mode">mode</label><div><select id="f-mode" name="mode"><option>async</option><option>sync</option><option>ssp</option></select><div class="field-error" data-for="mode"></div></div>
      <label for="f-strategy">strategy</label><div><select id="f-strategy" name="strategy"><option>ps</option><option>allreduce</option></select></div>
      <label for="f-backend">backend</label><div><select id="f-backend" name="backend"><option>local</option><option>slurm</option>
        <option>ssh</option><option>k8s</option></select><div class="field-error" data-for="backend"></div></div>
      <label for="f-nodes" data-backends="slurm">nodes</label><div data-backends="slurm"><input id="f-nodes" name="nodes" type="number" min="1" placeholder="1">
        <div class="field-error" data-for="nodes"></div></div>
      <label for="f-sbatch" data-backends="slurm">sbatch options</label><div data-backends="slurm"><input id="f-sbatch" name="sbatch_args" type="text" placeholder="--partition=gpu --time=02:00:00" style="width:100%">
        <div class="muted">more #SBATCH options, as on sbatch's command line (optional)</div><div class="field-error" data-for="sbatch_args"></div></div>
      <label for="f-hosts" data-backends="ssh">hosts</label><div data-backends="ssh"><input id="f-hosts" name="hosts" type="text" placeholder="node1:2,node2:2" style="width:100%">
        <div class="muted">HOST:SLOTS,...: the tasks are started over ssh on these hosts, filled in order</div><div class="field-error" data-for="hosts"></div></div>
      <label for="f-coordinator" data-backends="slurm ssh">coordinator host</label><div data-backends="slurm ssh"><input id="f-coordinator" name="coordinator_host" type="text" placeholder="this host's address">
        <div class="muted">the address the nodes reach this launcher at (optional)</div><div class="field-error" data-for="coordinator_host"></div></div>
      <label for="f-image" data-backends="k8s">image</label><div data-backends="k8s"><input id="f-image" name="image" type="text" placeholder="registry.example/train:1" style="width:100%">
        <div class="muted">a container image with Python, psflow and the script</div><div class="field-error" data-for="image"></div></div>
      <label for="f-namespace" data-backends="k8s">namespace</label><div data-backends="k8s"><input id="f-namespace" name="namespace" type="text" placeholder="default">
        <div class="field-error" data-for="namespace"></div></div>
      <label for="f-claim" data-backends="k8s">volume claim</label><div data-backends="k8s"><input id="f-claim" name="volume_claim" type="text" placeholder="a ReadWriteMany claim">
        <div class="muted">mounted at /psflow in every pod: the log dir</div><div class="field-error" data-for="volume_claim"></div></div>
      <label for="f-restart">restart policy</label><div><input id="f-restart" name="restart" type="text" value="never" placeholder="never | on-failure | worker=on-failure,ps=never">
        <div class="field-error" data-for="restart"></div></div>
      <label for="f-max-restarts">max restarts</label><div><input id="f-max-restarts" name="max_restarts" type="number" min="0" value="3"><div class="field-error" data-for="max_restarts"></div></div>
      <div class="full errors" id="form-errors"></div>
      <div class="full"><button class="primary" type="submit" id="start-btn">Start</button></div>
    </form></div>`;
  const form = document.getElementById("start-form");
  // each backend's own fields, shown only for it (and sent only for it)
  const backend = document.getElementById("f-backend");
  const showFields = () => {
    for (const el of form.querySelectorAll("[data-backends]")) el.hidden = !el.dataset.backends.split(" ").includes(backend.value);
  };
  backend.addEventListener("change", showFields);
  showFields();
  form.addEventListener("submit", async ev => {
    ev.preventDefault();
    const f = new FormData(form);
    const body = {
      script: f.get("script").trim(), args: f.get("args").trim() ? f.get("args").trim().split(/\s+/) : [],
      ps: Number(f.get("ps")), workers: Number(f.get("workers")), chief: f.get("chief") === "on",
      evaluator: f.get("evaluator") === "on", mode: f.get("mode"), strategy: f.get("strategy"),
      backend: f.get("backend"), restart: f.get("restart").trim() || "never", max_restarts: Number(f.get("max_restarts")),
      gpus_per_worker: ["local", "k8s"].includes(f.get("backend")) ? Number(f.get("gpus_per_worker")) : 0,
    };
    for (const el of form.querySelectorAll("div[data-backends] input")) {  // the chosen backend's own fields, when given
      if (!el.closest("[data-backends]").hidden && el.value.trim() && el.name !== "gpus_per_worker")
        body[el.name] = el.type === "number" ? Number(el.value) : el.value.trim();
    }
    for (const e of form.querySelectorAll(".field-error")) e.textContent = "";
    document.getElementById("form-errors").textContent = "";
    const button = document.getElementById("start-btn");
    button.disabled = true; button.textContent = "Starting…";
    try {
      const r = await api("/api/runs", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
      location.hash = `#/run/${encodeURIComponent(r.run_id)}`;
    } catch (e) {
      const rest = [];
      for (const d of (e.body && Array.isArray(e.body.detail)) ? e.body.detail : []) {
        const slot = form.querySelector(`.field-error[data-for="${d.loc[d.loc.length - 1]}"]`);
        if (slot) slot.textContent = d.msg; else rest.push(d.msg);
      }
      if (!(e.body && Array.isArray(e.body.detail)) || rest.length) document.getElementById("form-errors").textContent = rest.join("\n") || e.message;
    } finally { button.disabled = false; button.textContent = "Start"; }
  });
}

route();
