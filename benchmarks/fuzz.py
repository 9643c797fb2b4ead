"""Fuzz `hyperserve serve` and `hyperserve gateway` (in front of it) with schemathesis.

schemathesis generates requests from each one's /openapi.json (boundary values, then random ones)
and checks every response: `not_a_server_error` fails on any 5xx, and `--request-timeout` on any
hang. Prints the cases generated and the failures found per target; exits non-zero on a failure.

    python benchmarks/fuzz.py [--max-examples 150] [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.serving import start_server  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402


def start_gateway(port: int, backend_url: str, directory: str) -> subprocess.Popen:
    config = Path(directory) / "gateway.yaml"
    config.write_text(yaml.safe_dump({"backends": [{"name": "engine", "url": backend_url}],
                                      "routes": [{"model": "smollm2-135m", "backends": ["engine"]}],
                                      "cache": {"store": "memory"}}))
    return start_server(port, ["--config", str(config), "--quiet"], command="gateway")


def fuzz(url: str, max_examples: int, seed: int, schema_url: str | None = None) -> dict:
    """schemathesis against `url`, generating from `schema_url`'s schema (default: its own)."""
    binary = str(Path(sys.executable).with_name("schemathesis"))
    started = time.perf_counter()
    run = subprocess.run([binary, "run", f"{schema_url or url}/openapi.json", "--url", url,
                          "--checks", "not_a_server_error",
                          "--phases", "coverage,fuzzing", "-n", str(max_examples), "--request-timeout", "60",
                          "--seed", str(seed)], capture_output=True, text=True)
    generated = re.search(r"(\d+) generated", run.stdout)
    failed = re.search(r"(\d+) failed", run.stdout)
    return {"cases": int(generated.group(1)) if generated else 0, "failed": int(failed.group(1)) if failed else 0,
            "ok": run.returncode == 0, "seconds": time.perf_counter() - started, "output": run.stdout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=150, help="per API operation and phase")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=8811)
    args = parser.parse_args()
    flags = cpu_flags()
    print(f"CPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
          f"{os.cpu_count()} cores")
    server_url, gateway_url = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
    server = start_server(args.port, ["--max-model-len", "64", "--kv-cache-memory-gb", "0.25", "--max-num-seqs", "4",
                                      "--default-max-tokens", "8", "--embedding-model", "all-MiniLM-L6-v2"])
    results = {}
    try:
        with tempfile.TemporaryDirectory() as directory:
            gateway = start_gateway(args.port + 1, server_url, directory)
            try:
                results["hyperserve serve"] = fuzz(server_url, args.max_examples, args.seed)
                results["hyperserve gateway"] = fuzz(gateway_url, args.max_examples, args.seed)
                # The gateway's routes take raw bodies (it validates just enough to route and cache),
                # so its own schema has no bodies to generate: fuzz it with the server's too.
                results["hyperserve gateway, server's schema"] = fuzz(gateway_url, args.max_examples, args.seed,
                                                                      schema_url=server_url)
            finally:
                gateway.terminate()
                gateway.wait(timeout=60)
        server_alive = server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=60)
    print("\n| target | cases | 5xx or hung | time s | server alive after |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['cases']} | {r['failed']} | {r['seconds']:.0f} | {server_alive} |")
    for name, r in results.items():
        if not r["ok"]:
            print(f"\n{name} failed:\n{r['output'][-6000:]}")
    sys.exit(0 if all(r["ok"] for r in results.values()) else 1)


if __name__ == "__main__":
    main()
