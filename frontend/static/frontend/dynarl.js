/* Shared helpers for every dashboard page: window.dynarl.{api, fmtTime, fmtAge, socket, el}.
 * Pages talk to the REST API with the session cookie (CSRF header on writes) and to the live
 * WebSocket endpoints, which resend a "hello" with the current state after every reconnect. */
(function () {
  "use strict";

  function cookie(name) {
    const found = document.cookie.split("; ").find((c) => c.startsWith(name + "="));
    return found ? decodeURIComponent(found.split("=")[1]) : "";
  }

  /** fetch() against /api/v1/: JSON in and out; rejects with {status, error} on 4xx/5xx,
   *  where error is the API's error object (status, code, message, fields, request_id). */
  async function api(path, options = {}) {
    const headers = Object.assign({ Accept: "application/json" }, options.headers || {});
    const init = { method: options.method || "GET", headers, credentials: "same-origin" };
    if (init.method !== "GET") headers["X-CSRFToken"] = cookie("csrftoken");
    if (options.body !== undefined) {
      if (typeof options.body === "string") {
        init.body = options.body;
      } else {
        init.body = JSON.stringify(options.body);
        headers["Content-Type"] = "application/json";
      }
    }
    const url = path.startsWith("/") ? path : "/api/v1/" + path;
    const response = await fetch(url, init);
    const text = await response.text();
    let payload = null;
    try { payload = text ? JSON.parse(text) : null; } catch (e) { payload = { raw: text }; }
    if (!response.ok) {
      const error = (payload && payload.error) || { status: response.status, message: response.statusText, fields: {} };
      throw { status: response.status, error };
    }
    return payload;
  }

  /** All pages of a paginated list (bounded, for charts and logs). */
  async function apiAll(path, maxPages = 20) {
    const results = [];
    let next = path;
    for (let page = 0; next && page < maxPages; page++) {
      const body = await api(next);
      results.push(...(body.results || []));
      next = body.next ? new URL(body.next, location.origin).pathname + new URL(body.next, location.origin).search : null;
    }
    return results;
  }

  /** Timestamps are shown in the viewer's own timezone. */
  function fmtTime(iso, withDate = false) {
    if (!iso) return "";
    const d = new Date(iso);
    const options = { hour: "2-digit", minute: "2-digit", second: "2-digit" };
    if (withDate) Object.assign(options, { year: "numeric", month: "short", day: "2-digit" });
    return d.toLocaleString(undefined, options);
  }

  function fmtAge(iso) {
    if (!iso) return "";
    let s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    if (s < 60) return Math.round(s) + "s";
    s /= 60; if (s < 60) return Math.round(s) + "m";
    s /= 60; if (s < 48) return s.toFixed(1) + "h";
    return (s / 24).toFixed(1) + "d";
  }

  /** A WebSocket that reconnects with backoff. onFrame gets every frame ({type, at, data});
   *  a "hello" after a reconnect carries the state to start over from. onStatus(bool). */
  function socket(path, onFrame, onStatus) {
    let ws = null, delay = 500, closedByPage = false;
    function connect() {
      const scheme = location.protocol === "https:" ? "wss://" : "ws://";
      ws = new WebSocket(scheme + location.host + path);
      ws.onopen = () => { delay = 500; if (onStatus) onStatus(true); };
      ws.onmessage = (event) => { try { onFrame(JSON.parse(event.data)); } catch (e) { console.error(e); } };
      ws.onclose = (event) => {
        if (onStatus) onStatus(false);
        if (closedByPage || event.code === 4401 || event.code === 4404) return;
        setTimeout(connect, delay);
        delay = Math.min(delay * 2, 10000);
      };
    }
    connect();
    return {
      send: (frame) => ws && ws.readyState === 1 && ws.send(JSON.stringify(frame)),
      close: () => { closedByPage = true; if (ws) ws.close(); },
    };
  }

  /** el("td", {class: "num"}, "3") — build DOM without innerHTML (no injection from data). */
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else if (key === "dataset") Object.assign(node.dataset, value);
      // Through CSSOM: the Content-Security-Policy refuses style attributes set as markup.
      else if (key === "style") node.style.cssText = value;
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function badge(state) { return el("span", { class: "badge state-" + state }, state); }

  window.dynarl = {
    api, apiAll, fmtTime, fmtAge, socket, el, badge,
    canOperate: document.body.dataset.canOperate === "true",
    role: document.body.dataset.role,
  };
})();
