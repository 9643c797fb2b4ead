// The live dashboard: polls /stats (the process's Prometheus metrics as JSON) every second and
// charts rates and latency percentiles over a sliding window, for a server or a gateway.
import uPlot from "./vendor/uPlot.esm.js";
import { getJSON } from "./api.js";

const POINTS = 120; // two minutes of history
const WINDOW_S = 10; // percentiles and hit rates over the last ten seconds
const COLORS = ["#2455d6", "#d6602a", "#2a9d5c", "#8a3fd1"];

const snapshots = []; // {time, samples}, oldest first

function total(snapshot, name, keep = () => true) {
  return (snapshot?.samples[name] || []).filter((s) => keep(s.labels)).reduce((sum, s) => sum + s.value, 0);
}

/** The snapshot about `seconds` before the newest one (the oldest we have if not that old). */
function before(seconds) {
  const newest = snapshots.at(-1);
  return snapshots.findLast((s) => newest.time - s.time >= seconds) || snapshots[0];
}

function rate(name, seconds = 3, keep) {
  const now = snapshots.at(-1), then = before(seconds);
  const dt = now.time - then.time;
  return dt > 0 ? (total(now, name, keep) - total(then, name, keep)) / dt : null;
}

function ratio(part, whole, seconds = WINDOW_S) {
  const now = snapshots.at(-1), then = before(seconds);
  const denominator = total(now, whole) - total(then, whole);
  return denominator > 0 ? (total(now, part) - total(then, part)) / denominator : null;
}

/** Quantile q (in ms) of a histogram's observations in the window, interpolated in its bucket. */
function quantile(histogram, q, seconds = WINDOW_S, keep = () => true) {
  const counts = (snapshot) => {
    const byBound = new Map();
    for (const s of (snapshot.samples[`${histogram}_bucket`] || []).filter((s) => keep(s.labels))) {
      byBound.set(s.labels.le, (byBound.get(s.labels.le) || 0) + s.value);
    }
    return byBound;
  };
  const now = counts(snapshots.at(-1)), then = counts(before(seconds));
  const buckets = [...now].map(([le, n]) => [Number(le === "+Inf" ? Infinity : le), n - (then.get(le) || 0)])
    .sort((a, b) => a[0] - b[0]);
  const count = buckets.at(-1)?.[1] || 0;
  if (count <= 0) return null;
  let lower = 0, below = 0;
  for (const [bound, cumulative] of buckets) {
    if (cumulative >= q * count) {
      if (bound === Infinity) return lower * 1000;
      const inBucket = cumulative - below;
      return (lower + (bound - lower) * (inBucket > 0 ? (q * count - below) / inBucket : 1)) * 1000;
    }
    lower = bound;
    below = cumulative;
  }
  return null;
}

const SERVER = {
  tiles: [
    ["running", () => total(snapshots.at(-1), "hyperserve:num_requests_running"), 0],
    ["waiting", () => total(snapshots.at(-1), "hyperserve:num_requests_waiting"), 0],
    ["KV cache used", () => 100 * total(snapshots.at(-1), "hyperserve:kv_cache_usage_perc"), 1, "%"],
    ["output tok/s", () => rate("hyperserve:generation_tokens_total"), 1],
    ["TTFT p50", () => quantile("hyperserve:time_to_first_token_seconds", 0.5), 0, " ms"],
    ["ITL p50", () => quantile("hyperserve:inter_token_latency_seconds", 0.5), 1, " ms"],
    ["requests done", () => total(snapshots.at(-1), "hyperserve:request_success_total"), 0],
    ["batches running", () => total(snapshots.at(-1), "hyperserve:batches_running"), 0],
  ],
  charts: [
    ["Time to first token (ms)", ["p50", () => quantile("hyperserve:time_to_first_token_seconds", 0.5)],
      ["p95", () => quantile("hyperserve:time_to_first_token_seconds", 0.95)]],
    ["Inter-token latency (ms)", ["p50", () => quantile("hyperserve:inter_token_latency_seconds", 0.5)],
      ["p95", () => quantile("hyperserve:inter_token_latency_seconds", 0.95)]],
    ["Throughput (tokens/s)", ["output", () => rate("hyperserve:generation_tokens_total")],
      ["prompt", () => rate("hyperserve:prompt_tokens_total")]],
    ["Requests", ["running", () => total(snapshots.at(-1), "hyperserve:num_requests_running")],
      ["waiting", () => total(snapshots.at(-1), "hyperserve:num_requests_waiting")]],
    ["KV cache (% of the pool)", ["used", () => 100 * total(snapshots.at(-1), "hyperserve:kv_cache_usage_perc")],
      ["written", () => 100 * total(snapshots.at(-1), "hyperserve:kv_cache_touched_perc")]],
    ["Hit rates (%)",
      ["prefix cache", () => pct(ratio("hyperserve:prefix_cache_hits_total", "hyperserve:prefix_cache_queries_total"))],
      ["speculative acceptance", () => pct(ratio("hyperserve:spec_decode_num_accepted_tokens_total",
        "hyperserve:spec_decode_num_draft_tokens_total"))]],
  ],
};

const REQUESTS = "hyperserve:gateway_requests_total";
const cacheIs = (prefix) => (labels) => labels.cache.startsWith(prefix);
const GATEWAY = {
  tiles: [
    ["requests/s", () => rate(REQUESTS), 1],
    ["cache hits/s", () => rate(REQUESTS, 3, cacheIs("hit")), 1],
    ["backends up", () => total(snapshots.at(-1), "hyperserve:gateway_backend_up"), 0],
    ["backend p50", () => quantile("hyperserve:gateway_backend_latency_seconds", 0.5), 0, " ms"],
    ["batches running", () => total(snapshots.at(-1), "hyperserve:batches_running"), 0],
  ],
  charts: [
    ["Requests/s by cache outcome", ["exact hit", () => rate(REQUESTS, 3, cacheIs("hit-exact"))],
      ["semantic hit", () => rate(REQUESTS, 3, cacheIs("hit-semantic"))], ["miss", () => rate(REQUESTS, 3, cacheIs("miss"))],
      ["bypass", () => rate(REQUESTS, 3, cacheIs("bypass"))]],
    ["Backend latency (ms)", ["p50", () => quantile("hyperserve:gateway_backend_latency_seconds", 0.5)],
      ["p95", () => quantile("hyperserve:gateway_backend_latency_seconds", 0.95)]],
    ["Gateway overhead (ms)", ["p50", () => quantile("hyperserve:gateway_overhead_seconds", 0.5)],
      ["p95", () => quantile("hyperserve:gateway_overhead_seconds", 0.95)]],
    ["Backend errors/s", ["errors", () => rate("hyperserve:gateway_backend_errors_total")]],
  ],
};

function chartWidth(box) {
  return Math.max(240, box.clientWidth - 20);
}

function pct(value) {
  return value === null ? null : 100 * value;
}

function chart(title, series) {
  const box = document.createElement("section");
  box.className = "chart";
  box.setAttribute("aria-label", title);
  const heading = document.createElement("h2");
  heading.textContent = title;
  box.append(heading);
  document.getElementById("dashboard").append(box);
  const data = [[], ...series.map(() => [])];
  const plot = new uPlot({
    width: chartWidth(box), height: 180,
    scales: { x: { time: true } },
    series: [{}, ...series.map(([label], i) => ({ label, stroke: COLORS[i], width: 2, spanGaps: true }))],
    axes: [{}, { size: 50 }],
  }, data, box);
  return { data, plot, series, box };
}

function backendsTable() {
  const rows = (snapshots.at(-1).samples["hyperserve:gateway_backend_up"] || []).map((s) => {
    const row = document.createElement("tr");
    const latency = quantile("hyperserve:gateway_backend_latency_seconds", 0.5, WINDOW_S,
      (labels) => labels.backend === s.labels.backend);
    for (const text of [s.labels.backend, s.value ? "up" : "down", latency === null ? "–" : `${latency.toFixed(0)} ms`]) {
      row.append(Object.assign(document.createElement("td"), { textContent: text }));
    }
    return row;
  });
  document.querySelector("#backends tbody").replaceChildren(...rows);
}

async function main() {
  const { kind } = await getJSON("kind.json");
  snapshots.push(await getJSON("/stats"));
  // A gateway in front of its own process's engine (serve --response-cache) shows the engine too.
  const withEngine = kind === "gateway" && "hyperserve:num_requests_running" in snapshots[0].samples;
  const layout = kind !== "gateway" ? SERVER : withEngine ? {
    tiles: [...GATEWAY.tiles, ...SERVER.tiles], charts: [...GATEWAY.charts, ...SERVER.charts],
  } : GATEWAY;
  const charts = layout.charts.map(([title, ...series]) => chart(title, series));
  if (kind === "gateway") {
    const section = document.createElement("section");
    section.className = "backends";
    section.id = "backends";
    section.innerHTML = "<h2>Backends</h2><table><thead><tr><th>backend</th><th>circuit</th>" +
      "<th>latency p50</th></tr></thead><tbody></tbody></table>";
    document.getElementById("dashboard").append(section);
  }
  window.addEventListener("resize", () => charts.forEach((c) => c.plot.setSize({ width: chartWidth(c.box), height: 180 })));
  const tiles = document.getElementById("tiles");
  for (;;) {
    tiles.replaceChildren(...layout.tiles.map(([label, value, digits, unit = ""]) => {
      const v = value();
      const tile = Object.assign(document.createElement("div"), { className: "tile" });
      tile.append(Object.assign(document.createElement("span"), { textContent: label }),
        Object.assign(document.createElement("strong"), { textContent: v === null ? "–" : `${v.toFixed(digits)}${unit}` }));
      return tile;
    }));
    for (const c of charts) {
      c.data[0].push(snapshots.at(-1).time);
      c.series.forEach(([, value], i) => c.data[i + 1].push(value()));
      if (c.data[0].length > POINTS) c.data.forEach((column) => column.shift());
      c.plot.setData(c.data);
      c.box.dataset.points = String(c.data[1].filter((v) => v !== null && v > 0).length);
    }
    if (kind === "gateway") backendsTable();
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    await new Promise((resolve) => setTimeout(resolve, 1000));
    snapshots.push(await getJSON("/stats"));
    if (snapshots.length > POINTS + WINDOW_S) snapshots.shift();
  }
}

main();
