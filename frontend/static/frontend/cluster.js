/* Cluster overview: headline totals, a node × GPU map coloured by the owning job and component,
 * and GPUs by job and component. Data from /api/v1/cluster/, /nodes/ and /devices/; re-fetched
 * (debounced) when /ws/cluster/ reports a job, migration, alert or telemetry event. */
(function () {
  "use strict";
  const { api, apiAll, fmtTime, fmtAge, socket, el, badge } = window.dynarl;

  const HUES = [212, 28, 135, 280, 352, 45, 180, 318, 95, 250];
  const SHADES = [[44, "#fff"], [66, "#1d2733"], [32, "#fff"], [78, "#1d2733"], [55, "#fff"]];
  const REFRESH_DEBOUNCE_MS = 800;
  const REFRESH_EVENTS = new Set(["hello", "job.state", "migration", "alert", "telemetry"]);

  let latest = null;  // {summary, nodes, devices, at}

  /** Stable colours: one hue per job (by id), one shade per component within the job. */
  function palette(summary, devices) {
    const jobs = new Map();
    for (const job of summary.gpus.by_job) jobs.set(job.job, { name: job.name, groups: job.components.map((c) => c.group) });
    for (const d of devices) {
      if (d.job === null) continue;
      if (!jobs.has(d.job)) jobs.set(d.job, { name: d.job_name, groups: [] });
      if (!jobs.get(d.job).groups.includes(d.group)) jobs.get(d.job).groups.push(d.group);
    }
    const colours = new Map();
    const entries = [];
    [...jobs.keys()].sort((a, b) => a - b).forEach((jobId, j) => {
      const job = jobs.get(jobId);
      [...job.groups].sort().forEach((group, g) => {
        const [lightness, text] = SHADES[g % SHADES.length];
        const colour = { bg: `hsl(${HUES[j % HUES.length]} 62% ${lightness}%)`, fg: text };
        colours.set(jobId + "/" + group, colour);
        entries.push({ jobId, jobName: job.name, group, colour });
      });
    });
    return { colour: (jobId, group) => colours.get(jobId + "/" + group), entries };
  }

  function pct(value) { return Math.round((value || 0) * 100); }

  function showError(error) {
    const banner = document.getElementById("error");
    if (!error) { banner.classList.add("hidden"); banner.textContent = ""; return; }
    const detail = error.error || {};
    banner.textContent = `Could not load the cluster (${error.status || "network"}): ${detail.message || error.message || error}`;
    banner.classList.remove("hidden");
  }

  function renderStats(summary) {
    const gpus = summary.gpus, nodes = summary.nodes.by_status, jobs = summary.jobs.by_state;
    const stat = (label, value, sub, id, alerting) =>
      el("div", { class: "stat" + (alerting ? " alerting" : ""), id },
        el("div", { class: "value" }, value), el("div", { class: "label" }, label), sub ? el("div", { class: "sub" }, sub) : null);
    document.getElementById("stats").replaceChildren(
      stat("GPUs", gpus.total, `${gpus.by_status.allocated} allocated · ${gpus.by_status.free} free`, "stat-gpus"),
      stat("GPUs lost", gpus.by_status.lost, null, "stat-gpus-lost", gpus.by_status.lost > 0),
      stat("Nodes", summary.nodes.total, `${nodes.ready} ready · ${nodes.drained} drained`, "stat-nodes"),
      stat("Nodes lost", nodes.lost, null, "stat-nodes-lost", nodes.lost > 0),
      stat("Jobs running", jobs.running + jobs.paused_scheduling, `${summary.jobs.total} in all`, "stat-running"),
      stat("Queue", summary.jobs.queue_length, "pending admission", "stat-queue"),
      stat("Migrations", summary.migrations_in_flight, "in flight", "stat-migrations"),
      stat("Open alerts", summary.open_alerts, null, "stat-alerts", summary.open_alerts > 0),
    );
  }

  function gpuCell(device, colours) {
    const owned = device.job !== null;
    const lost = device.status === "lost" || device.node_status === "lost";
    const hover = [
      `${device.uid} (${device.hardware}, ${device.memory_gb} GB)`,
      `status: ${device.status}`,
      owned ? `job #${device.job} ${device.job_name}` : null,
      owned ? `component: ${device.group}${device.group_kind && device.group_kind !== device.group ? " (" + device.group_kind + ")" : ""}` : null,
      device.worker_name ? `worker: ${device.worker_name}` : null,
      device.shared_with && device.shared_with.length ? `shared with: ${device.shared_with.join(", ")}` : null,
      `utilisation: ${pct(device.utilisation)}%`,
      `memory used: ${Number(device.memory_used_gb || 0).toFixed(1)} GB`,
      device.reported_at ? `reported ${fmtAge(device.reported_at)} ago (${fmtTime(device.reported_at)})` : "no report yet",
    ].filter(Boolean).join("\n");
    const colour = owned ? colours.colour(device.job, device.group) : null;
    const classes = ["gpu", lost ? "lost" : owned ? "owned" : "free"];
    if (device.shared_with && device.shared_with.length) classes.push("shared");
    const cell = el("div", {
      class: classes.join(" "), title: hover, role: "img", "aria-label": hover,
      dataset: { uid: device.uid, job: owned ? String(device.job) : "", group: device.group || "", status: device.status },
      style: colour ? `background:${colour.bg};color:${colour.fg}` : null,
    },
      el("span", { class: "idx" }, "gpu" + device.index),
      owned || device.utilisation > 0 ? el("span", { class: "util" }, pct(device.utilisation) + "%") : null,
      el("span", { class: "owner" }, lost ? "lost" : owned ? `#${device.job} ${device.group}` : "free"),
      owned ? el("span", { class: "bar", style: `width:${pct(device.utilisation)}%` }) : null,
    );
    return cell;
  }

  function renderMap(nodes, devices, colours) {
    const byNode = new Map(nodes.map((n) => [n.name, []]));
    for (const d of devices) {
      if (!byNode.has(d.node)) byNode.set(d.node, []);
      byNode.get(d.node).push(d);
    }
    const nodeInfo = new Map(nodes.map((n) => [n.name, n]));
    const rows = [...byNode.keys()].sort().map((name) => {
      const node = nodeInfo.get(name) || { name, status: "ready", hardware: [] };
      const gpus = byNode.get(name).sort((a, b) => a.index - b.index);
      const lost = node.status === "lost";
      const heartbeat = node.last_heartbeat_at ? `heartbeat ${fmtAge(node.last_heartbeat_at)} ago` : "no heartbeat";
      return el("div", { class: "node-row " + node.status, dataset: { node: name, status: node.status },
        title: node.status_reason || null },
        el("div", { class: "node-label" },
          el("div", {}, el("span", { class: "name" }, name), " ",
            lost ? el("span", { class: "badge lost-flag" }, "LOST") : node.status !== "ready" ? badge(node.status) : null),
          el("div", { class: "meta" }, `${(node.hardware || []).join(", ") || "—"} · ${gpus.length} GPUs`),
          el("div", { class: "meta" }, heartbeat),
          // From the cells drawn beside it, so the row agrees with itself between fetches.
          el("div", { class: "meta" }, gpus.length
            ? `mean utilisation ${pct(gpus.reduce((sum, d) => sum + (d.utilisation || 0), 0) / gpus.length)}%` : ""),
        ),
        el("div", { class: "gpu-cells" }, gpus.map((d) => gpuCell(d, colours))),
      );
    });
    const map = document.getElementById("gpu-map");
    if (!rows.length) map.replaceChildren(el("p", { class: "muted" }, "No nodes registered yet. Start a node agent to add GPUs."));
    else map.replaceChildren(...rows);

    document.getElementById("legend").replaceChildren(
      ...colours.entries.map((e) => el("span", {},
        el("span", { class: "swatch", style: `background:${e.colour.bg}` }),
        el("a", { href: `/jobs/${e.jobId}/` }, `#${e.jobId} ${e.jobName}`), ` · ${e.group}`)),
      el("span", {}, el("span", { class: "swatch gpu free", style: "height:12px;padding:0" }), "free"),
      el("span", {}, el("span", { class: "swatch gpu lost", style: "height:12px;padding:0" }), "lost"),
    );
  }

  function renderByJob(summary, colours) {
    const jobs = summary.gpus.by_job;
    const rows = [];
    for (const job of jobs) {
      job.components.forEach((c, i) => rows.push(el("tr", { dataset: { job: String(job.job), group: c.group } },
        el("td", {}, i === 0 ? el("a", { href: `/jobs/${job.job}/` }, `#${job.job} ${job.name}`) : ""),
        el("td", {}, i === 0 ? badge(job.state) : ""),
        el("td", {}, el("span", { class: "swatch", style: `background:${(colours.colour(job.job, c.group) || { bg: "#999" }).bg}` }),
          c.group, c.kind !== c.group ? el("span", { class: "muted" }, ` (${c.kind})`) : null),
        el("td", { class: "num" }, c.gpus))));
      rows.push(el("tr", {}, el("td", {}), el("td", {}), el("td", { class: "muted" }, "total"), el("td", { class: "num" }, el("strong", {}, job.gpus))));
    }
    const free = summary.gpus.by_status.free, lost = summary.gpus.by_status.lost;
    rows.push(el("tr", {}, el("td", { class: "muted" }, "unallocated"), el("td", {}), el("td", { class: "muted" }, "free / lost"),
      el("td", { class: "num" }, `${free} / ${lost}`)));
    document.querySelector("#by-job-table tbody").replaceChildren(...rows);

    const labels = jobs.map((j) => `#${j.job} ${j.name}`);
    const traces = [];
    jobs.forEach((job, j) => job.components.forEach((c) => {
      const colour = colours.colour(job.job, c.group);
      traces.push({
        type: "bar", orientation: "h", name: `#${job.job} ${c.group}`, y: [labels[j]], x: [c.gpus],
        marker: { color: colour ? colour.bg : "#999" }, text: [c.group], textposition: "inside",
        hovertemplate: `#${job.job} ${job.name}<br>${c.group} (${c.kind}): %{x} GPUs<extra></extra>`,
      });
    }));
    traces.push({ type: "bar", orientation: "h", name: "free", y: ["unallocated"], x: [free], marker: { color: "#d5dbe2" },
      text: ["free"], textposition: "inside", hovertemplate: "free: %{x} GPUs<extra></extra>" });
    if (lost) traces.push({ type: "bar", orientation: "h", name: "lost", y: ["unallocated"], x: [lost], marker: { color: "#e5898d" },
      text: ["lost"], textposition: "inside", hovertemplate: "lost: %{x} GPUs<extra></extra>" });
    const layout = {
      barmode: "stack", showlegend: false, height: Math.max(220, 70 + 46 * (jobs.length + 1)),
      margin: { l: 170, r: 20, t: 10, b: 40 }, xaxis: { title: { text: "GPUs" }, dtick: summary.gpus.total > 40 ? null : 2 },
      yaxis: { automargin: true, autorange: "reversed" }, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
      font: { family: "system-ui, sans-serif", size: 12 },
    };
    Plotly.react("by-job-chart", traces, layout, { displayModeBar: false, responsive: true });
  }

  function render() {
    if (!latest) return;
    const colours = palette(latest.summary, latest.devices);
    renderStats(latest.summary);
    renderMap(latest.nodes, latest.devices, colours);
    renderByJob(latest.summary, colours);
    document.getElementById("updated-at").textContent = fmtTime(latest.at);
  }

  let inFlight = false, again = false, timer = null;
  async function refresh() {
    if (inFlight) { again = true; return; }
    inFlight = true;
    try {
      const [summary, nodes, devices] = await Promise.all([
        api("cluster/"), apiAll("nodes/?page_size=500"), apiAll("devices/?page_size=500"),
      ]);
      latest = { summary, nodes, devices, at: new Date().toISOString() };
      showError(null);
      render();
    } catch (error) {
      showError(error);
    } finally {
      inFlight = false;
      if (again) { again = false; scheduleRefresh(); }
    }
  }

  /** Events come in bursts (a migration's steps, every job's telemetry): the first one sets a
   *  short timer and the rest of the burst joins it, so a steady stream cannot starve the page. */
  function scheduleRefresh() {
    if (timer !== null) return;
    timer = setTimeout(() => { timer = null; refresh(); }, REFRESH_DEBOUNCE_MS);
  }

  const live = document.getElementById("live");
  socket("/ws/cluster/", (frame) => { if (REFRESH_EVENTS.has(frame.type)) scheduleRefresh(); }, (connected) => {
    live.className = "live " + (connected ? "connected" : "disconnected");
    live.textContent = connected ? "live" : "reconnecting…";
  });
  refresh();
  // Heartbeat ages move on between events; redraw them without asking the server.
  setInterval(render, 5000);
})();
