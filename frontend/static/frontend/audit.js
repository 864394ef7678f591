/* Audit trail: /api/v1/audit-events/ with its filters (kept in the page URL), a page at a time;
 * a row opens to show its payload; the export links carry the same filters. */
(function () {
  "use strict";
  const { api, fmtTime, el } = window.dynarl;
  const PAGE_SIZE = 50;
  const TEXT_FILTERS = ["actor_type", "actor", "verb", "object_type", "job"];
  const TIME_FILTERS = ["after", "before"];
  const known = { actors: new Set(), verbs: new Set(), objectTypes: new Set() };

  const form = document.getElementById("filters");
  let page = 1, seq = 0, timer = null, lastQuery = null;
  const opened = new Set();  // events whose payload is shown, kept open across reloads

  /** datetime-local (the viewer's local time) <-> ISO 8601 with an offset, for the API. */
  function localToIso(value) { return value ? new Date(value).toISOString() : ""; }
  function isoToLocal(iso) {
    const d = new Date(iso);
    if (isNaN(d)) return "";
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function filters() {
    const params = new URLSearchParams();
    for (const name of TEXT_FILTERS) {
      const value = form.elements[name].value.trim();
      if (value) params.set(name, value);
    }
    for (const name of TIME_FILTERS) {
      const value = localToIso(form.elements[name].value);
      if (value) params.set(name, value);
    }
    return params;
  }

  function restore() {
    const params = new URLSearchParams(location.search);
    for (const name of TEXT_FILTERS) if (params.has(name)) form.elements[name].value = params.get(name);
    for (const name of TIME_FILTERS) if (params.has(name)) form.elements[name].value = isoToLocal(params.get(name));
    page = Math.max(1, parseInt(params.get("page") || "1", 10) || 1);
  }

  function showError(error) {
    const banner = document.getElementById("error");
    if (!error) { banner.classList.add("hidden"); banner.replaceChildren(); return; }
    const detail = error.error || {};
    const fields = Array.isArray(detail.fields) ? detail.fields : [];
    banner.replaceChildren(el("div", {}, `${error.status || "Network error"}: ${detail.message || error}`,
      fields.length ? el("ul", {}, fields.map((f) => el("li", {}, el("span", { class: "code-inline" }, f.path), ": ", f.message))) : null));
    banner.classList.remove("hidden");
  }

  function remember(event) {
    known.actors.add(event.actor);
    known.verbs.add(event.verb);
    known.objectTypes.add(event.object_type);
  }

  function fillDatalists() {
    const options = (set) => [...set].sort().map((value) => el("option", { value }));
    document.getElementById("known-actors").replaceChildren(...options(known.actors));
    document.getElementById("known-verbs").replaceChildren(...options(known.verbs));
    document.getElementById("known-object-types").replaceChildren(...options(known.objectTypes));
  }

  function rows(event) {
    const isOpen = opened.has(event.id);
    const payload = el("tr", { class: "payload-row" + (isOpen ? "" : " hidden"), dataset: { payloadOf: String(event.id) } },
      el("td", { colspan: "7" },
        el("pre", {}, JSON.stringify(event.payload, null, 2)),
        el("div", { class: "small muted" }, `event ${event.id} · request ${event.request_id || "—"}`
          + (event.actor_user ? ` · user ${event.actor_user}` : ""))));
    const toggle = el("button", { type: "button", class: "link small", "aria-expanded": String(isOpen) }, "payload");
    const main = el("tr", { class: "expandable", dataset: { event: String(event.id), verb: event.verb } },
      el("td", { title: event.at, style: "white-space:nowrap" }, fmtTime(event.at, true)),
      el("td", {}, el("span", { class: "badge" }, event.actor_type), " ", event.actor),
      el("td", {}, el("span", { class: "code-inline" }, event.verb)),
      el("td", {}, el("span", { class: "code-inline" }, `${event.object_type}#${event.object_id}`)),
      el("td", {}, event.job ? el("a", { href: `/jobs/${event.job}/` }, `#${event.job}`) : ""),
      el("td", {}, event.reason),
      el("td", {}, toggle),
    );
    main.addEventListener("click", (e) => {
      if (e.target.closest("a")) return;
      const open = payload.classList.toggle("hidden") === false;
      if (open) opened.add(event.id); else opened.delete(event.id);
      toggle.setAttribute("aria-expanded", String(open));
    });
    return [main, payload];
  }

  async function load(force = false) {
    const params = filters();
    const query = params.toString() + "#" + page;
    if (!force && query === lastQuery) return;  // e.g. a field that lost focus without a change
    lastQuery = query;
    const shown = new URLSearchParams(params);
    if (page > 1) shown.set("page", String(page));
    history.replaceState(null, "", location.pathname + (shown.toString() ? "?" + shown : ""));
    for (const format of ["csv", "json"]) {
      const exported = new URLSearchParams(params);
      exported.set("format", format);
      document.getElementById("export-" + format).href = "/api/v1/audit-events/export/?" + exported;
    }
    params.set("page", String(page));
    params.set("page_size", String(PAGE_SIZE));
    const mine = ++seq;
    try {
      const body = await api("audit-events/?" + params);
      if (mine !== seq) return;
      showError(null);
      body.results.forEach(remember);
      fillDatalists();
      document.querySelector("#audit-table tbody").replaceChildren(...(body.results.length ? body.results.flatMap(rows)
        : [el("tr", {}, el("td", { colspan: "7", class: "muted" }, "No events match these filters."))]));
      const pages = Math.max(1, Math.ceil(body.count / PAGE_SIZE));
      document.getElementById("event-count").textContent = `${body.count} event${body.count === 1 ? "" : "s"}`;
      document.getElementById("page-info").textContent = `page ${page} of ${pages}`;
      document.getElementById("prev-page").disabled = !body.previous;
      document.getElementById("next-page").disabled = !body.next;
    } catch (error) {
      if (mine !== seq) return;
      lastQuery = null;
      if (error.status === 404 && page > 1) { page = 1; load(); return; }
      showError(error);
    }
  }

  function schedule(delay = 350) { clearTimeout(timer); timer = setTimeout(load, delay); }
  form.addEventListener("change", () => { page = 1; schedule(0); });
  form.addEventListener("input", (e) => { if (e.target.type === "text" || e.target.type === "number") { page = 1; schedule(); } });
  form.addEventListener("reset", () => { page = 1; setTimeout(() => schedule(0)); });
  form.addEventListener("submit", (e) => { e.preventDefault(); page = 1; schedule(0); });
  document.getElementById("prev-page").addEventListener("click", () => { page = Math.max(1, page - 1); load(); });
  document.getElementById("next-page").addEventListener("click", () => { page += 1; load(); });
  restore();
  load();
})();
