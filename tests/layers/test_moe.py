"""The mixture-of-experts MLP against a per-token reference, quantized and not, and a MoE model in
the engine: batched, chunked and preempted runs against single-request runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyperserve import LLM, SamplingParams
from hyperserve.layers.moe import Router, SparseMoE
from hyperserve.layers.quantization import Int4Linear, quantize_model
from hyperserve.models.llama import LlamaForCausalLM
from tests.conftest import tiny_config

HIDDEN, WIDTH, EXPERTS = 64, 64, 6


def _moe(top_k: int, renormalize: bool) -> SparseMoE:
    from hyperserve.layers.linear import Linear

    class Expert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = Linear(HIDDEN, 2 * WIDTH, bias=False)
            self.down_proj = Linear(WIDTH, HIDDEN, bias=False)

        def forward(self, x):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)

    torch.manual_seed(0)
    moe = SparseMoE(HIDDEN, EXPERTS, top_k, renormalize, Expert)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe.eval().requires_grad_(False)


def _per_token(moe: SparseMoE, x: torch.Tensor, weight_of=lambda linear: linear.weight) -> torch.Tensor:
    """Each token alone: the softmax over every expert's score, its top k (renormalised where
    asked), and the weighted sum of those experts' MLPs on weights `weight_of` gives."""
    rows = []
    for token in x:
        probs = F.linear(token, moe.gate.weight).softmax(-1)
        top, chosen = probs.topk(moe.top_k)
        if moe.renormalize:
            top = top / top.sum()
        out = torch.zeros(HIDDEN)
        for p, e in zip(top, chosen):
            expert = moe.experts[int(e)]
            gate, up = F.linear(token, weight_of(expert.gate_up_proj)).chunk(2)
            out += p * F.linear(F.silu(gate) * up, weight_of(expert.down_proj))
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.parametrize(("top_k", "renormalize"), [(1, False), (2, True), (2, False), (6, True)])
def test_routed_tokens_equal_each_token_alone(top_k, renormalize):
    moe = _moe(top_k, renormalize)
    x = torch.randn(37, HIDDEN)
    torch.testing.assert_close(moe(x), _per_token(moe, x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe(x[5:6]), _per_token(moe, x[5:6]), atol=1e-5, rtol=1e-5)


def test_a_step_whose_tokens_all_choose_one_expert_runs_only_it():
    moe = _moe(1, False)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[3, 0] = 10.0  # expert 3 wins wherever x[0] > 0
    x = torch.randn(9, HIDDEN).abs()
    calls = []
    for index, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda module, args, out, index=index: calls.append((index, args[0].shape[0])))
    moe(x)
    assert calls == [(3, 9)]


def test_int4_experts_equal_their_dequantized_weights_and_the_router_stays_float():
    """quantize_model turns every expert's projections into int4 and leaves the router's scores
    alone (a rounded score can change which experts run)."""
    model = LlamaForCausalLM(tiny_config("qwen3_moe", moe_intermediate_size=64), backend=None, max_position=64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    moe = model.model.layers[1].mlp
    gate_before = moe.gate.weight.clone()
    quantize_model(model, "int4", torch.float32)
    assert all(isinstance(m, Int4Linear) for e in moe.experts for m in (e.gate_up_proj, e.down_proj))
    assert isinstance(moe.gate, Router) and torch.equal(moe.gate.weight, gate_before)
    x = torch.randn(5, 64)  # few rows: the int4 kernel's own path (8-bit activations where the CPU's best is AVX2)
    reference = _per_token(moe, x, weight_of=lambda linear: linear.dense().float())
    torch.testing.assert_close(moe(x), reference, atol=0.05 * reference.abs().max().item(), rtol=0)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_mixed_batch_with_chunking_and_preemption_matches_single_runs(arch, save_hf_model):
    _, path = save_hf_model(tiny_config(arch))
    llm = LLM(model=path, num_kv_blocks=14, block_size=4, max_model_len=56, dtype="float32",
              max_num_batched_tokens=16)  # 56 slots for 4 sequences of up to 46 tokens: preempted
    prompts = [[int(t) for t in torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 30, 11, 26)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the pool should have forced preemption"
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert llm.engine.kv_cache.num_free_blocks == 14
