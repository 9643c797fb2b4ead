"""Whether one tenant can time another's prompts: time to first answer of a long document sent by
one API key, then by another, then by the first again, against `hyperserve serve` with two keys.

A prefix cache shared across keys answers the second key's copy from the first one's KV, in a
fraction of the time: that difference tells a client whether someone else sent the same text.
Each key's `cache_scope` salts the cache (README, Security), so only the first key's own repeat is
fast. `--shared` gives both keys one scope, which shares the cache on purpose (the control).

    python benchmarks/tenant_cache.py [--documents 3] [--repeats 90] [--shared]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from benchmarks.serving import start_server  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

KEYS = ("alice", "bob")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=90, help="sentences per document (~14 tokens each)")
    parser.add_argument("--shared", action="store_true", help="both keys in one cache_scope (the control)")
    args = parser.parse_args()
    scope = ", cache_scope: team" if args.shared else ""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as config:  # read once, at start
        config.write("keys:\n" + "".join(
            f"  - {{name: {key}, sha256: {hashlib.sha256(key.encode()).hexdigest()}{scope}}}\n" for key in KEYS))
        config.flush()
        port = free_port()
        server = start_server(port, ["--security-config", config.name])
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    def ask(key: str, document: str) -> tuple[float, int]:
        """Seconds to the (one-token) answer, and the prompt tokens found cached."""
        started = time.perf_counter()
        reply = httpx.post(url, headers={"Authorization": f"Bearer {key}"}, timeout=300, json={
            "messages": [{"role": "user", "content": document + " Summarise this."}], "max_tokens": 1})
        reply.raise_for_status()
        return time.perf_counter() - started, reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    rows = []
    try:
        for i in range(args.documents):
            document = f"Report {i}: " + "The committee reviewed the figures and the hiring plan. " * args.repeats
            rows.append([ask("alice", document), ask("bob", document), ask("alice", document)])
    finally:
        server.terminate()
        server.wait(30)
    print(f"SmolLM2-135M-Instruct, default `hyperserve serve`, keys in {'one' if args.shared else 'their own'} "
          f"cache_scope. {cpu_header(os.cpu_count())}")
    print("\n| request | time to answer, median ms | cached prompt tokens |\n|---|---|---|")
    for column, name in enumerate(("alice sends the document", "bob sends the same document",
                                   "alice sends it again")):
        seconds = statistics.median(row[column][0] for row in rows)
        cached = statistics.median(row[column][1] for row in rows)
        print(f"| {name} | {seconds * 1e3:.0f} | {cached:.0f} |")


if __name__ == "__main__":
    main()
