// The swarm dashboard: polls api/swarm every 2 s and redraws the header, warnings, peers table and SVG charts.
//
// Everything in the snapshot (peer ids, warning messages, the run id) was published by some peer of the swarm, so
// none of it ever reaches the DOM as markup: text goes in through textContent / createTextNode, attributes through
// setAttribute. No innerHTML anywhere in this file. Any field of the snapshot may be null or missing.
"use strict";

(function () {
  const POLL_MS = 2000;
  const FETCH_TIMEOUT_MS = 10000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  // Tableau 10, reordered so the first peers get the most distinct hues; later peers get golden-angle hues
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
                   "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];
  const TIME_STEPS_S = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
                        86400, 172800, 604800];

  const state = {
    data: null,           // the last good snapshot
    receivedAt: null,     // server time (unix s) when it arrived
    error: null,          // one line, or null while api/swarm answers
    serverOffsetS: 0,     // server clock - browser clock: ages are measured on the server's clock
    colours: new Map(),   // peer id -> colour, kept for the page's life so a peer never changes colour
  };

  // ---------------------------------------------------------------- small helpers

  function isNum(value) {
    return typeof value === "number" && Number.isFinite(value);
  }

  function asArray(value) {
    return Array.isArray(value) ? value : [];
  }

  function asObject(value) {
    return value && typeof value === "object" && !Array.isArray(value) ? value : {};
  }

  function str(value) {
    return value === null || value === undefined ? "" : String(value);
  }

  function shortId(id) {
    const text = str(id);
    return text.length > 8 ? text.slice(-8) : text;
  }

  function serverNow() {
    return Date.now() / 1000 + state.serverOffsetS;
  }

  function fmtAge(seconds) {
    if (!isNum(seconds)) return "—";
    const s = Math.max(0, seconds);
    if (s < 90) return `${Math.round(s)} s`;
    if (s < 90 * 60) return `${Math.round(s / 60)} min`;
    if (s < 48 * 3600) return `${(s / 3600).toFixed(1)} h`;
    return `${(s / 86400).toFixed(1)} d`;
  }

  function ago(timestamp) {
    return isNum(timestamp) ? `${fmtAge(serverNow() - timestamp)} ago` : "—";
  }

  function fmtNum(value, digits) {
    if (!isNum(value)) return "—";
    return value.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
  }

  function fmtMB(bytes) {
    if (!isNum(bytes)) return "—";
    const mb = bytes / 1e6;
    return `${mb.toFixed(mb < 10 ? 2 : 1)} MB`;
  }

  function el(tag, options, parent) {
    const node = document.createElement(tag);
    const opts = options || {};
    if (opts.className) node.className = opts.className;
    if (opts.text !== undefined) node.textContent = opts.text;
    if (opts.title) node.setAttribute("title", opts.title);
    if (parent) parent.appendChild(node);
    return node;
  }

  function svg(tag, attrs, parent) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (parent) parent.appendChild(node);
    return node;
  }

  function svgText(parent, x, y, text, attrs) {
    const node = svg("text", Object.assign({x: x, y: y}, attrs || {}), parent);
    node.textContent = text;
    return node;
  }

  function svgTitle(parent, text) {
    svg("title", {}, parent).textContent = text;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function swatch(colour, parent) {
    const node = el("span", {className: "swatch"}, parent);
    node.style.background = colour;  // CSSOM, not a style attribute: allowed by the page's CSP
    return node;
  }

  // ---------------------------------------------------------------- colours

  function colourOf(id) {
    const key = str(id);
    if (!state.colours.has(key)) {
      const i = state.colours.size;
      state.colours.set(key, i < PALETTE.length ? PALETTE[i] : `hsl(${Math.round((i * 137.508) % 360)}, 60%, 42%)`);
    }
    return state.colours.get(key);
  }

  function allPeerIds(data) {
    const ids = new Set();
    for (const peer of asArray(data.peers)) if (peer && peer.peer_id != null) ids.add(str(peer.peer_id));
    for (const id of Object.keys(asObject(data.losses))) ids.add(id);
    for (const id of Object.keys(asObject(data.evals))) ids.add(id);
    for (const round of asArray(data.rounds)) if (round && round.peer_id != null) ids.add(str(round.peer_id));
    return Array.from(ids).sort();
  }

  // ---------------------------------------------------------------- scales and ticks

  function linear(d0, d1, r0, r1) {
    const k = d1 === d0 ? 0 : (r1 - r0) / (d1 - d0);
    return (v) => r0 + (v - d0) * k;
  }

  // about `count` round-numbered ticks covering [lo, hi]; the domain widened to the outer ticks
  function niceLinear(lo, hi, count, integer) {
    if (!(hi > lo)) {
      const pad = lo === 0 ? 1 : Math.abs(lo) * 0.1;
      lo -= pad;
      hi += pad;
    }
    const rough = (hi - lo) / count;
    const magnitude = Math.pow(10, Math.floor(Math.log10(rough)));
    const ratio = rough / magnitude;
    let step = (ratio >= 7.5 ? 10 : ratio >= 3.5 ? 5 : ratio >= 1.5 ? 2 : 1) * magnitude;
    if (integer) step = Math.max(1, Math.round(step));
    const first = Math.floor(lo / step) * step;
    const last = Math.ceil(hi / step) * step;
    const ticks = [];
    for (let i = 0; first + i * step <= last + step * 1e-9; i++) ticks.push(first + i * step);
    const digits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    return {lo: first, hi: last, ticks: ticks, format: (v) => v.toFixed(digits)};
  }

  function pad2(n) {
    return String(n).padStart(2, "0");
  }

  // wall-clock ticks in the browser's time zone, on whole seconds / minutes / hours
  function timeTicks(lo, hi, count) {
    const span = Math.max(hi - lo, 1);
    const step = TIME_STEPS_S.find((s) => span / s <= count) || TIME_STEPS_S[TIME_STEPS_S.length - 1];
    const zone = -new Date(lo * 1000).getTimezoneOffset() * 60;
    const ticks = [];
    for (let t = Math.ceil((lo + zone) / step) * step - zone; t <= hi; t += step) ticks.push(t);
    const format = (t) => {
      const d = new Date(t * 1000);
      if (step >= 86400) return d.toLocaleDateString("en-US", {month: "short", day: "numeric"});
      const hm = `${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
      return step < 60 ? `${hm}:${pad2(d.getSeconds())}` : hm;
    };
    return {lo: lo, hi: hi, ticks: ticks, format: format};
  }

  // ---------------------------------------------------------------- chart frame

  function chartBox(node, fallbackHeight) {
    const rect = node.getBoundingClientRect();
    const width = Math.max(240, Math.round(rect.width) || 600);
    const height = Math.max(120, Math.round(rect.height) || fallbackHeight);
    node.setAttribute("viewBox", `0 0 ${width} ${height}`);
    node.setAttribute("width", width);
    node.setAttribute("height", height);
    return {width: width, height: height, left: 56, right: width - 14, top: 10, bottom: height - 32};
  }

  function emptyChart(node, box, message) {
    svg("rect", {x: box.left, y: box.top, width: box.right - box.left, height: box.bottom - box.top,
                 fill: "none", class: "grid-line"}, node);
    svgText(node, (box.left + box.right) / 2, (box.top + box.bottom) / 2, message,
            {"text-anchor": "middle", "dominant-baseline": "middle", class: "empty-text"});
  }

  function drawAxes(node, box, xAxis, yAxis, xLabel, yLabel) {
    const x = linear(xAxis.lo, xAxis.hi, box.left, box.right);
    const y = linear(yAxis.lo, yAxis.hi, box.bottom, box.top);
    const axes = svg("g", {class: "axes"}, node);
    for (const tick of yAxis.ticks) {
      const ty = y(tick);
      svg("line", {x1: box.left, x2: box.right, y1: ty, y2: ty, class: "grid-line"}, axes);
      svgText(axes, box.left - 6, ty, yAxis.format(tick),
              {"text-anchor": "end", "dominant-baseline": "middle", class: "tick y-tick"});
    }
    let lastRight = -Infinity;
    for (const tick of xAxis.ticks) {
      const tx = x(tick);
      if (tx < box.left - 0.5 || tx > box.right + 0.5) continue;
      const label = xAxis.format(tick);
      if (tx - label.length * 3.5 < lastRight + 6) continue;  // labels would overlap: skip this one
      lastRight = tx + label.length * 3.5;
      svg("line", {x1: tx, x2: tx, y1: box.bottom, y2: box.bottom + 4, class: "axis-line"}, axes);
      svgText(axes, tx, box.bottom + 16, label, {"text-anchor": "middle", class: "tick x-tick"});
    }
    svg("line", {x1: box.left, x2: box.right, y1: box.bottom, y2: box.bottom, class: "axis-line"}, axes);
    svg("line", {x1: box.left, x2: box.left, y1: box.top, y2: box.bottom, class: "axis-line"}, axes);
    svgText(axes, box.right, box.bottom + 29, xLabel, {"text-anchor": "end", class: "axis-label"});
    const yMid = (box.top + box.bottom) / 2;
    svgText(axes, 14, yMid, yLabel, {"text-anchor": "middle", class: "axis-label",
                                     transform: `rotate(-90 14 ${yMid})`});
    return {x: x, y: y};
  }

  // ---------------------------------------------------------------- loss chart

  // [[local_step, loss, unix_time], ...] -> finite [step, loss] pairs sorted by step
  function cleanSeries(points) {
    return asArray(points)
      .filter((p) => Array.isArray(p) && isNum(p[0]) && isNum(p[1]))
      .map((p) => [p[0], p[1], p[2]])
      .sort((a, b) => a[0] - b[0]);
  }

  function pathOf(points, x, y) {
    const parts = points.map((p, i) => `${i === 0 ? "M" : "L"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`);
    if (points.length === 1) parts.push(`L${x(points[0][0]).toFixed(1)},${y(points[0][1]).toFixed(1)}`);
    return parts.join(" ");
  }

  function drawLossChart(node, data, stale) {
    clear(node);
    const box = chartBox(node, 320);
    const series = [];
    for (const [kind, source] of [["train", data.losses], ["eval", data.evals]]) {
      for (const [id, points] of Object.entries(asObject(source))) {
        const clean = cleanSeries(points);
        if (clean.length) series.push({id: id, kind: kind, points: clean});
      }
    }
    if (!series.length) {
      emptyChart(node, box, "no loss samples yet");
      return;
    }
    const steps = series.flatMap((s) => s.points.map((p) => p[0]));
    const losses = series.flatMap((s) => s.points.map((p) => p[1]));
    const xAxis = niceLinear(Math.min(...steps), Math.max(...steps), 8, true);
    const yAxis = niceLinear(Math.min(...losses), Math.max(...losses), 5, false);
    const {x, y} = drawAxes(node, box, xAxis, yAxis, "local step", "loss");
    // training curves first, so the sparser dashed eval curves stay visible on top
    series.sort((a, b) => (a.kind === b.kind ? (a.id < b.id ? -1 : 1) : a.kind === "train" ? -1 : 1));
    for (const s of series) {
      const colour = colourOf(s.id);
      const eval_ = s.kind === "eval";
      const group = svg("g", {class: stale.has(s.id) ? "peer-series stale" : "peer-series"}, node);
      const path = svg("path", {class: eval_ ? "series eval" : "series", "data-peer-id": s.id,
                                d: pathOf(s.points, x, y), stroke: colour}, group);
      svgTitle(path, `${s.id}: ${eval_ ? "held-out loss" : "training loss"}, ${s.points.length} point(s)`);
      // evals are one per round: mark each; a lone training sample is a dot
      if (eval_ || s.points.length === 1) {
        for (const p of s.points) {
          const dot = svg("circle", {class: eval_ ? "point eval" : "point", "data-peer-id": s.id,
                                     cx: x(p[0]).toFixed(1), cy: y(p[1]).toFixed(1), r: eval_ ? 3 : 3.5,
                                     stroke: colour, fill: eval_ ? "#fff" : colour}, group);
          svgTitle(dot, `${shortId(s.id)} step ${p[0]}: ${eval_ ? "held-out" : "training"} loss ${fmtNum(p[1], 4)}`);
        }
      }
    }
  }

  // ---------------------------------------------------------------- rounds charts

  const ROUND_PANELS = [
    {id: "rounds-seconds", label: "seconds", value: (r) => r.seconds, integer: false},
    {id: "rounds-group", label: "peers", value: (r) => r.group_size, integer: true},
    {id: "rounds-bytes", label: "MB sent", value: (r) => (isNum(r.bytes_sent) ? r.bytes_sent / 1e6 : null),
     integer: false},
  ];

  function roundTitle(r) {
    const parts = [
      `${str(r.peer_id)}`,
      `outer step ${isNum(r.outer_step) ? r.outer_step : "?"}`,
      r.averaged === false ? "FAILED (not averaged)" : "averaged",
      `finished ${ago(r.finished_at)}`,
      `group of ${isNum(r.group_size) ? r.group_size : "?"}`,
      `${fmtNum(r.seconds, 2)} s (matchmaking ${fmtNum(r.matchmaking_s, 2)} s, all-reduce ${fmtNum(r.allreduce_s, 2)} s)`,
      `${fmtMB(r.bytes_sent)} sent, ${fmtMB(r.bytes_received)} received`,
    ];
    return parts.join("\n");
  }

  function drawRoundsCharts(data, stale) {
    const rounds = asArray(data.rounds).filter((r) => r && typeof r === "object" && isNum(r.finished_at));
    const times = rounds.map((r) => r.finished_at);
    let lo = Math.min(...times);
    let hi = Math.max(...times);
    const pad = rounds.length ? Math.max((hi - lo) * 0.04, 5) : 0;  // keep the outermost dots off the axes
    lo -= pad;
    hi += pad;
    for (const panel of ROUND_PANELS) {
      const node = document.getElementById(panel.id);
      clear(node);
      const box = chartBox(node, 180);
      const marks = rounds.filter((r) => isNum(panel.value(r)));
      if (!marks.length) {
        emptyChart(node, box, rounds.length ? "not reported" : "no averaging rounds yet");
        continue;
      }
      const xAxis = timeTicks(lo, hi, Math.max(2, Math.floor((box.right - box.left) / 90)));
      const yAxis = niceLinear(0, Math.max(...marks.map(panel.value)), 4, panel.integer);
      const {x, y} = drawAxes(node, box, xAxis, yAxis, "finished at", panel.label);
      for (const r of marks) {
        const id = str(r.peer_id);
        const colour = colourOf(id);
        const failed = r.averaged === false;
        const classes = ["round"];
        if (failed) classes.push("failed");
        if (stale.has(id)) classes.push("stale");
        const dot = svg("circle", {class: classes.join(" "), "data-peer-id": id,
                                   cx: x(r.finished_at).toFixed(1), cy: y(panel.value(r)).toFixed(1),
                                   r: 4, stroke: colour, fill: failed ? "#fff" : colour}, node);
        svgTitle(dot, roundTitle(r));
      }
    }
  }

  // ---------------------------------------------------------------- header, warnings, table, legend

  function renderHeader(data) {
    const peers = asArray(data.peers).filter((p) => p && typeof p === "object");  // as many as the table's rows
    const runId = data.run_id == null ? "unknown run" : str(data.run_id);
    document.getElementById("run-id").textContent = runId;
    document.title = `${runId} · p2ptrain swarm`;
    document.getElementById("peer-count").textContent = String(peers.length);
    document.getElementById("peer-noun").textContent = peers.length === 1 ? "peer" : "peers";
    const badge = document.getElementById("swarm-kind");
    badge.hidden = typeof data.private !== "boolean";
    badge.className = data.private ? "badge private" : "badge open";
    badge.textContent = data.private ? "private swarm" : "open swarm";
    badge.setAttribute("title", data.private ? "a swarm key is in use: only peers holding it can join"
                                             : "no swarm key: any peer that knows the run id can join");
    const publicPeers = document.getElementById("public-peers");
    publicPeers.textContent = isNum(data.public_peers) ? `${data.public_peers} public` : "";
    publicPeers.setAttribute("title", "peers that others can dial directly");
    document.getElementById("updated").textContent =
      isNum(data.updated_at) ? `updated ${fmtAge(serverNow() - data.updated_at)} ago` : "updated: unknown";

    const coverage = asObject(data.coverage);
    const parts = [];
    if (isNum(coverage.fraction_seen)) parts.push(`${(coverage.fraction_seen * 100).toFixed(1)}% of the corpus seen`);
    if (isNum(coverage.num_shards)) {
      parts.push(`${isNum(coverage.shards_complete) ? coverage.shards_complete : "?"} of ${coverage.num_shards} shards complete`);
    }
    if (isNum(coverage.passes)) parts.push(`${coverage.passes} full pass${coverage.passes === 1 ? "" : "es"}`);
    const line = document.getElementById("coverage");
    line.textContent = parts.length ? `data: ${parts.join(" · ")}` : "";
    line.hidden = !parts.length;
  }

  function renderWarnings(data) {
    const list = document.getElementById("warnings");
    clear(list);
    const warnings = asArray(data.warnings).filter((w) => w && typeof w === "object");
    for (const w of warnings) {
      const kind = str(w.kind) || "warning";
      const item = el("li", {className: `warning warning-${kind.replace(/[^A-Za-z0-9_-]/g, "_")}`}, list);
      if (w.peer_id != null) item.setAttribute("data-peer-id", str(w.peer_id));
      el("span", {className: "kind", text: kind}, item);
      item.appendChild(document.createTextNode(w.message == null ? "" : str(w.message)));
    }
    document.getElementById("warnings-empty").hidden = warnings.length > 0;
  }

  function cell(row, text, options) {
    const opts = options || {};
    const td = el("td", {className: opts.className, text: text, title: opts.title}, row);
    return td;
  }

  function lastSyncText(sync) {
    if (!sync || typeof sync !== "object") return {text: "—", failed: false, title: ""};
    const parts = [ago(sync.finished_at)];
    if (isNum(sync.group_size)) parts.push(`group ${sync.group_size}`);
    if (isNum(sync.seconds)) parts.push(`${sync.seconds.toFixed(1)} s`);
    if (isNum(sync.bytes_sent)) parts.push(`${fmtMB(sync.bytes_sent)} sent`);
    const failed = sync.averaged === false;
    if (failed) parts.push("failed");
    const title = `outer step ${isNum(sync.outer_step) ? sync.outer_step : "?"}, ` +
                  `${fmtMB(sync.bytes_received)} received${failed ? ", not averaged" : ""}`;
    return {text: parts.join(" · "), failed: failed, title: title};
  }

  function dataText(peer) {
    const parts = [];
    if (peer.shard != null) parts.push(`shard ${str(peer.shard)}`);
    if (isNum(peer.shard_passes)) parts.push(`${peer.shard_passes.toFixed(2)} passes`);
    const position = asArray(peer.data_position);
    if (position.length === 2) parts.push(`${str(position[0])}/${str(position[1])}`);
    return parts.length ? parts.join(" · ") : "—";
  }

  function renderPeers(data) {
    const table = document.getElementById("peers");
    const body = table.tBodies[0];
    clear(body);
    const peers = asArray(data.peers).filter((p) => p && typeof p === "object");
    for (const peer of peers) {
      const id = str(peer.peer_id);
      const row = el("tr", {className: peer.stale ? "peer stale" : "peer"}, body);
      row.setAttribute("data-peer-id", id);

      const idCell = cell(row, "", {className: "peer-id", title: id});
      swatch(colourOf(id), idCell);
      idCell.appendChild(document.createTextNode(shortId(id)));
      if (peer.stale) el("span", {className: "tag", text: "stale"}, idCell);

      const modeCell = cell(row, str(peer.mode) || "—", {title: str(peer.reachability)});
      const banned = asArray(peer.banned);
      if (banned.length) {
        el("span", {className: "tag bad", text: `bans ${banned.length}`,
                    title: `banned: ${banned.map(str).join(", ")}`}, modeCell);
      }
      cell(row, isNum(peer.outer_step) ? String(peer.outer_step) : "—", {className: "num"});
      cell(row, isNum(peer.local_step) ? String(peer.local_step) : "—", {className: "num"});
      cell(row, fmtNum(peer.samples_per_s, 1), {className: "num"});
      cell(row, fmtNum(peer.tokens_per_s, 0), {className: "num"});
      const sync = lastSyncText(peer.last_sync);
      cell(row, sync.text, {className: sync.failed ? "sync-failed" : "", title: sync.title});
      const position = asArray(peer.data_position);
      cell(row, dataText(peer), {title: position.length === 2
        ? `epoch ${str(position[0])}, sample ${str(position[1])}` : ""});
      const lossCell = cell(row, fmtNum(peer.loss, 3), {className: "num", title: "training loss · held-out loss"});
      if (isNum(peer.eval_loss)) el("span", {className: "muted", text: ` · ${fmtNum(peer.eval_loss, 3)}`}, lossCell);
      cell(row, ago(peer.last_seen), {className: "num"});
    }
    document.getElementById("peers-empty").hidden = peers.length > 0;
  }

  function renderLegend(data, ids, stale) {
    const legend = document.getElementById("legend");
    clear(legend);
    for (const id of ids) {
      const item = el("li", {className: stale.has(id) ? "stale" : "", title: id}, legend);
      item.setAttribute("data-peer-id", id);
      swatch(colourOf(id), item);
      item.appendChild(document.createTextNode(shortId(id) + (stale.has(id) ? " (stale)" : "")));
    }
  }

  function renderCharts(data) {
    const stale = new Set(asArray(data.peers).filter((p) => p && p.stale).map((p) => str(p.peer_id)));
    renderLegend(data, allPeerIds(data), stale);
    drawLossChart(document.getElementById("loss-chart"), data, stale);
    drawRoundsCharts(data, stale);
  }

  // ---------------------------------------------------------------- polling

  function render() {
    const problems = [];
    if (state.data) {
      const data = state.data;
      // colours are handed out on first sight, in peer-id order and before anything is drawn, so that a peer has
      // the same colour in the table and every chart, and after a reload, whatever order the snapshot lists it in
      try {
        allPeerIds(data).forEach(colourOf);
      } catch (e) {
        console.error(e);
      }
      for (const [name, draw] of [["header", renderHeader], ["warnings", renderWarnings],
                                  ["peers", renderPeers], ["charts", renderCharts]]) {
        try {
          draw(data);
        } catch (e) {  // one odd field must not blank the rest of the page
          console.error(e);
          problems.push(`cannot draw the ${name}: ${e && e.message ? e.message : e}`);
        }
      }
    }
    const box = document.getElementById("error");
    let message = state.error || problems[0] || null;
    if (state.error && state.data) message += ` (showing the data received ${ago(state.receivedAt)})`;
    box.textContent = message || "";
    box.hidden = !message;
  }

  function noteServerClock(response) {
    const precise = parseFloat(response.headers.get("X-Server-Time"));
    const coarse = Date.parse(response.headers.get("Date") || "") / 1000;
    const serverTime = isNum(precise) ? precise : isNum(coarse) ? coarse : null;
    if (serverTime !== null) state.serverOffsetS = serverTime - Date.now() / 1000;
  }

  class SnapshotError extends Error {}

  async function fetchSnapshot() {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
    try {
      const response = await fetch("api/swarm", {cache: "no-store", signal: controller.signal});
      noteServerClock(response);
      let body = null;
      try {
        body = await response.json();
      } catch (e) {
        body = null;
      }
      if (!response.ok) {
        const why = body && typeof body.error === "string" ? body.error : `HTTP ${response.status}`;
        throw new SnapshotError(`the dashboard server cannot read the swarm: ${why}`);
      }
      if (!body || typeof body !== "object" || Array.isArray(body)) {
        throw new SnapshotError("the dashboard server sent something that is not a swarm snapshot");
      }
      return body;
    } finally {
      clearTimeout(timer);
    }
  }

  async function poll() {
    try {
      state.data = await fetchSnapshot();
      state.receivedAt = serverNow();
      state.error = null;
    } catch (e) {
      if (e instanceof SnapshotError) state.error = e.message;
      else if (e && e.name === "AbortError") state.error = `the dashboard server did not answer in ${FETCH_TIMEOUT_MS / 1000} s`;
      else state.error = `cannot reach the dashboard server (${e && e.message ? e.message : e})`;
    }
    render();
    // the next poll is timed from this one's end, so a slow server never has two requests from one page
    setTimeout(poll, POLL_MS);
  }

  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(render, 150);
  });

  poll();
})();
