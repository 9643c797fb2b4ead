"""The Triton LoRA kernels (BGMV shrink and expand) against PyTorch, and a LoRA model run through
them against the dense masked path. On the CPU under TRITON_INTERPRET=1 (set in conftest)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import DEVICES, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank, in_features, out_features", [(4, 64, 96), (16, 100, 130), (64, 32, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_own_adapters_delta(device, rank, in_features, out_features, dtype):
    from hyperserve.layers.triton_lora import lora_expand, lora_shrink

    generator = torch.Generator().manual_seed(rank)
    num_adapters, rows = 3, torch.tensor([2, -1, 0, 0, 1, -1, 2])
    x = torch.randn(len(rows), in_features, generator=generator).to(device, dtype)
    a = torch.randn(num_adapters, rank, in_features, generator=generator).to(device, dtype)
    b = torch.randn(num_adapters, rank, out_features, generator=generator).to(device, dtype)
    y = torch.randn(len(rows), out_features + 10, generator=generator).to(device, dtype)  # a column slice of it
    expected = y.double().clone()
    for t, adapter in enumerate(rows.tolist()):
        if adapter >= 0:
            expected[t, 5 : 5 + out_features] += (x[t].double() @ a[adapter].double().T) @ b[adapter].double()
    rows = rows.to(device)
    h = lora_shrink(x, a, rows)
    assert torch.equal(h[1], torch.zeros(rank, device=device))
    lora_expand(h, b, rows, y[:, 5 : 5 + out_features])
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_a_lora_batch_through_the_triton_kernels_equals_the_dense_path(tmp_path):
    """Mixed adapters and base rows, prefill and decode, through LoRALinear both ways."""
    from transformers import AutoModelForCausalLM

    from hyperserve import LLM, LoRARequest, SamplingParams
    from tests.conftest import tiny_config
    from tests.engine.test_lora import ENGINE, PROMPTS, make_adapter

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32).save_pretrained(tmp_path / "base")
    loras = [None]
    for i, variant in enumerate([dict(rank=4), dict(rank=8, targets=["q_proj", "v_proj", "down_proj"])]):
        make_adapter(str(tmp_path / "base"), tmp_path / f"a{i}", seed=i, **variant)
        loras.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(kernel: str) -> tuple[list[list[int]], list[float]]:
        llm = LLM(model=str(tmp_path / "base"), **ENGINE)
        llm.engine.lora.batch.kernel = kernel
        completions = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)]
        return ([c.token_ids for c in completions],
                [e[t].logprob for c in completions for t, e in zip(c.token_ids, c.logprobs)])

    (triton_tokens, triton_logprobs), (torch_tokens, torch_logprobs) = run("triton"), run("torch")
    assert triton_tokens == torch_tokens and len(set(map(tuple, torch_tokens))) == 3
    assert triton_logprobs == pytest.approx(torch_logprobs, abs=1e-4)
