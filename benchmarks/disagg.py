"""Disaggregated prefill: chat streams beside long prompts, on one server and split in two.

Workload (for --seconds): `--chat-streams` clients each streaming short chat requests (about 30
prompt tokens, 128 output tokens) back to back, and one client sending a long prompt (random
tokens, none shared, `--long-tokens` long, 8 output tokens) every `--long-every-s` seconds.

- colocated: one `hyperserve serve` on every core; long prompts prefill in chunks between the
  chat streams' decode steps.
- disaggregated: a `--role prefill` server and a `--role decode` server, each on half the cores
  (OMP_NUM_THREADS), so the same machine; the decode server has long prompts computed by the
  prefill server and takes their KV blocks.

Reports the chat streams' inter-token latency (p50, p99: the interference a long prefill
causes), chat TTFT, long-prompt TTFT, and for the split the KV bytes moved and the time spent
waiting on the prefill server, per long prompt and per token.

    python benchmarks/disagg.py [--seconds 40] [--chat-streams 4] [--long-tokens 1500] [--long-every-s 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import start_server  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

CHAT = ["Tell me a short story about a robot who learns to paint.", "What are the benefits of regular exercise?",
        "Explain how a hash table works.", "Give me three tips for learning a new language."]
FLAGS = ["--max-model-len", "4096", "--kv-cache-memory-gb", "1"]


async def chat_client(client: httpx.AsyncClient, url: str, index: int, stop: float, itl: list, ttft: list) -> None:
    while time.perf_counter() < stop:
        body = {"messages": [{"role": "user", "content": CHAT[index % len(CHAT)]}], "max_tokens": 128,
                "temperature": 0, "ignore_eos": True, "stream": True}
        started = last = time.perf_counter()
        first = True
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                (ttft.append(now - started) if first else itl.append(now - last))
                first, last = False, now


async def long_client(client: httpx.AsyncClient, url: str, args, stop: float, ttft: list) -> None:
    rng = random.Random(0)
    while time.perf_counter() < stop:
        prompt = [rng.randrange(1000, 40000) for _ in range(args.long_tokens)]
        started = time.perf_counter()
        response = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                                    "temperature": 0, "ignore_eos": True})
        response.raise_for_status()
        ttft.append(time.perf_counter() - started)  # 8 tokens: nearly all of it is the prefill
        await asyncio.sleep(max(0.0, args.long_every_s - (time.perf_counter() - started)))


async def workload(url: str, args) -> dict:
    itl, chat_ttft, long_ttft = [], [], []
    stop = time.perf_counter() + args.seconds
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(chat_client(client, url, i, stop, itl, chat_ttft) for i in range(args.chat_streams)),
                             long_client(client, url, args, stop, long_ttft))
    pct = lambda values, q: 1000 * float(np.percentile(values, q))
    return {"itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), "chat_ttft_p50_ms": pct(chat_ttft, 50),
            "long_ttft_p50_ms": pct(long_ttft, 50), "long_prompts": len(long_ttft), "chat_tokens": len(itl)}


def counter(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"hyperserve:{name}_total{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def run(mode: str, args) -> dict:
    cores = os.cpu_count() or 2
    servers = []
    try:
        if mode == "colocated":
            port = free_port()
            servers.append(start_server(port, FLAGS))
        else:
            half = {"OMP_NUM_THREADS": str(max(1, cores // 2))}
            prefill = free_port()
            servers.append(start_server(prefill, ["--role", "prefill", *FLAGS], env=half))
            port = free_port()
            servers.append(start_server(port, ["--role", "decode", "--prefill-url", f"http://127.0.0.1:{prefill}",
                                               "--disagg-min-tokens", "256", *FLAGS], env=half))
        url = f"http://127.0.0.1:{port}"
        result = asyncio.run(workload(url, args))
        moved = counter(url, "kv_bytes_received")
        result.update(kv_mb=moved / 2**20, kv_blocks=counter(url, "kv_blocks_received"),
                      transfer_s=counter(url, "kv_transfer_seconds"), failures=counter(url, "kv_transfer_failures"))
        return result
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--chat-streams", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--long-every-s", type=float, default=2.0)
    parser.add_argument("--modes", nargs="+", default=["colocated", "disaggregated"])
    args = parser.parse_args()
    results = {mode: run(mode, args) for mode in args.modes}
    flags = cpu_flags()
    print(f"\nCPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
          f"{os.cpu_count()} cores; {args.chat_streams} chat streams, a {args.long_tokens}-token prompt every "
          f"{args.long_every_s:g} s, {args.seconds:g} s\n")
    print("| mode | chat ITL p50 ms | chat ITL p99 ms | chat TTFT p50 ms | long TTFT p50 ms | long prompts | "
          "chat tokens | KV moved MB | transfer s (total) | failures |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['chat_ttft_p50_ms']:.0f} | "
              f"{r['long_ttft_p50_ms']:.0f} | {r['long_prompts']} | {r['chat_tokens']} | {r['kv_mb']:.1f} | "
              f"{r['transfer_s']:.2f} | {r['failures']:.0f} |")
    disagg = results.get("disaggregated")
    if disagg and disagg["kv_blocks"]:
        tokens = disagg["kv_blocks"] * 16
        per_prompt = disagg["kv_mb"] / disagg["long_prompts"], disagg["transfer_s"] / disagg["long_prompts"]
        print(f"\nKV moved per prompt token: {disagg['kv_mb'] * 2**20 / tokens / 1024:.1f} KiB; per long prompt: "
              f"{per_prompt[0]:.1f} MiB in {per_prompt[1]:.2f} s (the prefill server's prefill and the transfer)")
    out = Path(__file__).parent / "results" / "disagg.json"
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
