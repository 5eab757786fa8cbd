// kvserve's playground: chat over /v1/chat/completions (SSE), each token shaded by its probability, and the
// KV cache's slots from GET /slots once a second. Plain JavaScript; every request goes to this server.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // the conversation: {role, content}
let controller = null;  // aborts the running request (Stop)
const timing = { sent: null, first: null };  // performance.now() at Send and at the first token, for the tests' log
window.kvserveTiming = timing;

$("key").value = localStorage.getItem("kvserve-key") || "";
$("key").addEventListener("change", () => localStorage.setItem("kvserve-key", $("key").value));

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("key").value) h.Authorization = `Bearer ${$("key").value}`;
  return h;
}

function showError(text) { $("error").textContent = text; }

function number(id) {
  const value = $(id).value;
  return value === "" ? undefined : Number(value);
}

function body() {
  const messages = [];
  if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
  const request = {
    messages: messages.concat(history), stream: true, logprobs: true, top_logprobs: 5,
    temperature: number("temperature"), top_p: number("top_p"), top_k: number("top_k"), min_p: number("min_p"),
    max_tokens: number("max_tokens"), seed: number("seed"),
  };
  const stops = $("stop_text").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stops.length) request.stop = stops;
  if ($("schema").value.trim()) {
    request.response_format = { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse($("schema").value) } };
  }
  return request;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  $("messages").appendChild(div);
  return div;
}

// One token as a span: the likelier, the lighter; the tooltip gives its logprob and the alternatives.
function tokenSpan(entry) {
  const span = document.createElement("span");
  span.className = "token";
  span.textContent = entry.token;
  const p = Math.exp(entry.logprob);
  span.style.background = `rgba(230, 120, 60, ${(1 - p) * 0.6})`;
  const alternatives = (entry.top_logprobs || []).map((t) => `${JSON.stringify(t.token)} ${t.logprob.toFixed(2)}`);
  span.title = `logprob ${entry.logprob.toFixed(3)} (p ${p.toFixed(3)})\n${alternatives.join("\n")}`;
  return span;
}

async function generate() {
  showError("");
  const reply = addMessage("assistant", "");
  let text = "";
  controller = new AbortController();
  timing.sent = performance.now();
  timing.first = null;
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body()), signal: controller.signal,
    });
    if (!response.ok) {
      const error = await response.json();
      throw new Error(error.error && error.error.message ? error.error.message : response.statusText);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: ?/, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices) {
          const piece = choice.delta.content || "";
          if (piece && timing.first === null) timing.first = performance.now();
          text += piece;
          const entries = choice.logprobs ? choice.logprobs.content : [];
          if (entries.length) entries.forEach((entry) => reply.appendChild(tokenSpan(entry)));
          else if (piece) reply.appendChild(document.createTextNode(piece));
        }
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") showError(String(error.message || error));
  } finally {
    history.push({ role: "assistant", content: text });
    reply.dataset.text = text;
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim()) return;
  history.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  $("prompt").value = "";
  generate();
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { history.length = 0; $("messages").textContent = ""; });
$("copy").addEventListener("click", () => {  // the last reply's text
  const last = [...history].reverse().find((m) => m.role === "assistant");
  if (last) navigator.clipboard.writeText(last.content).catch((error) => showError(`copy failed: ${error}`));
});
$("regenerate").addEventListener("click", () => {
  if (history.length && history[history.length - 1].role === "assistant") {
    history.pop();
    $("messages").lastChild.remove();
  }
  if (history.length) generate();
});

let last = null;  // the previous refresh's token count and time: tokens/s between refreshes

function bytes(n) { return n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${(n / 1024).toFixed(1)} KiB`; }

async function refreshSlots() {
  try {
    const response = await fetch("/slots", { headers: headers() });
    if (!response.ok) return;
    const view = await response.json();
    const cache = view.kv_cache;
    $("usage").textContent = `${bytes(cache.used_bytes)} used, ${bytes(cache.kept_bytes)} kept of ` +
      `${bytes(cache.capacity_bytes)} (MHA would need ${bytes(cache.mha_capacity_bytes)}); ` +
      `${view.running} running, ${view.waiting} waiting`;
    $("slots").textContent = "";
    for (const slot of view.slots) {
      const row = document.createElement("div");
      row.className = `slot ${slot.state}`;
      row.dataset.state = slot.state;
      const age = slot.age_s === null ? "" : `, ${slot.age_s.toFixed(1)} s`;
      const held = slot.state === "free" ? `${slot.kept} tokens kept for reuse` : `${slot.tokens} tokens`;
      row.textContent = `slot ${slot.slot}: ${slot.state}, ${held}${age}`;
      const bar = document.createElement("div");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.className = slot.state === "free" ? "kept" : "held";
      fill.style.width = `${(100 * (slot.tokens || slot.kept)) / view.max_seq_len}%`;
      bar.appendChild(fill);
      row.appendChild(bar);
      $("slots").appendChild(row);
    }
    const ms = (s) => (s === null ? "-" : `${(s * 1000).toFixed(1)} ms`);
    const now = performance.now();
    const rate = last ? ((view.generation_tokens_total - last.tokens) * 1000) / (now - last.at) : 0;
    last = { tokens: view.generation_tokens_total, at: now };
    $("figures").textContent = `${rate.toFixed(1)} tokens/s now; mean time to first token ` +
      `${ms(view.time_to_first_token_mean_s)}, mean inter-token latency ${ms(view.inter_token_latency_mean_s)}, ` +
      `${view.generation_tokens_total} tokens so far`;
  } catch (error) { /* the next refresh tries again */ }
}

// The cache's size as its formula, with this model's numbers, from /info.
fetch("/info", { headers: headers() }).then((r) => r.ok ? r.json() : null).then((info) => {
  if (!info) return;
  const c = info.kv_cache;
  $("formula").textContent = `2·B·L·T·h_kv·d_h·itemsize = 2 · ${c.B} · ${c.L} · ${c.T} · ${c.h_kv} · ${c.d_h} · ` +
    `${c.itemsize} = ${bytes(c.capacity_bytes)}; with all ${c.h_q} query heads as K/V heads (MHA): ` +
    `${bytes(c.mha_capacity_bytes)}`;
});
fetch("/v1/models", { headers: headers() }).then((r) => r.ok ? r.json() : null).then((models) => {
  if (models) $("model").textContent = models.data[0].id;
});
refreshSlots();
setInterval(refreshSlots, 1000);
