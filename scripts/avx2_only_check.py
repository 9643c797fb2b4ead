"""The shipped models' default configuration on an AVX2-only CPU, emulated: greedy answers inside
qemu-user emulating a Haswell (CPUID: AVX2, FMA, F16C; no AVX-512, no bfloat16 instructions; the
first AVX-512 instruction stops the process) against the same answers run natively.

Natively the answers are taken twice: on this CPU's own paths, and on its AVX2 paths
(HYPERSERVE_MAX_ISA=avx2 and ATEN_CPU_CAPABILITY=avx2, the code an AVX2-only CPU runs). The
emulated tokens must equal the native AVX2 paths' exactly; agreement with this CPU's own paths is
shown, not required (other kernels, other roundings). Emulation says nothing about speed.

    python scripts/avx2_only_check.py [--models smollm2-135m gemma3-270m] [--max-tokens 24]

~5 minutes a model on 2 cores. `make test` runs the kernel tests the same way
(tests/kernels/test_avx2_only_cpu.py); this adds the real weights, tokenizer and engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, torch
from hyperserve import LLM, SamplingParams, kernels
model, max_tokens = sys.argv[1], int(sys.argv[2])
llm = LLM(model=model, max_model_len=2048)
document = " ".join(f"Item {i} is a small {'red' if i % 3 else 'blue'} box on shelf {i % 7}." for i in range(60))
prompts = ["What is the capital of France?", f"{document}\\n\\nWhich shelves hold blue boxes?"]
params = SamplingParams(temperature=0, max_tokens=max_tokens)
outputs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0] for p in prompts]
print("RESULT " + json.dumps({
    "isa": kernels.isa() if kernels.available() else "none", "torch": torch.backends.cpu.get_cpu_capability(),
    "dtype": str(llm.engine.config.model.torch_dtype).removeprefix("torch."),
    "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
    "tokens": [list(o.outputs[0].token_ids) for o in outputs], "text": [o.outputs[0].text for o in outputs]}))
llm.close()
"""


def answers(model: str, max_tokens: int, mode: str) -> tuple[dict, float]:
    """The child's result and its seconds: mode `native`, `native-avx2` or `emulated`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYPERSERVE_MAX_ISA", "ATEN_CPU_CAPABILITY")}
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, "-c", CHILD, model, str(max_tokens)]
    if mode == "native-avx2":
        env.update(HYPERSERVE_MAX_ISA="avx2", ATEN_CPU_CAPABILITY="avx2")
    elif mode == "emulated":
        command = [shutil.which("qemu-x86_64"), "-cpu", "Haswell", *command]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        errors = "\n".join(line for line in done.stderr.splitlines() if "TCG doesn't support" not in line)
        raise SystemExit(f"{model} ({mode}) failed with status {done.returncode}:\n{errors[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT ")), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    if shutil.which("qemu-x86_64") is None:
        raise SystemExit("needs qemu-user: `make qemu` (or apt-get install qemu-user)")
    sys.path.insert(0, str(ROOT))
    from benchmarks.cpu_vs_llamacpp import cpu_header

    print(f"{cpu_header(2)}; emulated: qemu-x86_64 -cpu Haswell")
    print("| model | run | kernels | PyTorch | activations | prompt tokens | seconds | greedy tokens |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for model in args.models:
        runs = {mode: answers(model, args.max_tokens, mode) for mode in ("native", "native-avx2", "emulated")}
        reference = runs["native-avx2"][0]["tokens"]
        for mode, (result, seconds) in runs.items():
            same = result["tokens"] == reference
            verdict = ("the reference" if mode == "native-avx2" else "same" if same
                       else "DIFFER" if mode == "emulated" else "other tokens (other kernels; allowed)")
            failed |= mode == "emulated" and not same
            print(f"| {model} | {mode} | {result['isa']} | {result['torch']} | {result['dtype']} "
                  f"| {result['prompt_tokens']} | {seconds:.0f} | {verdict} |", flush=True)
        for text in runs["emulated"][0]["text"]:
            print(f"  emulated answer: {text!r}")
    if failed:
        raise SystemExit("the emulated AVX2-only CPU's answers differ from the native AVX2 paths'")


if __name__ == "__main__":
    main()
