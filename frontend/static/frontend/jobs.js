/* Jobs: the list (filters through the API's own query parameters, kept in the page URL) and, for
 * operators and admins, the submit form. A rejected spec shows each problem at its line. */
(function () {
  "use strict";
  const { api, fmtTime, fmtAge, socket, el, badge, canOperate } = window.dynarl;
  const PAGE_SIZE = 25;
  const FILTERS = ["state", "policy", "owner", "name"];

  // --- the list ---------------------------------------------------------------------------------

  const filtersForm = document.getElementById("filters");
  let page = 1;

  function readFilters() {
    const params = new URLSearchParams();
    for (const name of FILTERS) {
      const value = filtersForm.elements[name].value.trim();
      if (value) params.set(name, value);
    }
    return params;
  }

  function restoreFilters() {
    const params = new URLSearchParams(location.search);
    for (const name of FILTERS) if (params.has(name)) filtersForm.elements[name].value = params.get(name);
    page = Math.max(1, parseInt(params.get("page") || "1", 10) || 1);
  }

  function showError(where, error) {
    const banner = document.getElementById(where);
    if (!error) { banner.classList.add("hidden"); banner.replaceChildren(); return; }
    const detail = error.error || {};
    const fields = Array.isArray(detail.fields) ? detail.fields : [];
    banner.replaceChildren(el("div", {},
      el("strong", {}, `${error.status || "Network error"}: `), detail.message || String(error.message || error),
      fields.length ? el("ul", {}, fields.map((f) => el("li", {}, el("span", { class: "code-inline" }, f.path || "(document)"), ": ", f.message))) : null,
      detail.request_id ? el("div", { class: "small muted" }, `request ${detail.request_id}`) : null,
    ));
    banner.classList.remove("hidden");
  }

  function fmtRate(value) {
    if (!value) return "—";
    if (value >= 1e6) return (value / 1e6).toFixed(2) + "M tok/s";
    if (value >= 1e3) return (value / 1e3).toFixed(1) + "k tok/s";
    return value.toFixed(0) + " tok/s";
  }

  function row(job) {
    const total = job.iterations_total || 0;
    const done = Math.min(job.iteration || 0, total || job.iteration || 0);
    const share = total ? Math.round((100 * done) / total) : 0;
    return el("tr", { dataset: { job: String(job.id), state: job.state } },
      el("td", {}, el("a", { href: `/jobs/${job.id}/` }, `#${job.id} ${job.name}`)),
      el("td", { title: job.state_detail || null }, badge(job.state),
        job.state_reason ? el("div", { class: "small muted" }, job.state_reason.replaceAll("_", " ")) : null),
      el("td", {}, job.policy),
      el("td", {}, job.owner),
      el("td", { class: "num", title: `${job.allocated_gpus} held now; the spec asks for ${job.total_gpus}` },
        `${job.allocated_gpus} / ${job.total_gpus}`),
      el("td", { class: "num" }, fmtRate(job.tokens_per_s)),
      el("td", { title: total ? `${share}%` : null },
        el("span", { class: "progress", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": String(total), "aria-valuenow": String(done) },
          el("span", { style: `width:${share}%` })),
        total ? `${done} / ${total}` : String(done)),
      el("td", { title: fmtTime(job.submitted_at, true) }, fmtAge(job.submitted_at)),
    );
  }

  let listTimer = null, listSeq = 0, lastQuery = null;
  /** Reload the list; a filter event that changed nothing (a field losing focus) is skipped,
   *  live refreshes pass force. */
  async function loadList(force = false) {
    const params = readFilters();
    const query = params.toString() + "#" + page;
    if (!force && query === lastQuery) return;
    lastQuery = query;
    const shown = new URLSearchParams(params);
    if (page > 1) shown.set("page", String(page));
    history.replaceState(null, "", location.pathname + (shown.toString() ? "?" + shown : "") + location.hash);
    params.set("page_size", String(PAGE_SIZE));
    params.set("page", String(page));
    const seq = ++listSeq;
    try {
      const body = await api("jobs/?" + params.toString());
      if (seq !== listSeq) return;  // a newer request has been made meanwhile
      showError("error", null);
      const tbody = document.querySelector("#jobs-table tbody");
      tbody.replaceChildren(...(body.results.length ? body.results.map(row)
        : [el("tr", {}, el("td", { colspan: "8", class: "muted" },
          readFilters().toString() ? "No jobs match these filters." : "No jobs yet."))]));
      const pages = Math.max(1, Math.ceil(body.count / PAGE_SIZE));
      document.getElementById("job-count").textContent = `${body.count} job${body.count === 1 ? "" : "s"}`;
      document.getElementById("page-info").textContent = `page ${page} of ${pages}`;
      document.getElementById("prev-page").disabled = !body.previous;
      document.getElementById("next-page").disabled = !body.next;
    } catch (error) {
      if (seq !== listSeq) return;
      lastQuery = null;
      if (error.status === 404 && page > 1) { page = 1; loadList(); return; }  // the page is gone
      showError("error", error);
    }
  }

  /** Filter edits restart a short debounce; live events ask for a refresh no later than
   *  `delay` but never push back one already due sooner (events may arrive every second). */
  function scheduleList(delay = 300) {
    clearTimeout(listTimer);
    clearTimeout(liveTimer); liveTimer = null;
    listTimer = setTimeout(loadList, delay);
  }
  let liveTimer = null;
  function scheduleLive(delay) {
    if (liveTimer !== null) return;
    liveTimer = setTimeout(() => { liveTimer = null; loadList(true); }, delay);
  }

  filtersForm.addEventListener("change", () => { page = 1; scheduleList(0); });
  filtersForm.addEventListener("input", (event) => { if (event.target.tagName === "INPUT") { page = 1; scheduleList(); } });
  filtersForm.addEventListener("reset", () => { page = 1; setTimeout(() => scheduleList(0)); });
  filtersForm.addEventListener("submit", (event) => { event.preventDefault(); page = 1; scheduleList(0); });
  document.getElementById("prev-page").addEventListener("click", () => { page = Math.max(1, page - 1); loadList(); });
  document.getElementById("next-page").addEventListener("click", () => { page += 1; loadList(); });

  const live = document.getElementById("live");
  socket("/ws/cluster/", (frame) => {
    if (frame.type === "hello" || frame.type === "job.state") scheduleLive(500);
    else if (frame.type === "telemetry") scheduleLive(1500);  // throughput and progress move on
  }, (connected) => {
    live.className = "live " + (connected ? "connected" : "disconnected");
    live.textContent = connected ? "live" : "reconnecting…";
  });
  restoreFilters();
  loadList();

  // --- the submit form (operators and admins) ---------------------------------------------------

  if (!canOperate || !document.getElementById("submit-form")) return;

  const card = document.getElementById("submit-card");
  const openButton = document.getElementById("open-submit");
  const form = document.getElementById("submit-form");
  const text = document.getElementById("spec-text");
  const gutter = document.getElementById("spec-gutter");
  const errorList = document.getElementById("spec-errors");
  const status = document.getElementById("submit-status");
  const button = document.getElementById("submit-button");
  const examples = JSON.parse(document.getElementById("example-specs").textContent);
  let errorLines = new Map();  // line -> messages

  function setOpen(open) {
    card.classList.toggle("hidden", !open);
    openButton.setAttribute("aria-expanded", String(open));
    if (open) text.focus();
  }
  openButton.addEventListener("click", () => setOpen(card.classList.contains("hidden")));
  document.getElementById("close-submit").addEventListener("click", () => setOpen(false));
  if (location.hash === "#submit") setOpen(true);

  function drawGutter() {
    const count = text.value.split("\n").length;
    const lines = [];
    for (let n = 1; n <= count; n++) {
      const messages = errorLines.get(n);
      lines.push(messages ? el("span", { class: "err", title: messages.join("\n"), dataset: { line: String(n) } }, String(n)) : String(n));
      if (n < count) lines.push("\n");
    }
    gutter.replaceChildren(...lines);
    gutter.scrollTop = text.scrollTop;
  }
  text.addEventListener("input", drawGutter);
  text.addEventListener("scroll", () => { gutter.scrollTop = text.scrollTop; });

  function clearProblems() {
    errorLines = new Map();
    errorList.replaceChildren();
    showError("submit-error", null);
    drawGutter();
  }

  document.getElementById("example-picker").addEventListener("change", (event) => {
    const chosen = examples[Number(event.target.value)];
    if (!chosen) return;
    text.value = chosen.text;
    clearProblems();
    status.textContent = `loaded ${chosen.name}`;
  });

  /** Select line n in the editor and scroll it into view. */
  function goToLine(n) {
    const lines = text.value.split("\n");
    const start = lines.slice(0, n - 1).reduce((sum, line) => sum + line.length + 1, 0);
    text.focus();
    text.setSelectionRange(start, start + (lines[n - 1] || "").length);
    const lineHeight = parseFloat(getComputedStyle(text).lineHeight) || 19;
    text.scrollTop = Math.max(0, (n - 4) * lineHeight);
  }

  async function showProblems(spec, problems) {
    let lines = problems.map(() => null);
    try {
      lines = (await api("/jobs/spec-lines/", { method: "POST", body: { spec, problems } })).lines;
    } catch (error) { /* the problems are still listed, without line numbers */ }
    errorLines = new Map();
    const items = problems.map((problem, i) => {
      const line = lines[i];
      if (line) errorLines.set(line, [...(errorLines.get(line) || []), `${problem.path || "(document)"}: ${problem.message}`]);
      return el("li", { dataset: { path: problem.path, line: line ? String(line) : "" }, onclick: () => line && goToLine(line), class: "spec-error" },
        el("span", { class: "where" }, line ? `line ${line}` : "spec"), " · ",
        el("span", { class: "code-inline" }, problem.path || "(document)"), ": ", problem.message);
    });
    errorList.replaceChildren(...items);
    drawGutter();
  }

  function idempotencyKey() {
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return "web-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearProblems();
    const spec = text.value;
    if (!spec.trim()) {
      await showProblems(spec, [{ path: "", message: "the spec is empty: write one or pick an example" }]);
      return;
    }
    button.disabled = true;
    status.textContent = "submitting…";
    try {
      const job = await api("jobs/", {
        method: "POST", body: spec,
        headers: { "Content-Type": "application/yaml", "Idempotency-Key": idempotencyKey() },
      });
      status.textContent = `job #${job.id} ${job.state}; opening it…`;
      location.assign(`/jobs/${job.id}/`);
    } catch (error) {
      status.textContent = "";
      const detail = error.error || {};
      let problems = Array.isArray(detail.fields) ? detail.fields
        : Object.entries(detail.fields || {}).flatMap(([path, messages]) => [].concat(messages).map((message) => ({ path, message })));
      if (!problems.length && error.status === 400) problems = [{ path: "", message: detail.message || "invalid spec" }];
      // The problems are listed at their lines under the editor; the banner only sums them up.
      const summary = problems.length
        ? `The job was not created: ${problems.length} problem${problems.length === 1 ? "" : "s"} in the spec, marked at ${problems.length === 1 ? "its line" : "their lines"} below.`
        : detail.message;
      showError("submit-error", { status: error.status, error: { message: summary, request_id: detail.request_id } });
      await showProblems(spec, problems);
    } finally {
      button.disabled = false;
    }
  });
  drawGutter();
})();
