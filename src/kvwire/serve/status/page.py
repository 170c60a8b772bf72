"""The status page at ``/``: plain HTML + inline JS + inline SVG, no build step and no
external assets. Every second it polls ``/status.json`` (per engine, the last minutes'
requests/s, cached-token ratio, TTFT p50 and in-flight, drawn as small line charts),
``/engines`` (the stream table) and ``/health``. Without the proxy (decision API only) the
charts show what the router knows, routed/s and its predicted hit ratio, and say the rest
is n/a."""

STATUS_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvwire router</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse}td,th{padding:.25em .7em;border-bottom:1px solid #ddd;
text-align:right}td:first-child,td:nth-child(2),th{text-align:left}
.dead{color:#b00}.live{color:#070}#health.bad{color:#b00}#health.ok{color:#070}
small{color:#777}
#charts{display:flex;flex-wrap:wrap;gap:1em;margin-bottom:1.5em}
.engine{border:1px solid #ddd;border-radius:6px;padding:.5em .8em}
.engine h2{font-size:1em;margin:.2em 0 .4em}
.chart{display:inline-block;margin:0 .8em .3em 0;vertical-align:top;width:200px}
.chart .label{font-size:.8em;color:#555}.chart .value{font-weight:bold;float:right}
.chart svg{display:block;background:#fafafa;border:1px solid #eee}
.chart path{fill:none;stroke:#2563eb;stroke-width:1.5}.chart circle{fill:#2563eb}
.chart .na{font-size:.8em;color:#999;height:48px;line-height:48px;text-align:center;
background:#fafafa;border:1px solid #eee}
</style></head><body>
<h1>kvwire router</h1>
<p>Health: <b id="health">?</b> <small id="detail"></small></p>
<p><small>Last <select id="window"><option value="60">1 minute</option>
<option value="300" selected>5 minutes</option><option value="600">10 minutes</option>
</select>, one point a second (charts span the last <span id="span">?</span> s);
<span id="mode"></span></small></p>
<div id="charts"></div>
<table id="engines"><thead><tr><th>engine</th><th>stream</th><th>alive</th><th>phase</th>
<th>mode</th><th>epoch</th><th>blocks (GPU/CPU/DISK)</th><th>events</th><th>last event</th>
<th>resets</th><th>load</th><th>note</th></tr></thead><tbody></tbody></table>
<p><small>refreshed <span id="refreshes">0</span> times; <a href="/metrics">metrics</a>,
<a href="/status.json">status.json</a></small></p>
<script>
"use strict";
let refreshes = 0;
const W = 200, H = 48;
// Per chart: the figure with the proxy, the one without (decision API only), and format.
const CHARTS = [
  {title: "requests/s", key: "requests_per_s", alt: "routed_per_s", altTitle: "routed/s",
   fmt: v => v.toFixed(1)},
  {title: "cached-token ratio", key: "cached_ratio", alt: "predicted_hit_ratio",
   altTitle: "predicted hit ratio", fmt: v => (100 * v).toFixed(0) + "%", max: 1},
  {title: "TTFT p50", key: "ttft_p50_s", fmt: v => v < 1 ? (1000 * v).toFixed(0) + " ms"
   : v.toFixed(2) + " s"},
  {title: "in-flight", key: "in_flight", fmt: v => v.toFixed(0)},
];
function cell(tr, text, cls) {
  const td = document.createElement("td"); td.textContent = text;
  if (cls) td.className = cls; tr.appendChild(td);
}
function el(tag, attrs, text) {
  const ns = ["svg", "path", "title", "circle"].includes(tag) ? "http://www.w3.org/2000/svg"
    : "http://www.w3.org/1999/xhtml";
  const e = document.createElementNS(ns, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
// One line chart: x = seconds ago over the span shown, y from 0 to the max (1 for
// ratios); a gap where a point is null (nothing answered in that second), a dot for a
// point alone between gaps.
function spark(engine, key, ts, vs, windowS, max) {
  let top = max || 0, n = 0, last = null, d = "", pen = false;
  for (const v of vs) if (v !== null) { top = Math.max(top, v); n += 1; last = v; }
  top = top > 0 ? top : 1;
  const dots = [];
  for (let i = 0; i < vs.length; i++) {
    const v = vs[i];
    if (v === null) { pen = false; continue; }
    const x = (2 + (W - 4) * (1 - ts[i] / windowS)).toFixed(1);
    const y = (H - 2 - (H - 4) * v / top).toFixed(1);
    d += (pen ? "L" : "M") + x + " " + y;
    if (!pen && (i + 1 >= vs.length || vs[i + 1] === null)) dots.push([x, y]);
    pen = true;
  }
  const svg = el("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "spark",
    "data-engine": engine, "data-series": key, "data-points": n});
  svg.appendChild(el("title", {}, `${key}: ${n} points, max ${top}`));
  svg.appendChild(el("path", {d: d}));
  for (const [x, y] of dots) svg.appendChild(el("circle", {cx: x, cy: y, r: 2}));
  return [svg, last];
}
function drawCharts(st) {
  const box = document.getElementById("charts");
  // the x axis spans the window, or less while the router has not been up that long
  let oldest = 10;
  for (const e of Object.values(st.engines)) if (e.t.length) oldest = Math.max(oldest, e.t[0]);
  const windowS = Math.min(st.seconds, oldest + 1);
  document.getElementById("span").textContent = windowS.toFixed(0);
  document.getElementById("mode").textContent = st.proxy ? "proxy figures (OpenAI API)"
    : "no proxy (decision API only): TTFT and in-flight are n/a";
  const cards = [];
  for (const [name, e] of Object.entries(st.engines)) {
    const card = el("div", {class: "engine", "data-engine": name});
    card.appendChild(el("h2", {class: e.alive ? "live" : "dead"},
      name + (e.alive ? "" : " (dead)")));
    for (const c of CHARTS) {
      const key = e.proxied ? c.key : c.alt;
      const title = e.proxied ? c.title : (c.altTitle || c.title);
      const div = el("div", {class: "chart", "data-series": key || c.key});
      const label = el("div", {class: "label"}, title);
      div.appendChild(label);
      if (!key) {
        div.appendChild(el("div", {class: "na", "data-na": c.key}, "n/a (no proxy)"));
      } else {
        const [svg, last] = spark(name, key, e.t, e[key], windowS, c.max);
        label.appendChild(el("span", {class: "value"}, last === null ? "-" : c.fmt(last)));
        div.appendChild(svg);
      }
      card.appendChild(div);
    }
    cards.push(card);
  }
  box.replaceChildren(...cards);
}
async function refresh() {
  try {
    const seconds = document.getElementById("window").value;
    const [e, h, s] = await Promise.all([fetch("/engines"), fetch("/health"),
                                         fetch("/status.json?seconds=" + seconds)]);
    const engines = await e.json(), health = await h.json(), st = await s.json();
    const hb = document.getElementById("health");
    hb.textContent = health.ok ? "ok" : "unhealthy"; hb.className = health.ok ? "ok" : "bad";
    document.getElementById("detail").textContent = health.detail;
    drawCharts(st);
    const body = document.querySelector("#engines tbody");
    body.replaceChildren();
    for (const [name, eng] of Object.entries(engines)) {
      for (const r of eng.ranks) {
        const tr = document.createElement("tr"); tr.dataset.stream = r.stream;
        tr.dataset.alive = r.alive;
        const b = r.blocks || {};
        cell(tr, eng.role && eng.role !== "both" ? name + " (" + eng.role + ")" : name);
        cell(tr, r.stream);
        cell(tr, r.alive ? "live" : "dead", r.alive ? "live" : "dead");
        cell(tr, r.phase); cell(tr, r.mode); cell(tr, r.epoch === null ? "-" : r.epoch);
        cell(tr, [b.GPU || 0, b.CPU || 0, b.DISK || 0].join(" / "));
        cell(tr, r.events_applied);
        cell(tr, r.last_event_age_s === null ? "never" : r.last_event_age_s.toFixed(1) + " s ago");
        cell(tr, r.resets); cell(tr, r.load.toFixed(1)); cell(tr, r.suspect || "");
        body.appendChild(tr);
      }
    }
    refreshes += 1;
    document.getElementById("refreshes").textContent = refreshes;
  } catch (err) {
    const hb = document.getElementById("health");
    hb.textContent = "router unreachable"; hb.className = "bad";
  }
}
refresh(); setInterval(refresh, 1000);
</script></body></html>
"""
