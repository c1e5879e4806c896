// The draftwise playground: a streaming chat against this server's OpenAI-compatible API that shows
// what speculative decoding did - every accepted draft token coloured by the drafter that proposed
// it, the accepted drafts per step, and the request's own counters (usage.spec_decode). No
// framework, no build step; model output enters the page as text nodes only (see markdown.js).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const STORE = "draftwise.playground.v1";
  const KEY_STORE = "draftwise.playground.api_key";
  const NUMBERS = ["temperature", "top_p", "top_k", "max_tokens", "seed", "response_format", "json_schema",
    "tools", "tool_choice"];
  const CHECKS = ["speculate", "markdown"];
  const HINTS = {
    400: "The server refused the request",
    401: "The server needs an API key (Settings)",
    413: "The request is too large for this server",
    429: "The server is busy; try again in a moment",
    503: "The server is not taking requests right now (starting or shutting down)",
  };
  let state = load();
  let controller = null;
  let modelName = null;

  // --- persistence ------------------------------------------------------------------------------
  function load() {
    try {
      const s = JSON.parse(localStorage.getItem(STORE) || "null");
      if (s && Array.isArray(s.messages)) return { messages: s.messages, settings: s.settings || {} };
    } catch (e) { /* a corrupt entry starts a fresh conversation */ }
    return { messages: [], settings: {} };
  }

  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(state));
    } catch (e) { /* storage full or disabled: the page still works */ }
  }

  function restoreSettings() {
    for (const k of NUMBERS) if (state.settings[k] !== undefined) $(k).value = state.settings[k];
    for (const k of CHECKS) if (state.settings[k] !== undefined) $(k).checked = !!state.settings[k];
    $("api_key").value = sessionStorage.getItem(KEY_STORE) || "";
    for (const k of NUMBERS.concat(CHECKS)) {
      $(k).addEventListener("change", () => {
        state.settings[k] = $(k).type === "checkbox" ? $(k).checked : $(k).value;
        save();
        if (k === "markdown") renderAll();
      });
    }
    $("api_key").addEventListener("change", () => sessionStorage.setItem(KEY_STORE, $("api_key").value));
  }

  // --- requests ---------------------------------------------------------------------------------
  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = $("api_key").value.trim();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function parsedSetting(id, what) {
    try {
      return JSON.parse($(id).value);
    } catch (e) {
      const err = new Error("The " + what + " in Settings is not valid JSON: " + e.message);
      err.status = 0;
      throw err;
    }
  }

  function samplingFields(speculate) {
    const body = { speculate: speculate };
    const num = (k) => ($(k).value === "" ? null : Number($(k).value));
    for (const k of ["temperature", "top_p"]) if (num(k) !== null) body[k] = num(k);
    for (const k of ["top_k", "max_tokens", "seed"]) if (num(k) !== null) body[k] = Math.trunc(num(k));
    const fmt = $("response_format").value;
    if (fmt === "json_object") body.response_format = { type: "json_object" };
    if (fmt === "json_schema") {
      body.response_format = { type: "json_schema",
        json_schema: { name: "schema", schema: parsedSetting("json_schema", "JSON schema") } };
    }
    if ($("tools").value.trim()) {
      body.tools = parsedSetting("tools", "tools list");
      body.tool_choice = $("tool_choice").value;
    }
    return body;
  }

  async function httpError(r) {
    let msg = r.statusText || "request failed";
    try {
      const j = await r.json();
      if (j && j.error && j.error.message) msg = j.error.message;
    } catch (e) { /* not JSON */ }
    const err = new Error((HINTS[r.status] || "The request failed") + " (HTTP " + r.status + "): " + msg);
    err.status = r.status;
    return err;
  }

  // POST a streamed chat completion; calls onChunk(obj) per event; resolves at [DONE]
  async function streamChat(messages, speculate, onChunk, signal) {
    const body = Object.assign({ messages: messages, stream: true,
      stream_options: { include_usage: true, include_spec_trace: true } }, samplingFields(speculate));
    if (modelName) body.model = modelName;
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(body), signal: signal });
    if (!r.ok) throw await httpError(r);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          const obj = JSON.parse(data);
          if (obj.error) {
            const err = new Error("The request failed: " + obj.error.message);
            err.status = 500;
            throw err;
          }
          onChunk(obj);
        }
      }
    }
  }

  // --- rendering --------------------------------------------------------------------------------
  function cssName(s) {
    return String(s).toLowerCase().replace(/[^a-z0-9]+/g, "-");
  }

  function tokenSpan(sp) {
    const el = document.createElement("span");
    el.className = "tok " + (sp.draft ? "draft src-" + cssName(sp.source) : "own");
    el.dataset.token = String(sp.token);
    el.dataset.step = String(sp.step);
    if (sp.draft) {
      el.dataset.source = sp.source;
      el.title = "accepted " + sp.source + " draft, step " + sp.step;
    } else {
      el.title = "target, step " + sp.step;
    }
    el.textContent = sp.text;
    return el;
  }

  function toolSpan(text) {
    const el = document.createElement("span");
    el.className = "toolcall";
    el.textContent = text;
    return el;
  }

  function fillBody(body, msg) {
    body.replaceChildren();
    const md = msg.role === "assistant" && $("markdown").checked;
    body.classList.toggle("markdown", md);
    if (md) {
      body.appendChild(window.renderMarkdown(msg.content || ""));
    } else if (msg.role === "assistant" && Array.isArray(msg.trace)) {
      for (const sp of msg.trace) body.appendChild(tokenSpan(sp));
      if (msg.toolCalls) body.appendChild(toolSpan(msg.toolCalls));
    } else {
      body.textContent = msg.content || "";
    }
  }

  function acceptedPerStep(trace) {
    const seen = new Set(), per = [];
    for (const sp of trace || []) {
      if (seen.has(sp.token)) continue;
      seen.add(sp.token);
      while (per.length <= sp.step) per.push(0);
      if (sp.draft) per[sp.step] += 1;
    }
    return per;
  }

  function fillSteps(el, msg) {
    el.replaceChildren();
    for (const n of acceptedPerStep(msg.trace)) {
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.height = (2 + 4 * n) + "px";
      bar.title = n + " accepted";
      el.appendChild(bar);
    }
  }

  function fillStats(el, st) {
    el.replaceChildren();
    if (!st) return;
    el.dataset.completionTokens = String(st.tokens);
    el.dataset.numDrafts = String(st.drafts);
    el.dataset.numDraftTokens = String(st.draftTokens);
    el.dataset.numAcceptedTokens = String(st.accepted);
    const parts = [st.tokens + " tokens", st.tps.toFixed(1) + " tokens/s",
      "drafted " + st.draftTokens + " / accepted " + st.accepted,
      "mean acceptance length " + st.mal.toFixed(2)];
    if (st.ttft !== null && st.ttft !== undefined) parts.push("first token " + st.ttft + " ms");
    if (st.stopped) parts.push("stopped");
    el.textContent = parts.join(" · ");
  }

  function messageElement(msg) {
    const el = document.createElement("div");
    el.className = "msg " + msg.role;
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = msg.role;
    const body = document.createElement("div");
    body.className = "body";
    el.append(role, body);
    fillBody(body, msg);
    if (msg.role === "assistant") {
      const stats = document.createElement("div");
      stats.className = "stats";
      const steps = document.createElement("div");
      steps.className = "steps";
      el.append(stats, steps);
      fillStats(stats, msg.stats);
      fillSteps(steps, msg);
    }
    return el;
  }

  function renderAll() {
    $("messages").replaceChildren(...state.messages.map(messageElement));
  }

  function showError(text) {
    $("error").textContent = text;
    $("error").hidden = !text;
  }

  function busy(on) {
    $("send").disabled = on;
    $("compare").disabled = on;
    $("stop").disabled = !on;
  }

  function statsFrom(usage, timings, trace, ttft, liveTps) {
    const sd = usage && usage.spec_decode;
    const tokens = new Set((trace || []).map((s) => s.token));
    const accepted = (trace || []).filter((s, i, a) => s.draft && a.findIndex((t) => t.token === s.token) === i).length;
    return {
      tokens: usage ? usage.completion_tokens : tokens.size,
      drafts: sd ? sd.num_drafts : 0,
      draftTokens: sd ? sd.num_draft_tokens : 0,
      accepted: sd ? sd.num_accepted_tokens : accepted,
      mal: sd ? sd.mean_acceptance_length : 1,
      tps: timings ? timings.predicted_per_second : liveTps,
      ttft: ttft,
    };
  }

  // one streamed answer into `msg` (rendered in `el`); returns when done, stopped or failed
  async function answer(history, speculate, msg, el, signal) {
    const t0 = performance.now();
    let tFirst = null, usage = null, timings = null;
    const body = el.querySelector(".body"), stats = el.querySelector(".stats"), steps = el.querySelector(".steps");
    const live = () => {
      const n = new Set(msg.trace.map((s) => s.token)).size;
      const dt = tFirst === null ? 0 : (performance.now() - tFirst) / 1000;
      return n > 1 && dt > 0 ? (n - 1) / dt : 0;
    };
    try {
      await streamChat(history, speculate, (obj) => {
        const ch = obj.choices && obj.choices[0];
        if (ch) {
          const text = ch.delta && ch.delta.content;
          for (const call of (ch.delta && ch.delta.tool_calls) || []) {
            const t = "tool call: " + call.function.name + "(" + call.function.arguments + ")";
            msg.toolCalls = (msg.toolCalls || "") + t;
            msg.content += t;
            body.appendChild(toolSpan(t));
          }
          if (text) {
            if (tFirst === null) tFirst = performance.now();
            msg.content += text;
          }
          if (Array.isArray(ch.spec_trace)) {
            for (const sp of ch.spec_trace) {
              const c = { token: sp.token, text: sp.text, draft: sp.draft, source: sp.source, step: sp.step };
              msg.trace.push(c);
              if (!body.classList.contains("markdown")) body.appendChild(tokenSpan(c));
            }
          }
          if (body.classList.contains("markdown") && text) fillBody(body, msg);
        }
        if (obj.usage) usage = obj.usage;
        if (obj.timings) timings = obj.timings;
        fillStats(stats, statsFrom(usage, timings, msg.trace,
          tFirst === null ? null : Math.round(tFirst - t0), live()));
        fillSteps(steps, msg);
      }, signal);
    } catch (e) {
      if (e.name !== "AbortError") throw e;
      msg.stopped = true;
    } finally {
      msg.stats = statsFrom(usage, timings, msg.trace, tFirst === null ? null : Math.round(tFirst - t0), live());
      msg.stats.stopped = !!msg.stopped;
      msg.seconds = (performance.now() - t0) / 1000;
      fillStats(stats, msg.stats);
      fillSteps(steps, msg);
    }
  }

  function chatHistory() {
    return state.messages.filter((m) => m.content).map((m) => ({ role: m.role, content: m.content }));
  }

  async function send(ev) {
    if (ev) ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    showError("");
    $("compare-result").hidden = true;
    state.messages.push({ role: "user", content: text });
    const history = chatHistory();
    const msg = { role: "assistant", content: "", trace: [], stats: null };
    state.messages.push(msg);
    $("prompt").value = "";
    $("messages").append(messageElement(state.messages[state.messages.length - 2]));
    const el = messageElement(msg);
    $("messages").append(el);
    controller = new AbortController();
    busy(true);
    try {
      await answer(history, $("speculate").checked, msg, el, controller.signal);
    } catch (e) {
      showError(e.message);
      if (!msg.content) {                     // nothing came back: drop the empty answer
        state.messages.pop();
        el.remove();
      }
    } finally {
      controller = null;
      busy(false);
      save();
    }
  }

  // the same prompt with and without speculation, side by side
  async function compare() {
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    showError("");
    const box = $("compare-result");
    box.replaceChildren();
    box.hidden = false;
    const history = chatHistory().concat([{ role: "user", content: text }]);
    controller = new AbortController();
    busy(true);
    const runs = [];
    try {
      for (const speculate of [true, false]) {
        const msg = { role: "assistant", content: "", trace: [], stats: null };
        const el = messageElement(msg);
        el.classList.add(speculate ? "with-speculation" : "without-speculation");
        el.querySelector(".role").textContent = speculate ? "with speculation" : "without speculation";
        box.append(el);
        await answer(history, speculate, msg, el, controller.signal);
        const t = document.createElement("div");
        t.className = "stats time";
        t.textContent = "wall time " + msg.seconds.toFixed(2) + " s";
        el.append(t);
        runs.push(msg);
      }
      const verdict = document.createElement("div");
      verdict.className = "verdict";
      const same = runs[0].content === runs[1].content;
      const greedy = Number($("temperature").value || 0) === 0;
      verdict.dataset.identical = String(same);
      verdict.textContent = (same ? "identical texts" : "the texts differ") +
        (greedy ? " (greedy: speculation must not change the output)" : " (sampled: texts may differ)") +
        " · speed-up " + (runs[1].seconds / runs[0].seconds).toFixed(2) + "x";
      box.prepend(verdict);
    } catch (e) {
      showError(e.message);
    } finally {
      controller = null;
      busy(false);
    }
  }

  async function loadModel() {
    try {
      const r = await fetch("/v1/models", { headers: headers() });
      if (!r.ok) throw await httpError(r);
      const j = await r.json();
      const m = j.data && j.data[0];
      modelName = m ? m.id : null;
      $("model").textContent = m ? m.id + " (context " + m.max_model_len + " tokens)" : "no model";
    } catch (e) {
      $("model").textContent = "model unknown";
      showError(e.message);
    }
  }

  restoreSettings();
  renderAll();
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("compare").addEventListener("click", compare);
  $("clear").addEventListener("click", () => {
    state.messages = [];
    save();
    renderAll();
    $("compare-result").hidden = true;
  });
  $("api_key").addEventListener("change", loadModel);
  busy(false);
  loadModel();
})();
