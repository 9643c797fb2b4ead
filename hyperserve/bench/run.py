"""`hyperserve bench`: load any OpenAI-compatible server and report latency and throughput.

Requests stream (SSE) so every token's arrival is timed on the client: time to first token (TTFT),
inter-token latency (ITL, the gaps between streamed chunks), time per output token (TPOT) and
end-to-end latency, at a fixed concurrency or a Poisson arrival rate. Goodput counts requests per
second that met the SLOs (TTFT <= --slo-ttft-ms and TPOT <= --slo-itl-ms).

Several loads (`--concurrency 1 4 16`) make a sweep: each in turn on requests of the same lengths
(with other lead-ins, so none hits the prefix cache of an earlier load's), then a table and a plot
of latency against throughput, one point per load. `--compare a.json b.json`
draws the curves of earlier runs' --output-json side by side (our server against vLLM's, say).

The client is urllib3, blocking, on a thread per request in flight: each chunk is timed as its
read returns and parsed once the stream has ended. On a small machine the client shares the cores
with the server it measures, and its CPU per chunk shows up in the server's inter-token latency:
this one takes 0.08-0.10 ms a chunk, parsing included, where aiohttp on uvloop took 0.15-0.2 (its
event loop's wake-ups, however little it parsed) and httpx on asyncio 0.5-0.6.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial

import urllib3
from urllib3.exceptions import HTTPError, ProtocolError

from hyperserve.common.sse import parse_sse_chunk

DEFAULT_MODEL = "smollm2-135m"  # HyperServe's own default, for a server that lists no model

# Tries of a request whose kept-alive connection the server had closed (several pooled ones may be).
STALE_CONNECTION_TRIES = 3

# Common English words: one token each in the usual BPE vocabularies (SmolLM2, Llama 3, Qwen2).
_WORDS = (
    "the of and to in is was that for it with as his on be at by had are but from or have an they which "
    "one you were all we her she there would their will when who him been has more if no out so said what "
    "up its about than into them can only other time new some could these two may first then do any like "
    "my now over such our man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take three river city "
    "music garden window paper light water stone market engine signal number story letter morning table"
).split()


@dataclass
class RequestSpec:
    prompt: str
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    status: int | None = None  # the HTTP status, once the server answered
    chunks: int = 0  # chunks with text
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache, if it said

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def make_requests(args: argparse.Namespace, run: int = 0) -> list[RequestSpec]:
    """The requests of one load. A sweep's `run` (its load's index) changes only the generated
    prompts' lead-ins: the same lengths, and no prefix cache hit on an earlier load's prompts
    (a --prompts-file's prompts repeat as they are)."""
    if args.prompts_file:
        with open(args.prompts_file) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rows = rows[: args.num_requests]
        return [RequestSpec(r["prompt"], int(r.get("max_tokens", args.output_tokens))) for r in rows]
    rng = random.Random(args.seed)

    def draw(mean: int, spread: float) -> int:
        return max(1, round(mean * rng.uniform(1 - spread, 1 + spread)))

    specs = []
    for i in range(args.num_requests):
        # A unique lead-in per request (about 4 tokens), so no two prompts share a long prefix.
        words = max(1, draw(args.input_tokens, args.input_spread) - 4)
        prompt = f"Request {f'{run}.' * (run > 0)}{i}: " + " ".join(rng.choice(_WORDS) for _ in range(words))
        specs.append(RequestSpec(prompt, draw(args.output_tokens, args.output_spread)))
    return specs


def send(pool: urllib3.PoolManager, args: argparse.Namespace, spec: RequestSpec) -> RequestResult:
    body: dict = {"model": args.model, "stream": True, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "responses":  # always reports usage, in its last event
        url, body["input"], body["max_output_tokens"] = "/v1/responses", spec.prompt, spec.max_tokens
    elif args.endpoint == "messages":  # Anthropic's: usage in message_start and message_delta
        url, body["max_tokens"] = "/v1/messages", spec.max_tokens
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body.update(max_tokens=spec.max_tokens, stream_options={"include_usage": True})
        if args.endpoint == "chat":
            url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": spec.prompt}]
        else:
            url, body["prompt"] = "/v1/completions", spec.prompt
    url, payload = args.base_url.rstrip("/") + url, json.dumps(body).encode()
    result = RequestResult(ok=False)
    start = time.perf_counter()
    for attempt in range(STALE_CONNECTION_TRIES):
        try:
            arrivals = _stream(pool, url, payload, args.timeout_s, result)
            break
        except ProtocolError as error:
            # A kept-alive connection that the server had closed (llama-server closes each after a
            # few requests) fails before any answer: send it again, on another connection.
            if attempt + 1 < STALE_CONNECTION_TRIES and result.status is None:
                continue
            result.error = f"{type(error).__name__}: {error}"
            return result
        except (HTTPError, OSError) as error:
            result.error = f"{type(error).__name__}: {error}"
            return result
    if result.error:
        return result
    result.e2e = time.perf_counter() - start
    try:
        _count(arrivals, start, result)
    except ValueError as error:  # a data line that is not JSON
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.output_tokens = result.output_tokens or result.chunks
    result.ok = result.chunks > 0
    if not result.ok:
        result.error = "no tokens received"
    return result


def _stream(pool: urllib3.PoolManager, url: str, payload: bytes, timeout_s: float,
            result: RequestResult) -> list[tuple[float, bytes]]:
    """One streamed request: its status into `result`, and what arrived, each read with its time."""
    response = pool.urlopen("POST", url, body=payload, preload_content=False, retries=False,
                            timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s))
    try:
        result.status = response.status
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return []
        # Each HTTP chunk as it comes (the servers we compare send one per event), else whatever
        # has arrived as soon as it has (read1; slower per call than urllib3's chunked reads).
        reads = response.read_chunked() if response.chunked else iter(partial(response.read1, 1 << 16), b"")
        return [(time.perf_counter(), data) for data in reads]
    finally:
        response.release_conn()


Counts = tuple[int | None, int | None, int | None]  # prompt, output and cached prompt tokens; None: not said


def _cached(details: object) -> int | None:
    """`cached_tokens` of a usage's prompt (or input) token details, as OpenAI and vLLM report it."""
    return details.get("cached_tokens") if isinstance(details, dict) else None


def _read_event(chunk: dict) -> tuple[str | None, Counts | None]:
    """The text of one streamed event (a completions, chat, Responses or Anthropic one), and the
    token counts where it reports them."""
    kind = chunk.get("type")
    if kind in ("message_start", "message_delta", "content_block_delta"):  # Anthropic's Messages API
        usage = (chunk.get("message") or {}).get("usage") if kind == "message_start" else chunk.get("usage")
        text = (chunk.get("delta") or {}).get("text") if kind == "content_block_delta" else None
        return text, (usage.get("input_tokens"), usage.get("output_tokens"),
                      usage.get("cache_read_input_tokens")) if usage else None
    if isinstance(kind, str) and kind.startswith("response."):
        usage = (chunk.get("response") or {}).get("usage")
        text = chunk.get("delta") if kind == "response.output_text.delta" else None
        return text, (usage["input_tokens"], usage["output_tokens"],
                      _cached(usage.get("input_tokens_details"))) if usage else None
    usage = chunk.get("usage")
    counts = (usage["prompt_tokens"], usage["completion_tokens"],
              _cached(usage.get("prompt_tokens_details"))) if usage else None
    choices = chunk.get("choices") or []
    if not choices:
        return None, counts
    choice = choices[0]
    return choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content"), counts


def _count(arrivals: list[tuple[float, bytes]], start: float, result: RequestResult) -> None:
    """TTFT, the gaps between chunks with text, and the usage, from the stream's data lines; each
    line is timed by the read that completed it."""
    last, pending = None, b""
    for now, data in arrivals:
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            chunk = parse_sse_chunk(line.decode().rstrip("\r"))
            if chunk is None:
                continue
            text, usage = _read_event(chunk)
            if usage is not None:  # a count left out (None) keeps the one an earlier event gave
                result.prompt_tokens = usage[0] if usage[0] is not None else result.prompt_tokens
                result.output_tokens = usage[1] if usage[1] is not None else result.output_tokens
                result.cached_tokens = usage[2] if usage[2] is not None else result.cached_tokens
            if not text:
                continue
            if result.chunks == 0:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
            result.chunks += 1


def run_load(args: argparse.Namespace, specs: list[RequestSpec]) -> tuple[list[RequestResult], float]:
    workers = args.concurrency or len(specs)  # a Poisson load has no bound on requests in flight
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    pool = urllib3.PoolManager(maxsize=workers, headers=headers)
    rng = random.Random(args.seed + 1)
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(specs), desc="requests", unit="req")
    except ImportError:  # pragma: no cover
        bar = None

    def one(spec: RequestSpec) -> RequestResult:
        result = send(pool, args, spec)
        if bar is not None:
            bar.update(1)
        return result

    # A thread that parses a finished stream holds the GIL; others waiting to time a chunk get it
    # within 0.5 ms rather than Python's default 5.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench") as executor:
            start = time.perf_counter()
            futures = []
            try:
                for spec in specs:
                    futures.append(executor.submit(one, spec))
                    if args.request_rate:
                        time.sleep(rng.expovariate(args.request_rate))
                results = [future.result() for future in futures]
            except KeyboardInterrupt:  # requests not yet sent are not sent; those in flight finish
                executor.shutdown(wait=False, cancel_futures=True)
                raise
            duration = time.perf_counter() - start
    finally:
        sys.setswitchinterval(switch_interval)
        pool.clear()
        if bar is not None:
            bar.close()
    return results, duration


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    itls = [gap for r in ok for gap in r.itls]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    told = [r for r in ok if r.cached_tokens is not None]  # servers that say what their prefix cache gave
    good = [r for r in ok
            if (args.slo_ttft_ms is None or r.ttft * 1000 <= args.slo_ttft_ms)
            and (args.slo_itl_ms is None or r.tpot * 1000 <= args.slo_itl_ms)]
    summary = {
        "label": getattr(args, "label", None) or f"{args.base_url} ({args.model})",
        "base_url": args.base_url, "model": args.model, "endpoint": args.endpoint,
        "concurrency": args.concurrency, "request_rate": args.request_rate,
        "num_requests": len(results), "num_ok": len(ok), "num_failed": len(results) - len(ok),
        "duration_s": duration,
        "mean_prompt_tokens": prompt_tokens / len(ok) if ok else 0,
        # a TTFT is only comparable across servers that cached alike: the share of prompt tokens
        # that came from the prefix cache (None: the server does not report it)
        "prompt_cache_hit_rate": (sum(r.cached_tokens for r in told)
                                  / max(1, sum(r.prompt_tokens for r in told)) if told else None),
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "goodput": len(good) / duration,
        "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("itl", itls), ("tpot", [r.tpot for r in ok]),
                         ("e2e", [r.e2e for r in ok])):
        for q in (50, 90, 95, 99):
            summary[f"{name}_p{q}_ms"] = percentile(values, q) * 1000
        summary[f"{name}_mean_ms"] = (sum(values) / len(values) * 1000) if values else float("nan")
    return summary


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hyperserve bench: {summary['base_url']} ({summary['model']})")
    table.add_column("metric")
    for q in ("mean", "p50", "p90", "p95", "p99"):
        table.add_column(q, justify="right")
    for name, label in (("ttft", "TTFT ms"), ("itl", "ITL ms"), ("tpot", "TPOT ms"), ("e2e", "E2E ms")):
        table.add_row(label, *(f"{summary[f'{name}_{q}_ms']:.1f}" for q in ("mean", "p50", "p90", "p95", "p99")))
    console = Console()
    console.print(table)
    console.print(
        f"requests ok {summary['num_ok']}/{summary['num_requests']} in {summary['duration_s']:.1f}s | "
        f"{summary['request_throughput']:.2f} req/s | output {summary['output_token_throughput']:.1f} tok/s | "
        f"total {summary['total_token_throughput']:.1f} tok/s | goodput {summary['goodput']:.2f} req/s"
        + ("" if summary.get("prompt_cache_hit_rate") is None
           else f" | prompt tokens from the prefix cache {summary['prompt_cache_hit_rate']:.0%}")
    )
    for error in summary["errors"]:
        console.print(f"[red]error:[/red] {error}")


def load_label(summary: dict) -> str:
    return f"c={summary['concurrency']}" if summary["concurrency"] else f"{summary['request_rate']:g} req/s"


def print_sweep(runs: dict[str, list[dict]]) -> None:
    """One row per load of each run (a run: a sweep's summaries, named by its server)."""
    from rich.console import Console
    from rich.table import Table

    several = len(runs) > 1
    title = "latency against throughput" + ("" if several else f": {next(iter(runs))}")
    table = Table(title=f"hyperserve bench, {title} (ms)")
    for column in ("run",) * several + ("load", "ok", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50",
                                        "ITL p99", "TPOT p50", "goodput", "prompt cached"):
        table.add_column(column, justify="left" if column in ("run", "load") else "right")
    for name, summaries in runs.items():
        for s in summaries:
            table.add_row(*(name,) * several, load_label(s), f"{s['num_ok']}/{s['num_requests']}",
                          f"{s['request_throughput']:.2f}", f"{s['output_token_throughput']:.1f}",
                          *(f"{s[key]:.1f}" for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                                          "tpot_p50_ms")),
                          f"{s['goodput']:.2f}",
                          "-" if s.get("prompt_cache_hit_rate") is None
                          else f"{s['prompt_cache_hit_rate']:.0%}")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: the table's width, not a default 80 columns
        console = Console(width=200)
    console.print(table)


def plot_sweep(runs: dict[str, list[dict]], path: str) -> None:
    """Output tokens/s against TPOT and TTFT (p50), a point per load, a curve per run: further
    right is more throughput, lower is faster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, summaries in runs.items():
        throughput = [s["output_token_throughput"] for s in summaries]
        for ax, key in zip(axes, ("tpot_p50_ms", "ttft_p50_ms")):
            ax.plot(throughput, [s[key] for s in summaries], marker="o", label=name)
            for x, s in zip(throughput, summaries):
                ax.annotate(load_label(s), (x, s[key]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes[0].set(title="Time per output token (p50)", xlabel="output tokens/s", ylabel="ms")
    axes[1].set(title="Time to first token (p50)", xlabel="output tokens/s", ylabel="ms")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_runs(paths: list[str]) -> dict[str, list[dict]]:
    """Earlier --output-json files as runs: each its sweep (or one load), named by its server and
    model (the file's name where two share them)."""
    runs: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        summaries = data["sweep"] if "sweep" in data else [data["summary"]]
        name = summaries[0].get("label") or f"{summaries[0]['base_url']} ({summaries[0]['model']})"
        runs[path if name in runs else name] = summaries
    return runs


def plot(results: list[RequestResult], summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].hist([r.ttft * 1000 for r in ok], bins=30, color="tab:blue")
    axes[0].set(title="Time to first token", xlabel="ms", ylabel="requests")
    axes[1].hist([g * 1000 for r in ok for g in r.itls], bins=50, color="tab:orange")
    axes[1].set(title="Inter-token latency", xlabel="ms", ylabel="token gaps")
    axes[2].scatter([r.ttft * 1000 for r in ok], [r.tpot * 1000 for r in ok], s=10, color="tab:green")
    axes[2].set(title="Per request: TTFT vs TPOT", xlabel="TTFT ms", ylabel="TPOT ms")
    load = f"concurrency {summary['concurrency']}" if summary["concurrency"] else f"{summary['request_rate']} req/s"
    fig.suptitle(f"{summary['model']} @ {summary['base_url']}, {load}: "
                 f"{summary['output_token_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model a server lists at GET /v1/models (OpenAI's API; vLLM, llama-server and ours
    answer it), for a run given no --model; smollm2-135m where it lists none (the server's 404s for
    an unknown model then say which it serves)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = urllib3.request("GET", base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30,
                                   retries=False)
        models = (response.json().get("data") or []) if response.status == 200 else []
        return str(models[0]["id"])
    except (HTTPError, ValueError, LookupError, AttributeError, TypeError):
        return DEFAULT_MODEL


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None,
                        help=f"default: the first model the server lists at GET /v1/models, else "
                             f"{DEFAULT_MODEL}")
    parser.add_argument("--endpoint", choices=["completions", "chat", "responses", "messages"],
                        default="completions", help="/v1/completions, /v1/chat/completions, /v1/responses "
                                                    "(OpenAI's Responses API) or /v1/messages (Anthropic's)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", default=None,
                      help="requests in flight (default 8); several: a sweep, one load after another")
    load.add_argument("--request-rate", type=float, nargs="+", default=None,
                      help="Poisson arrivals per second; several: a sweep")
    load.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                      help="no load: the table and --plot of earlier runs' --output-json, side by side")
    parser.add_argument("--input-tokens", type=int, default=200, help="mean prompt length (approximate)")
    parser.add_argument("--input-spread", type=float, default=0.0, help="uniform +- fraction")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--output-spread", type=float, default=0.0)
    parser.add_argument("--prompts-file", default=None, help="JSONL with 'prompt' and optional 'max_tokens'")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-itl-ms", type=float, default=None)
    parser.add_argument("--timeout-s", type=float, default=600,
                        help="seconds a request may wait to connect, or for the next bytes of its answer")
    parser.add_argument("--label", default=None, help="the run's name in tables and plots (default: URL and model)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, help="write a PNG of the latency distributions here")


def run_from_args(args: argparse.Namespace) -> dict:
    """One load: its summary. A sweep (several values of --concurrency or --request-rate):
    {"sweep": a summary per load}. --compare: {"runs": the files' summaries by run}."""
    if getattr(args, "compare", None):
        runs = read_runs(args.compare)
        print_sweep(runs)
        if args.plot:
            plot_sweep(runs, args.plot)
        return {"runs": runs}
    if args.model is None:
        args.model = served_model(args.base_url, args.api_key)
    loads = [{"concurrency": c, "request_rate": None} for c in _values(args.concurrency)] or [
        {"concurrency": None, "request_rate": r} for r in _values(args.request_rate)] or [
        {"concurrency": 8, "request_rate": None}]
    summaries, outputs, timings = [], [], []
    for run, load in enumerate(loads):
        one = argparse.Namespace(**{**vars(args), **load})
        results, duration = run_load(one, make_requests(args, run))
        summaries.append(summarize(results, duration, one))
        outputs.append({"summary": summaries[-1], "requests": [asdict(r) for r in results]})
        timings.append(results)
        print_summary(summaries[-1])
    if len(loads) == 1:
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(outputs[0], f, indent=2)
        if args.plot:
            plot(timings[0], summaries[0], args.plot)
        return summaries[0]
    name = summaries[0]["label"]
    print_sweep({name: summaries})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"sweep": summaries, "loads": outputs}, f, indent=2)
    if args.plot:
        plot_sweep({name: summaries}, args.plot)
    return {"sweep": summaries}


def _values(value: int | float | list | None) -> list:
    """A load flag as parsed (a list), or as a script sets it (one number)."""
    return [] if value is None else list(value) if isinstance(value, list) else [value]
