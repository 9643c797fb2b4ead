// What both pages need from the server: the API key (asked for once, kept in this browser), fetch
// with it, and a streamed chat completion over the WebSocket (HTTP server-sent events where the
// server refuses sockets because rate limits or guardrails are configured).

const KEY_STORAGE = "hyperserve.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

function keyDialog() {
  let dialog = document.getElementById("key-dialog");
  if (!dialog) {
    dialog = Object.assign(document.createElement("dialog"), { id: "key-dialog" });
    dialog.innerHTML = '<form method="dialog"><p data-key-message></p><label>API key ' +
      '<input type="password" autocomplete="off" required></label><button type="submit">Save</button></form>';
    document.body.append(dialog);
  }
  return dialog;
}

/** Shows the key dialog and resolves once a key is saved (the page retries what needed it). */
export function askForKey(message = "This server needs an API key.") {
  const dialog = keyDialog();
  dialog.querySelector("[data-key-message]").textContent = message;
  const input = dialog.querySelector("input");
  input.value = apiKey();
  dialog.showModal();
  input.focus();
  return new Promise((resolve) => {
    dialog.querySelector("form").onsubmit = (event) => {
      event.preventDefault();
      localStorage.setItem(KEY_STORAGE, input.value.trim());
      dialog.close();
      resolve();
    };
  });
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

/** fetch(path, options) with the key; on 401 asks for a key and tries again; throws the error's message. */
export async function request(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: headers(options.headers) });
    if (response.status === 401) {
      await askForKey((await errorMessage(response)) || "This server needs an API key.");
      continue;
    }
    if (!response.ok) throw new Error(`${path}: ${response.status} ${await errorMessage(response)}`);
    return response;
  }
}

/** GET path as JSON. */
export async function getJSON(path) {
  return (await request(path)).json();
}

/** POST a JSON body (or a FormData) to path; the answer as JSON. */
export async function postJSON(path, body) {
  const form = body instanceof FormData;
  return (await request(path, {
    method: "POST",
    headers: form ? {} : { "Content-Type": "application/json" },
    body: form ? body : JSON.stringify(body),
  })).json();
}

async function errorMessage(response) {
  try {
    return (await response.json()).error?.message || "";
  } catch {
    return "";
  }
}

/**
 * Streams a chat completion. handlers: chunk(data) for each OpenAI chunk, done({cancelled}),
 * error(message, status). Returns {cancel()}, which stops generation on the server.
 */
export function streamChat(body, handlers) {
  const stream = { cancel: () => {} };
  const viaHTTP = () => Object.assign(stream, streamOverHTTP(body, handlers));
  const requestId = `ui-${Date.now()}-${Math.random().toString(16).slice(2, 8)}`;
  const protocols = ["hyperserve"];
  if (apiKey()) protocols.push(`bearer.${apiKey()}`);
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/ws`;
  let socket;
  try {
    socket = new WebSocket(url, protocols);
  } catch {
    return viaHTTP(); // a key the subprotocol syntax cannot carry
  }
  let finished = false;
  let opened = false;
  const finish = (result) => {
    if (finished) return;
    finished = true;
    socket.close();
    handlers.done(result);
  };
  socket.onopen = () => (opened = true) && socket.send(JSON.stringify({ type: "chat.completions", request_id: requestId, body }));
  socket.onmessage = (event) => {
    const message = JSON.parse(event.data);
    if (message.type === "chunk") handlers.chunk(message.data);
    else if (message.type === "done") finish({ cancelled: false });
    else if (message.type === "cancelled") finish({ cancelled: true });
    else if (message.type === "error") {
      finished = true;
      socket.close();
      handlers.error(message.error?.message || "error", message.status);
    }
  };
  socket.onclose = (event) => {
    if (finished) return;
    // Refused for limits or guardrails, or no socket endpoint at all (an older server): HTTP instead.
    if (event.reason.startsWith("use HTTP") || (!opened && event.reason === "")) viaHTTP();
    else {
      finished = true;
      handlers.error(event.reason || "the connection closed", event.reason === "invalid API key" ? 401 : 0);
    }
  };
  stream.cancel = () => {
    if (socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "cancel", request_id: requestId }));
  };
  return stream;
}

function streamOverHTTP(body, handlers) {
  const controller = new AbortController();
  (async () => {
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers({ "Content-Type": "application/json" }),
        body: JSON.stringify({ ...body, stream: true }),
        signal: controller.signal,
      });
      if (!response.ok) return handlers.error(await errorMessage(response), response.status);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        const events = buffer.split("\n\n");
        buffer = events.pop();
        for (const event of events) {
          const data = event.replace(/^data: /, "");
          if (data === "[DONE]") return handlers.done({ cancelled: false });
          const chunk = JSON.parse(data);
          if (chunk.error) return handlers.error(chunk.error.message, 500);
          handlers.chunk(chunk);
        }
      }
      handlers.done({ cancelled: false });
    } catch (error) {
      if (error.name === "AbortError") handlers.done({ cancelled: true });
      else handlers.error(String(error), 0);
    }
  })();
  return { cancel: () => controller.abort() };
}
