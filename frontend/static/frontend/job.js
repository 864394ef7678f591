/* One job's page: header and operator controls, the hypergraph, the GPU ownership timeline,
 * utilisation and throughput per group, the predictor's error, the decision and migration logs.
 * Everything is read from the REST API once, then kept current from /ws/jobs/<id>/ without a
 * reload; after a reconnect the "hello" frame says what changed, and only that is fetched again. */
(function () {
  "use strict";
  const { api, apiAll, fmtTime, socket, el, badge, canOperate } = window.dynarl;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const root = document.getElementById("job-page");
  const jobId = Number(root.dataset.jobId);
  const TERMINAL_JOB = new Set(["succeeded", "failed", "cancelled"]);
  const OPEN_MIGRATION = new Set(["planned", "running", "rolling_back"]);
  const KIND_COLOURS = { rollout: "#1f77b4", inference: "#9467bd", reward: "#2ca02c", tool: "#8c564b", actor: "#d62728" };
  const EXTRA_COLOURS = ["#17becf", "#ff7f0e", "#bcbd22", "#e377c2", "#7f7f7f", "#393b79"];
  const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  const LIVE_POINTS = 2000;

  const page = {
    job: null,
    groups: [],            // [{name, kind, gpus}] from the job detail
    colours: {},           // group name -> colour
    snapshot: null,
    timeline: null,
    liveGroups: {},        // group name -> latest telemetry roll-up (util, tokens/s, progress)
    helloSeen: false,
    lastSnapshotId: null,
    lastDecisionId: null,
    telemetryTraces: [],   // group names in trace order (both time-series charts)
    telemetryUntil: null,
    migrations: [],        // rows as listed, newest first
    expandedMigrations: new Set(),
    decisions: [],
    expandedDecisions: new Set(),
  };

  // --- small helpers -----------------------------------------------------------------------------

  function svg(tag, attrs = {}, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (value !== null && value !== undefined) node.setAttribute(key, String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fmtNumber(value, digits = 0) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits });
  }

  function fmtRate(value) {
    if (value === null || value === undefined) return "–";
    if (value >= 1e6) return (value / 1e6).toFixed(2) + " M tok/s";
    if (value >= 1e3) return (value / 1e3).toFixed(1) + " k tok/s";
    return value.toFixed(0) + " tok/s";
  }

  function fmtPct(value, digits = 0) {
    return value === null || value === undefined ? "–" : (value * 100).toFixed(digits) + "%";
  }

  function fmtSeconds(value) {
    if (value === null || value === undefined) return "–";
    return value < 10 ? value.toFixed(2) + " s" : value.toFixed(1) + " s";
  }

  function errorText(failure) {
    const error = (failure && failure.error) || {};
    return error.message || (failure && failure.message) || String(failure);
  }

  /** The API's field problems as {path: [messages]}, whichever shape they came in. */
  function fieldProblems(failure) {
    const fields = (failure && failure.error && failure.error.fields) || [];
    const found = {};
    if (Array.isArray(fields)) {
      for (const f of fields) (found[f.path || ""] ||= []).push(f.message);
    } else {
      for (const [path, messages] of Object.entries(fields)) found[path] = [].concat(messages);
    }
    return found;
  }

  const banner = document.getElementById("job-errors");
  const bannerMessages = new Map();
  function showError(source, failure) {
    bannerMessages.set(source, source + ": " + errorText(failure));
    renderBanner();
  }
  function clearError(source) {
    if (bannerMessages.delete(source)) renderBanner();
  }
  function renderBanner() {
    banner.replaceChildren(...[...bannerMessages.values()].map((m) => el("div", {}, m)));
    banner.hidden = bannerMessages.size === 0;
  }

  /** Run ``load`` now, then at most once per ``ms`` however often it is asked for. */
  function coalesced(load, ms) {
    let timer = null, again = false, running = false;
    async function run() {
      running = true;
      try { await load(); } finally {
        running = false;
        if (again) { again = false; schedule(); }
      }
    }
    function schedule() {
      if (running) { again = true; return; }
      if (timer) return;
      timer = setTimeout(() => { timer = null; run(); }, ms);
    }
    return schedule;
  }

  /** Each failing loader reports into the banner under its own name; success clears it. */
  function guarded(name, load) {
    return async (...args) => {
      try {
        const result = await load(...args);
        clearError(name);
        return result;
      } catch (failure) {
        console.error(name, failure);
        showError(name, failure);
        return undefined;
      }
    };
  }

  function colourOf(group, kind) {
    if (!page.colours[group]) {
      const used = new Set(Object.values(page.colours));
      const base = KIND_COLOURS[kind];
      page.colours[group] = base && !used.has(base) ? base : EXTRA_COLOURS.find((c) => !used.has(c)) || "#555";
    }
    return page.colours[group];
  }

  function kindOf(group) {
    const found = page.groups.find((g) => g.name === group);
    return found ? found.kind : "";
  }

  function baseLayout(extra) {
    return Object.assign({
      margin: { l: 60, r: 20, t: 10, b: 40 },
      font: { family: "system-ui, -apple-system, Segoe UI, sans-serif", size: 12, color: "#1d2733" },
      legend: { orientation: "h", y: 1.12, x: 0 },
      paper_bgcolor: "#fff",
      plot_bgcolor: "#fff",
      hovermode: "closest",
    }, extra);
  }

  // --- header and controls -----------------------------------------------------------------------

  function renderHeader() {
    const job = page.job;
    if (!job) return;
    document.getElementById("job-name").textContent = job.name;
    document.getElementById("job-state").replaceWith(Object.assign(badge(job.state), { id: "job-state" }));
    document.getElementById("job-reason").textContent =
      job.state_reason.replaceAll("_", " ") + (job.state_detail ? ": " + job.state_detail : "");
    document.getElementById("job-policy").textContent = job.policy;
    document.getElementById("job-owner").textContent = job.owner;
    document.getElementById("job-iteration").textContent = `${job.iteration} / ${job.iterations_total}`;
    const progress = document.getElementById("job-progress");
    progress.max = Math.max(1, job.iterations_total);
    progress.value = job.iteration;
    const allocated = job.allocated_gpus ?? job.total_gpus;
    document.getElementById("job-gpus").textContent = `${allocated} held · ${job.total_gpus} asked`;
    document.getElementById("job-throughput").textContent = fmtRate(job.tokens_per_s);
    document.getElementById("job-submitted").textContent = fmtTime(job.submitted_at, true);
    renderControls();
  }

  function renderControls() {
    if (!canOperate || !page.job) return;
    const state = page.job.state;
    const pause = document.getElementById("pause-btn");
    const resume = document.getElementById("resume-btn");
    pause.hidden = state === "paused_scheduling";
    resume.hidden = state !== "paused_scheduling";
    pause.disabled = state !== "running";
    document.getElementById("cancel-btn").disabled = TERMINAL_JOB.has(state);
    const migrateOpen = state === "running" || state === "paused_scheduling";
    for (const field of document.querySelectorAll("#migrate-form select, #migrate-form input, #migrate-form button")) {
      field.disabled = !migrateOpen;
    }
    fillGroupSelect("migrate-donor", 0);
    fillGroupSelect("migrate-recipient", page.groups.length - 1);
  }

  function fillGroupSelect(id, defaultIndex) {
    const select = document.getElementById(id);
    const names = page.groups.map((g) => g.name);
    const current = [...select.options].map((o) => o.value);
    if (names.join("\n") === current.join("\n")) {
      for (const option of select.options) {
        const group = page.groups.find((g) => g.name === option.value);
        option.textContent = `${group.name} (${group.kind}, ${group.workers} workers)`;
      }
      return;
    }
    const chosen = select.value;
    select.replaceChildren(...page.groups.map((g) => el("option", { value: g.name }, `${g.name} (${g.kind}, ${g.workers} workers)`)));
    if (names.includes(chosen)) select.value = chosen;
    else if (names.length) select.value = names[Math.max(0, defaultIndex)];
  }

  function say(message) {
    const line = document.getElementById("control-message");
    if (line) line.textContent = message;
  }

  async function jobAction(verb, detail) {
    try {
      const job = await api(`jobs/${jobId}/${verb}/`, { method: "POST", body: { detail: detail || "" } });
      clearError("controls");
      applyJobDetail(job);
      say(`${verb} done at ${fmtTime(new Date().toISOString())}`);
    } catch (failure) {
      showError("controls", failure);
    }
  }

  function setupControls() {
    if (!canOperate) return;
    document.getElementById("pause-btn").addEventListener("click", () => jobAction("pause"));
    document.getElementById("resume-btn").addEventListener("click", () => jobAction("resume"));
    const dialog = document.getElementById("cancel-dialog");
    document.getElementById("cancel-btn").addEventListener("click", () => {
      document.getElementById("cancel-detail").value = "";
      dialog.showModal();
    });
    dialog.addEventListener("close", () => {
      if (dialog.returnValue === "cancel") jobAction("cancel", document.getElementById("cancel-detail").value);
    });
    const form = document.getElementById("migrate-form");
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      for (const slot of form.querySelectorAll(".field-error")) slot.textContent = "";
      const workers = form.elements.workers.value.trim();
      const body = {
        donor: form.elements.donor.value,
        recipient: form.elements.recipient.value,
        workers: /^\d+$/.test(workers) ? Number(workers) : workers,
        reason: form.elements.reason.value,
      };
      const submit = document.getElementById("migrate-submit");
      submit.disabled = true;
      try {
        const migration = await api(`jobs/${jobId}/migrate/`, { method: "POST", body });
        say(`migration ${migration.migration_id} started: ${migration.donor} → ${migration.recipient}`);
        form.elements.reason.value = "";
        upsertMigration(migration);
        refreshDecisions();
      } catch (failure) {
        const problems = fieldProblems(failure);
        let placed = false;
        for (const [path, messages] of Object.entries(problems)) {
          const slot = form.querySelector(`.field-error[data-field="${CSS.escape(path)}"]`) || form.querySelector('.field-error[data-field="job"]');
          slot.textContent = messages.join("; ");
          placed = true;
        }
        if (!placed) form.querySelector('.field-error[data-field="job"]').textContent = errorText(failure);
      } finally {
        submit.disabled = false;
        renderControls();
      }
    });
  }

  // --- job detail ------------------------------------------------------------------------------

  function applyJobDetail(job) {
    page.job = job;
    if (job.groups) {
      page.groups = job.groups.map((g) => ({ name: g.name, kind: g.kind, gpus: g.gpus, workers: g.workers.length }));
      for (const g of page.groups) colourOf(g.name, g.kind);
    }
    renderHeader();
  }

  const loadJob = guarded("job", async () => applyJobDetail(await api(`jobs/${jobId}/`)));
  const refreshJob = coalesced(loadJob, 700);

  // --- the hypergraph ------------------------------------------------------------------------------

  const loadSnapshot = guarded("hypergraph", async () => {
    try {
      page.snapshot = await api(`snapshots/latest/?job=${jobId}`);
      page.lastSnapshotId = page.snapshot.id;
    } catch (failure) {
      if (failure.status !== 404) throw failure;
      page.snapshot = null;
    }
    drawHypergraph();
  });
  const refreshSnapshot = coalesced(loadSnapshot, 500);

  /** Columns by dependency depth: sources left, the trainer usually right. */
  function layers(nodes) {
    const depth = {};
    const byId = Object.fromEntries(nodes.map((n) => [n.id, n]));
    function depthOf(id, seen = new Set()) {
      if (depth[id] !== undefined) return depth[id];
      if (seen.has(id) || !byId[id]) return 0;
      seen.add(id);
      const deps = byId[id].depends_on.filter((d) => byId[d]);
      depth[id] = deps.length ? 1 + Math.max(...deps.map((d) => depthOf(d, seen))) : 0;
      return depth[id];
    }
    nodes.forEach((n) => depthOf(n.id));
    const columns = [];
    for (const n of nodes) (columns[depth[n.id]] ||= []).push(n);
    return columns.filter(Boolean);
  }

  function groupUtilisation(node) {
    const live = page.liveGroups[node.id];
    if (live && live.utilisation_mean !== null && live.utilisation_mean !== undefined) return live.utilisation_mean;
    const signals = page.snapshot && page.snapshot.data.signals && page.snapshot.data.signals[node.id];
    if (signals) return signals.utilisation_mean;
    if (!node.workers.length) return null;
    return node.workers.reduce((sum, w) => sum + w.utilisation, 0) / node.workers.length;
  }

  function edgeProgress(edge) {
    const total = edge.items_total;
    const source = page.liveGroups[edge.source], target = page.liveGroups[edge.target];
    if (total && source && target && source.progress !== null && target.progress !== null) {
      const produced = Math.floor(total * source.progress);
      return { total, produced, consumed: Math.min(Math.floor(total * target.progress), produced) };
    }
    return { total, produced: edge.items_produced, consumed: edge.items_consumed };
  }

  function drawHypergraph() {
    const box = document.getElementById("hypergraph");
    const meta = document.getElementById("hg-meta");
    if (!page.snapshot) {
      box.replaceChildren(el("p", { class: "muted" }, "No snapshot yet: the hypergraph appears once the job is admitted."));
      meta.textContent = "";
      return;
    }
    const data = page.snapshot.data;
    meta.textContent = `snapshot #${page.snapshot.id} (${page.snapshot.cause}) at ${fmtTime(page.snapshot.taken_at)}, iteration ${data.iteration}`;
    const nodes = data.nodes;
    const gpusOf = (n) => n.workers.reduce((sum, w) => sum + w.devices.length, 0);
    const maxGpus = Math.max(1, ...nodes.map(gpusOf));
    const columns = layers(nodes);
    const width = 640, height = Math.max(260, 150 * Math.max(...columns.map((c) => c.length)));
    const position = {};
    columns.forEach((column, ci) => {
      const x = columns.length === 1 ? width / 2 : 110 + (ci * (width - 220)) / (columns.length - 1);
      column.forEach((n, ri) => {
        position[n.id] = { x, y: ((ri + 1) * height) / (column.length + 1), r: 22 + 38 * Math.sqrt(gpusOf(n) / maxGpus) };
      });
    });
    const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "hypergraph of worker groups" });
    chart.append(svg("defs", {}, svg("marker", { id: "hg-arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
      svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#5b6878" }))));
    for (const edge of data.edges) {
      const a = position[edge.source], b = position[edge.target];
      if (!a || !b) continue;
      const dx = b.x - a.x, dy = b.y - a.y, length = Math.hypot(dx, dy) || 1;
      const x1 = a.x + (dx / length) * a.r, y1 = a.y + (dy / length) * a.r;
      const x2 = b.x - (dx / length) * (b.r + 4), y2 = b.y - (dy / length) * (b.r + 4);
      const flow = edgeProgress(edge);
      const fraction = flow.total ? flow.consumed / flow.total : 0;
      const produced = flow.total ? flow.produced / flow.total : 0;
      const group = svg("g", { class: "hg-edge", "data-edge": edge.id });
      group.append(
        svg("line", { x1, y1, x2, y2, stroke: "#d9dee5", "stroke-width": 10, "stroke-linecap": "round" }),
        svg("line", { x1, y1, x2: x1 + (x2 - x1) * produced, y2: y1 + (y2 - y1) * produced, stroke: "#a9c6f0", "stroke-width": 10, "stroke-linecap": "round" }),
        svg("line", { x1, y1, x2: x1 + (x2 - x1) * fraction, y2: y1 + (y2 - y1) * fraction, stroke: "#1f5fbf", "stroke-width": 10, "stroke-linecap": "round" }),
        svg("line", { x1, y1, x2, y2, stroke: "#5b6878", "stroke-width": 1.2, "marker-end": "url(#hg-arrow)" }),
      );
      const mx = (x1 + x2) / 2, my = (y1 + y2) / 2 - 16;
      group.append(
        svg("text", { x: mx, y: my, "text-anchor": "middle", class: "hg-edge-label" },
          flow.total ? `${fmtNumber(flow.consumed)} / ${fmtNumber(flow.total)} consumed (${fmtPct(fraction)})` : "no items yet"),
        svg("text", { x: mx, y: my + 36, "text-anchor": "middle", class: "hg-edge-sub" },
          flow.total ? `${fmtNumber(flow.produced)} produced` : ""),
        svg("title", {}, `${edge.source} → ${edge.target}: ${flow.produced} produced, ${flow.consumed} consumed of ${flow.total}`),
      );
      chart.append(group);
    }
    for (const node of nodes) {
      const p = position[node.id];
      const util = groupUtilisation(node);
      const colour = colourOf(node.id, node.kind);
      const gpus = gpusOf(node);
      const group = svg("g", { class: "hg-node", "data-group": node.id });
      group.append(
        svg("circle", { cx: p.x, cy: p.y, r: p.r, fill: colour, "fill-opacity": 0.16, stroke: colour, "stroke-width": 2.5 }),
        // The filled arc shows utilisation at a glance.
        svg("circle", {
          cx: p.x, cy: p.y, r: p.r - 5, fill: "none", stroke: colour, "stroke-width": 5, "stroke-opacity": 0.75,
          "stroke-dasharray": `${2 * Math.PI * (p.r - 5) * (util || 0)} ${2 * Math.PI * (p.r - 5)}`,
          transform: `rotate(-90 ${p.x} ${p.y})`,
        }),
        svg("text", { x: p.x, y: p.y - 4, "text-anchor": "middle", class: "hg-name" }, node.id),
        svg("text", { x: p.x, y: p.y + 12, "text-anchor": "middle", class: "hg-sub" }, `${gpus} GPU${gpus === 1 ? "" : "s"}`),
        svg("text", { x: p.x, y: p.y + p.r + 16, "text-anchor": "middle", class: "hg-caption" },
          `${node.kind} · ${node.workers.length} worker${node.workers.length === 1 ? "" : "s"} · util ${fmtPct(util)}`),
        svg("title", {}, `${node.id} (${node.kind}, ${node.scaling}, ${node.interruptibility}): ${node.workers.length} workers on ${gpus} GPUs, utilisation ${fmtPct(util, 1)}`),
      );
      chart.append(group);
    }
    box.replaceChildren(chart);
  }

  // --- GPU ownership timeline ------------------------------------------------------------------

  const loadTimeline = guarded("timeline", async () => {
    page.timeline = await api(`jobs/${jobId}/timeline/`);
    drawTimeline(page.timeline);
  });
  const refreshTimeline = coalesced(loadTimeline, 1500);
  /** Between fetches, the bars of GPUs still held grow with the clock. */
  const extendTimeline = coalesced(async () => {
    if (!page.timeline || !page.job || TERMINAL_JOB.has(page.job.state)) return;
    page.timeline.end = new Date().toISOString();
    drawTimeline(page.timeline);
  }, 5000);

  function drawTimeline(timeline) {
    const box = document.getElementById("gantt");
    if (!timeline.segments.length) {
      Plotly.purge(box);
      box.replaceChildren(el("p", { class: "muted" }, "No GPU held yet."));
      return;
    }
    if (box.firstElementChild && box.firstElementChild.tagName === "P") box.replaceChildren();
    const rows = timeline.devices.map((d) => d.uid);
    const byGroup = new Map();
    for (const s of timeline.segments) {
      if (!byGroup.has(s.group)) byGroup.set(s.group, { kind: s.kind, y: [], base: [], x: [], text: [], opacity: [] });
      const trace = byGroup.get(s.group);
      const end = s.end || timeline.end;
      trace.y.push(s.device);
      trace.base.push(s.start);
      trace.x.push(Math.max(1000, new Date(end) - new Date(s.start)));
      trace.text.push(`${s.worker}${s.colocated ? " (colocated)" : ""}<br>${fmtTime(s.start)} → ${s.end ? fmtTime(s.end) : "now"}`);
    }
    const traces = [...byGroup.entries()].map(([group, t]) => ({
      type: "bar", orientation: "h", name: `${group} (${t.kind})`, y: t.y, base: t.base, x: t.x, text: t.text,
      marker: { color: colourOf(group, t.kind), line: { color: "#fff", width: 1 } },
      textposition: "none", hovertemplate: "%{y}<br>%{text}<extra>" + group + "</extra>",
    }));
    const shapes = [];
    const marks = { committed: { x: [], y: [], text: [] }, other: { x: [], y: [], text: [] }, open: { x: [], y: [], text: [] } };
    for (const m of timeline.migrations) {
      const at = m.finished_at || m.started_at || m.created_at;
      const kind = m.state === "committed" ? "committed" : OPEN_MIGRATION.has(m.state) ? "open" : "other";
      for (const uid of m.device_uids) {
        marks[kind].x.push(at);
        marks[kind].y.push(uid);
        marks[kind].text.push(`${m.migration_id} ${m.state}: ${m.donor} → ${m.recipient} (${m.strategy})`);
      }
      if (kind === "committed") {
        shapes.push({ type: "line", xref: "x", yref: "paper", x0: at, x1: at, y0: 0, y1: 1, line: { color: "#5b6878", width: 1, dash: "dot" } });
      }
    }
    const markerStyle = {
      committed: { name: "migration committed", marker: { symbol: "diamond", size: 9, color: "#16202c" } },
      other: { name: "migration rolled back / failed", marker: { symbol: "x", size: 9, color: "#c0262d" } },
      open: { name: "migration in flight", marker: { symbol: "circle-open", size: 10, color: "#9a6700", line: { width: 2 } } },
    };
    for (const [kind, points] of Object.entries(marks)) {
      if (!points.x.length) continue;
      traces.push(Object.assign({ type: "scatter", mode: "markers", x: points.x, y: points.y, text: points.text, hovertemplate: "%{text}<extra></extra>" }, markerStyle[kind]));
    }
    const height = Math.min(1400, 90 + 18 * rows.length);
    Plotly.react(box, traces, baseLayout({
      barmode: "overlay", height, shapes,
      margin: { l: 130, r: 20, t: 34, b: 40 },
      xaxis: { type: "date", range: [timeline.start, timeline.end], showgrid: true, gridcolor: "#eef1f4" },
      yaxis: { type: "category", categoryorder: "array", categoryarray: rows, autorange: "reversed", automargin: true, tickfont: { size: 11 } },
      legend: { orientation: "h", y: 1, yanchor: "bottom", x: 0 },
      bargap: 0.25,
    }), PLOT_CONFIG);
  }

  // --- utilisation and throughput per group -------------------------------------------------------

  function telemetryTraces(groups, field, scale) {
    return groups.map((g) => ({
      type: "scatter", mode: "lines", name: `${g.group} (${g.kind})`, line: { color: colourOf(g.group, g.kind), width: 2, shape: "linear" },
      x: g.points.map((p) => p.at), y: g.points.map((p) => p[field] * scale),
    }));
  }

  const loadTelemetry = guarded("telemetry", async () => {
    const body = await api(`jobs/${jobId}/telemetry/`);
    page.telemetryTraces = body.groups.map((g) => g.group);
    page.telemetryUntil = body.until;
    Plotly.react("util-chart", telemetryTraces(body.groups, "utilisation_mean", 100), baseLayout({
      height: 300, yaxis: { title: { text: "utilisation %" }, range: [0, 105], gridcolor: "#eef1f4" }, xaxis: { type: "date", gridcolor: "#eef1f4" },
    }), PLOT_CONFIG);
    Plotly.react("throughput-chart", telemetryTraces(body.groups, "tokens_per_s", 1), baseLayout({
      height: 300, yaxis: { title: { text: "tokens/s" }, rangemode: "tozero", gridcolor: "#eef1f4" }, xaxis: { type: "date", gridcolor: "#eef1f4" },
    }), PLOT_CONFIG);
  });

  /** Points newer than the last load, after a reconnect: the buckets since then are appended. */
  const catchUpTelemetry = guarded("telemetry", async () => {
    if (!page.telemetryUntil) return loadTelemetry();
    const body = await api(`jobs/${jobId}/telemetry/?since=${encodeURIComponent(page.telemetryUntil)}`);
    page.telemetryUntil = body.until;
    for (const g of body.groups) {
      for (const p of g.points) appendTelemetry(g.group, g.kind, p.at, p.utilisation_mean, p.tokens_per_s);
    }
  });

  function appendTelemetry(group, kind, at, utilisation, tokensPerS) {
    let index = page.telemetryTraces.indexOf(group);
    if (index < 0) {
      page.telemetryTraces.push(group);
      index = page.telemetryTraces.length - 1;
      const trace = () => ({ type: "scatter", mode: "lines", name: `${group} (${kind})`, line: { color: colourOf(group, kind), width: 2 }, x: [], y: [] });
      Plotly.addTraces("util-chart", trace());
      Plotly.addTraces("throughput-chart", trace());
    }
    if (utilisation !== null && utilisation !== undefined) {
      Plotly.extendTraces("util-chart", { x: [[at]], y: [[utilisation * 100]] }, [index], LIVE_POINTS);
    }
    if (tokensPerS !== null && tokensPerS !== undefined) {
      Plotly.extendTraces("throughput-chart", { x: [[at]], y: [[tokensPerS]] }, [index], LIVE_POINTS);
    }
  }

  function onTelemetry(data) {
    if (data.scope !== "job" || !page.job) return;
    const iterationBefore = page.job.iteration;
    page.job.iteration = data.iteration ?? page.job.iteration;
    if (page.job.iteration !== iterationBefore) refreshResults();
    page.job.tokens_per_s = data.tokens_per_s ?? page.job.tokens_per_s;
    renderHeader();
    // A roll-up older than what the charts hold (queued while the page loaded) is not plotted.
    const newer = !page.telemetryUntil || Date.parse(data.computed_at) > Date.parse(page.telemetryUntil);
    const charted = Boolean(document.getElementById("util-chart").data);
    for (const [group, values] of Object.entries(data.groups || {})) {
      page.liveGroups[group] = values;
      if (newer && charted) {
        appendTelemetry(group, values.kind, data.computed_at, values.utilisation_mean, values.tokens_per_s);
      }
    }
    if (newer) page.telemetryUntil = data.computed_at;
    if (page.snapshot) drawHypergraph();
    extendTimeline();
  }

  // --- predictor ---------------------------------------------------------------------------------

  const loadPredictor = guarded("predictor", async () => {
    const [samples, summary] = await Promise.all([
      apiAll(`predictor-samples/?job=${jobId}&page_size=200`, 5),
      api(`predictor-samples/summary/?job=${jobId}`),
    ]);
    const box = document.getElementById("predictor-chart");
    const tbody = document.querySelector("#predictor-summary tbody");
    tbody.replaceChildren(...summary.map((row) => el("tr", {},
      el("td", {}, row.component || "whole job"), el("td", {}, row.scope), el("td", { class: "num" }, row.count),
      el("td", { class: "num" }, row.mape === null ? "–" : row.mape.toFixed(1) + "%"),
      el("td", { class: "num" }, row.max_abs_pct_error === null ? "–" : row.max_abs_pct_error.toFixed(1) + "%"),
      el("td", { class: "num" }, fmtNumber(row.mean_abs_error)))));
    if (!summary.length) tbody.append(el("tr", {}, el("td", { colspan: 6, class: "muted" }, "No settled migration yet: each committed migration is checked once its new allocation settles.")));
    if (!samples.length) {
      Plotly.purge(box);
      box.classList.add("empty");
      box.replaceChildren();
      return;
    }
    box.classList.remove("empty");
    const scopes = ["job", "recipient", "donor"];
    const colours = { job: "#16202c", recipient: "#d62728", donor: "#1f77b4" };
    const traces = scopes.map((scope) => {
      const rows = samples.filter((s) => s.scope === scope);
      return {
        type: "scatter", mode: "markers", name: scope === "job" ? "whole job" : scope,
        x: rows.map((s) => s.observed), y: rows.map((s) => s.predicted),
        text: rows.map((s) => `${s.migration} ${s.group || "job"}: error ${s.abs_pct_error === null ? "–" : s.abs_pct_error.toFixed(1) + "%"}`),
        marker: { color: colours[scope], size: 9, opacity: 0.8 },
        hovertemplate: "%{text}<br>observed %{x:,.0f} tok/s<br>predicted %{y:,.0f} tok/s<extra></extra>",
      };
    }).filter((t) => t.x.length);
    const values = samples.flatMap((s) => [s.observed, s.predicted]);
    const top = values.length ? Math.max(...values) * 1.08 : 1;
    traces.unshift({ type: "scatter", mode: "lines", name: "perfect prediction", x: [0, top], y: [0, top], line: { color: "#b0b8c3", dash: "dash", width: 1 }, hoverinfo: "skip" });
    Plotly.react(box, traces, baseLayout({
      height: 250, margin: { l: 70, r: 20, t: 10, b: 45 },
      xaxis: { title: { text: "observed tokens/s" }, range: [0, top], gridcolor: "#eef1f4" },
      yaxis: { title: { text: "predicted tokens/s" }, range: [0, top], gridcolor: "#eef1f4" },
    }), PLOT_CONFIG);
  });
  const refreshPredictor = coalesced(loadPredictor, 3000);

  // --- training (a real job on the ray backend) ---------------------------------------------------

  const loadResults = guarded("training", async () => {
    const rewardBox = document.getElementById("reward-chart");
    const rolloutBox = document.getElementById("rollout-chart");
    if (!rewardBox || !rolloutBox) return;
    const results = await api(`jobs/${jobId}/iterations/`);
    page.resultsSeen = results.length;
    const meta = document.getElementById("training-meta");
    if (!results.length) {
      meta.textContent = "no iteration trained yet";
      return;
    }
    const x = results.map((r) => r.iteration);
    const m = results.map((r) => r.metrics);
    const last = m[m.length - 1];
    meta.textContent = `iteration ${last.iteration}: reward ${last.mean_reward.toFixed(3)}, accuracy ${fmtPct(last.accuracy)}, weights v${last.weight_version} on every engine`;
    // An agentic job's turns: tool calls, and how much of each turn's context the engines'
    // prefix caches gave back (the DataRouter's affinity at work) against what was prefilled again.
    const agentic = last.agentic;
    if (agentic) {
      meta.textContent += `; ${agentic.tool_calls} tool calls in ${agentic.turns} turns, ${fmtPct(agentic.cached_tokens / Math.max(agentic.prompt_tokens, 1))} of the context from the prefix caches, ${agentic.reprefilled_tokens} tokens prefilled again (${agentic.router_mode} order)`;
    }
    Plotly.react(rewardBox, [
      { type: "scatter", mode: "lines+markers", name: "mean reward", x, y: results.map((r) => r.mean_reward), line: { color: "#d62728" } },
      { type: "scatter", mode: "lines", name: "accuracy", x, y: m.map((r) => r.accuracy), line: { color: "#1f77b4", dash: "dot" } },
    ], baseLayout({
      height: 250, margin: { l: 55, r: 20, t: 10, b: 45 },
      xaxis: { title: { text: "iteration" }, gridcolor: "#eef1f4", dtick: 1 },
      yaxis: { title: { text: "reward" }, range: [0, 1], gridcolor: "#eef1f4" },
    }), PLOT_CONFIG);
    Plotly.react(rolloutBox, [
      { type: "bar", name: "generated tokens/s", x, y: m.map((r) => r.tokens_generated / Math.max(r.seconds.generate, 1e-6)), marker: { color: "#9aa5b1" } },
      { type: "scatter", mode: "lines+markers", name: "response p50", x, y: m.map((r) => r.response_length.p50), yaxis: "y2", line: { color: "#2ca02c" } },
      { type: "scatter", mode: "lines+markers", name: "response max", x, y: m.map((r) => r.response_length.max), yaxis: "y2", line: { color: "#ff7f0e" } },
    ], baseLayout({
      height: 250, margin: { l: 60, r: 60, t: 10, b: 45 },
      xaxis: { title: { text: "iteration" }, gridcolor: "#eef1f4", dtick: 1 },
      yaxis: { title: { text: "tokens/s" }, gridcolor: "#eef1f4" },
      yaxis2: { title: { text: "response tokens" }, overlaying: "y", side: "right", rangemode: "tozero" },
    }), PLOT_CONFIG);
  });
  const refreshResults = coalesced(loadResults, 1000);

  // --- decisions ---------------------------------------------------------------------------------

  const loadDecisions = guarded("decisions", async () => {
    const body = await api(`decisions/?job=${jobId}&page_size=50`);
    const known = new Set(page.decisions.map((d) => d.id));
    const fresh = page.decisions.length ? new Set(body.results.filter((d) => !known.has(d.id)).map((d) => d.id)) : new Set();
    page.decisions = body.results;
    page.lastDecisionId = body.results.length ? body.results[0].id : null;
    document.getElementById("decision-count").textContent = body.count > body.results.length ? `latest ${body.results.length} of ${body.count}` : `${body.count}`;
    renderDecisions(fresh);
  });
  const refreshDecisions = coalesced(loadDecisions, 500);

  // The scheduler's latest tick, and why it moved nothing when it did not. Ticks come every
  // second or so and are not pushed over the socket: the page asks while it is shown.
  const LAST_TICK_EVERY_MS = 5000;
  const loadLastTick = guarded("last tick", async () => {
    const body = await api(`ticks/?job=${jobId}&page_size=1`);
    const tick = body.results[0];
    document.getElementById("last-tick").textContent = tick
      ? `Last tick ${fmtTime(tick.started_at)}: ${tick.outcome.replaceAll("_", " ")}` + (tick.note ? ` — ${tick.note}` : "")
      : "No tick yet.";
  });
  function pollLastTick() {
    setTimeout(async () => {
      if (!document.hidden) await loadLastTick();
      pollLastTick();
    }, LAST_TICK_EVERY_MS);
  }

  function renderDecisions(fresh = new Set()) {
    const tbody = document.querySelector("#decision-log tbody");
    const rows = [];
    for (const d of page.decisions) {
      const open = page.expandedDecisions.has(d.id);
      const toggle = () => {
        if (page.expandedDecisions.has(d.id)) page.expandedDecisions.delete(d.id);
        else page.expandedDecisions.add(d.id);
        renderDecisions();
      };
      rows.push(el("tr", { class: "expandable decision" + (fresh.has(d.id) ? " fresh" : ""), "data-decision-id": d.id, onclick: toggle, "aria-expanded": open ? "true" : "false" },
        el("td", { class: "toggle" }, open ? "▾" : "▸"),
        el("td", { class: "nowrap" }, fmtTime(d.at)),
        el("td", {}, d.policy),
        el("td", {}, el("code", {}, d.reason)),
        el("td", { class: "nowrap" }, d.donor || d.recipient ? `${d.donor || "free GPUs"} → ${d.recipient || "free"}` : "–"),
        el("td", { class: "num" }, d.device_uids.length || "–"),
        el("td", { class: "detail" }, d.detail),
        el("td", {}, d.requested_by),
        el("td", {}, d.migration || "–")));
      if (open) rows.push(el("tr", { class: "expansion" }, el("td", {}), el("td", { colspan: 8 }, decisionDetail(d))));
    }
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 9, class: "muted" }, "No decision yet.")));
    tbody.replaceChildren(...rows);
  }

  function decisionDetail(d) {
    const parts = [];
    const candidates = d.candidates || [];
    const chosenKey = d.chosen && d.chosen.chosen ? JSON.stringify(d.chosen.chosen.device_ids) : null;
    if (candidates.length) {
      parts.push(el("h3", {}, `Candidates weighed (${candidates.length})`));
      parts.push(el("table", { class: "compact candidates" },
        el("thead", {}, el("tr", {}, ...["#", "Donor → recipient", "GPUs", "Score", "Job tok/s before → after", "Donor after", "Recipient after", "Cost", "Verdict"].map((h) => el("th", {}, h)))),
        el("tbody", {}, ...candidates.map((c, i) => {
          const p = c.prediction || {};
          const gain = p.job_before ? (p.job_after / p.job_before - 1) * 100 : null;
          const chosen = !c.rejected_because && (chosenKey === null || JSON.stringify(c.device_ids) === chosenKey);
          return el("tr", { class: chosen ? "chosen" : "" },
            el("td", {}, i + 1),
            el("td", {}, `${c.donor || "–"} → ${c.recipient || "–"}`),
            el("td", { class: "num" }, (c.device_ids || []).length),
            el("td", { class: "num" }, fmtNumber(c.score, 2)),
            el("td", { class: "num" }, `${fmtNumber(p.job_before)} → ${fmtNumber(p.job_after)}` + (gain === null ? "" : ` (${gain >= 0 ? "+" : ""}${gain.toFixed(0)}%)`)),
            el("td", { class: "num" }, `${fmtNumber(p.donor_before)} → ${fmtNumber(p.donor_after)}`),
            el("td", { class: "num" }, `${fmtNumber(p.recipient_before)} → ${fmtNumber(p.recipient_after)}`),
            el("td", { class: "num" }, fmtSeconds(c.migration_cost_s)),
            el("td", {}, chosen ? el("strong", {}, "chosen") : c.rejected_because || ""));
        }))));
    } else if (d.reason === "operator_request") {
      parts.push(el("p", {}, `Asked for by ${d.requested_by}: ${d.detail}. An operator's request is carried out as asked; no alternatives were weighed.`));
    } else {
      parts.push(el("p", {}, `${d.detail || d.reason}. No alternatives were weighed.`));
    }
    const inputs = Object.entries(d.inputs || {}).filter(([, v]) => v && typeof v === "object");
    if (inputs.length) {
      parts.push(el("h3", {}, "Signals the policy read"));
      parts.push(el("table", { class: "compact" },
        el("thead", {}, el("tr", {}, ...["Group", "Workers", "Util mean", "p90", "Under U_low", "Queue", "In flight", "tok/s", "Progress", "Busy"].map((h) => el("th", {}, h)))),
        el("tbody", {}, ...inputs.map(([group, s]) => el("tr", {},
          el("td", {}, group), el("td", { class: "num" }, s.workers ?? "–"), el("td", { class: "num" }, fmtPct(s.utilisation_mean)),
          el("td", { class: "num" }, fmtPct(s.utilisation_p90)), el("td", { class: "num" }, fmtPct(s.low_utilisation_fraction)),
          el("td", { class: "num" }, fmtNumber(s.queue_length)), el("td", { class: "num" }, fmtNumber(s.in_flight)),
          el("td", { class: "num" }, fmtNumber(s.tokens_per_s)), el("td", { class: "num" }, fmtPct(s.progress)),
          el("td", {}, s.busy === undefined ? "–" : s.busy ? "yes" : "no"))))));
    }
    if (d.device_uids.length) parts.push(el("p", { class: "muted small" }, "GPUs: " + d.device_uids.join(", ")));
    return el("div", { class: "decision-detail" }, ...parts);
  }

  // --- migrations --------------------------------------------------------------------------------

  function migrationQuery() {
    const strategy = document.getElementById("migration-strategy").value;
    const state = document.getElementById("migration-state").value;
    return `migrations/?job=${jobId}&page_size=50` + (strategy ? `&strategy=${encodeURIComponent(strategy)}` : "") + (state ? `&state=${encodeURIComponent(state)}` : "");
  }

  function matchesFilters(m) {
    const strategy = document.getElementById("migration-strategy").value;
    const state = document.getElementById("migration-state").value;
    return (!strategy || m.strategy.split("+").includes(strategy) || m.strategy === strategy) && (!state || m.state === state);
  }

  const loadMigrations = guarded("migrations", async () => {
    const body = await api(migrationQuery());
    page.migrations = body.results;
    document.getElementById("migration-count").textContent = body.count > body.results.length ? `latest ${body.results.length} of ${body.count}` : `${body.count}`;
    renderMigrations();
  });
  const refreshMigrations = coalesced(loadMigrations, 500);

  /** Put a migration (as the API answers it) in its row, in place, or at the top when new. */
  function upsertMigration(m) {
    const index = page.migrations.findIndex((x) => x.id === m.id);
    if (!matchesFilters(m)) {
      if (index >= 0) page.migrations.splice(index, 1);
    } else if (index >= 0) {
      page.migrations[index] = m;
    } else {
      page.migrations.unshift(m);
    }
    renderMigrations(new Set([m.id]));
  }

  const migrationLoads = new Map();
  /** Fetch one migration again (coalesced per migration), e.g. after each of its step events. */
  function refreshMigration(pk) {
    if (!migrationLoads.has(pk)) {
      migrationLoads.set(pk, coalesced(guarded("migrations", async () => upsertMigration(await api(`migrations/${pk}/`))), 300));
    }
    migrationLoads.get(pk)();
  }

  function renderMigrations(touched = new Set()) {
    const tbody = document.querySelector("#migration-log tbody");
    const rows = [];
    for (const m of page.migrations) {
      const open = page.expandedMigrations.has(m.id);
      const toggle = () => {
        if (page.expandedMigrations.has(m.id)) page.expandedMigrations.delete(m.id);
        else page.expandedMigrations.add(m.id);
        renderMigrations();
      };
      rows.push(el("tr", { class: "expandable migration" + (touched.has(m.id) ? " fresh" : ""), "data-migration-id": m.migration_id, "data-state": m.state, onclick: toggle, "aria-expanded": open ? "true" : "false" },
        el("td", { class: "toggle" }, open ? "▾" : "▸"),
        el("td", { class: "nowrap" }, fmtTime(m.created_at)),
        el("td", {}, el("code", {}, m.migration_id)),
        el("td", {}, m.strategy),
        el("td", { class: "nowrap" }, `${m.donor || "free GPUs"} → ${m.recipient || "free"}`),
        el("td", { class: "num" }, m.device_uids.length),
        el("td", { class: "migration-state" }, badge(m.state)),
        el("td", { class: "num" }, fmtSeconds(m.duration_s)),
        el("td", {}, m.requested_by),
        el("td", { class: "error-text" }, m.error)));
      if (open) rows.push(el("tr", { class: "expansion" }, el("td", {}), el("td", { colspan: 9 }, migrationDetail(m))));
    }
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 10, class: "muted" }, "No migration matches.")));
    tbody.replaceChildren(...rows);
  }

  function migrationDetail(m) {
    const parts = [];
    if (m.error && (m.state === "rolled_back" || m.state === "failed" || m.state === "rolling_back")) {
      parts.push(el("p", { class: "rollback-reason" }, `${m.state === "failed" ? "Failed" : "Rolled back"}: ${m.error}`));
    }
    parts.push(el("p", { class: "muted small" },
      `estimated ${fmtSeconds(m.estimated_s)}, took ${fmtSeconds(m.duration_s)} · started ${fmtTime(m.started_at) || "–"} · finished ${fmtTime(m.finished_at) || "–"} · GPUs ${m.device_uids.join(", ")}`));
    parts.push(el("table", { class: "compact steps" },
      el("thead", {}, el("tr", {}, ...["#", "Step", "Group", "Nodes", "State", "Attempts", "Estimated", "Duration", "Notes", "Error"].map((h) => el("th", {}, h)))),
      el("tbody", {}, ...m.steps.map((s) => el("tr", { class: "step" + (s.is_rollback ? " rollback" : ""), "data-step-id": s.step_id },
        el("td", { class: "num" }, s.index),
        el("td", {}, el("code", {}, s.kind)),
        el("td", {}, s.group),
        el("td", {}, (s.nodes || []).join(", ")),
        el("td", {}, badge(s.state)),
        el("td", { class: "num step-attempts" }, s.attempts),
        el("td", { class: "num" }, fmtSeconds(s.estimated_s)),
        el("td", { class: "num step-duration" }, fmtSeconds(s.duration_s)),
        el("td", { class: "small" }, [s.is_rollback ? "rollback" : "", s.point_of_no_return ? "point of no return" : ""].filter(Boolean).join(", ")),
        el("td", { class: "error-text" }, s.error))))));
    return el("div", { class: "migration-detail" }, ...parts);
  }

  function onMigration(data) {
    // A migration this page has not seen comes with a decision (the scheduler's or an operator's).
    if (!page.migrations.some((m) => m.id === data.id)) refreshDecisions();
    refreshMigration(data.id);
    if (!OPEN_MIGRATION.has(data.state)) {
      refreshTimeline();
      refreshJob();
      refreshPredictor();
    } else {
      refreshTimeline();
    }
  }

  function onMigrationStep(data) {
    const row = page.migrations.find((m) => m.migration_id === data.migration);
    if (row) {
      refreshMigration(row.id);
    } else {
      refreshMigrations();
    }
  }

  // --- live events ---------------------------------------------------------------------------------

  function onHello(data) {
    const first = !page.helloSeen;
    page.helloSeen = true;
    if (page.job) {
      Object.assign(page.job, data.job);
      renderHeader();
    }
    if (first) return;
    // A reconnect: whatever may have changed while the socket was down is fetched again.
    refreshJob();
    if (data.latest_snapshot_id !== page.lastSnapshotId) refreshSnapshot();
    if (data.last_decision_id !== page.lastDecisionId) refreshDecisions();
    refreshMigrations();
    refreshTimeline();
    catchUpTelemetry();
    refreshPredictor();
    refreshResults();
  }

  function onFrame(frame) {
    switch (frame.type) {
      case "hello": return onHello(frame.data);
      case "job.state":
        if (page.job) {
          Object.assign(page.job, { state: frame.data.state, state_reason: frame.data.reason, state_detail: frame.data.detail });
          renderHeader();
        }
        refreshJob();
        if (TERMINAL_JOB.has(frame.data.state)) {
          refreshTimeline();
          refreshResults();
        }
        return undefined;
      case "snapshot":
        if (frame.data.id !== page.lastSnapshotId) refreshSnapshot();
        return undefined;
      case "decision": return refreshDecisions();
      case "migration": return onMigration(frame.data);
      case "migration.step": return onMigrationStep(frame.data);
      case "placement_change": return refreshTimeline();
      case "telemetry": return onTelemetry(frame.data);
      default: return undefined;
    }
  }

  function onStatus(connected) {
    const live = document.getElementById("live");
    live.className = "live " + (connected ? "connected" : "disconnected");
    live.textContent = connected ? "live" : "reconnecting…";
  }

  // --- start ---------------------------------------------------------------------------------------

  async function start() {
    document.getElementById("job-submitted").textContent = fmtTime(document.getElementById("job-submitted").dataset.time, true);
    setupControls();
    for (const id of ["migration-strategy", "migration-state"]) {
      document.getElementById(id).addEventListener("change", () => loadMigrations());
    }
    // Subscribe first and read after the first hello, so no event falls between the two; events
    // that arrive while the page loads are handled once it has.
    let loaded = false;
    const early = [];
    let helloArrived;
    const firstHello = new Promise((resolve) => { helloArrived = resolve; });
    socket(`/ws/jobs/${jobId}/`, (frame) => {
      if (frame.type === "hello") helloArrived();
      if (loaded) onFrame(frame);
      else early.push(frame);
    }, onStatus);
    await Promise.race([firstHello, new Promise((resolve) => setTimeout(resolve, 5000))]);
    await loadJob();
    await Promise.all([loadSnapshot(), loadTimeline(), loadTelemetry(), loadPredictor(), loadDecisions(), loadLastTick(), loadMigrations(), loadResults()]);
    pollLastTick();
    loaded = true;
    for (const frame of early.splice(0)) onFrame(frame);
    root.dataset.ready = "true";
  }

  start();
})();
