// psflow's dashboard: the run page's metric charts (uPlot), one per metric the tasks report: loss,
// accuracy, examples/sec, the script's own scalars (task.report(lr=...)) and its evaluation metrics
// (eval/...). Each chart has a line per task. The settings (x by time or step, smoothing, log y) hold
// for every chart and are kept in localStorage. Pure helpers (chartData, smooth) and drawing; app.js
// fetches the points.
"use strict";

// What the cluster card already shows, or counters: offered, not drawn unless asked for.
const COUNTERS = ["global_step", "local_step", "examples", "step_examples_per_sec", "pushes", "stale_dropped"];
const LABELS = {examples_per_sec: "examples/sec", step_examples_per_sec: "examples/sec inside steps"};
const COLORS = ["#1f7ae0", "#d0312d", "#1a9a4b", "#e07b1f", "#7a3fb0", "#008b8b", "#8a6d00", "#c2185b"];

function chartSettings() {
  let s = {};
  try { s = JSON.parse(localStorage.getItem("psflow-charts") || "{}"); } catch (e) { s = {}; }
  const smoothing = Number(s.smoothing);
  return {x: s.x === "step" ? "step" : "time", log: !!s.log,
          smoothing: Number.isFinite(smoothing) ? Math.min(0.99, Math.max(0, smoothing)) : 0};
}

function saveChartSettings(s) { localStorage.setItem("psflow-charts", JSON.stringify(s)); }

function metricLabel(name) { return LABELS[name] || name; }

// Drawn unless the user says otherwise: the basics, and every metric of the script's own.
function drawnByDefault(name) { return !COUNTERS.includes(name); }

// An exponential moving average as TensorBoard draws it (debiased, so the first points are not pulled
// towards 0); nulls are kept and skipped. weight 0: the values themselves.
function smooth(values, weight) {
  if (!weight) return values.slice();
  let last = 0, n = 0;
  return values.map(v => {
    if (v === null || v === undefined || !Number.isFinite(v)) return null;
    last = last * weight + (1 - weight) * v;
    n += 1;
    return last / (1 - Math.pow(weight, n));
  });
}

// uPlot's data for one metric: per = {task: [[time, step, value], ...]}. x: "time" or "step" (points
// without a step are left out); log: values <= 0 left out (no logarithm); smoothing > 0: each task's
// raw line (faint) and its smoothed one. Returns {data, series, points}.
function chartData(per, settings) {
  const tasks = Object.keys(per).sort();
  const xi = settings.x === "step" ? 1 : 0;
  const rows = {};
  let points = 0;
  for (const t of tasks) {
    const byX = new Map();  // a task's last value at an x (a step reported twice: the later)
    for (const p of per[t]) {
      if (p[xi] === null || p[xi] === undefined) continue;
      byX.set(p[xi], settings.log && !(p[2] > 0) ? null : p[2]);
      points += 1;
    }
    rows[t] = byX;
  }
  const xs = [...new Set(tasks.flatMap(t => [...rows[t].keys()]))].sort((a, b) => a - b);
  const data = [xs], series = [{label: settings.x}];
  tasks.forEach((t, i) => {
    const raw = xs.map(x => rows[t].has(x) ? rows[t].get(x) : null);
    const color = COLORS[i % COLORS.length];
    if (settings.smoothing > 0) {
      data.push(raw);
      series.push({label: `${t} (raw)`, stroke: color + "40", width: 1, spanGaps: true});
      // smoothed over the task's own points in x order, then put back on the shared x
      const own = raw.map((v, j) => [j, v]).filter(([, v]) => v !== null);
      const sm = smooth(own.map(([, v]) => v), settings.smoothing);
      const line = new Array(xs.length).fill(null);
      own.forEach(([j], k) => { line[j] = sm[k]; });
      data.push(line);
    } else {
      data.push(raw);
    }
    series.push({label: t, stroke: color, width: 1.5, spanGaps: true});
  });
  return {data, series, points};
}

// Draw (or redraw) metric `name`'s chart in `el`; returns the uPlot (kept by the caller for the next draw).
// onZoom(lo, hi): a range of x dragged over (onZoom(null) on a double click: the whole run again).
function drawMetricChart(el, name, per, settings, chart, onZoom) {
  const {data, series, points} = chartData(per || {}, settings);
  el.dataset.points = String(points);
  el.dataset.x = settings.x;
  el.dataset.log = settings.log ? "1" : "0";
  el.dataset.smoothing = String(settings.smoothing);
  if (!points) {
    if (chart) chart.destroy();
    el.innerHTML = `<p class="muted">No ${esc(metricLabel(name))} reported yet${settings.x === "step" ? " with a step" : ""}.</p>`;
    return null;
  }
  const width = Math.max(240, el.clientWidth || 400);
  const shape = JSON.stringify([series.map(s => s.label), settings.x, settings.log]);
  if (chart && chart._shape === shape && Math.abs(chart.width - width) < 2) { chart.setData(data); return chart; }
  if (chart) chart.destroy();
  el.innerHTML = "";
  const zoomed = u => {  // a drag: uPlot zooms its scale to the selection; the points of that range are asked for
    if (!onZoom || u.select.width < 2) return;
    onZoom(u.posToVal(u.select.left, "x"), u.posToVal(u.select.left + u.select.width, "x"));
  };
  chart = new uPlot({width, height: 220, legend: {show: true},
    scales: {x: {time: settings.x === "time"}, y: settings.log ? {distr: 3} : {}},
    axes: [settings.x === "step" ? {label: "step"} : {}, {size: 60}], series, hooks: {setSelect: [zoomed]}}, data, el);
  el.ondblclick = () => { if (onZoom) onZoom(null, null); };
  chart._shape = shape;
  return chart;
}
