"""Where the server's per-token work should run: beside the engine thread, or in another process.

Streaming a token costs the server's event loop about 0.35 ms of Python CPU (BENCHMARKS.md,
`event_loop_floor.py`). In `hyperserve serve` that loop shares the engine's process, so its Python
and the engine thread's Python (scheduling, inputs, sampling) take turns on one GIL, and what is
left of it lands during the forward pass, whose OpenMP threads hold both cores of a 2-core machine.
In another process it could run while the engine's step is in its single-threaded Python part.

This decodes SmolLM2 single-stream with the engine's step loop in this process and, after every
step, hands a stand-in for the event loop's work (JSON encoding, calibrated to --work-ms of CPU)
to one of:
- `none`: no per-token work (the offline engine);
- `thread`: an asyncio loop on a thread of this process, woken with `call_soon_threadsafe`, as
  AsyncEngine wakes the server's event loop;
- `process`: an asyncio loop in a child process, woken through a pipe.
Modes run in alternating rounds; the table gives median ms per token and the ratio to `none`.

    python benchmarks/engine_placement.py [--config int4] [--work-ms 0.35] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quality import engine_options  # noqa: E402
from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402

CHUNK = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "smollm2-135m",
         "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}]}
MODES = ("none", "thread", "process")
TOKENS = 128


def work(repeats: int) -> None:
    for _ in range(repeats):
        json.dumps(CHUNK)


def calibrate(work_ms: float) -> int:
    """Repeats of work() that take work_ms of CPU on this machine."""
    started, repeats = time.process_time(), 2000
    work(repeats)
    return max(1, round(repeats * work_ms / 1e3 / (time.process_time() - started)))


def _listen(connection, repeats: int) -> None:
    """The child process's event loop: one work() per message from the pipe, until it closes."""
    loop = asyncio.new_event_loop()

    def readable() -> None:
        try:
            connection.recv_bytes()
        except EOFError:
            loop.stop()
            return
        work(repeats)

    loop.add_reader(connection.fileno(), readable)
    loop.run_forever()


class Listener:
    """A stand-in event loop in a thread or a child process; notify() hands it one token's work."""

    def __init__(self, mode: str, repeats: int) -> None:
        self.mode = mode
        if mode == "thread":
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, daemon=True).start()
            self.notify = lambda: self.loop.call_soon_threadsafe(work, repeats)
        elif mode == "process":
            context = multiprocessing.get_context("spawn")
            reader, self.writer = context.Pipe(duplex=False)
            self.child = context.Process(target=_listen, args=(reader, repeats), daemon=True)
            self.child.start()
            reader.close()
            self.notify = lambda: self.writer.send_bytes(b"t")
        else:
            self.notify = lambda: None

    def close(self) -> None:
        if self.mode == "thread":
            self.loop.call_soon_threadsafe(self.loop.stop)
        elif self.mode == "process":
            self.writer.close()
            self.child.join(timeout=30)


def ms_per_token(llm: LLM, listener: Listener, request_id: str) -> float:
    """One greedy request of TOKENS tokens through the engine's step loop, listener told every step."""
    engine = llm.engine
    engine.add_request(request_id, list(range(1000, 1032)), SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                            ignore_eos=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            listener.notify()
            if output.finished:
                metrics = output.metrics
    return 1000 * (metrics.finished_time - metrics.first_token_time) / (TOKENS - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="int4")
    parser.add_argument("--work-ms", type=float, default=0.35, help="the stand-in event loop's CPU per token")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    repeats = calibrate(args.work_ms)
    llm = LLM(kv_cache_memory_gb=1, max_num_batched_tokens=512, **engine_options(args.config))
    listeners = {mode: Listener(mode, repeats) for mode in MODES}
    try:
        ms_per_token(llm, listeners["none"], "warm-up")
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode in MODES if round_ % 2 == 0 else reversed(MODES):
                times[mode].append(ms_per_token(llm, listeners[mode], f"{mode}-{round_}"))
            print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{m} {times[m][-1]:.2f}" for m in MODES),
                  flush=True)
    finally:
        for listener in listeners.values():
            listener.close()
    flags = cpu_flags()
    print(f"\nCPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
          f"{os.cpu_count()} cores; {args.config}; stand-in work {args.work_ms} ms a token; "
          f"medians of {args.rounds} alternating rounds\n")
    print("| per-token work | ms/token | against none |")
    print("|---|---|---|")
    for mode in MODES:
        median = statistics.median(times[mode])
        ratios = statistics.median(t / n for t, n in zip(times[mode], times["none"]))
        print(f"| {mode} | {median:.2f} | {ratios:.2f}x |")


if __name__ == "__main__":
    main()
