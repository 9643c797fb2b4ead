"""Memory and time to load a model in int4: peak RSS and peak anonymous memory of a fresh process.

A random-weight Llama of TinyLlama-1.1B's shape (22 layers, hidden 2048, MLP 5632, 32 query and 4
K/V heads, vocabulary 32k) is saved once as one safetensors file; a child process then loads it
with `LLM(model=..., quantization="int4")` while a thread samples its RssAnon every 20 ms. RSS
also counts the checkpoint's pages read through mmap, which the kernel reclaims under pressure;
anonymous memory is what the load itself holds.

    python benchmarks/load_memory.py [--dir /tmp/tinyllama-random] [--rounds 2]
    PYTHONPATH=/path/to/older/checkout python benchmarks/load_memory.py   # that commit's loader
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, os, resource, sys, threading, time
peak = [0]
def sample():
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
from hyperserve import LLM
start = time.perf_counter()
llm = LLM(model=sys.argv[1], quantization="int4", max_model_len=256, kv_cache_memory_gb=0.05)
statm = open("/proc/self/statm").read().split()
peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"load_s": time.perf_counter() - start, "peak_rss": peak_rss, "peak_anonymous": peak[0],
                  "rss_after": int(statm[1]) * os.sysconf("SC_PAGE_SIZE")}))
"""


def save_model(directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0, 0.02)
    model.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tinyllama-random"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not (args.dir / "model.safetensors").exists():
        save_model(args.dir)
    # PYTHONPATH set: that checkout's code is measured (an older commit, say); else this one's
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[1])}
    runs = []
    for _ in range(args.rounds):
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.dir)], capture_output=True, text=True, env=env,
                              cwd=env["PYTHONPATH"], check=True)  # its cwd comes first on sys.path
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    gib = 2**30
    print("| round | load s | peak RSS GiB | peak anonymous GiB | RSS after load GiB |")
    print("|---|---|---|---|---|")
    for i, run in enumerate(runs, 1):
        print(f"| {i} | {run['load_s']:.1f} | {run['peak_rss'] / gib:.2f} | {run['peak_anonymous'] / gib:.2f} "
              f"| {run['rss_after'] / gib:.2f} |")


if __name__ == "__main__":
    main()
