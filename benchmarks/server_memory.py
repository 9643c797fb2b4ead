"""Server memory over a long run of unrelated prompts: HyperServe's default against llama-server.

The issue-18 table reads each server's RSS once, after a short load. A server that keeps every
prompt's KV in its prefix cache grows with the traffic instead, up to its pool's cap, so this runs
`--waves` loads of `--requests` distinct prompts each (~200 tokens in, 128 out, 16 streams, each
wave with its own prompts) and reads every server's RSS after each wave. llama-server runs as in
cpu_vs_llamacpp.py (`-np 16 -c 8192`; its prompt cache, `--cache-ram`, grows up to 8 GiB by
default); HyperServe with no flags (what `make serve` runs). `--hyperserve NAME=DIR` adds the
server of another checkout (e.g. a worktree of an older commit) beside this one's. Servers take
each wave in turns.

    python benchmarks/server_memory.py [--waves 4] [--requests 64] [--hyperserve before=/tmp/wt]
        [--no-llama-cpp] [--plot benchmarks/results/server_memory.png] [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_vs_llamacpp import (  # noqa: E402
    bench_load,
    cpu_header,
    llama_cpp_bin,
    llama_server_command,
    memory_mb,
    start_timed,
)
from hyperserve.models.registry import resolve_model  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64, help="distinct prompts per wave")
    parser.add_argument("--hyperserve", action="append", default=[], metavar="NAME=DIR",
                        help="also run the server of the checkout in DIR, labelled NAME")
    parser.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--model", default="smollm2-135m", help="a registered name or a GGUF's path")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "server_memory.json"))
    parser.add_argument("--plot", default=None, help="a PNG of RSS against requests served")
    args = parser.parse_args()
    gguf = resolve_model(args.model).path
    checkouts = {"hyperserve": ROOT}
    for spec in args.hyperserve:
        name, _, checkout = spec.partition("=")
        checkouts[name] = Path(checkout)
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    rss: dict[str, list[float]] = {}
    try:
        if args.llama_cpp:
            port = free_port()
            command = llama_server_command(llama_cpp_bin(), gguf, args.threads, port)
            servers["llama.cpp"] = start_timed(command, port)[0], port
        for name, checkout in checkouts.items():
            port = free_port()
            command = [sys.executable, "-m", "hyperserve.cli", "serve", "--model", args.model,
                       "--port", str(port)]
            servers[name] = start_timed(command, port, cwd=checkout)[0], port
        for name, (process, _) in servers.items():
            rss[name] = [memory_mb(process.pid)[0]]
            print(f"{name}: {rss[name][0]:.0f} MB at start", flush=True)
        for wave in range(args.waves):
            for name, (process, port) in servers.items():
                bench_load(port, 16, args.requests, seed=1000 + wave)
                rss[name].append(memory_mb(process.pid)[0])
                print(f"wave {wave + 1}/{args.waves}: {name}: {rss[name][-1]:.0f} MB", flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    header = cpu_header(args.threads)
    served = [wave * args.requests for wave in range(args.waves + 1)]
    Path(args.json).write_text(json.dumps({"machine": header, "requests_served": served, "rss_mb": rss},
                                          indent=2))
    print(f"\n{gguf.name}. {header}\n")
    print("| requests served | " + " | ".join(f"{name} RSS MB" for name in rss) + " |")
    print("|---" * (len(rss) + 1) + "|")
    for i, count in enumerate(served):
        print(f"| {count} | " + " | ".join(f"{rss[name][i]:.0f}" for name in rss) + " |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 4))
        for name, values in rss.items():
            axes.plot(served, values, marker="o", label=name)
        axes.set(xlabel="distinct requests served (~330 tokens each)", ylabel="server RSS, MB",
                 ylim=(0, None), title=f"Server memory over unrelated prompts, {gguf.name}")
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
