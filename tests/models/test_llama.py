"""Our Llama-family and Gemma models against transformers on the same weights: logits at prefill
and decode."""

from __future__ import annotations

import pytest
import torch

from hyperserve import LLM, SamplingParams
from tests.conftest import DEVICES, assert_close_until_apart, needs_triton, random_prompts, tiny_config

ARCHS = {
    "llama": {},
    "llama-rope_llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}},
    "llama-tied": {"tie_word_embeddings": True},
    "mistral": {"sliding_window": 8},
    "qwen2": {},
    "qwen2-rope_yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64}},
    "qwen3": {},  # QK norms
    "mixtral": {},  # 4 experts, 2 a token
    "qwen3_moe": {"mlp_only_layers": [0]},  # a dense layer, then a sparse one
    "qwen3_moe-unnormalized": {"norm_topk_prob": False},
    "qwen2_moe": {"mlp_only_layers": [0]},  # a dense layer, then experts beside a gated shared one
    "granite": {},  # embedding, residual, attention and logits multipliers
    "granite-tied": {"tie_word_embeddings": True},
    "smollm3": {},  # a layer that rotates, then one that does not
    "phi3": {"sliding_window": 8},  # fused q/k/v and gate/up projections in the checkpoint
    # LongRoPE's short factors (the context stays within original_max_position_embeddings) and its
    # attention factor, from max_position_embeddings / original = 4
    "phi3-rope_longrope": {"original_max_position_embeddings": 128, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}},
    "phi3-partial_rotary": {"partial_rotary_factor": 0.5},  # Phi-4-mini's (0.75): half of each head turns
    "gemma3": {},  # a sliding-window layer (8 tokens) and a global one, QK norms, four norms per layer
    "gemma2": {},  # the same layers without QK norms, attention scores and logits soft-capped
    # latent attention with interleaved rotary rows; a dense layer, then softmax-routed experts beside
    # a shared one, their weights scaled; V3: q through its own low-rank projection, sigmoid scores
    # with a bias that chooses, experts of one group of two
    "deepseek_v2": {},
    "deepseek_v2-grouped": {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
    "deepseek_v3": {},
    # attention sinks; a windowed layer, then a full one; biased experts with a clamped SwiGLU
    "gpt_oss": {},
    "deepseek_v3-rope_yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 64, "mscale": 0.707,
                                                  "mscale_all_dim": 0.707}},
}


def _hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids], device=hf_model.device)).logits[0].float().cpu()
    return torch.log_softmax(logits, dim=-1)  # [L, V]


def _check_against_transformers(llm: LLM, hf_model, abs_tol: float, same_greedy: bool = True) -> None:
    """Log-probabilities within abs_tol of transformers' (teacher-forced), and greedy tokens equal."""
    prompts = random_prompts()
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        completion = out.outputs[0]
        reference = _hf_logprobs(hf_model, prompt + completion.token_ids)  # teacher-forced
        for step, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            expected = reference[len(prompt) - 1 + step]
            assert token == int(expected.argmax()) or not same_greedy, f"step {step}: greedy token differs"
            for token_id, logprob in entries.items():
                assert logprob.logprob == pytest.approx(float(expected[token_id]), abs=abs_tol)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.pool.num_blocks


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("max_num_batched_tokens", [512, 7])  # one prefill, or chunks of 7
@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_match_transformers(name, max_num_batched_tokens, device, save_hf_model):
    arch = name.split("-")[0]
    hf_model, path = save_hf_model(tiny_config(arch, **ARCHS[name]))
    hf_model.to(device)
    llm = LLM(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, device=device, dtype="float32",
              max_num_batched_tokens=max_num_batched_tokens)
    _check_against_transformers(llm, hf_model, abs_tol=2e-4)


def test_longrope_runs_where_its_short_factors_hold(save_hf_model):
    """Beyond original_max_position_embeddings LongRoPE rotates every position by other factors,
    which a cache of rotated keys cannot follow: the context stops there, by default and when asked
    for more."""
    _, path = save_hf_model(tiny_config("phi3", **ARCHS["phi3-rope_longrope"]))
    assert LLM(model=path, num_kv_blocks=8, dtype="float32").engine.max_model_len == 128
    with pytest.raises(ValueError, match="max_model_len 256 exceeds 128"):
        LLM(model=path, num_kv_blocks=8, dtype="float32", max_model_len=256)


@needs_triton
# Gemma 2: capped scores; GPT-OSS: attention sinks
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_matches_transformers(name, kv_cache_dtype, device, save_hf_model):
    """Decodes through the Triton paged kernel (its interpreter on the CPU; on CUDA replayed from
    CUDA graphs), prefill in chunks of 7 that read their context back from the cache."""
    hf_model, path = save_hf_model(tiny_config(name, **ARCHS[name]))
    hf_model.to(device)
    llm = LLM(model=path, num_kv_blocks=32, block_size=16, max_model_len=128, device=device, dtype="float32",
              max_num_batched_tokens=7, attention_backend="triton", kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.model.attention_backend.ragged_decode
    model = llm.engine.runner.model
    assert (llm.engine.runner.decode_graphs is not None) == (device == "cuda" and not model.has_experts)
    if kv_cache_dtype == "auto":
        _check_against_transformers(llm, hf_model, abs_tol=2e-4)
    else:  # GPT-OSS's biased keys lose more to fp8 (the portable backend's error: 0.97)
        tolerance = 0.6 if name == "gpt_oss" else 0.4
        _check_against_transformers(llm, hf_model, abs_tol=tolerance, same_greedy=False)


@needs_triton
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "gemma2"])
def test_qk_norms_in_the_rotary_kernel_match_transformers(name, save_hf_model, monkeypatch):
    """Qwen3's and Gemma 3's per-head QK norms, the rotation and the K/V write in one Triton kernel,
    as on CUDA (here under the interpreter, with the models' other Triton kernels): prefill chunks
    of 7 and decodes, Gemma's windowed layer included; Gemma 2 without the norms, its scores capped
    in the attention kernels."""
    from hyperserve.models import gemma, llama

    for module in (llama, gemma):
        monkeypatch.setattr(module, "on_triton", lambda x: True)
    hf_model, path = save_hf_model(tiny_config(name, **ARCHS[name]))
    llm = LLM(model=path, num_kv_blocks=32, block_size=16, max_model_len=128, dtype="float32",
              max_num_batched_tokens=7, attention_backend="triton")
    _check_against_transformers(llm, hf_model, abs_tol=2e-4)


@needs_triton
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "gemma2"])
@pytest.mark.parametrize("device", DEVICES[1:])
def test_triton_kernels_in_bfloat16_match_pytorchs_ops(name, device, save_hf_model, monkeypatch):
    """The half-precision paths of the models' Triton kernels (norms and adds, gated activations,
    QK norms with the rotation and K/V write, the six-kernel layers) against the same model with
    PyTorch's ops in their place, both in bfloat16 on CUDA."""
    from hyperserve.layers import gemv_decode, norm
    from hyperserve.models import gemma, llama

    _, path = save_hf_model(tiny_config(name, **ARCHS[name]))
    prompts = random_prompts()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    results = []
    for kernels in (True, False):
        for module in (llama, gemma, norm):
            monkeypatch.setattr(module, "on_triton", lambda x, kernels=kernels: kernels and x.is_cuda)
        monkeypatch.setattr(gemv_decode, "ENABLED", kernels)
        llm = LLM(model=path, num_kv_blocks=32, block_size=16, max_model_len=128, device=device,
                  dtype="bfloat16", max_num_batched_tokens=30)
        results.append(llm.generate(prompts, params, use_tqdm=False))
        llm.close()
    assert_close_until_apart(*results, tolerance=0.1)  # bfloat16 roundings in other places


@needs_triton
# windows wider than the prompts: see below
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_mixes_flash_and_paged_prefill(name, device, save_hf_model, monkeypatch):
    """New prompts from FLASH_PREFILL_TOKENS on attend through SDPA, the rest (shorter prompts,
    chunks after context) through the Triton kernel, in the same steps as each other and decodes;
    Gemma 2's and GPT-OSS's all through the kernel, which caps their scores and takes their
    attention sinks as SDPA cannot."""
    from hyperserve.engine import model_runner
    from hyperserve.layers import attention

    monkeypatch.setattr(model_runner, "FLASH_PREFILL_TOKENS", 20)  # the 23-token prompt; the others are paged
    calls = {"flash": 0, "paged": 0}
    for path, key in (("TorchPagedAttention.prefill", "flash"), ("TritonPagedAttention.__call__", "paged")):
        cls, method = path.split(".")
        original = getattr(getattr(attention, cls), method)

        def counted(self, *args, _original=original, _key=key, **kwargs):
            calls[_key] += _key == "flash" or kwargs.get("meta", args[4]).prefill_batch is not None
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(getattr(attention, cls), method, counted)
    # a windowed prompt longer than its window is paged: these windows hold every prompt
    plain_scores = name in ("gemma2", "gpt_oss")
    window = {"sliding_window": 64} if plain_scores else {}
    hf_model, path = save_hf_model(tiny_config(name, **ARCHS[name], **window))
    hf_model.to(device)
    llm = LLM(model=path, num_kv_blocks=32, block_size=16, max_model_len=128, device=device, dtype="float32",
              max_num_batched_tokens=30, attention_backend="triton")
    _check_against_transformers(llm, hf_model, abs_tol=2e-4)
    assert (calls["flash"] == 0 if plain_scores else calls["flash"] > 0) and calls["paged"] > 0


@pytest.mark.parametrize("name", ["llama-tied", "mistral"])
def test_compiled_decode_matches_transformers(name, save_hf_model):
    """The torch.compile'd decode step (every step after the prefill here) against transformers."""
    hf_model, path = save_hf_model(tiny_config(name.split("-")[0], **ARCHS[name]))
    llm = LLM(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32", compile=True)
    assert llm.engine.runner._compiled_decode is not None
    _check_against_transformers(llm, hf_model, abs_tol=2e-4)


@pytest.mark.parametrize(("kv_cache_dtype", "abs_tol"), [("int8", 0.1), ("fp8", 0.4)])
def test_quantized_kv_cache_stays_close_to_transformers(kv_cache_dtype, abs_tol, save_hf_model):
    """Within quantization error (measured worst: 0.06 for int8, 0.24 for fp8's 3-bit mantissa); a
    near-tie can flip a greedy token, so only log-probabilities are compared."""
    hf_model, path = save_hf_model(tiny_config("llama"))
    llm = LLM(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32",
              max_num_batched_tokens=7, kv_cache_dtype=kv_cache_dtype)  # chunks read their context back
    stored = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    assert llm.engine.runner.kv_caches[0].key.dtype == stored
    _check_against_transformers(llm, hf_model, abs_tol=abs_tol, same_greedy=False)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_weights_stay_close_to_transformers(device, save_hf_model):
    """Every projection in float8 with per-channel weight scales (and per-token activation scales
    in calls of more than 16 rows; on CUDA, fewer rows run weight-only): within quantization error
    of transformers' float32. This random model's logits are steep, so the error is large: the
    worst top-5 log-probability was 0.62 off in float32 on the CPU, 0.93 in bfloat16 on an H100
    (weight-only decode; on the CPU its mean error over all entries, 0.14, is below the 0.17 of
    scaling activations too). The quality guard is SmolLM2's perplexity (tests/layers/test_quantization.py).
    Near-ties may flip greedy tokens."""
    hf_model, path = save_hf_model(tiny_config("llama"))
    hf_model.to(device)
    llm = LLM(model=path, num_kv_blocks=64, block_size=16, max_model_len=128, device=device,
              dtype="float32" if device == "cpu" else "bfloat16", quantization="fp8")
    _check_against_transformers(llm, hf_model, abs_tol=1.2, same_greedy=False)


def test_sliding_window_changes_the_output(save_hf_model):
    """Guards the test above: a window of 8 over 40 tokens must matter, or nothing is tested."""
    hf_model, _ = save_hf_model(tiny_config("mistral", sliding_window=8))
    tokens = list(range(40))
    windowed = _hf_logprobs(hf_model, tokens)
    hf_model.config.sliding_window = None
    hf_model.config._attn_implementation = "eager"
    full = _hf_logprobs(hf_model, tokens)
    assert not torch.allclose(windowed[-1], full[-1], atol=1e-3)


@pytest.mark.parametrize("name", ["mistral", "gemma3", "gemma2", "gpt_oss"])
def test_sliding_window_layers_hold_only_their_window(name, save_hf_model):
    """Decoding far past the 8-token window: the windowed layers' blocks stay bounded (Mistral's
    every layer, Gemma's local ones, in a pool of their own) while full attention keeps them all."""
    _, path = save_hf_model(tiny_config(name, **ARCHS[name]))
    llm = LLM(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32",
              max_num_batched_tokens=7, max_num_seqs=2)
    engine, kv = llm.engine, llm.engine.kv_cache
    windowed = kv.groups[-1]
    assert windowed.window == 8 and len(kv.groups) == (1 if name == "mistral" else 2)
    engine.add_request("a", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    most_held = 0
    while engine.has_unfinished_requests():
        engine.step()
        if "a" in windowed.tables:
            most_held = max(most_held, len(windowed.held(windowed.tables["a"])))
            if name != "mistral":  # the global layers' table holds every token's block
                assert kv.groups[0].padding_block not in kv.block_table("a")
    assert most_held <= -(-(8 + 7) // 4) + 1  # a window and a step's tokens: not the 100-token context
    assert all(group.pool.num_free_blocks == group.pool.num_blocks for group in kv.groups)


@pytest.mark.parametrize("name", ["mistral", "gemma3", "gemma2", "gpt_oss"])
def test_a_prefix_cached_under_a_window_answers_as_computed_afresh(name, save_hf_model):
    """A prefix hit past the window reuses only what the next token can see (the rest of the
    windowed group's blocks were released): the answers equal an engine without prefix caching."""
    _, path = save_hf_model(tiny_config(name, **ARCHS[name]))
    engine = dict(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32",
                  max_num_batched_tokens=7)
    prompt = list(range(3, 43))
    prompts = [prompt, prompt, prompt[:30] + [7, 8, 9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    cached_llm, fresh = LLM(**engine), LLM(**engine, enable_prefix_caching=False)
    cached = [cached_llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [c.metrics.num_cached_tokens for c in cached] == [0, 36, 28]
    for out, p in zip(cached, prompts):
        ref = fresh.generate([p], params, use_tqdm=False)[0].outputs[0]
        assert out.outputs[0].token_ids == ref.token_ids
        assert [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)] == pytest.approx(
            [e[t].logprob for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)], abs=1e-5)
