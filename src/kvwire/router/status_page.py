"""The status page at ``/``: plain HTML + JS that polls ``/engines`` and ``/health`` every
second, so a person can watch streams come and go (no build step, no external assets)."""

STATUS_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvwire router</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse}td,th{padding:.25em .7em;border-bottom:1px solid #ddd;
text-align:right}td:first-child,td:nth-child(2),th{text-align:left}
.dead{color:#b00}.live{color:#070}#health.bad{color:#b00}#health.ok{color:#070}
small{color:#777}
</style></head><body>
<h1>kvwire router</h1>
<p>Health: <b id="health">?</b> <small id="detail"></small></p>
<table id="engines"><thead><tr><th>engine</th><th>stream</th><th>alive</th><th>phase</th>
<th>mode</th><th>epoch</th><th>blocks (GPU/CPU/DISK)</th><th>events</th><th>last event</th>
<th>resets</th><th>load</th><th>note</th></tr></thead><tbody></tbody></table>
<p><small>refreshed <span id="refreshes">0</span> times; <a href="/metrics">metrics</a></small></p>
<script>
"use strict";
let refreshes = 0;
function cell(tr, text, cls) {
  const td = document.createElement("td"); td.textContent = text;
  if (cls) td.className = cls; tr.appendChild(td);
}
async function refresh() {
  try {
    const [e, h] = await Promise.all([fetch("/engines"), fetch("/health")]);
    const engines = await e.json(), health = await h.json();
    const hb = document.getElementById("health");
    hb.textContent = health.ok ? "ok" : "unhealthy"; hb.className = health.ok ? "ok" : "bad";
    document.getElementById("detail").textContent = health.detail;
    const body = document.querySelector("#engines tbody");
    body.replaceChildren();
    for (const [name, eng] of Object.entries(engines)) {
      for (const r of eng.ranks) {
        const tr = document.createElement("tr"); tr.dataset.stream = r.stream;
        tr.dataset.alive = r.alive;
        const b = r.blocks || {};
        cell(tr, name); cell(tr, r.stream);
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
