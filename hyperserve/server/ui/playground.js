// The chat playground: a conversation kept in this browser, streamed answers rendered as
// Markdown (sanitized: a model's output is never trusted HTML), and each answer's time to first
// token, tokens per second and cached prompt tokens.
import { marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.mjs";
import { askForKey, getJSON, streamChat } from "./api.js";

const CONVERSATION_STORAGE = "hyperserve.conversation";
const $ = (id) => document.getElementById(id);
const SETTINGS = ["model", "system", "temperature", "top_p", "max_tokens", "seed", "stop", "response_format", "schema",
  "tools"];

let conversation = JSON.parse(localStorage.getItem(CONVERSATION_STORAGE) || "[]");
let running = null; // the stream of the answer being generated

function save() {
  localStorage.setItem(CONVERSATION_STORAGE, JSON.stringify(conversation));
  for (const id of SETTINGS) localStorage.setItem(`hyperserve.setting.${id}`, $(id).value);
}

function render(message, item) {
  item.className = message.role;
  const body = document.createElement("div");
  body.className = "content";
  if (message.role === "assistant") {
    body.innerHTML = DOMPurify.sanitize(marked.parse(message.content || ""));
    for (const call of message.tool_calls || []) {
      const pre = document.createElement("pre");
      pre.textContent = `${call.function.name}(${call.function.arguments})`;
      body.append(pre);
    }
  } else {
    body.textContent = message.content;
  }
  const stats = document.createElement("p");
  stats.className = "stats";
  stats.textContent = message.stats || "";
  item.replaceChildren(body, stats);
}

function show() {
  $("messages").replaceChildren(...conversation.map((message) => {
    const item = document.createElement("li");
    render(message, item);
    return item;
  }));
}

function requestBody() {
  const messages = [];
  if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
  for (const { role, content } of conversation) messages.push({ role, content });
  const body = {
    model: $("model").value,
    messages,
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
    stream_options: { include_usage: true },
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const stop = $("stop").value.split("\n").filter((s) => s);
  if (stop.length) body.stop = stop;
  if ($("response_format").value === "json_object") body.response_format = { type: "json_object" };
  if ($("response_format").value === "json_schema") {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse($("schema").value) } };
  }
  if ($("tools").value.trim()) body.tools = JSON.parse($("tools").value);
  return body;
}

function generating(on) {
  $("send").hidden = on;
  $("stop-button").hidden = !on;
  if (on) $("stop-button").focus();
  else $("prompt").focus();
}

function send(text) {
  let body;
  try {
    conversation.push({ role: "user", content: text });
    body = requestBody();
  } catch (error) {
    conversation.pop();
    alert(`A setting is not valid JSON: ${error.message}`);
    return;
  }
  const answer = { role: "assistant", content: "", tool_calls: [], stats: "waiting…" };
  conversation.push(answer);
  show();
  const item = $("messages").lastElementChild;
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  const calls = {};
  generating(true);
  const finish = (note) => {
    const seconds = (performance.now() - (firstToken ?? started)) / 1000;
    const parts = [];
    if (firstToken !== null) parts.push(`TTFT ${Math.round(firstToken - started)} ms`);
    if (usage) {
      if (usage.completion_tokens > 1 && seconds > 0) parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
      parts.push(`${usage.completion_tokens} tokens`, `${usage.prompt_tokens_details?.cached_tokens ?? 0} cached`);
    }
    if (note) parts.push(note);
    answer.stats = parts.join(" · ");
    answer.tool_calls = Object.values(calls);
    render(answer, item);
    running = null;
    generating(false);
    save();
  };
  running = streamChat(body, {
    chunk(data) {
      if (data.usage) usage = data.usage;
      const delta = data.choices?.[0]?.delta;
      if (!delta) return;
      if (delta.content || delta.tool_calls) firstToken ??= performance.now();
      answer.content += delta.content || "";
      for (const call of delta.tool_calls || []) {
        const known = (calls[call.index] ??= { function: { name: "", arguments: "" } });
        known.function.name += call.function?.name || "";
        known.function.arguments += call.function?.arguments || "";
      }
      answer.tool_calls = Object.values(calls);
      answer.stats = "generating…";
      render(answer, item);
      item.scrollIntoView({ block: "end" });
    },
    done({ cancelled }) {
      finish(cancelled ? "stopped" : "");
    },
    error(message, status) {
      finish(`error: ${message}`);
      if (status === 401) askForKey(message);
    },
  });
}

async function loadModels() {
  const { data } = await getJSON("/v1/models");
  const chosen = localStorage.getItem("hyperserve.setting.model");
  const chat = data.filter((card) => card.task !== "embed"); // an embedding model cannot chat
  $("model").replaceChildren(...chat.map((card) => {
    const option = new Option(card.parent ? `${card.id} (adapter of ${card.parent})` : card.id, card.id);
    option.selected = card.id === chosen;
    return option;
  }));
}

for (const id of SETTINGS) {
  const stored = localStorage.getItem(`hyperserve.setting.${id}`);
  if (stored !== null && id !== "model") $(id).value = stored;
  $(id).addEventListener("change", save);
}
$("schema-field").hidden = $("response_format").value !== "json_schema";
$("response_format").addEventListener("change", () => {
  $("schema-field").hidden = $("response_format").value !== "json_schema";
});
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop-button").addEventListener("click", () => running?.cancel());
$("clear").addEventListener("click", () => {
  conversation = [];
  save();
  show();
});
$("key-button").addEventListener("click", () => askForKey("The API key this browser sends.").then(loadModels));
show();
loadModels();
