"""Llama layers in six kernels (layers/gemv_decode.py) against transformers, and against the modules'
own path with float8 weights. The path is for half precision on CUDA; on the CPU its kernels run
under Triton's interpreter in float32, where folding the norm into the GEMV changes no more than
float32's rounding, so the comparison is as tight as the module path's own."""

from __future__ import annotations

import pytest
import torch

from hyperserve import LLM, SamplingParams
from tests.conftest import DEVICES, assert_close_until_apart, needs_triton, random_prompts, tiny_config
from tests.models.test_llama import ARCHS, _check_against_transformers

pytestmark = needs_triton


@pytest.fixture
def fused_steps(monkeypatch):
    """Every one-token step through the six kernels, in any dtype on any device; the count of
    layers run there."""
    from hyperserve.layers import gemv_decode

    monkeypatch.setattr(gemv_decode, "gemv_takes", lambda x: True)
    calls = {"layers": 0}
    original = gemv_decode.layer_forward

    def counted(*args, **kwargs):
        calls["layers"] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(gemv_decode, "layer_forward", counted)
    return calls


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("device", DEVICES)
def test_six_kernel_layers_match_transformers(name, device, save_hf_model, fused_steps):
    """Every decode through the six kernels (one sequence at a time), after a prompt prefilled in
    chunks of 7 by the modules; Qwen2's QKV bias and Qwen3's QK norms (the attention is the
    module's: on the CPU, PyTorch's rotation; test_llama.py runs the rotary kernel)."""
    hf_model, path = save_hf_model(tiny_config(name, **ARCHS[name]))
    hf_model.to(device)
    llm = LLM(model=path, num_kv_blocks=32, block_size=16, max_model_len=128, device=device, dtype="float32",
              max_num_batched_tokens=7, max_num_seqs=1, attention_backend="triton", enforce_eager=True)
    _check_against_transformers(llm, hf_model, abs_tol=2e-4)
    assert fused_steps["layers"] == 3 * 11 * 2  # 3 prompts' 11 decodes after the first token, 2 layers


ON_CUDA = DEVICES[1].marks


@pytest.mark.parametrize(("device", "dtype", "quantization", "tolerance"), [
    ("cpu", "float32", "fp8", 1e-4),
    pytest.param("cuda", "bfloat16", None, 0.1, marks=ON_CUDA),
    pytest.param("cuda", "bfloat16", "fp8", 0.1, marks=ON_CUDA)], ids=["cpu-fp8", "cuda", "cuda-fp8"])
def test_six_kernel_layers_match_the_modules(device, dtype, quantization, tolerance, save_hf_model,
                                             fused_steps, monkeypatch):
    """The same log-probabilities as the layer modules' path (which adds and normalises separately):
    on the CPU in float32, with float8 projections handing the GEMV their codes and scales; on CUDA
    in bfloat16 as decode runs there, within the norm's rounding (its input is rounded before 1 / RMS
    scales it, not after), compared up to the first greedy token where near-ties part the paths."""
    from hyperserve.layers import gemv_decode

    _, path = save_hf_model(tiny_config("llama"))
    prompts = random_prompts((5, 23))
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(gemv_decode, "ENABLED", fused)
        llm = LLM(model=path, num_kv_blocks=32, block_size=16, max_model_len=128, device=device, dtype=dtype,
                  quantization=quantization, max_num_batched_tokens=7, max_num_seqs=1,
                  attention_backend="triton", enforce_eager=True)
        results.append(llm.generate(prompts, params, use_tqdm=False))
        llm.close()
    assert fused_steps["layers"] == 2 * 7 * 2  # 2 prompts' 7 decodes after the first token, 2 layers
    if dtype == "float32":
        assert [r.outputs[0].token_ids for r in results[0]] == [r.outputs[0].token_ids for r in results[1]]
    assert_close_until_apart(*results, tolerance)


@pytest.mark.parametrize(("name", "takes"), [("llama", True), ("qwen2", True), ("qwen3", True),
                                             ("mixtral", False), ("qwen3_moe", False), ("smollm3", False)])
def test_only_plain_llama_layers_take_the_six_kernels(name, takes, save_hf_model, monkeypatch):
    """Experts (Mixtral, Qwen3-MoE) and layers without rotary (SmolLM3) keep the modules' path; so
    does a step of more than one token."""
    from hyperserve.layers import gemv_decode

    monkeypatch.setattr(gemv_decode, "gemv_takes", lambda x: True)
    _, path = save_hf_model(tiny_config(name.split("-")[0], **ARCHS[name]))
    llm = LLM(model=path, num_kv_blocks=32, block_size=16, max_model_len=128, dtype="float32")
    model = llm.engine.runner.model
    assert gemv_decode.takes(model, torch.zeros(1, 64)) is takes
    assert not gemv_decode.takes(model, torch.zeros(2, 64))
    llm.close()
