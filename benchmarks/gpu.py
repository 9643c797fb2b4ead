"""GPU benchmark on a Llama-3-8B-shaped model with random bf16 weights (nothing to download).

  (a) single-stream decode tokens/s and its ratio to the memory-bandwidth limit: weight bytes
      per token over the measured device-to-device copy bandwidth (bytes read + written)
  (b) offline throughput: N requests of 512 prompt and 256 output tokens through HyperServe
  (c) the same workload through transformers.generate in static batches (a subset of requests:
      throughput is a rate, and a batch of the same size runs at the same rate)
  (d) with --serve-concurrency: `hyperserve serve` on the same model, loaded by `hyperserve bench`
      at each concurrency (streamed completions: TTFT, ITL, output tok/s), and its start-up time

Each engine run also reports its start-up time (weights, KV profiling, graph capture) and where
its steps' time goes (scheduling, the synchronised forward pass, sampling, bookkeeping): the
forward's share is the GPU's, the rest is host work the GPU waits for.

    python benchmarks/gpu.py [--num-requests 1000] [--hf-requests 128] [--layers 32]
        [--quantization fp8] [--enforce-eager] [--attention-backend torch] [--serve-concurrency 1 16 64]

By default the engine runs as a user gets it on CUDA: Triton paged decode, decode steps replayed
from CUDA graphs, the KV pool sized by gpu_memory_utilization.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import start_server  # noqa: E402


def llama3_8b_config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    )


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    del src, dst
    return 2 * 2 * 2**30 / seconds


class StepProfile:
    """Where an engine's steps spend their time, timed by wrapping its parts: scheduling, the
    forward pass (synchronised after, so it is the GPU's time, or the host's launch time where
    that is longer), the rest of the runner (inputs, sampling) and the engine's bookkeeping."""

    PARTS = ("schedule", "forward", "execute", "step")

    def __init__(self, engine) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = defaultdict(float)
        for owner, name in ((engine.scheduler, "schedule"), (engine.runner, "forward"),
                            (engine.runner, "execute"), (engine, "step")):
            self._wrap(owner, name)

    def _wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            if name == "forward" and torch.cuda.is_available():
                torch.cuda.synchronize()
            self._current[name] += time.perf_counter() - started
            if name == "schedule":
                self._current["batch"] = len(result.requests)
                self._current["num_steps"] = result.num_steps
                decode_only = result.num_steps > 1 or all(n == 1 for n in result.num_new_tokens)
                self._current["decode_only"] = float(decode_only)
            if name == "step":
                if self._current.get("batch"):
                    self.steps.append(dict(self._current))
                self._current = defaultdict(float)
            return result

        setattr(owner, name, timed)

    def summary(self) -> dict[str, dict[str, float]]:
        """Mean milliseconds per step of each part, for decode-only steps and steps with prefill
        (a multi-step decode counts as its number of steps)."""
        out = {}
        for kind, decode_only in (("decode", 1.0), ("prefill", 0.0)):
            steps = [s for s in self.steps if s["decode_only"] == decode_only]
            if not steps:
                continue
            count = sum(s["num_steps"] for s in steps)
            mean = lambda key, steps=steps, count=count: 1e3 * sum(s.get(key, 0.0) for s in steps) / count
            out[kind] = {"steps": count, "batch": sum(s["batch"] * s["num_steps"] for s in steps) / count,
                         "step_ms": mean("step"), "schedule_ms": mean("schedule"),
                         "forward_ms": mean("forward"),
                         "runner_rest_ms": mean("execute") - mean("forward"),
                         "engine_rest_ms": mean("step") - mean("execute") - mean("schedule")}
        return out


def print_profile(title: str, summary: dict[str, dict[str, float]]) -> None:
    print(f"{title}: mean ms per step")
    print(f"  {'steps':<9}{'count':>7}{'batch':>8}{'step':>9}{'schedule':>10}{'forward':>9}{'runner':>8}"
          f"{'engine':>8}{'host share':>12}")
    for kind, p in summary.items():
        # multi-step decodes replay the graphs without a forward call, so without a sync in
        # between: their GPU time is inside the runner's, and the host's share is not visible
        host = f"{1 - p['forward_ms'] / p['step_ms']:.1%}" if p["forward_ms"] else "overlapped"
        print(f"  {kind:<9}{p['steps']:>7}{p['batch']:>8.1f}{p['step_ms']:>9.2f}{p['schedule_ms']:>10.2f}"
              f"{p['forward_ms']:>9.2f}{p['runner_rest_ms']:>8.2f}{p['engine_rest_ms']:>8.2f}{host:>12}")


def write_word_tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer over the model's whole vocabulary, so a server can take text and
    stream text from a model with random weights: each word `hyperserve bench` writes is one
    token, every other id a filler word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hyperserve.bench.run import _WORDS

    words = ["<unk>", "<eos>", *dict.fromkeys([*_WORDS, "Request", ":"])]
    vocab = {word: i for i, word in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(directory)


def workload(num: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(input_len)] for _ in range(num)]


def run_hyperserve(model_dir: str, args) -> dict:
    from hyperserve import LLM, SamplingParams
    from hyperserve.layers import gemv_decode, triton_gemv
    from hyperserve.layers.quantization import weight_bytes as model_weight_bytes

    gemv_decode.ENABLED = not args.unfused_layers

    if args.gemv_tiles:  # a sweep's winners (benchmarks/gpu_kernels.py --tiles-json)
        with open(args.gemv_tiles) as f:
            for entry in json.load(f):
                key = (entry.pop("n"), entry.pop("k"), entry.pop("itemsize"))
                triton_gemv.TILES[key] = triton_gemv.GemvTiles(**entry)

    started = time.perf_counter()
    llm = LLM(model=model_dir, load_format="random", device="cuda", dtype="bfloat16", max_model_len=2048,
              kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization,
              enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
              kv_cache_dtype=args.kv_cache_dtype,
              num_scheduler_steps=args.num_scheduler_steps)
    startup = time.perf_counter() - started
    graphs = llm.engine.runner.decode_graphs
    model = llm.engine.runner.model
    weight_bytes = model_weight_bytes(model)
    # the embedding table is gathered, not read whole, each step
    embed = model.model.embed_tokens.weight
    streamed_bytes = weight_bytes - embed.numel() * embed.element_size()
    setup = {"attention": type(model.attention_backend).__name__, "cuda_graphs": graphs is not None,
             "gemv_tiles": {f"{n}x{k}x{b}": vars(t) for (n, k, b), t in triton_gemv.TILES.items()},
             "kv_blocks": llm.engine.kv_cache.pool.num_blocks, "startup_seconds": startup,
             "graph_capture_seconds": graphs.capture_seconds if graphs is not None else 0.0,
             "graphs_rerouted": {b: to for b, to in (graphs.route if graphs else {}).items() if to != b},
             "graph_replay_ms": {b: 1e3 * t for b, t in (graphs.replay_seconds if graphs else {}).items()}}
    del model, embed, graphs  # so that deleting llm frees the GPU for what runs next

    one = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([workload(1, 128, 128256)[0]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    profile = StepProfile(llm.engine)
    decode_tps, single_profile = {}, {}
    for steps in dict.fromkeys((1, args.num_scheduler_steps)):  # one step per schedule, then as configured
        llm.engine.scheduler.config.num_scheduler_steps = steps
        out = llm.generate([workload(1, 128, 128256)[0]], one, use_tqdm=False)[0]
        m = out.metrics
        decode_tps[steps] = (args.decode_tokens - 1) / (m.finished_time - m.first_token_time)
        single_profile[steps], profile.steps = profile.summary(), []

    elapsed = 0.0
    if args.num_requests:
        prompts = workload(args.num_requests, args.input_len, 128256)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
        del outputs
    kernels = ""
    if args.kernel_table:  # prompts the offline run left out of the prefix cache (seeds other than its 0)
        n = args.input_len
        kernels = (kernel_table(llm, workload(1, n, 128256, 1), 64, "one prompt: prefill, 63 decode steps")
                   + kernel_table(llm, workload(32, n, 128256, 2), 1,
                                  f"32 prompts of {n} tokens: prefill steps only")
                   + kernel_table(llm, workload(448, n, 128256, 3), 33,
                                  f"448 prompts of {n} tokens already cached: 32 decode steps at batch 448",
                                  cache_first=True))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {**setup, "weight_bytes": weight_bytes, "streamed_bytes": streamed_bytes, "decode_tps": decode_tps,
            "offline_seconds": elapsed,
            "offline_tps": args.num_requests * args.output_len / elapsed if elapsed else 0.0,
            "single_stream_profile": single_profile, "offline_profile": profile.summary(),
            "kernel_table": kernels}


def kernel_table(llm, prompts: list[list[int]], max_tokens: int, title: str,
                 cache_first: bool = False) -> str:
    """The GPU kernels of a short run by their total time, from torch.profiler. cache_first: the prompts
    are prefilled before the profile, so that it holds (nearly) only decode steps at their full batch."""
    from torch.profiler import ProfilerActivity, profile

    from hyperserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if cache_first:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25,
                                      max_name_column_width=60)
    return f"\nkernels, {title}\n{table}"


def run_transformers(config: LlamaConfig, args) -> dict:
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    prompts = workload(args.hf_requests, args.input_len, config.vocab_size)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        input_ids = torch.tensor(prompts[i : i + args.hf_batch_size], device="cuda")
        with torch.no_grad():
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                           max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                           pad_token_id=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"hf_seconds": elapsed, "hf_tps": args.hf_requests * args.output_len / elapsed}


def run_server(model_dir: str, args) -> dict:
    """`hyperserve serve` on the model (start-up timed to its first healthy answer), then
    `hyperserve bench` at each concurrency: ~input_len-token prompts, output_len tokens, streamed."""
    from hyperserve.bench.run import add_bench_args, run_from_args

    write_word_tokenizer(model_dir, 128256)
    port = 8765
    flags = ["--model", model_dir, "--load-format", "random", "--device", "cuda", "--dtype", "bfloat16",
             "--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-queue", "10000"]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    started = time.perf_counter()
    server = start_server(port, flags, log_path=os.path.join(args.out_dir, "server.log"))
    try:
        result = {"server_startup_seconds": time.perf_counter() - started, "serving": {}}
        parser = argparse.ArgumentParser()
        add_bench_args(parser)
        for concurrency in args.serve_concurrency:
            bench = parser.parse_args([
                "--base-url", f"http://127.0.0.1:{port}", "--model", model_dir,
                "--concurrency", str(concurrency),
                "--num-requests", str(max(8, 3 * concurrency)), "--input-tokens", str(args.input_len),
                "--output-tokens", str(args.output_len), "--input-spread", "0", "--output-spread", "0",
                "--output-json", os.path.join(args.out_dir, f"serving-c{concurrency}.json")])
            result["serving"][concurrency] = run_from_args(bench)
        return result
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=1000, help="(b)'s requests; 0: no offline run")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--hf-requests", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="default: gpu_memory_utilization")
    parser.add_argument("--quantization", default=None, help="fp8: float8 weights")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="decode steps per schedule (single-stream decode is measured with 1 too)")
    parser.add_argument("--attention-backend", default="auto", help="auto (Triton on CUDA) or torch")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's), fp8 or int8")
    parser.add_argument("--gemv-tiles", default=None,
                        help="JSON of per-shape GEMV tiles (benchmarks/gpu_kernels.py --tiles-json) "
                             "to run with")
    parser.add_argument("--unfused-layers", action="store_true",
                        help="single-token steps through the layer modules' kernels, not the six a "
                             "layer of layers/gemv_decode.py")
    parser.add_argument("--serve-concurrency", type=int, nargs="*", default=[],
                        help="also serve the model and load it at these concurrencies")
    parser.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                        help="the offline engine runs (a) and (b)")
    parser.add_argument("--out-dir", default="bench-results", help="the server's log and each level's JSON")
    parser.add_argument("--kernel-table", action="store_true",
                        help="print the top GPU kernels of a short run")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    config = llama3_8b_config(args.layers)
    bandwidth = copy_bandwidth()
    theirs = run_transformers(config, args) if args.hf_requests else {}  # first: it frees all it took
    ours = served = {}
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        if args.offline:
            ours = run_hyperserve(model_dir, args)
        if args.serve_concurrency:
            served = run_server(model_dir, args)
    result = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bandwidth / 1e9, **ours, **served,
              **theirs, "args": vars(args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"GPU: {result['gpu']}   copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    if ours:
        print_offline(ours, bandwidth, theirs, args)
    if served:
        print_served(served)


def print_offline(ours: dict, bandwidth: float, theirs: dict, args) -> None:
    limit_tps = bandwidth / ours["streamed_bytes"]
    print(f"weights {ours['weight_bytes'] / 1e9:.2f} GB "
          f"({ours['streamed_bytes'] / 1e9:.2f} GB read per token)")
    print(f"engine: {ours['attention']}, CUDA graphs {'on' if ours['cuda_graphs'] else 'off'}, "
          f"weights {args.quantization or 'bfloat16'}, KV {args.kv_cache_dtype}, "
          f"GEMV tiles {'swept' if args.gemv_tiles else 'as shipped'}, "
          f"single-token layers {'as modules' if args.unfused_layers else 'in six kernels'}, "
          f"{ours['kv_blocks']} KV blocks; "
          f"started in "
          f"{ours['startup_seconds']:.1f} s ({ours['graph_capture_seconds']:.1f} s capturing graphs)")
    if ours["graph_replay_ms"]:
        replays = ", ".join(f"{b}: {ms:.2f}" for b, ms in ours["graph_replay_ms"].items())
        print(f"decode graphs' replay ms, rows all padding (bucket: ms): {replays}")
    if ours["graphs_rerouted"]:
        print(f"batches run in larger graphs (bucket -> graph): {ours['graphs_rerouted']}")
    for steps, summary in ours["single_stream_profile"].items():
        print_profile(f"single stream, {steps} step(s) per schedule", summary)
    print_profile(f"offline, {args.num_scheduler_steps} step(s) per schedule", ours["offline_profile"])
    print(ours["kernel_table"])
    print(f"{'measure':<42}{'value':>12}")
    print(f"{'    bandwidth limit tok/s':<42}{limit_tps:>12.1f}")
    for steps, tps in ours["decode_tps"].items():
        print(f"{f'(a) single-stream decode tok/s, {steps} step(s)':<42}{tps:>12.1f}")
        print(f"{'    fraction of the limit':<42}{tps / limit_tps:>12.1%}")
    if args.num_requests:
        print(f"{f'(b) HyperServe offline output tok/s, {args.num_scheduler_steps} step(s)':<42}"
              f"{ours['offline_tps']:>12.1f}")
    if theirs and args.num_requests:
        print(f"{'(c) transformers.generate output tok/s':<42}{theirs['hf_tps']:>12.1f}")
        print(f"{'    ratio':<42}{ours['offline_tps'] / theirs['hf_tps']:>12.2f}x")


def print_served(served: dict) -> None:
    print(f"hyperserve serve: healthy {served['server_startup_seconds']:.1f} s after launch")
    print("| concurrency | requests | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for concurrency, s in served["serving"].items():
        print(f"| {concurrency} | {s['num_ok']}/{s['num_requests']} | {s['ttft_p50_ms']:.0f} "
              f"| {s['ttft_p95_ms']:.0f} | {s['itl_p50_ms']:.1f} | {s['itl_p95_ms']:.1f} "
              f"| {s['output_token_throughput']:.1f} |")


if __name__ == "__main__":
    main()
