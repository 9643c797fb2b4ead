"""Start-up: seconds from launching `hyperserve serve` to its /health answering 200, and how much of
it the model's load took (the server's "loaded in" log line; the rest is Python's imports, the
app and uvicorn). Starts alternate between models and checkouts, so a slow spell of the machine
falls on all of them alike; medians and ranges over `--rounds` starts.

    python benchmarks/startup.py [--models smollm2-135m gemma3-270m] [--rounds 5]
    python benchmarks/startup.py --checkouts /path/to/older/checkout .   # that commit against this one
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

LOADED = re.compile(r"ready \(loaded in ([0-9.]+) s")


def start(checkout: Path, model: str) -> tuple[float, float]:
    """One start of `model` with `checkout`'s code: seconds to /health 200, and the load's seconds."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(checkout)}
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        server = subprocess.Popen([sys.executable, "-m", "hyperserve.cli", "serve", "--model", model,
                                   "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log, env=env,
                                  cwd=checkout)
        try:
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited with {server.returncode}: {log.read()[-2000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            ready = time.perf_counter() - started
        finally:
            server.terminate()
            server.wait(timeout=30)
        log.seek(0)
        loaded = LOADED.search(log.read())
    return ready, float(loaded.group(1)) if loaded else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--checkouts", nargs="+", type=Path, default=[Path(__file__).resolve().parents[1]])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    checkouts = [c.resolve() for c in args.checkouts]
    runs: dict[tuple[str, Path], list[tuple[float, float]]] = {
        (model, checkout): [] for model in args.models for checkout in checkouts}
    for round_ in range(args.rounds):
        for model in args.models:
            for checkout in checkouts:
                runs[model, checkout].append(start(checkout, model))
                ready = runs[model, checkout][-1][0]
                print(f"round {round_ + 1}: {model} {checkout}: {ready:.2f} s", flush=True)
    print(f"\n{cpu_header(torch.get_num_threads())}; medians (ranges) of {args.rounds} starts\n")
    print("| model | checkout | to /health 200, s | the model's load, s | before the load, s |")
    print("|---|---|---|---|---|")
    for (model, checkout), times in runs.items():
        ready, loaded = [t for t, _ in times], [t for _, t in times]
        before = [r - load for r, load in times]
        cells = [f"{statistics.median(x):.2f} ({min(x):.2f}-{max(x):.2f})" for x in (ready, loaded, before)]
        print(f"| {model} | {checkout} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
