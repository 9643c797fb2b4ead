"""Batch jobs beside interactive traffic: what a running /v1/batches job costs a chat user, and what
the job gets done, for pairs of --batch-concurrency (lines at once while nothing else runs) and
--batch-concurrency-busy (while chat runs, and 5 s after).

For each pair a fresh `hyperserve serve` (default flags otherwise) runs:
- chat alone: `hyperserve bench`, one stream (64-token prompts, 64 greedy tokens, ignore_eos);
- the batch alone: B chat lines of 64 tokens each, timed from creation to completion;
- both: the batch is created, and the same chat load runs while it is in progress; the batch's rate
  is the lines it finished during the chat load (in whole lines, so coarse).
Then `hyperserve run-batch` on the same lines (in process, no port), against a script of `LLM.chat`.

    python benchmarks/batch_api.py [--lines 256] [--pairs 16:16 16:2 64:64 64:2] [--requests 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from benchmarks.serving import start_server  # noqa: E402
from hyperserve.bench.run import add_bench_args, run_from_args  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

TOPICS = ["rivers", "colours", "planets", "fruits", "mountains", "cities", "birds", "trees", "metals", "oceans",
          "languages", "instruments"]
OUTPUT_TOKENS = 64
QUIET_S = 5  # the server's: batch lines stay at the busy limit this long after other requests


def batch_lines(count: int) -> bytes:
    lines = []
    for i in range(count):
        body = {"messages": [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]}, part {i}."}],
                "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}
        lines.append(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return ("\n".join(lines) + "\n").encode()


def chat_load(port: int, requests: int) -> dict:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return run_from_args(parser.parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2-135m", "--endpoint", "chat",
        "--concurrency", "1", "--num-requests", str(requests), "--input-tokens", "64",
        "--output-tokens", str(OUTPUT_TOKENS), "--output-spread", "0", "--ignore-eos", "--temperature", "0"]))


class BatchJob:
    """One batch on the server, created now and followed on a thread until it ends."""

    def __init__(self, port: int, data: bytes) -> None:
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        upload = self.client.post("/v1/files", files={"file": ("lines.jsonl", data)}, data={"purpose": "batch"})
        self.start = time.perf_counter()
        self.id = self.client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                        "endpoint": "/v1/chat/completions",
                                                        "completion_window": "24h"}).json()["id"]
        self.done = threading.Event()
        self.state: dict = {}
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        while True:
            self.state = self.client.get(f"/v1/batches/{self.id}").json()
            if self.state["status"] in ("completed", "failed", "cancelled", "expired"):
                self.seconds = time.perf_counter() - self.start
                return self.done.set()
            time.sleep(0.05)

    def wait_running(self) -> None:
        """Until its lines are in the engine (a second after it went in progress)."""
        while not self.done.is_set() and self.state.get("status") != "in_progress":
            time.sleep(0.05)
        time.sleep(1.0)

    def completed(self) -> int:
        return self.state.get("request_counts", {}).get("completed", 0)

    def tokens_per_s(self) -> float:
        self.done.wait()
        assert self.state["status"] == "completed", self.state
        text = self.client.get(f"/v1/files/{self.state['output_file_id']}/content").text
        tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in text.splitlines())
        return tokens / self.seconds


def serve_and_measure(idle: int, busy: int, lines: int, requests: int) -> dict:
    port = free_port()
    server = start_server(port, ["--batch-concurrency", str(idle), "--batch-concurrency-busy", str(busy)])
    try:
        chat_load(port, 2)  # warm up
        time.sleep(QUIET_S + 1)  # the server's batch lines take their idle limit again
        batch_alone = BatchJob(port, batch_lines(lines)).tokens_per_s()
        alone = chat_load(port, requests)
        time.sleep(QUIET_S + 1)
        job = BatchJob(port, batch_lines(lines))
        job.wait_running()
        started, lines_before = time.perf_counter(), job.completed()
        beside = chat_load(port, requests)
        batch_beside = (job.completed() - lines_before) * OUTPUT_TOKENS / (time.perf_counter() - started)
        if job.done.is_set():
            raise RuntimeError("the batch ended before the chat load did: give it more --lines")
        job.done.wait()
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"ttft_alone": alone["ttft_p50_ms"], "itl_alone": alone["itl_p50_ms"], "batch_alone": batch_alone,
            "ttft_beside": beside["ttft_p50_ms"], "itl_beside": beside["itl_p50_ms"], "batch_beside": batch_beside}


LLM_SCRIPT = """
import json, sys
from hyperserve import LLM, SamplingParams
lines = [json.loads(line) for line in open(sys.argv[1])]
outputs = LLM(model="smollm2-135m").chat([line["body"]["messages"] for line in lines],
                                         SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), ignore_eos=True),
                                         use_tqdm=False)
print(sum(len(o.outputs[0].token_ids) for o in outputs))
"""


def offline(lines: int) -> tuple[float, float]:
    """(hyperserve run-batch, a script of LLM.chat): seconds from start to exit on the same lines, each
    in its own process (imports and the model's load included, as a user waits for them)."""
    with tempfile.TemporaryDirectory() as directory:
        source, target = Path(directory) / "in.jsonl", Path(directory) / "out.jsonl"
        source.write_bytes(batch_lines(lines))
        commands = ([sys.executable, "-m", "hyperserve.cli", "run-batch", "-i", str(source), "-o", str(target)],
                    [sys.executable, "-c", LLM_SCRIPT, str(source), str(OUTPUT_TOKENS)])
        seconds = []
        for command in commands:
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            seconds.append(time.perf_counter() - started)
    return seconds[0], seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=256,
                        help="lines per batch, times busy concurrency / 16 above 16 (so the batch outlasts the chat)")
    parser.add_argument("--pairs", nargs="+", default=["4:4", "16:16", "16:2", "64:64", "64:2"],
                        help="IDLE:BUSY, --batch-concurrency and --batch-concurrency-busy")
    parser.add_argument("--requests", type=int, default=8, help="chat requests per measurement")
    args = parser.parse_args()
    rows = []
    for pair in args.pairs:
        idle, busy = map(int, pair.split(":"))
        print(f"--batch-concurrency {idle} --batch-concurrency-busy {busy}", flush=True)
        lines = args.lines * max(1, busy // 16)
        rows.append((idle, busy, serve_and_measure(idle, busy, lines, args.requests)))
        print(rows[-1], flush=True)
    run_batch_s, llm_s = offline(args.lines)
    import torch

    print(f"\n{cpu_header(torch.get_num_threads())}")
    print(f"Batches of {args.lines} chat lines of {OUTPUT_TOKENS} tokens (x busy concurrency / 16 above 16); "
          f"chat: 1 stream, {args.requests} requests "
          f"of {OUTPUT_TOKENS} tokens; default `hyperserve serve` flags besides --batch-concurrency.\n")
    print("| --batch-concurrency | --batch-concurrency-busy | chat TTFT p50 ms alone / beside the batch | "
          "chat ITL p50 ms alone / beside | batch output tok/s alone / while chat runs |")
    print("|---|---|---|---|---|")
    for idle, busy, r in rows:
        print(f"| {idle} | {busy} | {r['ttft_alone']:.0f} / {r['ttft_beside']:.0f} | "
              f"{r['itl_alone']:.1f} / {r['itl_beside']:.1f} | {r['batch_alone']:.1f} / {r['batch_beside']:.1f} |")
    print(f"\nOffline, the same {args.lines} lines, start to exit (imports and the model's load included): "
          f"`hyperserve run-batch` {run_batch_s:.1f} s, a script of `LLM.chat` {llm_s:.1f} s "
          f"({run_batch_s / llm_s:.2f}x).")


if __name__ == "__main__":
    main()
