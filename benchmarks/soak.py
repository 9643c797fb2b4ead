"""Soak: a real server at twice its measured capacity, with cancelling and hostile clients.

First measures capacity (completed requests per second with `--capacity-concurrency` clients
streaming back to back), then sends Poisson arrivals at `--overload` times that rate for
`--duration-s`. Of the clients, 20% cancel mid-stream (they close the connection after a few
chunks) and 5% send a hostile request drawn from tests/reliability's table. Half the others speak
chat completions, a quarter each the Responses and the Messages API. Reports requests
served, 429/503s, 5xx (must be 0), crashes (must be 0), KV-cache usage once idle (must be 0),
RSS at start and end, and TTFT p50/p99 over time (a PNG). The KV pool's memory is first written as
the prefix cache fills it (engine/block_pool.py), so RSS grows toward the weights plus the whole
pool (printed beside it); growth past that would be a leak.

    python benchmarks/soak.py [--duration-s 600] [--server-args "--max-num-seqs 16"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.serving import start_server  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402
from tests.reliability.test_hostile_requests import CASES  # noqa: E402

PROMPTS = ["Write a short poem about the sea.", "Explain recursion to a child.", "List five fruits and their colours.",
           "What is the capital of Japan, and why is it famous?", "Summarise the plot of Hamlet in three lines.",
           "Give me three tips for writing clean Python code.", "Describe a sunrise over the mountains."]


@dataclass
class Outcome:
    started: float
    kind: str  # normal | cancel | hostile
    status: int | None = None  # None: the connection failed
    case: str | None = None  # the hostile request sent
    ttft: float | None = None
    completed: bool = False


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random) -> Outcome:
    outcome = Outcome(time.perf_counter(), kind)
    if kind == "hostile":
        outcome.case = rng.choice(sorted(CASES))
        path, body = CASES[outcome.case]
        raw = body if isinstance(body, bytes) else str(body).encode()
        kwargs = {"json": body} if isinstance(body, dict | list) else {
            "content": raw, "headers": {"content-type": "application/json"}}
        try:
            response = await client.post(path, **kwargs)
            outcome.status = response.status_code
        except httpx.HTTPError:
            pass
        return outcome
    api = rng.choice(("chat", "chat", "responses", "messages"))  # half chat, the translated APIs the rest
    path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                                          "max_tokens": rng.randint(16, 64), "temperature": 0.7, "stream": True}
    if api == "responses":
        path, body = "/v1/responses", {"input": body["messages"][0]["content"], "max_output_tokens": body["max_tokens"],
                                       "temperature": 0.7, "stream": True}
    elif api == "messages":
        path = "/v1/messages"
    cancel_after = rng.randint(1, 8) if kind == "cancel" else None
    try:
        async with client.stream("POST", path, json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return outcome
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event or event.get("type") == "error":  # the stream ended with an error event
                    detail = event["error"] if isinstance(event.get("error"), dict) else event
                    failure = detail.get("code") if api == "responses" else detail.get("type")
                    outcome.status = 503 if failure in ("service_unavailable", "overloaded_error") else 500
                    return outcome
                if api == "chat" or event.get("type") in ("response.output_text.delta", "content_block_delta"):
                    chunks += 1
                if outcome.ttft is None and chunks == (2 if api == "chat" else 1):  # chat's first: the role
                    outcome.ttft = time.perf_counter() - outcome.started
                if cancel_after is not None and chunks >= cancel_after:
                    return outcome  # leaving the block closes the connection mid-stream
            outcome.completed = True
    except httpx.HTTPError:
        outcome.status = None
    return outcome


async def measure_capacity(url: str, concurrency: int, seconds: float) -> float:
    """Completed requests per second with `concurrency` clients sending back to back."""
    done = 0
    deadline = time.perf_counter() + seconds
    rng = random.Random(0)

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            if (await one_request(client, "normal", rng)).completed:
                done += 1

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


async def soak(url: str, pid: int, rate: float, duration: float, max_in_flight: int, seed: int):
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    rss: list[tuple[float, int]] = []
    in_flight: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        started = time.perf_counter()
        next_sample = started
        while (now := time.perf_counter()) - started < duration:
            if now >= next_sample:
                rss.append((now - started, rss_bytes(pid)))
                next_sample += 5
            roll = rng.random()
            kind = "hostile" if roll < 0.05 else "cancel" if roll < 0.25 else "normal"
            if len(in_flight) < max_in_flight:
                task = asyncio.create_task(one_request(client, kind, rng))
                task.add_done_callback(lambda t: (in_flight.discard(t), outcomes.append(t.result())))
                in_flight.add(task)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*in_flight, return_exceptions=True)
        rss.append((time.perf_counter() - started, rss_bytes(pid)))
    for o in outcomes:
        o.started -= started
    return outcomes, rss


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def plot(outcomes: list[Outcome], rss: list[tuple[float, int]], window: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max((o.started for o in outcomes), default=0)
    starts = [w * window for w in range(int(end // window) + 1)]
    p50, p99 = [], []
    for start in starts:
        ttfts = [o.ttft for o in outcomes if o.ttft is not None and start <= o.started < start + window]
        p50.append(percentile(ttfts, 0.5) * 1000)
        p99.append(percentile(ttfts, 0.99) * 1000)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(starts, p50, label="TTFT p50")
    top.plot(starts, p99, label="TTFT p99")
    top.set_ylabel("ms")
    top.set_yscale("log")
    top.legend()
    top.set_title(f"Soak at 2x capacity: TTFT per {window:.0f} s window")
    bottom.plot([t for t, _ in rss], [b / 2**20 for _, b in rss], color="tab:green")
    bottom.set_ylabel("server RSS, MiB")
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--overload", type=float, default=2.0, help="arrival rate as a multiple of capacity")
    parser.add_argument("--capacity-concurrency", type=int, default=16, help="at least the server's --max-num-seqs")
    parser.add_argument("--capacity-s", type=float, default=60)
    parser.add_argument("--max-in-flight", type=int, default=256, help="client-side bound on open requests")
    parser.add_argument("--port", type=int, default=8799)
    # The limits tests/reliability's hostile table assumes (context 2048, bodies up to 200 kB).
    parser.add_argument("--server-args", default="--max-num-seqs 16 --max-queue 32 --max-model-len 2048 "
                                                 "--max-body-bytes 200000")
    parser.add_argument("--out-dir", default="bench-results")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    flags = cpu_flags()
    print(f"CPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
          f"{os.cpu_count()} cores; server: hyperserve serve {args.server_args}")
    process = start_server(args.port, args.server_args.split())
    try:
        capacity = asyncio.run(measure_capacity(url, args.capacity_concurrency, args.capacity_s))
        rate = capacity * args.overload
        print(f"capacity {capacity:.2f} requests/s; soaking at {rate:.2f}/s for {args.duration_s:.0f} s")
        rss_start = rss_bytes(process.pid)
        outcomes, rss = asyncio.run(soak(url, process.pid, rate, args.duration_s, args.max_in_flight, args.seed))
        deadline = time.time() + 60
        while time.time() < deadline:  # idle again: nothing running, no KV held
            text = httpx.get(f"{url}/metrics").text
            gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("hyperserve:num_requests_") or line.startswith("hyperserve:kv_cache_usage")}
            if not any(gauges.values()):
                break
            time.sleep(0.5)
        alive = process.poll() is None
        rss_end = rss_bytes(process.pid) if alive else 0
        # the bound on growth: the KV pool's pages are first written as the prefix cache fills them
        model_bytes = httpx.get(f"{url}/v1/models").json()["data"][0]["memory_bytes"] if alive else 0
    finally:
        process.terminate()
        process.wait(timeout=60)

    by_kind = {k: [o for o in outcomes if o.kind == k] for k in ("normal", "cancel", "hostile")}
    statuses = [o.status for o in outcomes]
    rows = [
        ("requests sent", len(outcomes)),
        ("served to the end (normal clients)", sum(o.completed for o in by_kind["normal"])),
        ("cancelled mid-stream by the client", len(by_kind["cancel"])),
        ("hostile, answered 4xx", sum(1 for o in by_kind["hostile"] if o.status and 400 <= o.status < 500)),
        ("hostile, answered otherwise", sum(1 for o in by_kind["hostile"] if not (o.status and 400 <= o.status < 500))),
        ("429 (overloaded)", sum(1 for s in statuses if s == 429)),
        ("503", sum(1 for s in statuses if s == 503)),
        ("5xx other than 503 (must be 0)", sum(1 for s in statuses if s and s >= 500 and s != 503)),
        ("connection failures", sum(1 for s in statuses if s is None)),
        ("server crashed (must be 0)", 0 if alive else 1),
        ("KV cache usage when idle (must be 0)", f"{gauges.get('hyperserve:kv_cache_usage_perc', -1):.3f}"),
        ("requests running/waiting when idle", f"{gauges.get('hyperserve:num_requests_running', -1):.0f}/"
                                               f"{gauges.get('hyperserve:num_requests_waiting', -1):.0f}"),
        ("RSS after warm-up, MiB", f"{rss_start / 2**20:.0f}"),
        ("RSS at the end, MiB", f"{rss_end / 2**20:.0f} ({(rss_end / rss_start - 1) * 100:+.1f}%)"),
        ("weights + whole KV pool, MiB (RSS grows toward it as the prefix cache fills)", f"{model_bytes / 2**20:.0f}"),
    ]
    half = args.duration_s / 2
    for label, part in (("first half", [o for o in outcomes if o.started < half]),
                        ("second half", [o for o in outcomes if o.started >= half]), ("all", outcomes)):
        values = [o.ttft for o in part if o.ttft is not None]
        rows.append((f"TTFT p50 / p99 ms, {label}",
                     f"{percentile(values, 0.5) * 1000:.0f} / {percentile(values, 0.99) * 1000:.0f}"))
    print("\n| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    odd = sorted({f"{o.kind}: {o.case or ''} -> {o.status}" for o in outcomes
                  if (o.kind == "hostile" and not (o.status and 400 <= o.status < 500)) or o.status is None})
    if odd:
        print("\nunexpected answers:\n" + "\n".join(odd))
    path = os.path.join(args.out_dir, "soak.png")
    plot(outcomes, rss, 30.0, path)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
