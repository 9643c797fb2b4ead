"""The gateway, in one run:

1. overhead: a non-streaming request through `hyperserve gateway` vs straight to the backend (an
   instant stub backend, so only the gateway's own time shows), requests interleaved;
2. semantic cache through HTTP: questions answered by SmolLM2 (misses), then paraphrases (hits),
   then different questions with the same words (must miss): latency and hit rates;
3. lookup time with 100,000 cached entries (index search + store read, embedding excluded), and
   recall of the nearest entry.

    python benchmarks/gateway.py [--requests 1000] [--entries 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyperserve.common.embedder import Embedder  # noqa: E402
from hyperserve.gateway.cache_store import CacheEntry, SQLiteStore  # noqa: E402
from hyperserve.gateway.response_cache import ResponseCache  # noqa: E402
from tests.gateway.conftest import STUB, wait_http  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

# (question, paraphrase): the paraphrase should be answered from the cache.
PAIRS = [
    ("What's the capital of France?", "Tell me France's capital city"),
    ("How many legs does a spider have?", "How many legs do spiders have?"),
    ("Who wrote Hamlet?", "Who is the author of Hamlet?"),
    ("What is the boiling point of water?", "At what temperature does water boil?"),
    ("How do I reverse a list in Python?", "How can I reverse a Python list?"),
    ("What is the tallest mountain in the world?", "Which mountain is the highest on Earth?"),
    ("How many days are in a leap year?", "How many days does a leap year have?"),
    ("Who painted the Mona Lisa?", "Who was the painter of the Mona Lisa?"),
    ("What is the speed of light?", "How fast does light travel?"),
    ("What is the largest planet in the solar system?", "Which planet in our solar system is the biggest?"),
    ("How do I make a cup of tea?", "What's the way to make a cup of tea?"),
    ("What is photosynthesis?", "Explain what photosynthesis is."),
    ("What is the square root of 144?", "What's the square root of 144?"),
    ("When did World War II end?", "In what year did the Second World War end?"),
    ("What language is spoken in Brazil?", "Which language do people speak in Brazil?"),
    ("How do I convert Celsius to Fahrenheit?", "How can I convert a temperature from Celsius to Fahrenheit?"),
    ("What does DNA stand for?", "What is DNA short for?"),
    ("Who discovered penicillin?", "Who was the discoverer of penicillin?"),
    ("What is the currency of Japan?", "Which currency is used in Japan?"),
    ("How many continents are there?", "What is the number of continents on Earth?"),
]
# Same words as a cached question, a different question: each must miss.
DIFFERENT = [
    "What's the capital gains tax in France?", "How many legs does a spider web have?",
    "Who wrote the music for Hamlet the film?", "What is the boiling point of olive oil?",
    "How do I sort a list in Python?", "What is the tallest building in the world?",
    "Who stole the Mona Lisa?", "What is the speed of sound?", "What is the smallest planet in the solar system?",
    "What is the square root of 169?", "When did World War I end?", "What language is spoken in Mexico?",
    "How do I convert Fahrenheit to Kelvin?", "Who discovered insulin?", "What is the currency of China?",
]


def percentiles(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def start(command: list[str], health: str, log: Path, timeout: float = 300) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_http(health, process, timeout=timeout)
    return process


def gateway(config: dict, workdir: Path, name: str) -> tuple[str, subprocess.Popen]:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start([sys.executable, "-m", "hyperserve.cli", "gateway", "--config", str(path), "--port", str(port),
                     "--quiet"], f"{url}/health", workdir / f"{name}.log")
    return url, process


def measure_overhead(workdir: Path, requests: int) -> dict:
    port = free_port()
    backend = f"http://127.0.0.1:{port}"
    stub = start([sys.executable, STUB, "--port", str(port), "--name", "stub"], f"{backend}/health",
                 workdir / "stub.log")
    url, proxy = gateway({"backends": [{"name": "stub", "url": backend}],
                          "routes": [{"model": "m", "backends": ["stub"]}], "cache": {"enabled": False}},
                         workdir, "overhead")
    body = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    direct, through = [], []
    try:
        with httpx.Client(timeout=30) as client:
            for i in tqdm(range(requests + 50), desc="overhead", leave=False):
                for base, times in ((backend, direct), (url, through)):  # interleaved, so drift hits both
                    t = time.perf_counter()
                    client.post(f"{base}/v1/chat/completions", json=body).raise_for_status()
                    if i >= 50:  # warm-up
                        times.append(time.perf_counter() - t)
    finally:
        proxy.terminate()
        stub.terminate()
    (d50, d99), (g50, g99) = percentiles(direct), percentiles(through)
    return {"direct_p50_ms": d50 * 1e3, "direct_p99_ms": d99 * 1e3, "gateway_p50_ms": g50 * 1e3,
            "gateway_p99_ms": g99 * 1e3, "added_p50_ms": (g50 - d50) * 1e3, "added_p99_ms": (g99 - d99) * 1e3}


def measure_semantic(workdir: Path, max_tokens: int) -> dict:
    config = {"backends": [{"name": "smol", "local": {"model": "smollm2-135m",
                                                      "args": ["--kv-cache-memory-gb", "0.5"]}}],
              "routes": [{"model": "smollm2", "backends": ["smol"]}],
              "cache": {"store": "sqlite", "path": str(workdir / "semantic.sqlite")}}
    url, proxy = gateway(config, workdir, "semantic")

    def ask(client: httpx.Client, question: str) -> tuple[float, str]:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": question}], "temperature": 0,
                "max_tokens": max_tokens}
        t = time.perf_counter()
        response = client.post(f"{url}/v1/chat/completions", json=body)
        response.raise_for_status()
        return time.perf_counter() - t, response.headers["x-hyperserve-cache"]

    try:
        with httpx.Client(timeout=120) as client:
            misses = [ask(client, q) for q, _ in tqdm(PAIRS, desc="questions (SmolLM2)", leave=False)]
            time.sleep(0.5)  # inserts finish after the answers
            paraphrases = [ask(client, p) for _, p in tqdm(PAIRS, desc="paraphrases", leave=False)]
            different = [ask(client, q) for q in tqdm(DIFFERENT, desc="different questions", leave=False)]
            repeats = [ask(client, p) for _, p in PAIRS for _ in range(5)]  # latency sample of hits
    finally:
        proxy.terminate()
    hits = [t for t, kind in paraphrases + repeats if kind.startswith("hit")]
    (h50, h99), (m50, _) = percentiles(hits), percentiles([t for t, _ in misses])
    return {"paraphrase_hit_rate": sum(k == "hit-semantic" for _, k in paraphrases) / len(PAIRS),
            "false_hit_rate": sum(k != "miss" for _, k in different) / len(DIFFERENT),
            "hit_p50_ms": h50 * 1e3, "hit_p99_ms": h99 * 1e3, "miss_p50_ms": m50 * 1e3, "num_hits_timed": len(hits)}


def measure_lookup(workdir: Path, num_entries: int, queries: int) -> dict:
    """Synthetic embeddings in topic clusters (real ones cluster too); one namespace, the worst case."""
    rng = np.random.default_rng(0)
    dim = 384
    centers = rng.standard_normal((max(1, num_entries // 50), dim)).astype(np.float32)
    vectors = centers[rng.integers(0, len(centers), num_entries)] + 0.35 * rng.standard_normal(
        (num_entries, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    store = SQLiteStore(str(workdir / "lookup.sqlite"), max_entries=num_entries)
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 200},
                             "finish_reason": "stop"}]}
    for i in tqdm(range(num_entries), desc="filling the store", leave=False):
        store.put(CacheEntry(f"k{i}", "ns", f"q{i}", response, vectors[i], time.time() + 3600))

    class _Dim:  # the index needs only the dimension; no embedding happens in this part
        dim = 384

    index_dir = workdir / "lookup.index"
    cache = ResponseCache(store, ttl_s=3600, embedder=_Dim(), threshold=0.8, index_dir=index_dir)
    t = time.perf_counter()
    cache.sync_index()
    build_s = time.perf_counter() - t
    cache.index.save(index_dir, store.high_water())
    t = time.perf_counter()
    ResponseCache(store, ttl_s=3600, embedder=_Dim(), threshold=0.8, index_dir=index_dir)  # a restart
    load_s = time.perf_counter() - t
    times, found = [], 0
    for i in tqdm(rng.integers(0, num_entries, queries), desc="lookups", leave=False):
        query = vectors[i] + 0.02 * rng.standard_normal(dim).astype(np.float32)
        query /= np.linalg.norm(query)
        t = time.perf_counter()
        entry_id, similarity = cache.index.nearest("ns", query)
        entry = store.get_by_id(entry_id)
        times.append(time.perf_counter() - t)
        found += entry is not None and entry.key == f"k{i}"
    embedder = Embedder()
    embed_times = []
    for question, _ in PAIRS * 3:
        t = time.perf_counter()
        embedder.embed([question])
        embed_times.append(time.perf_counter() - t)
    p50, p99 = percentiles(times)
    return {"entries": num_entries, "index_build_s": build_s, "index_load_s": load_s,
            "lookup_p50_ms": p50 * 1e3, "lookup_p99_ms": p99 * 1e3,
            "recall_at_1": found / queries, "embed_p50_ms": statistics.median(embed_times[len(PAIRS):]) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="overhead: requests each way")
    parser.add_argument("--entries", type=int, default=100_000, help="lookup: cached entries")
    parser.add_argument("--queries", type=int, default=2000, help="lookup: queries")
    parser.add_argument("--max-tokens", type=int, default=32, help="SmolLM2 answers to the cache misses")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gateway.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        overhead = measure_overhead(workdir, args.requests)
        semantic = measure_semantic(workdir, args.max_tokens)
        lookup = measure_lookup(workdir, args.entries, args.queries)
    results = {"overhead": overhead, "semantic": semantic, "lookup": lookup}
    Path(args.out).write_text(json.dumps(results, indent=2))

    o, s, lk = overhead, semantic, lookup
    print(f"\nGateway overhead, {args.requests} non-streaming requests each way, stub backend\n")
    print("| path | p50 ms | p99 ms |\n|---|---|---|")
    print(f"| straight to the backend | {o['direct_p50_ms']:.2f} | {o['direct_p99_ms']:.2f} |")
    print(f"| through the gateway | {o['gateway_p50_ms']:.2f} | {o['gateway_p99_ms']:.2f} |")
    print(f"| **added by the gateway** | **{o['added_p50_ms']:.2f}** | **{o['added_p99_ms']:.2f}** |")
    print(f"\nSemantic cache over HTTP, SmolLM2-135M backend, {len(PAIRS)} paraphrase pairs, "
          f"{len(DIFFERENT)} same-words different questions\n")
    print("| measure | value |\n|---|---|")
    print(f"| miss answered by SmolLM2 ({args.max_tokens} tokens), p50 | {s['miss_p50_ms']:.0f} ms |")
    print(f"| semantic hit end to end, p50 / p99 ({s['num_hits_timed']} hits) | "
          f"**{s['hit_p50_ms']:.1f}** / {s['hit_p99_ms']:.1f} ms |")
    print(f"| paraphrase hit rate | {s['paraphrase_hit_rate']:.0%} |")
    print(f"| false hits on different questions | {s['false_hit_rate']:.0%} |")
    print(f"\nLookup with {lk['entries']:,} entries in one namespace (usearch HNSW + SQLite)\n")
    print("| measure | value |\n|---|---|")
    print(f"| lookup p50 / p99 | **{lk['lookup_p50_ms']:.3f}** / {lk['lookup_p99_ms']:.3f} ms |")
    print(f"| recall@1 | {lk['recall_at_1']:.1%} |")
    print(f"| index build from the store (first start) | {lk['index_build_s']:.1f} s |")
    print(f"| index load from its saved file (restart) | {lk['index_load_s']:.2f} s |")
    print(f"| query embedding (all-MiniLM-L6-v2), p50 | {lk['embed_p50_ms']:.1f} ms |")


if __name__ == "__main__":
    main()
