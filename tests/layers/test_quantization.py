import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hyperserve import LLM, kernels
from hyperserve.config import ModelConfig
from hyperserve.engine.model_runner import SeqChunk
from hyperserve.layers.attention import TorchPagedAttention
from hyperserve.layers.quantization import (
    KEEP_FLOAT_INT8,
    QUANTIZED_MAX_ROWS,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    Mxfp4Linear,
    Q8Linear,
    int8_reduce_range,
    mxfp4_rows,
    quantize_model,
)
from hyperserve.models.gguf_reader import gguf_weight_bits
from hyperserve.models.loader import build_model
from tests.conftest import DEVICES, FLOAT32, tiny_config

TEXT = Path(__file__).parents[2] / "data" / "quality_text.txt"


def q4_1_weight(out_features: int, in_features: int) -> torch.Tensor:
    """A weight as a Q4_1 GGUF holds it: per group of 32, q * d + m with q in 0..15, d and m float16."""
    codes = torch.randint(0, 16, (out_features, in_features // 32, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # llama.cpp's quantizer maps each group's min to 0, max to 15
    d = (torch.rand(out_features, in_features // 32) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(out_features, in_features // 32) * 0.05).half().float()
    return (codes * d[..., None] + m[..., None]).reshape(out_features, in_features)


def test_int4_reproduces_q4_1_weights_exactly_and_both_kernels_agree():
    torch.manual_seed(0)
    weight, bias = q4_1_weight(96, 128), torch.randn(96)
    linear = Int4Linear(weight, bias, torch.float32)
    assert torch.equal(linear.dense(), weight)  # lossless for a Q4_1 checkpoint
    for rows in (1, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 3):  # the int4 kernel, then the dense copy
        x = torch.randn(rows, 128)
        expected = F.linear(x.bfloat16().float(), weight, bias)
        got = linear(x)
        assert (got - expected).norm() / expected.norm() < 0.01, rows  # bfloat16 activations
    assert (Int4Linear(weight.flip(0), bias, torch.float32)(x) - expected).norm() / expected.norm() > 0.5


def test_int4_quantizes_any_float_weight_within_a_sixteenth_of_each_group_range():
    torch.manual_seed(0)
    weight = torch.randn(64, 96)
    dense = Int4Linear(weight, None, torch.float32).dense()
    groups = weight.reshape(64, 3, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15)[..., None]
    # scale and minimum are float16, as in GGUF
    rounding = 1e-3 * (step + groups.abs().amax(-1, keepdim=True))
    assert ((dense.reshape(64, 3, 32) - groups).abs() <= step / 2 + rounding).all()


def test_int8_linear_matches_float_within_quantization_error():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.1, torch.randn(96)
    x = torch.randn(5, 64)
    expected = F.linear(x, weight, bias)
    got = Int8Linear(weight, bias)(x)
    assert (got - expected).norm() / expected.norm() < 0.02
    wrong = Int8Linear(weight.flip(0), bias)(x)
    assert (wrong - expected).norm() / expected.norm() > 0.5  # a wrong weight shows


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels are not built")
def test_q8_linear_holds_gguf_weights_and_matches_float_at_any_row_count():
    """A Q8_0 weight (int8 codes times a float16 scale per group of 32) comes back exactly, a Q5_0
    one within half a Q8_0 step (16 / 254 of its own) plus the float16 scale's rounding; the
    kernel's rows (16-bit activations per group) and the dense product beyond INTERLEAVED_MAX_ROWS
    both match float32 within activation rounding."""
    torch.manual_seed(0)
    scale = (torch.rand(40, 4, 1) * 1e-3 + 1e-4).half().float()
    codes = torch.randint(-127, 128, (40, 4, 32)).float()
    codes[..., 0] = 127  # llama.cpp's Q8_0 maps each group's largest magnitude to 127
    q8_0, bias = (codes * scale).reshape(40, 128), torch.randn(40)
    linear = Q8Linear(q8_0, bias)
    assert torch.equal(torch.ops.hyperserve.dequantize(linear.q80, 128, "q8_0")[:40], q8_0)
    q5_step = scale * 8
    q5_0 = (torch.randint(-16, 16, (40, 4, 32)).float() * q5_step).reshape(40, 128)
    back = torch.ops.hyperserve.dequantize(Q8Linear(q5_0, None).q80, 128, "q8_0")[:40]
    assert ((back - q5_0).reshape(40, 4, 32).abs() <= q5_step / 12).all()
    for rows in (1, 17, linear.max_rows + 1):
        x = torch.randn(rows, 128)
        expected = F.linear(x, q8_0, bias)
        got = linear(x)
        assert got.shape == expected.shape
        assert (got - expected).norm() / expected.norm() < 2e-3, rows
    assert (Q8Linear(q8_0.flip(0), bias)(x) - expected).norm() / expected.norm() > 0.5  # a wrong weight shows


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels are not built")
def test_mxfp4_linear_keeps_a_checkpoints_blocks_and_matches_float_at_any_row_count():
    """An MXFP4 checkpoint's rows are kept as given and a float weight of the same values packs to
    the same weights; the kernel's rows (8-bit activations) and the dense product beyond
    INTERLEAVED_MAX_ROWS both match float32 within the activations' rounding."""
    from tests.kernels.test_cpu_ops import FP4_VALUES

    torch.manual_seed(0)
    codes = torch.randint(0, 16, (40, 4, 32), dtype=torch.uint8)
    exponents = torch.randint(118, 124, (40, 4), dtype=torch.uint8)
    weight = (FP4_VALUES[codes.long()] * torch.exp2(exponents.float() - 127)[..., None]).reshape(40, 128)
    bias = torch.randn(40)
    linear = Mxfp4Linear(mxfp4_rows(codes, exponents), bias)
    assert (linear.in_features, linear.out_features, linear.num_bytes) == (128, 40, 40 * 4 * 17)
    assert torch.equal(linear.dense().float(), weight)  # 3 significant bits: exact in bfloat16 too
    assert torch.equal(Mxfp4Linear(weight, None).dense().float(), weight)
    for rows in (1, 17, linear.max_rows + 1):
        x = torch.randn(rows, 128)
        expected = F.linear(x, weight, bias)
        got = linear(x)
        assert got.shape == expected.shape
        assert (got - expected).norm() / expected.norm() < 0.01, rows
    assert (Mxfp4Linear(weight.flip(0), bias)(x) - expected).norm() / expected.norm() > 0.5
    with pytest.raises(ValueError, match="out_features divisible by 8"):
        Mxfp4Linear(torch.randn(12, 64), None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [5, 40])  # on CUDA: the Triton GEMV (weight-only) and the scaled GEMM
def test_fp8_linear_matches_float_within_quantization_error(device, tokens):
    """float8 e4m3 keeps 3 mantissa bits: about 3% relative error per weight and per activation."""
    torch.manual_seed(0)
    weight, bias = (torch.randn(96, 64) * 0.1).to(device), torch.randn(96).to(device)
    x = torch.randn(2, tokens, 64, device=device)
    x[0, 0] *= 50  # an outlier token: with per-token scales it costs the others nothing
    expected = F.linear(x, weight, bias)
    # rowwise-scaled FP8 GEMMs output bfloat16 on CUDA
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    got = Fp8Linear(weight, bias)(x.to(dtype)).float()
    assert got.shape == expected.shape
    for row in range(1, 5):
        assert (got[0, row] - expected[0, row]).norm() / expected[0, row].norm() < 0.06
    assert (got - expected).norm() / expected.norm() < 0.06
    assert (Fp8Linear(weight.flip(0), bias)(x.to(dtype)).float() - expected).norm() / expected.norm() > 0.5


@pytest.mark.parametrize(("method", "tied"), [("int8", False), ("int4", False), ("int4", True), ("mxfp4", False)])
def test_quantize_model_replaces_projections_and_shrinks_weights(method, tied):
    if method == "mxfp4" and not kernels.available():
        pytest.skip("mxfp4 runs on the native CPU kernels only")
    config = tiny_config("llama", tie_word_embeddings=tied)
    model = build_model(config, None, TorchPagedAttention(), 512, torch.float32, "cpu")
    before, after = quantize_model(model, method, torch.bfloat16 if method == "int4" else torch.float32)
    kinds = {name.rsplit(".", 1)[-1]: type(module).__name__ for name, module in model.named_modules()
             if name.endswith(("proj", "lm_head"))}
    if method == "int8" and kernels.available():  # every projection in Q8_0, the head too
        assert kinds.pop("lm_head") == "Q8Head"
        assert set(kinds.values()) == {"Q8Linear"}
    elif method == "int8":  # fbgemm's dynamic int8
        assert kinds == {"qkv_proj": "Int8Linear", "o_proj": "Int8Linear", "gate_up_proj": "Int8Linear",
                         "down_proj": "Linear", "lm_head": "Linear"}
        assert set(KEEP_FLOAT_INT8) == {"down_proj", "lm_head"}
    elif method == "mxfp4":  # the MLP in MXFP4, attention and the head in Q8_0
        assert kinds == {"qkv_proj": "Q8Linear", "o_proj": "Q8Linear", "gate_up_proj": "Mxfp4Linear",
                         "down_proj": "Mxfp4Linear", "lm_head": "Q8Head"}
    else:  # every projection; the head, tied or not, in int8; what stays float is bfloat16
        assert kinds.pop("lm_head") == ("Q8Head" if kernels.available() else "Int8Head")
        assert set(kinds.values()) == {"Int4Linear"}
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert after < before


@pytest.mark.parametrize("bad", [dict(quantization="int3"), dict(quantization="int4", device="cuda")])
def test_invalid_quantization_is_rejected(bad):
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(**bad)


def test_a_4_bit_gguf_runs_in_int4_by_default_on_the_cpu(smollm2_source, save_hf_model):
    assert gguf_weight_bits(smollm2_source.path) == 4  # SmolLM2's Q4_1
    assert ModelConfig().quantization == "int4"  # the default model
    assert ModelConfig(quantization="none").quantization is None
    assert ModelConfig(quantization=None).quantization is None
    assert ModelConfig(load_format="random").quantization is None  # no checkpoint to follow
    assert ModelConfig(device="cuda").quantization is None
    _, path = save_hf_model(tiny_config("llama"))
    assert ModelConfig(model=path).quantization is None  # safetensors: as stored


def test_int4_and_native_int8_run_in_bfloat16_unless_told_otherwise():
    assert ModelConfig(quantization="int4").torch_dtype == torch.bfloat16
    native = kernels.available()  # Q8_0 through the native kernels; fbgemm's int8 takes float32
    assert ModelConfig(quantization="int8").torch_dtype == (torch.bfloat16 if native else torch.float32)
    assert ModelConfig(quantization="int8", dtype="float32").torch_dtype == torch.float32
    assert ModelConfig(quantization=None).torch_dtype == torch.float32


def _perplexity(llm: LLM, token_ids: list[int], chunk: int = 64) -> float:
    """Perplexity of one sequence fed in chunks, so each chunk attends to its context through the KV cache."""
    blocks = list(range(-(-len(token_ids) // llm.engine.config.cache.block_size)))
    with torch.inference_mode():
        logits = torch.cat([
            llm.engine.runner.forward([SeqChunk(token_ids[start:start + chunk], start, blocks,
                                                num_logits=len(token_ids[start:start + chunk]))])
            for start in range(0, len(token_ids), chunk)])
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return math.exp(-logprobs[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])].mean().item())


@pytest.fixture(scope="module")
def text_and_float_perplexity():
    reference = LLM(kv_cache_memory_gb=0.25, max_model_len=1024, **FLOAT32)
    token_ids = reference.tokenizer(TEXT.read_text()).input_ids[:512]
    return token_ids, _perplexity(reference, token_ids)


@pytest.mark.slow
@pytest.mark.parametrize(("options", "chunk"), [
    (dict(quantization="int8"), 64),
    (dict(quantization="int4"), 64),  # prefill: the dense copies
    (dict(quantization="int4"), 1),  # one token at a time: the int4 and int8 kernels that decode
    (dict(quantization="int4", kv_cache_dtype="int8"), 64),
    (dict(quantization="fp8"), 64),
])
def test_smollm2_perplexity_is_within_3_percent_of_float32(options, chunk, text_and_float_perplexity):
    token_ids, float_ppl = text_and_float_perplexity
    ppl = _perplexity(LLM(kv_cache_memory_gb=0.25, max_model_len=1024, **options), token_ids, chunk)
    # fbgemm's int8 without VNNI takes 7-bit activations (see layers/quantization.py): +7.0% on an
    # AVX2-only EPYC; the native kernels' Q8_0 takes 16 bits
    seven_bit = options["quantization"] == "int8" and int8_reduce_range() and not kernels.available()
    assert abs(ppl / float_ppl - 1) < (0.08 if seven_bit else 0.03), (ppl, float_ppl)
    assert ppl != float_ppl  # the configuration did change the numerics
