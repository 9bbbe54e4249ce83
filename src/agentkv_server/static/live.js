// The live page: polls /agentkv/slots once a second and draws slots, queue, agents, store and
// requests.
// Plain DOM (textContent only: agent ids are client input), no libraries, nothing fetched from
// elsewhere. The API key, when the server needs one, is asked for once and kept in this tab's
// sessionStorage; it is sent as x-api-key on each poll.
"use strict";

const KEY_ITEM = "agentkv-api-key";
const POLL_MS = 1000;
const HISTORY = 60;

const $ = (id) => document.getElementById(id);
const seen = new Map(); // ticket -> finished record, in the order first seen
let key = sessionStorage.getItem(KEY_ITEM);
let failures = 0;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined) continue;
    if (name === "class") node.className = value;
    else if (name === "style") Object.assign(node.style, value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function fill(tbody, rows, columns, emptyText) {
  tbody.replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colspan: columns }, emptyText))]),
  );
}

function num(n) {
  return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
}
function secs(s) {
  if (s === null || s === undefined) return "–";
  if (s < 10) return s.toFixed(2) + " s";
  if (s < 120) return s.toFixed(1) + " s";
  return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
}
function bytes(b) {
  if (!b) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log2(b) / 10));
  return (b / 2 ** (10 * i)).toFixed(i ? 1 : 0) + " " + units[i];
}
function pct(part, whole) {
  return whole ? Math.round((100 * part) / whole) + "%" : "–";
}
function bar(part, whole, cls) {
  const share = whole ? Math.max(0, Math.min(1, part / whole)) : 0;
  return el("div", { class: "bar " + (cls || "") }, el("div", { style: { width: share * 100 + "%" } }));
}

// Where a prompt left the best cached candidate (the record's divergence), in words.
function divergenceText(d) {
  if (!d || typeof d !== "object") return "";
  const words = [];
  let where = d.position !== undefined && d.position !== null ? "token " + num(d.position) : "";
  if (d.section) where = where ? where + " in " + d.section : "in " + d.section;
  if (where) words.push(where);
  const costs = [];
  if (d.reused !== undefined && d.reused !== null) costs.push("reused " + num(d.reused));
  if (d.computed !== undefined && d.computed !== null) costs.push("computed " + num(d.computed));
  if (typeof d.seconds === "number") costs.push("~" + d.seconds.toFixed(1) + " s");
  if (costs.length) words.push(costs.join(", "));
  const known = new Set(["position", "section", "reused", "computed", "seconds"]);
  const extra = Object.entries(d).filter(([k]) => !known.has(k)).map(([k, v]) => k + "=" + v);
  if (extra.length) words.push(extra.join(" "));
  return words.join(": ");
}

function sparkline(svg, values, max) {
  const w = 200, h = 40;
  const top = max || Math.max(1e-9, ...values);
  const step = values.length > 1 ? w / (values.length - 1) : 0;
  const points = values.map((v, i) => (i * step).toFixed(1) + "," + (h - 2 - (v / top) * (h - 4)).toFixed(1));
  const ns = "http://www.w3.org/2000/svg";
  const base = document.createElementNS(ns, "line");
  for (const [k, v] of Object.entries({ x1: 0, y1: h - 1, x2: w, y2: h - 1 })) base.setAttribute(k, v);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.length === 1 ? "0," + points[0].split(",")[1] + " " + w + "," + points[0].split(",")[1] : points.join(" "));
  svg.replaceChildren(base, ...(values.length ? [line] : []));
}

// -- sections ----------------------------------------------------------------------------------

function slotProgress(row, table) {
  const checkpoint = (table.checkpoints || []).find((c) => c.slot === row.slot);
  const running = (table.running || []).find((r) => r.slot === row.slot && r.status === "running");
  if (row.state === "prefilling") {
    if (checkpoint) {
      return el("div", {}, bar(checkpoint.progress, checkpoint.tokens),
        `shared head (checkpoint #${checkpoint.id}): ${num(checkpoint.progress)} / ${num(checkpoint.tokens)} tokens `
        + `(${pct(checkpoint.progress, checkpoint.tokens)}), ${secs(checkpoint.running_s)}`);
    }
    if (running && running.prefilled !== null && running.prefilled !== undefined) {
      return el("div", {}, bar(running.prefilled, running.prompt_tokens),
        `${num(running.prefilled)} / ${num(running.prompt_tokens)} prompt tokens `
        + `(${pct(running.prefilled, running.prompt_tokens)}), ${num(running.planned_reuse)} cached`);
    }
    if (running) {
      return el("div", { class: "muted" },
        `${num(running.prompt_tokens)} prompt tokens, ${num(running.planned_reuse)} cached (from ${running.source}); starting`);
    }
    return el("div", { class: "muted" }, "starting");
  }
  if (row.state === "decoding" && running) {
    // Too early for a rate that means anything: wait for half a second of output.
    const rate = running.generating_s >= 0.5 ? running.generated / running.generating_s : null;
    return el("div", {},
      `${rate === null ? "–" : rate.toFixed(1)} tokens/s, ${num(running.generated)} generated, `
      + `first token after ${secs(running.ttft_s)}`);
  }
  if (row.state === "idle") {
    const parts = [];
    if (row.idle_s !== null && row.idle_s !== undefined) parts.push("idle " + secs(row.idle_s));
    if (row.stored) parts.push("saved in the store");
    return el("div", { class: "muted" }, parts.join(", "));
  }
  if (row.state === "out") {
    return el("div", { class: "muted" }, "its engine is down: out of placement until it rejoins");
  }
  return el("div", {});
}

function heldTokens(row, table) {
  // A busy slot is on its way to holding the running request's prompt.
  const running = (table.running || []).find((r) => r.slot === row.slot && r.status === "running");
  return row.busy && running && running.prompt_tokens !== row.tokens
    ? `${num(row.tokens)} → ${num(running.prompt_tokens)}` : num(row.tokens);
}

// An agent's name with the description of the call that started it, where known.
function labelled(row) {
  return row.description ? `${row.agent || "–"} (${row.description})` : row.agent || "–";
}

function drawAgents(table) {
  const rows = (table.tree || []).map((a) => {
    let name = a.agent;
    if (a.parent && name.startsWith(a.root + "/")) name = name.slice(a.root.length + 1);
    let state = "";
    if (a.waiting_for) state = `waits for ${a.waiting_for} sub-agent${a.waiting_for === 1 ? "" : "s"}`;
    else if (a.parent) state = a.waited_on ? "waited on" : "background";
    const what = [a.description, a.subagent_type ? `[${a.subagent_type}]` : null].filter(Boolean).join(" ");
    return el("tr", { "data-agent": a.agent, "data-depth": a.depth },
      el("td", { style: { paddingLeft: 0.4 + 1.5 * a.depth + "em" } }, (a.depth ? "└ " : "") + name),
      el("td", {}, a.priority), el("td", { class: "num" }, num(a.requests)),
      el("td", {}, state), el("td", { class: "wide" }, what));
  });
  fill($("agents").tBodies[0], rows, 5, table.tree ? "no agent yet" : "the agent tree is off");
}

function drawSlots(table) {
  const rows = table.slots.map((row) => el("tr", { "data-slot": row.slot, "data-state": row.state },
    el("td", {}, row.slot),
    el("td", {}, labelled(row)),
    el("td", {}, row.priority ?? "–"),
    el("td", { class: "num" }, heldTokens(row, table)),
    el("td", {}, el("span", { class: "state " + row.state }, row.state)),
    el("td", { class: "wide" }, slotProgress(row, table)),
  ));
  fill($("slots").tBodies[0], rows, 6, "no slots");
}

function drawQueue(table) {
  const checkpoints = new Map((table.checkpoints || []).map((c) => [c.id, c]));
  const rows = table.queue.map((t) => {
    let waits = "a slot";
    if (t.waiting_for_checkpoint !== null) {
      const c = checkpoints.get(t.waiting_for_checkpoint);
      waits = c ? `checkpoint #${c.id} on slot ${c.slot} (${pct(c.progress, c.tokens)} of ${num(c.tokens)} tokens)`
        : `checkpoint #${t.waiting_for_checkpoint}`;
    }
    return el("tr", { "data-ticket": t.ticket },
      el("td", {}, t.ticket), el("td", {}, labelled(t)), el("td", {}, t.priority),
      el("td", { class: "num" }, num(t.tokens)), el("td", { class: "num" }, secs(t.waited_s)),
      el("td", { class: "num" }, t.score.toFixed(2)), el("td", {}, waits));
  });
  fill($("queue").tBodies[0], rows, 7, "nobody is waiting");
  const background = (table.background || []).length;
  $("queuenote").textContent = background ? `${background} background job(s) wait for an idle slot` : "";
}

function drawRecent(table) {
  const recent = (table.recent || []).slice().reverse();
  const rows = recent.map((r) => el("tr", {},
    el("td", {}, labelled(r)), el("td", {}, r.priority), el("td", {}, r.slot ?? "–"),
    el("td", { class: "source-" + r.source }, r.source || "–"),
    el("td", { class: "num" }, `${num(r.cached_tokens)} / ${num(r.prompt_tokens)}`,
      bar(r.cached_tokens, r.prompt_tokens, "cached")),
    el("td", { class: "num" }, secs(r.ttft_s)), el("td", { class: "num" }, secs(r.total_s)),
    el("td", { class: "num" }, num(r.output_tokens)),
    el("td", { class: "num" }, r.draft_tokens ? `${num(r.draft_accepted)} / ${num(r.draft_tokens)}` : "–"),
    el("td", { class: r.status === "ok" ? "" : "bad" }, r.status + (r.retried ? " (retried)" : "")),
    el("td", { class: "wide" }, divergenceText(r.divergence)),
  ));
  fill($("recent").tBodies[0], rows, 11, "no request has finished yet");
}

function drawStore(table) {
  const store = table.store;
  if (!store) {
    $("store").textContent = "off";
    $("storenote").textContent = "no slot states are saved";
    fill($("entries").tBodies[0], [], 6, "the prefix store is off");
    return;
  }
  const hits = store.entries.reduce((sum, e) => sum + e.hits, 0);
  $("store").textContent = `${num(store.entries.length)} ${store.entries.length === 1 ? "entry" : "entries"}`;
  $("storenote").textContent = `${bytes(store.bytes)} of ${bytes(store.budget)}, ${num(store.saves)} saves, `
    + `${num(store.restores)} restores (${num(hits)} hits on kept entries), `
    + `${secs(store.seconds_saved)} of prefill saved`;
  const rows = store.entries.slice(0, 12).map((e) => el("tr", {},
    el("td", {}, e.kind), el("td", {}, e.agent || "shared"), el("td", { class: "num" }, num(e.tokens)),
    el("td", { class: "num" }, bytes(e.bytes)), el("td", { class: "num" }, num(e.hits)),
    el("td", { class: "num" }, secs(e.idle_s))));
  fill($("entries").tBodies[0], rows, 6, "empty");
  $("entrynote").textContent = store.entries.length > 12 ? `the 12 most valuable of ${store.entries.length}` : "";
}

function lastRequests(n) {
  return n === 1 ? "the last request" : `last ${n} requests`;
}

function drawCards(table) {
  for (const r of table.recent || []) if (!seen.has(r.ticket)) seen.set(r.ticket, r);
  while (seen.size > HISTORY) seen.delete(seen.keys().next().value);
  const history = [...seen.values()];
  const prompt = history.reduce((s, r) => s + r.prompt_tokens, 0);
  const cached = history.reduce((s, r) => s + r.cached_tokens, 0);
  $("hitrate").textContent = pct(cached, prompt);
  $("hitnote").textContent = history.length ? `${num(cached)} of ${num(prompt)} tokens, ${lastRequests(history.length)}` : "no requests yet";
  sparkline($("hitspark"), history.map((r) => (r.prompt_tokens ? r.cached_tokens / r.prompt_tokens : 0)), 1);
  const ttfts = history.filter((r) => r.ttft_s !== null).map((r) => r.ttft_s);
  const sorted = ttfts.slice().sort((a, b) => a - b);
  $("ttft").textContent = sorted.length ? secs(sorted[Math.floor((sorted.length - 1) / 2)]) + " median" : "–";
  $("ttftnote").textContent = sorted.length ? `max ${secs(sorted[sorted.length - 1])}, ${lastRequests(sorted.length)}` : "no requests yet";
  sparkline($("ttftspark"), ttfts);
  const drafted = history.reduce((s, r) => s + (r.draft_tokens || 0), 0);
  const accepted = history.reduce((s, r) => s + (r.draft_accepted || 0), 0);
  $("drafts").textContent = drafted ? pct(accepted, drafted) + " accepted" : "–";
  $("draftnote").textContent = drafted
    ? `${num(accepted)} of ${num(drafted)} drafted tokens, ${lastRequests(history.length)}`
    : "no tokens drafted yet (speculative decoding off, or nothing to copy)";
  const p = table.placements;
  $("placements").textContent = p.acquired ? pct(p.from_slot + p.from_store, p.acquired) + " warm" : "–";
  $("placementnote").textContent = `${num(p.from_slot)} from a slot, ${num(p.from_store)} from the store, ${num(p.cold)} cold`;
  const c = table.costs || {};
  $("speeds").textContent = c.decode_tokens_per_s
    ? `engine: prefill ${num(c.prefill_tokens_per_s_at_0)} tokens/s, decode ${num(c.decode_tokens_per_s)} tokens/s` : "";
}

function draw(table) {
  drawCards(table);
  drawSlots(table);
  drawQueue(table);
  drawAgents(table);
  drawRecent(table);
  drawStore(table);
}

// -- polling and the key -----------------------------------------------------------------------

function connection(state, text) {
  const conn = $("conn");
  conn.dataset.state = state;
  conn.textContent = text;
}

function askForKey(message) {
  connection("key", "needs the API key");
  $("keyform").hidden = false;
  $("keyerror").textContent = message || "";
  $("key").focus();
}

async function poll() {
  try {
    const headers = key ? { "x-api-key": key } : {};
    const response = await fetch("slots", { headers, cache: "no-store" });
    if (response.status === 401) {
      askForKey(key ? "that key was refused" : "");
      return; // resumes when a key is given
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    draw(await response.json());
    failures = 0;
    connection("live", "live");
  } catch (err) {
    failures += 1;
    connection("stale", `cannot reach agentkv (${err.message}); retrying`);
  }
  setTimeout(poll, failures ? Math.min(10, failures) * POLL_MS : POLL_MS);
}

$("keyform").addEventListener("submit", (event) => {
  event.preventDefault();
  key = $("key").value.trim();
  sessionStorage.setItem(KEY_ITEM, key);
  $("keyform").hidden = true;
  connection("connecting", "connecting…");
  poll();
});

poll();
