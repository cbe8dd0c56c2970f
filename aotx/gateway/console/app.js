// aotx web console: plain JavaScript, no framework, no CDN.
// The token lives in this closure only (never in a cookie or in storage).
"use strict";
(() => {
  let token = null;
  let model = "smollm2";
  const history = [];
  let current = null; // the request being streamed: {id, cancelled}
  const $ = (id) => document.getElementById(id);

  const EXPLAIN = {
    401: "Your token was refused (401): check it and sign in again.",
    403: "Your grant does not allow this (403).",
    404: "Not found (404): unknown, foreign or reclaimed.",
    409: "Conflict (409).",
    410: "The service restarted (410): that request belonged to an ended runtime epoch.",
    429: "Too many requests (429): wait a moment.",
    503: "The device is not reachable right now (503).",
  };

  // An in-stream error's status, from its type (docs/api.md, "Errors").
  const STATUS_OF_TYPE = {
    authentication_error: 401, permission_error: 403, not_found_error: 404,
    gone_error: 410, service_unavailable: 503,
  };

  function show(text, info) {
    const m = $("message");
    m.textContent = text;
    m.className = info ? "info" : "";
    m.hidden = !text;
  }

  function explain(err) {
    if (!err.status) return `Network error: ${err.message}`;
    return `${EXPLAIN[err.status] || "Error " + err.status + "."} ${err.message || ""}`.trim();
  }

  async function api(path, opts = {}) {
    const headers = Object.assign({}, opts.headers || {}, { Authorization: `Bearer ${token}` });
    return fetch(path, Object.assign({}, opts, { headers }));
  }

  async function call(path, opts) {
    const r = await api(path, opts);
    if (!r.ok) {
      let e = { message: r.statusText };
      try { e = (await r.json()).error || e; } catch (_) { /* not JSON */ }
      const err = new Error(e.message);
      err.status = r.status;
      err.error = e;
      throw err;
    }
    return r.status === 204 ? null : r.json();
  }

  // -- sign in -----------------------------------------------------------------------
  $("signin-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    token = $("token").value.trim();
    try {
      const caps = await call("/aotx/v1/capabilities");
      const chats = caps.models.filter((m) => m.chat);
      if (chats.length) model = chats[0].alias;
      epoch = caps.runtime_epoch;
      fillPicker(chats);
      showModel();
      $("signin").hidden = true;
      $("app").hidden = false;
      $("token").value = "";
      show("");
      refreshPolicy();
      refreshMemory();
      refreshModels();
      setInterval(refreshModels, 2000);
      setInterval(sampleLive, 500);
      setInterval(refreshPolicy, 2000);
    } catch (err) {
      token = null;
      show(explain(err));
    }
  });

  // -- the model picker and the models' residency ---------------------------------------
  let epoch = "";
  let states = {}; // alias -> status.value, from the last GET /aotx/v1/models

  function fillPicker(chats) {
    const pick = $("model-pick");
    pick.replaceChildren();
    for (const m of chats) {
      const o = document.createElement("option");
      o.value = m.alias;
      o.textContent = m.alias;
      pick.append(o);
    }
    pick.value = model;
  }

  function showModel() {
    const state = states[model];
    $("model").textContent =
      `(${model}${state && state !== "loaded" ? ", " + state : ""}, epoch ${epoch})`;
  }

  $("model-pick").addEventListener("change", () => {
    model = $("model-pick").value;
    showModel();
  });

  function cell(text) {
    const td = document.createElement("td");
    td.textContent = text;
    return td;
  }

  // One row a model: its state (and why it failed), its memory once loaded, when an idle
  // one unloads; an admin (whose list has "unassigned") gets Load and Unload.
  async function refreshModels() {
    let doc;
    try { doc = await call("/aotx/v1/models"); } catch (err) {
      $("models-budget").textContent = explain(err);
      return;
    }
    const admin = doc.unassigned !== null;
    const mib = (n) => `${(n / 1048576).toFixed(0)} MiB`;
    $("models-budget").textContent =
      `memory budget ${mib(doc.budget_bytes)}, ${mib(doc.used_bytes)} estimated in use`;
    const body = $("models-table").querySelector("tbody");
    body.replaceChildren();
    states = {};
    for (const m of doc.models) {
      const s = m.status;
      states[m.alias] = s.value;
      const tr = document.createElement("tr");
      tr.dataset.alias = m.alias;
      tr.dataset.state = s.value;
      const until = s.keep_alive < 0 ? "pinned" :
        s.expires_in === null ? "" : `${s.expires_in.toFixed(0)} s`;
      tr.append(cell(m.alias), cell(s.value + (s.reason ? `: ${s.reason}` : "")),
                cell(mib(s.memory_bytes)), cell(until));
      const actions = document.createElement("td");
      if (admin && s.on_demand) {
        for (const action of ["load", "unload"]) {
          const btn = document.createElement("button");
          btn.textContent = action === "load" ? "Load" : "Unload";
          btn.dataset.action = action;
          btn.disabled = action === "load" ? s.value === "loaded" || s.value === "loading"
                                           : s.value === "unloaded" || s.value === "failed";
          btn.addEventListener("click", async () => {
            try {
              // an alias's "/" stays a "/": the gateway refuses "%2F" in a path
              const path = m.alias.split("/").map(encodeURIComponent).join("/");
              await call(`/aotx/v1/models/${path}/${action}`,
                         { method: "POST" });
              show("");
            } catch (err) { show(explain(err)); }
            refreshModels();
          });
          actions.append(btn);
        }
      }
      tr.append(actions);
      body.append(tr);
    }
    for (const o of $("model-pick").options) {
      const state = states[o.value];
      o.textContent = state && state !== "loaded" ? `${o.value} (${state})` : o.value;
    }
    showModel();
  }

  // -- chat over the native SSE route, with exact resume ------------------------------
  function addTurn(who, text) {
    const div = document.createElement("div");
    div.className = `turn ${who}`;
    const w = document.createElement("span");
    w.className = "who";
    w.textContent = who === "user" ? "you" : "bot";
    const t = document.createElement("span");
    t.className = "text";
    t.textContent = text;
    div.append(w, t);
    $("log").append(div);
    $("log").scrollTop = $("log").scrollHeight;
    return t;
  }

  function b64bytes(s) {
    const bin = atob(s);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  async function follow(id, target) {
    const decoder = new TextDecoder("utf-8"); // {stream: true} keeps split characters whole
    let cursor = 0;
    let giveUp = Date.now() + 60000;
    for (;;) {
      try {
        const r = await api(`/aotx/v1/requests/${id}/events`,
                            { headers: { "Last-Event-ID": `${id}:${cursor}` } });
        if (!r.ok) {
          let e = { message: r.statusText };
          try { e = (await r.json()).error || e; } catch (_) { /* ignore */ }
          const err = new Error(e.message);
          err.status = r.status;
          throw err;
        }
        giveUp = Date.now() + 60000;
        $("stream-status").textContent = cursor ? `resumed at byte ${cursor}` :
          states[model] && states[model] !== "loaded" ? `loading ${model}…` : "streaming…";
        const reader = r.body.getReader();
        const bytes = new TextDecoder("utf-8");
        let buf = "";
        let event = {};
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += bytes.decode(value, { stream: true });
          let nl;
          while ((nl = buf.indexOf("\n")) >= 0) {
            const line = buf.slice(0, nl).replace(/\r$/, "");
            buf = buf.slice(nl + 1);
            if (line.startsWith(":")) continue;
            if (line) {
              const i = line.indexOf(":");
              event[line.slice(0, i)] = line.slice(i + 1).replace(/^ /, "");
              continue;
            }
            const kind = event.event;
            const data = event.data ? JSON.parse(event.data) : {};
            event = {};
            if (kind === "emission") {
              if (!cursor) $("stream-status").textContent = "streaming…";
              target.textContent += decoder.decode(b64bytes(data.bytes), { stream: true });
              cursor = Number(data.next_cursor);
              $("log").scrollTop = $("log").scrollHeight;
            } else if (kind === "status" &&
                       ["completed", "failed", "cancelled"].includes(data.state)) {
              target.textContent += decoder.decode();
              $("stream-status").textContent =
                `${data.state} (${data.finish_reason || "-"}), ` +
                `${data.usage.completion_tokens} tokens`;
              return data;
            } else if (kind === "error") {
              // The error object's code is a word (epoch_ended); its type names the status.
              const err = new Error(data.error.message);
              err.status = STATUS_OF_TYPE[data.error.type] || 503;
              throw err;
            }
          }
        }
        throw new Error("the stream ended early");
      } catch (err) {
        if (err.status && err.status !== 503) throw err; // 401/403/404/410: not retryable
        if (Date.now() > giveUp) throw err;
        $("stream-status").textContent =
          `connection dropped — resuming at byte ${cursor}…`;
        await new Promise((res) => setTimeout(res, 500));
      }
    }
  }

  $("chat-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || current) return;
    $("prompt").value = "";
    addTurn("user", text);
    history.push({ role: "user", content: text });
    const target = addTurn("bot", "");
    $("send").disabled = true;
    $("stop").disabled = false;
    try {
      const adm = await call("/aotx/v1/requests", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ model, messages: history, max_tokens: 200 }),
      });
      current = { id: adm.id };
      target.parentElement.dataset.requestId = adm.id;
      await follow(adm.id, target);
      history.push({ role: "assistant", content: target.textContent });
      show("");
    } catch (err) {
      show(explain(err));
    } finally {
      current = null;
      $("send").disabled = false;
      $("stop").disabled = true;
    }
  });

  $("stop").addEventListener("click", async () => {
    if (!current) return;
    try { await call(`/aotx/v1/requests/${current.id}/cancel`, { method: "POST" }); }
    catch (err) { show(explain(err)); }
  });

  // -- live chart: device tick and completion tokens/s ---------------------------------
  const series = { tps: [], tick: [] };
  let last = null;
  async function sampleLive() {
    try {
      const [t, m] = await Promise.all([
        call("/aotx/v1/telemetry"),
        api("/metrics").then((r) => (r.ok ? r.text() : "")),
      ]);
      const now = performance.now();
      const match = m.match(/^aotx_completion_tokens_total\{[^}]*\} ([0-9.e+]+)$/m);
      const tokens = match ? Number(match[1]) : 0;
      const tick = Number(t.sample.device_tick);
      if (last) {
        const dt = (now - last.now) / 1000;
        series.tps.push(Math.max(0, (tokens - last.tokens) / dt));
        series.tick.push(Math.max(0, (tick - last.tick) / dt));
        if (series.tps.length > 120) { series.tps.shift(); series.tick.shift(); }
      }
      last = { now, tokens, tick };
      const mib = (Number(t.sample.service_allocation_bytes) / 1048576).toFixed(1);
      $("live-figures").textContent =
        `tokens/s ${(series.tps.at(-1) || 0).toFixed(1)} · steps/s ` +
        `${(series.tick.at(-1) || 0).toFixed(1)} · allocation ${mib} MiB · tick ${tick}`;
      draw();
    } catch (err) {
      $("live-figures").textContent = explain(err);
    }
  }

  function draw() {
    const c = $("chart");
    const g = c.getContext("2d");
    g.clearRect(0, 0, c.width, c.height);
    const max = Math.max(10, ...series.tps, ...series.tick);
    const plot = (ys, colour) => {
      g.strokeStyle = colour;
      g.beginPath();
      ys.forEach((y, i) => {
        const x = (i / 119) * (c.width - 10) + 5;
        const yy = c.height - 5 - (y / max) * (c.height - 20);
        if (i) g.lineTo(x, yy); else g.moveTo(x, yy);
      });
      g.stroke();
    };
    plot(series.tps, "#0b5394");
    plot(series.tick, "#e69138");
    g.fillStyle = "#555";
    g.fillText(`tokens/s (blue), steps/s (orange); top = ${max.toFixed(0)}`, 8, 12);
  }

  // -- policy --------------------------------------------------------------------------
  let policyRevision = null;
  async function refreshPolicy() {
    try {
      const p = await call("/aotx/v1/policy");
      policyRevision = p.control_revision;
      $("policy-status").dataset.state = p.state;
      $("policy-status").textContent =
        `state ${p.state} · reason ${p.reason} · review ${p.review_enabled ? "on" : "off"} · ` +
        `pending ${p.pending} · frontier ${p.source_frontier} · saved generations ` +
        `${p.saved_generation} · interrupted ${p.interrupted} · revision ${p.control_revision}`;
    } catch (err) {
      $("policy-status").textContent = explain(err);
    }
  }

  document.querySelectorAll("#policy button").forEach((b) => {
    b.addEventListener("click", async () => {
      try {
        await call("/aotx/v1/policy", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ action: b.dataset.action, expected_revision: policyRevision }),
        });
        show("");
      } catch (err) {
        show(explain(err));
      }
      refreshPolicy();
    });
  });

  // -- memory review queue and saved memory ---------------------------------------------
  async function refreshMemory() {
    try {
      const [saved, pending] = await Promise.all([
        call("/aotx/v1/memory"), call("/aotx/v1/memory/pending")]);
      $("memory-saved").textContent = saved.facts.length
        ? `generation ${saved.generation}: ${saved.facts.join(" · ")}`
        : "nothing saved";
      const ul = $("memory-pending");
      ul.replaceChildren();
      for (const p of pending.data) {
        const li = document.createElement("li");
        li.textContent = p.fact;
        for (const verdict of ["approve", "reject"]) {
          const btn = document.createElement("button");
          btn.textContent = verdict;
          btn.addEventListener("click", async () => {
            try {
              await call(`/aotx/v1/memory/pending/${p.id}/${verdict}`, { method: "POST" });
            } catch (err) { show(explain(err)); }
            refreshMemory();
          });
          li.append(btn);
        }
        ul.append(li);
      }
    } catch (err) {
      $("memory-saved").textContent = explain(err);
    }
  }

  $("memory-erase").addEventListener("click", async () => {
    try { await call("/aotx/v1/memory", { method: "DELETE" }); } catch (err) { show(explain(err)); }
    refreshMemory();
  });
  setInterval(() => { if (token) refreshMemory(); }, 3000);
})();
