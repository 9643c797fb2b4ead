"""HyperServe against llama.cpp on this CPU, same GGUF (SmolLM2-135M-Instruct Q4_1 unless `--model`), one run.

llama.cpp runs as its users run it: `llama-bench` (tg128, pp512) and `llama-server -np 16 -c 8192`,
built with native CPU flags from the llama-cpp-python sdist by `scripts/build_llama_cpp.sh`.
HyperServe runs its engine offline (decode and prefill, as llama-bench measures them) and
`hyperserve serve` with each configuration's flags. Both servers get the same `hyperserve bench`
load: 1 stream (ITL and TTFT) and 16 streams (output tokens/s), prompts of ~200 tokens, 128 output
tokens. Start-up is the time from launch to /health answering; RSS is the server's resident memory
after the load (peak in brackets). All servers run at once and take the loads in turns
(`--rounds`, medians), each turn with its own prompts.

    bash scripts/build_llama_cpp.sh          # once, ~6 minutes on 2 cores
    python benchmarks/cpu_vs_llamacpp.py [--configs default float32 default+compile] [--isa avx2]
        [--model gemma3-270m]         # another registered GGUF model (Gemma 3 270M: Q4_K_M)

`--isa avx2` runs both sides' AVX2 code paths on a machine that has more: llama.cpp built for AVX2 +
FMA only (LLAMA_CPP_ISA=avx2), HyperServe with AVX-512/AMX hidden from its kernels and PyTorch's
(ATEN_CPU_CAPABILITY=avx2: our native kernels on AVX2, dense prefill weights in float32; with its
own compile cache, since PyTorch's is not keyed by the capability). The caches, memory and clock
are not those of an AVX2-only CPU: this stands in for that class without replacing it
(scripts/avx2_only_check.py runs the defaults on an emulated one, for correctness only).

Configurations as in benchmarks/quality.py, plus `default`: no flags at all (what `make serve` runs).
Decode is compared in turns (`--rounds`, medians; the decode ratio is against the llama-bench runs
taken between ours), since this kind of VM drifts by 20% over minutes. `--depths 1000 4000 8000`
adds decode after that many tokens of context (llama-bench's `tg32 @ dN` against 32 of our tokens
after an N-token prompt), also in turns: what a long conversation or document costs per token.
`--prompt-lengths 2048 4096` adds prefill of prompts that long (llama-bench's ppN), also in turns:
where attention over the prompt, more than the weights, sets the time to first token.
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.quality import engine_options, server_args, speed  # noqa: E402
from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.bench.run import add_bench_args, run_from_args  # noqa: E402
from hyperserve.layers.quantization import cpu_flags, hardware_cpu_flags  # noqa: E402
from hyperserve.models.registry import resolve_model  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

FLAGS_SHOWN = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_header(threads: int) -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    flags = " ".join(f for f in FLAGS_SHOWN if f in cpu_flags())
    hidden = " ".join(f for f in FLAGS_SHOWN if f in hardware_cpu_flags() - cpu_flags())
    if hidden:
        flags += f" (AVX2 code paths only; the CPU also has {hidden})"
    return f"{model}, {os.cpu_count()} cores, {threads} threads; flags: {flags}; {datetime.date.today()}"


def run_llama_bench(bin_dir: Path, gguf: Path, threads: int, *args: str) -> list[dict]:
    """llama-bench's JSON rows for these arguments (-p, -n, -d, -r ...)."""
    command = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), *args, "-o", "json"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def llama_decode_tok_s(bin_dir: Path, gguf: Path, threads: int, tokens: int, depth: int = 0) -> float:
    """One llama-bench decode run: tg`tokens` after `depth` tokens of context."""
    rows = run_llama_bench(bin_dir, gguf, threads, "-p", "0", "-n", str(tokens), "-d", str(depth), "-r", "1")
    return rows[0]["avg_ts"]


def llama_bench(bin_dir: Path, gguf: Path, threads: int) -> dict:
    runs = run_llama_bench(bin_dir, gguf, threads, "-p", "512", "-n", "128", "-r", "3")
    return {"decode_tok_s": next(r["avg_ts"] for r in runs if r["n_gen"] == 128),
            "prefill_tok_s": next(r["avg_ts"] for r in runs if r["n_prompt"] == 512)}


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, in MB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def bench_load(port: int, concurrency: int, num_requests: int, seed: int = 0) -> dict:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return run_from_args(parser.parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--concurrency", str(concurrency), "--num-requests",
        str(num_requests), "--input-tokens", "200", "--output-tokens", "128", "--seed", str(seed)]))


def start_timed(command: list[str], port: int, cwd: Path | None = None) -> tuple[subprocess.Popen, float]:
    """A server, and the seconds from launch to its /health answering 200 (ours: model loaded)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process, time.perf_counter() - started
        except httpx.HTTPError:
            pass
        if time.perf_counter() - started > 900:
            process.kill()
            raise RuntimeError(f"{command[0]} did not start in 900 s")
        time.sleep(0.2)


def load_in_turns(servers: dict[str, tuple[subprocess.Popen, int]], rounds: int) -> dict[str, dict]:
    """Both loads on every server, one server after another, for `rounds` turns (medians): the
    servers idle while another is measured, and the VM's drift falls on all of them alike. Each
    turn has its own prompts (the same for every server), so no turn hits an earlier one's cache."""
    for _, port in servers.values():
        bench_load(port, 1, 2, seed=-1)  # warm-up
    turns: dict[str, list[dict]] = {name: [] for name in servers}
    for turn in range(max(rounds, 1)):
        for name, (_, port) in servers.items():
            one, sixteen = bench_load(port, 1, 8, seed=turn), bench_load(port, 16, 32, seed=100 + turn)
            turns[name].append({"itl_p50_ms": one["itl_p50_ms"], "ttft_p50_ms": one["ttft_p50_ms"],
                                "server16_output_tok_s": sixteen["output_token_throughput"]})
            print(f"turn {turn + 1}: {name}: {turns[name][-1]}", flush=True)
    results = {}
    for name, (process, _) in servers.items():
        results[name] = {key: statistics.median(t[key] for t in turns[name]) for key in turns[name][0]}
        results[name]["rss_mb"], results[name]["peak_rss_mb"] = memory_mb(process.pid)
    return results


def llama_cpp_bin() -> Path:
    bin_dir = Path(subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_cpp.sh")], capture_output=True,
                                  text=True, check=True).stdout.strip())
    print(f"llama.cpp: {bin_dir}", file=sys.stderr)
    return bin_dir


def paired_decode(llm: LLM, bin_dir: Path, gguf: Path, threads: int, rounds: int) -> tuple[float, float]:
    """Median decode tok/s of ours and of llama-bench tg128, taken in turns: this VM's speed drifts
    by 20% over minutes, which a ratio of two separate runs would carry."""
    ours, theirs = [], []
    for _ in range(rounds):
        theirs.append(llama_decode_tok_s(bin_dir, gguf, threads, 128))
        ours.append(speed(llm, decode_only=True)["decode_tok_s"])
    return statistics.median(ours), statistics.median(theirs)


def decode_at_depths(llm: LLM, bin_dir: Path, gguf: Path, threads: int, depths: list[int],
                     rounds: int) -> dict[str, dict[str, float]]:
    """Median decode tok/s after `depth` tokens of context, ours and llama-bench's tg32 @ depth, in
    turns. Our later turns find the prompt in the prefix cache: only the decode is timed anyway."""
    results = {}
    for depth in depths:
        prompt = [100 + (i * 7919) % 49000 for i in range(depth)]
        ours, theirs = [], []
        for _ in range(max(rounds, 1)):
            theirs.append(llama_decode_tok_s(bin_dir, gguf, threads, 32, depth))
            metrics = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
                                   use_tqdm=False)[0].metrics
            ours.append(32 / (metrics.finished_time - metrics.first_token_time))
        results[str(depth)] = {"decode_tok_s": statistics.median(ours),
                               "llama_decode_tok_s": statistics.median(theirs)}
        print(f"decode at {depth} tokens of context: ours {results[str(depth)]['decode_tok_s']:.1f}, "
              f"llama.cpp {results[str(depth)]['llama_decode_tok_s']:.1f} tok/s", flush=True)
    return results


def hyperserve_offline(model: str, config: str, bin_dir: Path, gguf: Path, threads: int, rounds: int,
                       depths: list[int], prompt_lengths: list[int]) -> dict:
    """Our engine offline: decode (in turns with llama-bench) and prefill, and decode at depth."""
    options = {} if config == "default" else engine_options(config.removeprefix("default+"))
    llm = LLM(model, **options)
    result = speed(llm)
    if rounds:
        paired = paired_decode(llm, bin_dir, gguf, threads, rounds)
        result["decode_tok_s"], result["paired_llama_decode_tok_s"] = paired
    if depths:
        result["decode_at_depth"] = decode_at_depths(llm, bin_dir, gguf, threads, depths, rounds)
    if prompt_lengths:
        result["prefill_at_length"] = prefill_at_lengths(llm, bin_dir, gguf, threads, prompt_lengths, rounds)
    return result


def prefill_at_lengths(llm: LLM, bin_dir: Path, gguf: Path, threads: int, lengths: list[int],
                       rounds: int) -> dict[str, dict[str, float]]:
    """Median prefill tok/s of an N-token prompt, ours and llama-bench's ppN, in turns: where
    attention over the prompt itself, not the weights, takes most of the time. Each of our turns has
    its own prompt, so none is found in the prefix cache."""
    rng = random.Random(1)
    results = {}
    for length in lengths:
        ours, theirs = [], []
        for _ in range(max(rounds, 1)):
            rows = run_llama_bench(bin_dir, gguf, threads, "-p", str(length), "-n", "0", "-r", "1")
            theirs.append(rows[0]["avg_ts"])
            prompt = [rng.randrange(100, 20000) for _ in range(length)]
            metrics = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics
            ours.append(length / (metrics.first_token_time - metrics.first_scheduled_time))
        results[str(length)] = {"prefill_tok_s": statistics.median(ours),
                                "llama_prefill_tok_s": statistics.median(theirs)}
        print(f"prefill of {length} tokens: ours {results[str(length)]['prefill_tok_s']:.1f}, "
              f"llama.cpp {results[str(length)]['llama_prefill_tok_s']:.1f} tok/s", flush=True)
    return results


def print_in_turns(results: dict, key: str, sizes: list[int], label: str) -> None:
    """The table of one measure taken in turns at several sizes (decode at depth, prefill at length)."""
    print("\n| system | " + " | ".join(label.format(size) for size in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    for name, r in results.items():
        if key not in r:
            continue
        ours = key.removesuffix("_at_depth").removesuffix("_at_length") + "_tok_s"
        pairs = [(r[key][str(size)][ours], r[key][str(size)]["llama_" + ours]) for size in sizes]
        theirs_cells = " | ".join(f"{theirs:.1f}" for _, theirs in pairs)
        ours_cells = " | ".join(f"{mine:.1f} ({mine / theirs:.2f}x)" for mine, theirs in pairs)
        print(f"| llama.cpp (turns beside {name}) | {theirs_cells} |")
        print(f"| {name} | {ours_cells} |")


def llama_server_command(bin_dir: Path, gguf: Path, threads: int, port: int) -> list[str]:
    """llama-server as its users run it for 16 streams: 16 slots sharing 8,192 tokens of context."""
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-np", "16", "-c", "8192",
            "--host", "127.0.0.1", "--port", str(port)]


def server_command(model: str, config: str, port: int) -> list[str]:
    flags = [] if config == "default" else server_args(config.removeprefix("default+"))
    return [sys.executable, "-m", "hyperserve.cli", "serve", "--model", model, "--port", str(port), *flags]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["default", "float32"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=5,
                        help="medians of this many turns: decode (llama-bench tg128 and ours) and the "
                             "servers' loads")
    parser.add_argument("--depths", nargs="*", type=int, default=[],
                        help="also decode after this many tokens of context (e.g. 1000 4000 8000)")
    parser.add_argument("--prompt-lengths", nargs="*", type=int, default=[],
                        help="also prefill prompts of this many tokens (e.g. 2048 4096), against "
                             "llama-bench ppN")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: both systems' AVX2 code paths, on a CPU that has more")
    parser.add_argument("--model", default="smollm2-135m", help="a registered GGUF model (hyperserve models)")
    parser.add_argument("--out", default=None,
                        help="default: benchmarks/results/cpu_vs_llamacpp[-MODEL][-ISA].json (MODEL: "
                             "other than SmolLM2)")
    args = parser.parse_args()
    # before anything reads the flags
    if args.isa == "avx2" and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_avx2"
        os.environ.update(ATEN_CPU_CAPABILITY="avx2", LLAMA_CPP_ISA="avx2", TORCHINDUCTOR_CACHE_DIR=str(cache))
        os.execv(sys.executable, [sys.executable, *sys.argv])
    suffix = "" if args.model == "smollm2-135m" else f"-{args.model}"
    suffix += "" if args.isa == "native" else f"-{args.isa}"
    out = args.out or str(ROOT / "benchmarks" / "results" / f"cpu_vs_llamacpp{suffix}.json")
    source = resolve_model(args.model)
    bin_dir = llama_cpp_bin()
    results = {"llama.cpp": llama_bench(bin_dir, source.path, args.threads)}
    for config in args.configs:
        print(f"offline: {config} ...", flush=True)
        results[f"hyperserve {config}"] = hyperserve_offline(
            args.model, config, bin_dir, source.path, args.threads, args.rounds, args.depths, args.prompt_lengths)
    servers = {}
    try:
        for name in results:
            port = free_port()
            command = (llama_server_command(bin_dir, source.path, args.threads, port) if name == "llama.cpp"
                       else server_command(args.model, name.removeprefix("hyperserve "), port))
            process, results[name]["startup_s"] = start_timed(command, port)
            servers[name] = (process, port)
        for name, measured in load_in_turns(servers, args.rounds).items():
            results[name].update(measured)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    header = cpu_header(args.threads)
    Path(out).write_text(json.dumps({"machine": header, "results": results}, indent=2))
    base = results["llama.cpp"]
    print(f"\n{source.path.name}. {header}\n")
    columns = [("decode tok/s", "decode_tok_s", 1, "{:.1f}"),
               ("prefill tok/s (512)", "prefill_tok_s", 1, "{:.0f}"),
               ("1 stream ITL p50 ms", "itl_p50_ms", -1, "{:.1f}"),
               ("1 stream TTFT p50 ms", "ttft_p50_ms", -1, "{:.0f}"),
               ("16 streams output tok/s", "server16_output_tok_s", 1, "{:.1f}"),
               ("start-up s", "startup_s", 0, "{:.1f}"),
               ("server RSS MB (peak)", "rss_mb", 0, "{:.0f}")]
    print("| system | " + " | ".join(c[0] for c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, r in results.items():
        cells = []
        for _, key, better, fmt in columns:
            cell = fmt.format(r[key])
            if key == "rss_mb":
                cell += f" ({r['peak_rss_mb']:.0f})"
                if name != "llama.cpp":
                    cell += f", {r[key] / base[key]:.1f}x llama.cpp's"
            elif name != "llama.cpp" and better:  # ours over theirs, where above 1 is better for us
                theirs = r.get("paired_llama_decode_tok_s", base[key]) if key == "decode_tok_s" else base[key]
                ratio = r[key] / theirs if better > 0 else theirs / r[key]
                cell += f" ({ratio:.2f}x)"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.depths:
        print_in_turns(results, "decode_at_depth", args.depths, "decode tok/s at {} of context")
    if args.prompt_lengths:
        print_in_turns(results, "prefill_at_length", args.prompt_lengths, "prefill tok/s, {}-token prompt")


if __name__ == "__main__":
    main()
