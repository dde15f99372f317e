// The tokentap trajectory viewer. Everything shown comes from ./api/* with the bearer token
// from the URL fragment (#token=…, kept in sessionStorage, never sent as part of a URL).
// Captured text is hostile: it is only ever written with textContent or as an attribute
// value, never parsed as HTML.
"use strict";

const TOKEN_KEY = "tokentap-view-token";
/// Tokens drawn at most for one trace (the rest are counted, not drawn).
const MAX_DRAWN_TOKENS = 400000;

// ---- small DOM helpers -------------------------------------------------------------------

/// An element with a class (optional) and children (strings become text nodes).
function el(tag, cls, ...children) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function link(href, text) {
  const a = el("a", null, text);
  a.href = href;
  return a;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

const main = () => document.getElementById("main");

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  if (ms >= 60000) return (ms / 60000).toFixed(1) + " min";
  if (ms >= 1000) return (ms / 1000).toFixed(2) + " s";
  return ms.toFixed(ms < 10 ? 1 : 0) + " ms";
}

function fmtTime(unixMs) {
  return unixMs ? new Date(unixMs).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z") : "–";
}

function fmtInt(n) {
  return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
}

function stat(value, label) {
  return el("div", null, el("b", null, value), el("span", null, label));
}

function setCrumbs(...parts) {
  const c = document.getElementById("crumbs");
  clear(c);
  c.append(link("#/", "sessions"));
  for (const p of parts) {
    c.append(" / ");
    c.append(p);
  }
}

// ---- data ----------------------------------------------------------------------------------

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, params) {
  const url = new URL("api/" + path, document.baseURI);
  for (const [k, v] of Object.entries(params || {})) url.searchParams.set(k, v);
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers["Authorization"] = "Bearer " + token;
  const r = await fetch(url, { headers, credentials: "omit", cache: "no-store" });
  if (!r.ok) {
    let message = r.status + " " + r.statusText;
    try {
      const body = await r.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON */ }
    throw new HttpError(r.status, message);
  }
  return r.json();
}

function showError(e) {
  const m = main();
  clear(m);
  if (e instanceof HttpError && e.status === 401) {
    m.append(el("p", "error", "This viewer needs its token. Open the address tokentap printed " +
      "(…/view/#token=…), or add #token=YOUR_TOKEN to this page's address."));
  } else {
    m.append(el("p", "error", String(e && e.message ? e.message : e)));
  }
}

// ---- sessions ------------------------------------------------------------------------------

async function showSessions() {
  setCrumbs();
  const data = await api("sessions", { limit: 2000 });
  const m = main();
  clear(m);
  m.append(el("h1", null, "Sessions"));
  const totals = data.sessions.reduce((t, s) => {
    t.calls += s.calls; t.prompt += s.prompt_tokens; t.completion += s.completion_tokens; t.traces += s.traces;
    return t;
  }, { calls: 0, prompt: 0, completion: 0, traces: 0 });
  m.append(el("div", "stats",
    stat(fmtInt(data.total), "sessions"), stat(fmtInt(totals.calls), "calls"),
    stat(fmtInt(totals.prompt), "prompt tokens"), stat(fmtInt(totals.completion), "sampled tokens"),
    stat(fmtInt(totals.traces), "traces")));
  if (data.sessions.length < data.total) {
    m.append(el("p", "muted", `The ${data.sessions.length} most recent of ${data.total} sessions.`));
  }
  if (data.sessions.length === 0) {
    m.append(el("p", "muted", "Nothing captured yet."));
    return;
  }
  const table = el("table", "sessions");
  table.append(el("thead", null, el("tr", null,
    el("th", null, "session"), el("th", "num", "calls"), el("th", "num", "prompt tok"),
    el("th", "num", "sampled tok"), el("th", "num", "errors"), el("th", "num", "traces"),
    el("th", "num", "engine"), el("th", "num", "harness"), el("th", null, "last activity"))));
  const body = el("tbody");
  for (const s of data.sessions) {
    const tr = el("tr", "clickable session-row",
      el("td", "id", s.session_id), el("td", "num", fmtInt(s.calls)),
      el("td", "num", fmtInt(s.prompt_tokens)), el("td", "num", fmtInt(s.completion_tokens)),
      el("td", "num" + (s.errors ? " error" : ""), fmtInt(s.errors)), el("td", "num", fmtInt(s.traces)),
      el("td", "num", fmtMs(s.engine_ms)), el("td", "num", fmtMs(s.harness_ms)),
      el("td", null, fmtTime(s.last_ended_at_unix_ms)));
    tr.dataset.session = s.session_id;
    tr.title = s.session_id;
    tr.addEventListener("click", () => { location.hash = "#/session/" + encodeURIComponent(s.session_id); });
    body.append(tr);
  }
  table.append(body);
  m.append(table);
}

// ---- one session ---------------------------------------------------------------------------

async function showSession(id) {
  setCrumbs(el("span", null, id));
  const data = await api("session", { id });
  const m = main();
  clear(m);
  const s = data.session;
  m.append(el("h1", null, id));
  const wall = s.calls ? s.last_ended_at_unix_ms - s.first_started_at_unix_ms : 0;
  m.append(el("div", "stats",
    stat(fmtInt(s.calls), "calls"), stat(fmtInt(s.prompt_tokens), "prompt tokens"),
    stat(fmtInt(s.completion_tokens), "sampled tokens"), stat(fmtInt(s.errors), "errors"),
    stat(fmtMs(wall), "wall time"), stat(fmtMs(s.engine_ms), "engine"),
    stat(fmtMs(s.harness_ms), "harness & tools")));

  const detail = el("div", "record-detail");
  if (data.calls.length) {
    m.append(el("h2", null, "Timeline"));
    m.append(el("div", "legend",
      el("span", null, el("span", "swatch engine"), "engine"),
      el("span", null, el("span", "swatch proxy"), "rest of the call (queue, proxy, network)"),
      el("span", null, el("span", "swatch harness"), "harness & tools (between calls)")));
    m.append(timeline(data.calls, detail));
    m.append(el("h2", null, "Calls"));
    m.append(callsTable(data.calls, detail));
    m.append(detail);
  } else {
    m.append(el("p", "muted", "This session's calls are not in the spool being viewed (only its traces are)."));
  }

  m.append(el("h2", null, "Traces"));
  if (!data.traces.length) {
    m.append(el("p", "muted", "No traces of this session yet (run tokentap reconstruct, or wait for the worker)."));
    return;
  }
  const table = el("table", "traces");
  table.append(el("thead", null, el("tr", null,
    el("th", null, "trace"), el("th", "num", "calls"), el("th", "num", "prompt tok"),
    el("th", "num", "response tok"), el("th", "num", "sampled (mask 1)"), el("th", "num", "reward"),
    el("th", "num", "gaps"))));
  const body = el("tbody");
  for (const t of data.traces) {
    const tr = el("tr", "clickable trace-row",
      el("td", "id", t.trace_id), el("td", "num", fmtInt(t.calls)),
      el("td", "num", fmtInt(t.prompt_tokens)), el("td", "num", fmtInt(t.response_tokens)),
      el("td", "num", fmtInt(t.trainable_tokens)),
      el("td", "num", t.reward === null || t.reward === undefined ? "–" : String(t.reward)),
      el("td", "num" + (t.gaps ? " error" : ""), fmtInt(t.gaps)));
    tr.dataset.trace = t.trace_id;
    tr.addEventListener("click", () => { location.hash = "#/trace/" + encodeURIComponent(t.trace_id); });
    body.append(tr);
  }
  table.append(body);
  m.append(table);
}

/// Each call a bar on its session's time axis: the engine's part, the rest of the call, and
/// the harness's time between calls as a thin grey line. Concurrent calls take more lanes.
function timeline(calls, detail) {
  const t0 = Math.min(...calls.map((c) => c.started_at_unix_ms));
  const t1 = Math.max(...calls.map((c) => c.ended_at_unix_ms), t0 + 1);
  const span = t1 - t0;
  const pct = (t) => ((t - t0) / span) * 100;
  const box = el("div", "timeline");
  const lanes = []; // each lane: end time of its last bar
  const laneEls = [];
  let lastEnd = null;
  const gaps = el("div", "lane gaps");
  for (const c of calls) {
    if (lastEnd !== null && c.started_at_unix_ms > lastEnd) {
      const g = el("div", "harness-gap");
      g.style.left = pct(lastEnd) + "%";
      g.style.width = pct(c.started_at_unix_ms) - pct(lastEnd) + "%";
      g.title = "harness & tools: " + fmtMs(c.started_at_unix_ms - lastEnd);
      gaps.append(g);
    }
    lastEnd = lastEnd === null ? c.ended_at_unix_ms : Math.max(lastEnd, c.ended_at_unix_ms);
    let lane = lanes.findIndex((end) => end <= c.started_at_unix_ms);
    if (lane < 0) {
      lane = lanes.length;
      lanes.push(0);
      laneEls.push(el("div", "lane"));
    }
    lanes[lane] = c.ended_at_unix_ms;
    const total = Math.max(c.ended_at_unix_ms - c.started_at_unix_ms, 0);
    const bar = el("div", "call-bar" + (c.error ? " failed" : ""));
    bar.style.left = pct(c.started_at_unix_ms) + "%";
    bar.style.width = Math.max(pct(c.ended_at_unix_ms) - pct(c.started_at_unix_ms), 0.15) + "%";
    const engine = el("div", "engine-part");
    engine.style.width = (total > 0 ? Math.min(c.backend_ms / total, 1) * 100 : 100) + "%";
    bar.append(engine);
    bar.dataset.record = c.record_id;
    bar.title = `call ${c.seq} · ${c.wire_api} · ${fmtMs(total)} (engine ${fmtMs(c.backend_ms)})` +
      (c.error ? " · " + c.error : "");
    bar.addEventListener("click", () => showRecord(c.record_id, detail));
    laneEls[lane].append(bar);
  }
  box.append(gaps, ...laneEls);
  box.append(el("div", "axis", el("span", null, fmtTime(t0)), el("span", null, fmtMs(span))));
  return box;
}

function callsTable(calls, detail) {
  const table = el("table", "calls");
  table.append(el("thead", null, el("tr", null,
    el("th", "num", "#"), el("th", null, "record"), el("th", null, "api"), el("th", null, "model"),
    el("th", "num", "status"), el("th", "num", "prompt tok"), el("th", "num", "sampled tok"),
    el("th", null, "token data"), el("th", "num", "first token"), el("th", "num", "engine"),
    el("th", "num", "proxy"), el("th", null, "finish"))));
  const body = el("tbody");
  for (const c of calls) {
    const tr = el("tr", "clickable call-row",
      el("td", "num", c.seq), el("td", "id", c.record_id), el("td", null, c.wire_api),
      el("td", null, c.model), el("td", "num" + (c.status >= 400 ? " error" : ""), c.status),
      el("td", "num", fmtInt(c.prompt_tokens)), el("td", "num", fmtInt(c.completion_tokens)),
      el("td", c.token_data ? null : "error", c.token_data ? "ids + logprobs" : "incomplete"),
      el("td", "num", fmtMs(c.time_to_first_token_ms)), el("td", "num", fmtMs(c.backend_ms)),
      el("td", "num", fmtMs(c.proxy_overhead_ms)), el("td", null, c.error || c.finish_reason || "–"));
    tr.dataset.record = c.record_id;
    tr.addEventListener("click", () => showRecord(c.record_id, detail));
    body.append(tr);
  }
  table.append(body);
  return table;
}

// ---- one record ----------------------------------------------------------------------------

async function showRecord(id, into) {
  for (const e of document.querySelectorAll(".selected")) e.classList.remove("selected");
  for (const e of document.querySelectorAll("[data-record]")) {
    if (e.dataset.record === id) e.classList.add("selected");
  }
  clear(into);
  into.append(el("p", "muted", "Loading record…"));
  let r;
  try {
    r = await api("record", { id });
  } catch (e) {
    clear(into);
    into.append(el("p", "error", e.message));
    return;
  }
  clear(into);
  const panel = el("div", "panel record");
  panel.append(el("h2", null, "Call " + r.seq + " · " + r.record_id));
  const t = r.timings || {};
  panel.append(el("div", "stats",
    stat(r.wire_api, "api"), stat(String(r.response_status), "status"),
    stat(r.backend.model, "model"), stat(fmtMs(t.total_ms), "total"),
    stat(fmtMs(t.time_to_first_token_ms), "first token"), stat(fmtMs(t.backend_ms), "engine"),
    stat(fmtMs(t.proxy_overhead_ms), "proxy"),
    stat(r.finish_reason || "–", "finish")));
  if (r.error) panel.append(el("p", "error", r.error.kind + ": " + r.error.message));
  for (const g of (r.token_provenance && r.token_provenance.gaps) || []) {
    panel.append(el("p", "error", "gap in " + g.field + ": " + g.reason));
  }
  for (const n of r.normalizations || []) {
    panel.append(el("p", "muted", "normalized (" + n.kind + "): " + n.detail));
  }
  const cols = el("div", "cols");
  const req = el("div", null, el("h2", null, "Request (as the harness sent it)"));
  const conversation = requestMessages(r.request.body);
  if (conversation.length) {
    for (const m of conversation) req.append(message(m.role, m.content));
  } else if (r.request.body_text) {
    req.append(el("pre", "json", r.request.body_text));
  }
  req.append(rawJson("whole request", r.request));
  const ans = el("div", null, el("h2", null, "Answer"));
  if (r.message) {
    const m = r.message;
    if (m.reasoning) ans.append(message("reasoning", m.reasoning));
    if (m.content) ans.append(message("assistant", m.content));
    for (const c of m.tool_calls || []) ans.append(message("tool call", c));
  } else {
    ans.append(el("p", "muted", "No answer was parsed."));
  }
  ans.append(rawJson("sampled token ids and logprobs", {
    completion_token_ids: r.completion_token_ids, logprobs: r.logprobs,
  }));
  ans.append(rawJson("whole record", r));
  cols.append(req, ans);
  panel.append(cols);
  into.append(panel);
  panel.scrollIntoView({ block: "nearest" });
}

/// The conversation of a request body in any of the three APIs: Chat Completions
/// (`messages`), Responses (`instructions` + `input`), Messages (`system` + `messages`).
function requestMessages(body) {
  if (!body || typeof body !== "object") return [];
  const out = [];
  if (body.system !== undefined) out.push({ role: "system", content: body.system });
  if (body.instructions !== undefined) out.push({ role: "instructions", content: body.instructions });
  const list = Array.isArray(body.messages) ? body.messages
    : Array.isArray(body.input) ? body.input
      : typeof body.input === "string" ? [{ role: "user", content: body.input }] : [];
  for (const m of list) {
    if (!m || typeof m !== "object") continue;
    const role = m.role || m.type || "item";
    let content = m.content !== undefined ? m.content : m.output !== undefined ? m.output : m;
    if (m.tool_calls) content = { content: m.content, tool_calls: m.tool_calls };
    out.push({ role, content });
  }
  return out;
}

/// Text of a content value: a string, or the text parts of a list, or JSON.
function contentText(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content.map((p) => {
      if (typeof p === "string") return p;
      if (p && typeof p.text === "string") return p.text;
      if (p && typeof p.content === "string") return p.content;
      return JSON.stringify(p, null, 2);
    }).join("\n");
  }
  return JSON.stringify(content, null, 2);
}

function message(role, content) {
  const cls = role === "assistant" || role === "tool call" ? "assistant" : role === "tool" ? "tool" : "";
  return el("div", "msg " + cls, el("div", "role", role), el("pre", null, contentText(content)));
}

function rawJson(label, value) {
  const d = el("details", null, el("summary", null, label));
  d.addEventListener("toggle", () => {
    if (d.open && d.childElementCount === 1) d.append(el("pre", "json", JSON.stringify(value, null, 2)));
  }, { once: false });
  return d;
}

// ---- one trace -----------------------------------------------------------------------------

async function showTrace(id) {
  const data = await api("trace", { id });
  const t = data.trace;
  const pieces = data.pieces || {};
  setCrumbs(link("#/session/" + encodeURIComponent(t.session_id), t.session_id), el("span", null, "trace " + t.index));
  const m = main();
  clear(m);
  m.append(el("h1", null, "Trace " + t.trace_id));
  const trainable = t.loss_mask.reduce((n, x) => n + (x === 1 ? 1 : 0), 0);
  const stats = el("div", "stats",
    stat(fmtInt(t.calls.length), "calls"), stat(fmtInt(t.prompt_ids.length), "prompt tokens"),
    stat(fmtInt(t.response_ids.length), "response tokens"), stat(fmtInt(trainable), "sampled (mask 1)"),
    stat(t.reward === null || t.reward === undefined ? "–" : String(t.reward), "reward"),
    stat(t.strategy, "strategy"), stat(t.started_by, "started by"));
  stats.id = "trace-stats";
  stats.dataset.trainable = String(trainable);
  m.append(stats);
  if (t.spans_policy_versions) m.append(el("p", "error", "The calls were served by more than one policy version."));
  for (const g of t.gaps || []) m.append(el("p", "error", "gap: " + g));
  m.append(el("div", "legend",
    el("span", null, el("span", "swatch prompt"), "prompt (context)"),
    el("span", null, el("span", "swatch ctx"), "context between calls (mask 0)"),
    el("span", null, el("span", "swatch sampled"), "sampled, likely"),
    el("span", null, el("span", "swatch sampled-low"), "sampled, unlikely (mask 1, shaded by logprob)"),
    el("span", null, "hover a token for its id, text and logprob")));

  const detail = el("div", "record-detail");
  const box = el("div", "tokens");
  const frag = document.createDocumentFragment();
  const total = t.prompt_ids.length + t.response_ids.length;
  let drawn = 0;
  const draw = (tokenId, cls, logprob) => {
    if (drawn >= MAX_DRAWN_TOKENS) return;
    drawn += 1;
    const piece = pieces[tokenId];
    const span = el("span", "tok " + cls);
    if (piece === undefined) {
      span.textContent = "⟨" + tokenId + "⟩";
    } else if (piece === "") {
      span.textContent = "⟨" + tokenId + "⟩";
      span.classList.add("special");
    } else {
      span.textContent = piece;
    }
    span.dataset.id = String(tokenId);
    if (logprob !== null) {
      span.dataset.lp = String(logprob);
      span.style.setProperty("--prob", String(Math.exp(logprob)));
    }
    frag.append(span);
  };
  for (const tokenId of t.prompt_ids) draw(tokenId, "p", null);
  let next = 0;
  for (let i = 0; i < t.response_ids.length; i++) {
    while (next < t.calls.length && t.calls[next].response_start === i) {
      const c = t.calls[next];
      const mark = el("span", "call-mark", "call " + next);
      mark.dataset.record = c.record_id;
      mark.title = "call " + next + ": record " + c.record_id + (c.trainable ? "" : " (not trainable)");
      mark.addEventListener("click", () => showRecord(c.record_id, detail));
      frag.append(mark);
      next += 1;
    }
    const sampled = t.loss_mask[i] === 1;
    draw(t.response_ids[i], sampled ? "s" : "c", sampled ? t.logprobs[i] : null);
  }
  box.append(frag);
  box.addEventListener("mouseover", (e) => hover(e, pieces));
  box.addEventListener("mousemove", (e) => placeHover(e));
  box.addEventListener("mouseleave", () => { document.getElementById("hover").hidden = true; });
  if (drawn < total) m.append(el("p", "muted", `The first ${fmtInt(drawn)} of ${fmtInt(total)} tokens are drawn.`));
  m.append(box);
  m.append(detail);
}

function hover(e, pieces) {
  const tip = document.getElementById("hover");
  const span = e.target.closest && e.target.closest(".tok");
  if (!span) {
    tip.hidden = true;
    return;
  }
  const id = Number(span.dataset.id);
  const piece = pieces[id];
  const kind = span.classList.contains("s") ? "sampled (mask 1)"
    : span.classList.contains("p") ? "prompt (mask 0)" : "context (mask 0)";
  let text = "id " + id + "  " + (piece === undefined ? "(no text)" : JSON.stringify(piece)) + "\n" + kind;
  if (span.dataset.lp !== undefined) {
    const lp = Number(span.dataset.lp);
    text += "\nlogprob " + lp.toFixed(4) + "  p " + Math.exp(lp).toFixed(4);
  }
  tip.textContent = text;
  tip.hidden = false;
  placeHover(e);
}

function placeHover(e) {
  const tip = document.getElementById("hover");
  if (tip.hidden) return;
  const x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  const y = e.clientY + 18 + tip.offsetHeight > window.innerHeight ? e.clientY - tip.offsetHeight - 10 : e.clientY + 18;
  tip.style.left = x + "px";
  tip.style.top = y + "px";
}

// ---- routing -------------------------------------------------------------------------------

async function route() {
  const hash = location.hash;
  if (hash.startsWith("#token=")) {
    // Keep the token for this tab only, and take it out of the address bar and history.
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(hash.slice("#token=".length)));
    history.replaceState(null, "", location.pathname + location.search + "#/");
  }
  const path = location.hash.replace(/^#/, "") || "/";
  document.getElementById("hover").hidden = true;
  try {
    if (path.startsWith("/session/")) {
      await showSession(decodeURIComponent(path.slice("/session/".length)));
    } else if (path.startsWith("/trace/")) {
      await showTrace(decodeURIComponent(path.slice("/trace/".length)));
    } else {
      await showSessions();
    }
    document.body.dataset.ready = path;
  } catch (e) {
    showError(e);
    document.body.dataset.ready = "error";
  }
}

async function showSource() {
  try {
    const o = await api("overview");
    const parts = [];
    if (o.corrupt_spool_lines) parts.push(o.corrupt_spool_lines + " unreadable spool lines skipped");
    if (o.unreadable_trace_lines) parts.push(o.unreadable_trace_lines + " unreadable trace lines skipped");
    parts.push("token text: " + o.token_text);
    document.getElementById("source").textContent = parts.join(" · ");
  } catch (_) { /* the main view reports errors */ }
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", async () => {
  await route();
  showSource();
});
