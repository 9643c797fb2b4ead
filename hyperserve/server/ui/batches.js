// The Batch API in the browser: upload a JSONL file of requests, start a batch over it, follow its
// progress, cancel it, download its results (the page polls GET /v1/batches every second).

import { getJSON, postJSON, request } from "./api.js";

const ACTIVE = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const rows = document.getElementById("batches");

document.getElementById("new-batch").addEventListener("submit", async (event) => {
  event.preventDefault();
  const error = document.getElementById("form-error");
  const start = document.getElementById("start");
  error.textContent = "";
  start.disabled = true;
  try {
    const form = new FormData();
    form.append("purpose", "batch");
    form.append("file", document.getElementById("file").files[0]);
    const file = await postJSON("/v1/files", form);
    await postJSON("/v1/batches", {
      input_file_id: file.id, endpoint: document.getElementById("endpoint").value, completion_window: "24h",
    });
    event.target.reset();
    await refresh();
  } catch (failure) {
    error.textContent = failure.message;
  } finally {
    start.disabled = false;
  }
});

async function download(fileId, name) {
  const blob = await (await request(`/v1/files/${fileId}/content`)).blob();
  const link = Object.assign(document.createElement("a"), { href: URL.createObjectURL(blob), download: name });
  link.click();
  URL.revokeObjectURL(link.href);
}

function cell(row, ...children) {
  const td = row.insertCell();
  td.append(...children);
  return td;
}

function button(text, onClick) {
  const b = Object.assign(document.createElement("button"), { type: "button", className: "quiet", textContent: text });
  b.addEventListener("click", onClick);
  return b;
}

function render(batches) {
  rows.replaceChildren();
  document.getElementById("none").hidden = batches.length > 0;
  for (const batch of batches) {
    const row = rows.insertRow();
    row.dataset.id = batch.id;
    row.dataset.status = batch.status;
    cell(row, batch.id);
    cell(row, batch.endpoint);
    const status = cell(row, batch.status);
    if (batch.errors) {
      const reasons = batch.errors.data.map((e) => (e.line ? `line ${e.line}: ` : "") + e.message);
      status.title = reasons.join("\n");
      status.append(Object.assign(document.createElement("div"), {
        className: "stats", textContent: reasons[0] + (reasons.length > 1 ? ` (and ${reasons.length - 1} more)` : ""),
      }));
    }
    const { total, completed, failed } = batch.request_counts;
    const bar = Object.assign(document.createElement("progress"), { max: total || 1, value: completed + failed });
    cell(row, bar, ` ${completed + failed} / ${total}` + (failed ? ` (${failed} failed)` : ""));
    cell(row, new Date(batch.created_at * 1000).toLocaleTimeString());
    const actions = cell(row);
    if (ACTIVE.has(batch.status) && batch.status !== "cancelling") {
      actions.append(button("Cancel", async () => { await postJSON(`/v1/batches/${batch.id}/cancel`, {}); refresh(); }));
    }
    if (batch.output_file_id) actions.append(button("Output", () => download(batch.output_file_id, `${batch.id}_output.jsonl`)));
    if (batch.error_file_id) actions.append(button("Errors", () => download(batch.error_file_id, `${batch.id}_errors.jsonl`)));
  }
}

async function refresh() {
  render((await getJSON("/v1/batches?limit=100")).data);
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

refresh();
setInterval(refresh, 1000);
