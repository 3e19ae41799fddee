// kvtier dashboard: polls the admin API once a second and draws on canvases. No libraries.
"use strict";
const COLORS = { hbm: "#f2a541", host: "#4fb3bf", nvme: "#9b7fd1", remote: "#d16d7f" };
const GRID = "#2b3540", MUTED = "#8a96a3", TEXT = "#e6e6e6";

function fmtBytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return n.toFixed(n < 10 && i ? 1 : 0) + " " + u[i];
}
function fmtCount(n) { return n >= 1e6 ? (n / 1e6).toFixed(2) + "M" : n >= 1e3 ? (n / 1e3).toFixed(1) + "k" : String(n); }

function frame(ctx, w, h, pad) {
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = GRID; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = pad.t + (h - pad.t - pad.b) * i / 4;
    ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
  }
}

function drawOccupancy(stats) {
  const c = document.getElementById("occupancy"), ctx = c.getContext("2d");
  const w = c.width, h = c.height; ctx.clearRect(0, 0, w, h);
  const tiers = Object.keys(stats.tiers); const bh = 34, gap = 18;
  ctx.font = "13px system-ui"; ctx.textBaseline = "middle";
  tiers.forEach((t, i) => {
    const d = stats.tiers[t], y = 20 + i * (bh + gap), x0 = 70, bw = w - x0 - 20;
    const frac = d.capacity_bytes ? Math.min(1, d.used_bytes / d.capacity_bytes) : 0;
    ctx.fillStyle = TEXT; ctx.fillText(t, 10, y + bh / 2);
    ctx.fillStyle = GRID; ctx.fillRect(x0, y, bw, bh);
    ctx.fillStyle = COLORS[t] || TEXT; ctx.fillRect(x0, y, bw * frac, bh);
    ctx.fillStyle = "#000";
    ctx.fillText(`${fmtBytes(d.used_bytes)} / ${fmtBytes(d.capacity_bytes)}  (${(frac * 100).toFixed(1)}%, ${fmtCount(d.blocks)} blocks)`, x0 + 8, y + bh / 2);
  });
}

function drawLines(id, series, yMax, fmt) {
  const c = document.getElementById(id), ctx = c.getContext("2d");
  const w = c.width, h = c.height, pad = { l: 60, r: 10, t: 10, b: 22 };
  frame(ctx, w, h, pad);
  ctx.fillStyle = MUTED; ctx.font = "11px system-ui"; ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const v = yMax * (4 - i) / 4, y = pad.t + (h - pad.t - pad.b) * i / 4;
    ctx.fillText(fmt(v), 4, y);
  }
  let legendX = pad.l;
  for (const s of series) {
    const pts = s.points; if (!pts.length) continue;
    const n = pts.length;
    ctx.strokeStyle = s.color; ctx.lineWidth = 2; ctx.beginPath();
    let pen = false;     // a null (no ops in that second) leaves a gap, not a fake zero
    pts.forEach((v, i) => {
      if (v === null || v === undefined) { pen = false; return; }
      const x = pad.l + (w - pad.l - pad.r) * (n === 1 ? 1 : i / (n - 1));
      const y = pad.t + (h - pad.t - pad.b) * (1 - Math.min(1, v / (yMax || 1)));
      pen ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
      pen = true;
    });
    ctx.stroke();
    ctx.fillStyle = s.color; ctx.fillText(s.name, legendX, h - 8); legendX += 70;
  }
}

function drawLatency(hist) {
  const c = document.getElementById("latency"), ctx = c.getContext("2d");
  const w = c.width, h = c.height, pad = { l: 40, r: 40, t: 10, b: 34 };
  frame(ctx, w, h, pad);
  const counts = hist.counts, total = counts.reduce((a, b) => a + b, 0);
  const nb = counts.length, bw = (w - pad.l - pad.r) / nb, max = Math.max(1, ...counts);
  ctx.font = "10px system-ui"; ctx.textBaseline = "top";
  let cum = 0; const cdf = [];
  counts.forEach((k, i) => {
    const bh = (h - pad.t - pad.b) * k / max;
    ctx.fillStyle = COLORS.host; ctx.fillRect(pad.l + i * bw + 1, h - pad.b - bh, bw - 2, bh);
    cum += k; cdf.push(total ? cum / total : 0);
    const le = hist.le_seconds[i];
    if (i % 2 === 0) {
      ctx.fillStyle = MUTED;
      ctx.fillText(le === null ? "inf" : (le < 1e-3 ? (le * 1e6) + "us" : le < 1 ? (le * 1e3) + "ms" : le + "s"), pad.l + i * bw, h - pad.b + 4);
    }
  });
  ctx.strokeStyle = COLORS.hbm; ctx.lineWidth = 2; ctx.beginPath();
  cdf.forEach((v, i) => {
    const x = pad.l + (i + 1) * bw, y = pad.t + (h - pad.t - pad.b) * (1 - v);
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = MUTED; ctx.fillText(`${fmtCount(total)} ops · bars: count · line: CDF`, pad.l, h - 14);
}

function drawClients(rows) {
  const tb = document.querySelector("#clients tbody"); tb.innerHTML = "";
  rows.slice(0, 10).forEach(r => {
    const tr = document.createElement("tr");
    [r.name || ("#" + r.id), r.pid, r.qps.toFixed(1), r.p99_ms.toFixed(3),
     (r.error_rate * 100).toFixed(2) + "%", r.load_weight.toFixed(2), fmtCount(r.ops)]
      .forEach(v => { const td = document.createElement("td"); td.textContent = v; tr.appendChild(td); });
    tb.appendChild(tr);
  });
}

async function tick() {
  try {
    const [stats, hist, clients] = await Promise.all(
      ["/v1/stats", "/v1/history", "/v1/clients"].map(u => fetch(u).then(r => r.json())));
    document.getElementById("status").textContent = "live"; document.getElementById("status").className = "pill ok";
    document.getElementById("uptime").textContent = `up ${Math.round(stats.uptime_s)} s · ${stats.write_policy}`;
    document.getElementById("kpi-hit").textContent = stats.hit_ratio === null ? "–" : (stats.hit_ratio * 100).toFixed(1) + "%";
    document.getElementById("kpi-gets").textContent = fmtCount(stats.gets);
    document.getElementById("kpi-puts").textContent = fmtCount(stats.puts);
    document.getElementById("kpi-leases").textContent = fmtCount(stats.leases);
    document.getElementById("kpi-cks").textContent = fmtCount(stats.checksum_failures);
    document.getElementById("kpi-clients").textContent = fmtCount(stats.clients);
    drawOccupancy(stats);
    const s = hist.samples;
    drawLines("hits", [{ name: "hit ratio", color: COLORS.host, points: s.map(p => p.hit_ratio) }], 1, v => (v * 100).toFixed(0) + "%");
    const tiers = Object.keys(stats.tiers);
    const bw = tiers.map(t => ({ name: t, color: COLORS[t], points: s.map(p => (p.tiers[t] ? p.tiers[t].read_bps + p.tiers[t].write_bps : 0)) }));
    const bmax = Math.max(1, ...bw.flatMap(x => x.points));
    drawLines("bandwidth", bw, bmax, v => fmtBytes(v) + "/s");
    drawLatency(hist.latency_histogram);
    drawClients(clients);
    document.body.dataset.drawn = String(stats.gets + stats.puts);
  } catch (e) {
    document.getElementById("status").textContent = "unreachable"; document.getElementById("status").className = "pill";
  }
}
tick(); setInterval(tick, 1000);
