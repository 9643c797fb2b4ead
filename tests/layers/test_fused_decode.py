"""The fused native decode layer against the layer-by-layer PyTorch path on the same weights."""

import pytest
import torch

from hyperserve import LLM, SamplingParams, kernels
from hyperserve.engine.model_runner import SeqChunk
from hyperserve.layers import fused_decode, quantization
from hyperserve.layers.fused_decode import DENSE_MLP_SLOTS, LAYER_SLOTS
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="the native CPU kernels could not be built here")


def _decode_both_ways(llm: LLM, loras: list | None = None, lengths: tuple[int, ...] = (20, 7, 40)
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one step, fused and then layer by layer (which rewrites the same slots with the
    same K/V): three sequences of these context lengths in scattered blocks, two decoding one token,
    one verifying four (each attends to those before it); each with its adapter from `loras`."""
    runner = llm.engine.runner
    assert runner.fused_decode is not None
    new = [1, 1, 4]
    generator = torch.Generator().manual_seed(0)
    needed = [-(-(n + k) // runner.block_size) for n, k in zip(lengths, new)]
    blocks = torch.randperm(sum(needed), generator=generator).tolist()
    tables = [blocks[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(needed))]
    prompts = [torch.randint(0, 256, (n + k,), generator=generator).tolist() for n, k in zip(lengths, new)]
    loras = loras or [None] * len(prompts)
    with torch.inference_mode():
        for prompt, table, n, lora in zip(prompts, tables, lengths, loras):
            runner.forward([SeqChunk(prompt[:n], 0, table, 1, lora)])  # prefill
        step = [SeqChunk(prompt[n:], n, table, k, lora)
                for prompt, table, n, k, lora in zip(prompts, tables, lengths, new, loras)]
        fused = runner.forward(step)
        runner.fused_decode, fused_decode = None, runner.fused_decode
        plain = runner.forward(step)
        runner.fused_decode = fused_decode
    return fused, plain


@pytest.fixture(params=["rows", "interleaved"])
def q41_layout(request, monkeypatch) -> str:
    """Both int4 layouts on any CPU with AVX2: rows (16-bit activations) and interleaved (8-bit)."""
    if request.param == "interleaved" and kernels.isa() == "portable":
        pytest.skip("the interleaved layout is chosen only where the CPU has AVX2")
    monkeypatch.setattr(quantization, "interleaves_q41", lambda: request.param == "interleaved")
    return request.param


@pytest.mark.parametrize(("arch", "num_heads", "num_kv_heads", "hidden"), [
    ("llama", 4, 2, 64),  # head_dim 16: the vectorized attention
    ("llama", 16, 8, 64),  # head_dim 4: the portable one
    # head_dim 64: the span kernel, its query heads reading each cached vector together: three a K/V
    # head as SmolLM2's, two, and four (a task of three and one of one)
    ("llama", 3, 1, 192),
    ("llama", 4, 2, 256),
    ("llama", 4, 1, 256),
    ("qwen3", 4, 2, 64),  # QK norms (head_dim 16, as tiny_config sets it)
    ("qwen2", 4, 2, 64),  # biases on q, k and v
    ("mixtral", 4, 2, 64),  # a mixture of 4 experts, 2 a token
    ("qwen3_moe", 4, 2, 64),  # a dense layer, then a mixture with QK norms
    ("granite", 4, 2, 64),  # its multipliers: the attention's scale, and folded into the weights
    ("smollm3", 4, 2, 64),  # a layer without rotary
])
def test_fused_decode_matches_the_pytorch_layers_in_float32(save_hf_model, arch, num_heads, num_kv_heads,
                                                            hidden, q41_layout):
    """With 16-bit activations the two paths differ by float rounding. With 8-bit ones such a
    difference can move an activation across a rounding boundary (a step of 1/127 of its group's
    largest value), after which every later rounding differs too: on this tiny random model (two
    groups per row) the two paths then differ by 3% of the logits' norm. Attention or the cache
    written wrongly would differ by the logits' own size."""
    moe = {"moe_intermediate_size": 64, "mlp_only_layers": [0]} if arch == "qwen3_moe" else {}
    _, path = save_hf_model(tiny_config(arch, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                                        hidden_size=hidden, **moe))
    llm = LLM(model=path, quantization="int4", dtype="float32", kv_cache_memory_gb=0.01)
    q_norm = llm.engine.runner.fused_decode.layers[0][LAYER_SLOTS.index("q_norm")]
    assert (q_norm.numel() > 0) == arch.startswith("qwen3")
    fused, plain = _decode_both_ways(llm)
    assert fused.shape == (6, 256)
    if q41_layout == "rows":
        assert (fused - plain).abs().max() <= 1e-3 * plain.abs().max()
    else:
        assert (fused - plain).norm() / plain.norm() < 0.1
    assert not torch.equal(fused[0], fused[1])  # the rows are different sequences


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_int8_experts_match_the_pytorch_layers(save_hf_model, arch):
    """A mixture of experts in int8: its experts in Q8_0, as the dense layers' projections (16-bit
    activations: float rounding apart)."""
    moe = {"moe_intermediate_size": 64, "mlp_only_layers": [0]} if arch == "qwen3_moe" else {}
    _, path = save_hf_model(tiny_config(arch, **moe))
    llm = LLM(model=path, quantization="int8", dtype="float32", kv_cache_memory_gb=0.01)
    fused, plain = _decode_both_ways(llm)
    assert (fused - plain).abs().max() <= 1e-3 * plain.abs().max()


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_mxfp4_mlps_match_the_pytorch_layers(save_hf_model, arch):
    """mxfp4: the MLPs' (or experts') projections in MXFP4, against 8-bit activations as the
    interleaved int4 layout takes them (tolerance as there), attention in Q8_0."""
    _, path = save_hf_model(tiny_config(arch))
    llm = LLM(model=path, quantization="mxfp4", dtype="float32", kv_cache_memory_gb=0.01)
    fused, plain = _decode_both_ways(llm)
    assert (fused - plain).norm() / plain.norm() < 0.1
    assert not torch.equal(fused[0], fused[1])


@pytest.mark.parametrize(("arch", "overrides", "fused"), [
    ("phi3", {"partial_rotary_factor": 0.5}, False),  # Phi-4-mini's: the native layers rotate whole heads
    ("phi3", {}, True),
    # the native mixture has no shared expert
    ("qwen2_moe", {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}, False),
])
def test_layers_the_native_path_cannot_run_are_left_to_pytorch(save_hf_model, arch, overrides, fused):
    _, path = save_hf_model(tiny_config(arch, **overrides))
    llm = LLM(model=path, quantization="int4", dtype="float32", kv_cache_memory_gb=0.01)
    assert (llm.engine.runner.fused_decode is not None) == fused


def test_attention_over_contexts_of_several_spans_matches_the_pytorch_layers(save_hf_model, q41_layout):
    """The fused attention cuts a context into spans of 256 positions (kAttentionSpan), each its own
    task, and combines them: contexts of 600 and 300 tokens, in blocks of 24 that spans cut through,
    against PyTorch's attention over the same cache (tolerances as above)."""
    _, path = save_hf_model(tiny_config("llama", num_attention_heads=3, num_key_value_heads=1, hidden_size=192,
                                        max_position_embeddings=1024))
    llm = LLM(model=path, quantization="int4", dtype="float32", kv_cache_memory_gb=0.05, block_size=24)
    fused, plain = _decode_both_ways(llm, lengths=(600, 7, 300))
    if q41_layout == "rows":
        assert (fused - plain).abs().max() <= 1e-3 * plain.abs().max()
    else:
        assert (fused - plain).norm() / plain.norm() < 0.1


@pytest.mark.parametrize(("arch", "quantization", "head_dim"), [
    ("mistral", "int4", 16),  # every layer windowed
    ("gemma3", "int4", 16),  # a windowed layer and a global one, each with its own rotary table
    ("gemma3", "int8", 16),  # Q8_0 projections
    ("gemma3", "int8", 64),  # the span kernel: windows that start inside a span and skip whole ones
    ("gemma2", "int8", 16),  # capped attention scores and logits, one rotary table for both kinds
    ("gemma2", "int4", 64),  # the same in the span kernel
])
def test_a_sliding_window_and_gemmas_layers_match_the_pytorch_layers(save_hf_model, arch, quantization,
                                                                     head_dim, q41_layout):
    """Rows whose context passes the window attend to its last positions only: contexts of 20 and 40
    against a window of 8, or of 600 and 300 against 300 where a row's window starts inside one span
    of 256 positions and skips the span before it. Gemma 3 adds the norms of attention's and the
    MLP's outputs, GELU, scaled embeddings and a rotary table per kind of layer; Gemma 2 caps the
    attention scores and the logits. Q8_0 takes 16-bit activations, as the int4 rows layout does
    (tolerances as above)."""
    spans = head_dim == 64
    extra = dict(head_dim=head_dim, max_position_embeddings=1024) if arch.startswith("gemma") else {}
    _, path = save_hf_model(tiny_config(arch, sliding_window=300 if spans else 8, **extra))
    llm = LLM(model=path, quantization=quantization, dtype="float32", kv_cache_memory_gb=0.05,
              block_size=24 if spans else 16)
    window = 300 if spans else 8
    assert llm.engine.runner.fused_decode.windows == ([window, window] if arch == "mistral" else [window, 0])
    fused, plain = _decode_both_ways(llm, lengths=(600, 7, 300) if spans else (20, 7, 40))
    if q41_layout == "rows" or quantization == "int8":
        assert (fused - plain).abs().max() <= 1e-3 * plain.abs().max()
    else:
        assert (fused - plain).norm() / plain.norm() < 0.1


def test_biases_on_every_projection_match_the_pytorch_layers(save_hf_model, q41_layout):
    """A Llama with attention_bias and mlp_bias: q, k, v, o, gate, up and down each add a bias (tolerances
    as above)."""
    _, path = save_hf_model(tiny_config("llama", attention_bias=True, mlp_bias=True))
    llm = LLM(model=path, quantization="int4", dtype="float32", kv_cache_memory_gb=0.01)
    layer = dict(zip(LAYER_SLOTS + DENSE_MLP_SLOTS, llm.engine.runner.fused_decode.layers[0]))
    assert [layer[f"{p}_bias"].numel() for p in ("qkv", "o", "gate_up", "down")] == [128, 64, 256, 64]
    fused, plain = _decode_both_ways(llm)
    if q41_layout == "rows":
        assert (fused - plain).abs().max() <= 1e-3 * plain.abs().max()
    else:
        assert (fused - plain).norm() / plain.norm() < 0.1


@pytest.mark.parametrize(("quantization", "head_dim"), [("int8", 16), ("int8", 64), ("mxfp4", 16)])
def test_gpt_oss_layers_match_the_pytorch_layers(save_hf_model, quantization, head_dim):
    """GPT-OSS: biased q/k/v and o, each head's sink in the softmax (head_dim 64: in the span kernel's
    combination of spans), a windowed layer (8 tokens, passed by contexts of 20 and 40) then a full
    one, a router with a bias, biased experts and the clamped SwiGLU (a limit of 1, which these
    activations pass). int8's Q8_0 takes 16-bit activations (float rounding apart); mxfp4's experts
    8-bit ones (tolerance as the interleaved int4 layout's)."""
    # expert widths in blocks of 32
    _, path = save_hf_model(tiny_config("gpt_oss", intermediate_size=64, head_dim=head_dim))
    llm = LLM(model=path, quantization=quantization, dtype="float32", kv_cache_memory_gb=0.01)
    fused_layers = llm.engine.runner.fused_decode
    assert fused_layers.windows == [8, 0]
    assert fused_layers.layers[0][LAYER_SLOTS.index("sinks")].numel() == 4  # one per head
    fused, plain = _decode_both_ways(llm)
    if quantization == "int8":
        assert (fused - plain).abs().max() <= 1e-3 * plain.abs().max()
    else:
        assert (fused - plain).norm() / plain.norm() < 0.1
    assert not torch.equal(fused[0], fused[1])


@pytest.mark.parametrize("q41_layout", ["interleaved"], indirect=True)
def test_a_step_gives_the_same_bits_on_one_thread_or_several(save_hf_model, q41_layout, monkeypatch):
    """The step's threads take pieces of each operation as they come free (a descheduled thread's
    share is done by the others), so which thread computes which channel or attention span varies;
    each is computed whole by one of them, so the logits must not change by a bit. Four threads on
    this machine's cores share them, so pieces do change hands. The prefills run fused too, as on
    AVX2-only CPUs: oneDNN's bfloat16 products may split their sums by the thread count."""
    monkeypatch.setattr(fused_decode, "dense_dtype", lambda: torch.float32)
    _, path = save_hf_model(tiny_config("llama", num_attention_heads=3, num_key_value_heads=1, hidden_size=192,
                                        intermediate_size=512, max_position_embeddings=1024))
    llm = LLM(model=path, quantization="int4", dtype="float32", kv_cache_memory_gb=0.05, block_size=24)
    threads = torch.get_num_threads()
    try:
        logits = []
        for count in (1, 2, 4, 3):
            torch.set_num_threads(count)
            logits.append(_decode_both_ways(llm, lengths=(600, 7, 300))[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(logits[0], other) for other in logits[1:])


@pytest.mark.parametrize("q41_layout", ["interleaved"], indirect=True)
@pytest.mark.parametrize("heads", [(3, 1, 192), (6, 2, 384)], ids=["one-kv-head", "two-kv-heads"])
def test_rows_of_one_sequence_attend_together_with_the_same_bits_as_alone(save_hf_model, q41_layout, heads,
                                                                          monkeypatch):
    """A chunk's rows attend in tiles (several rows of a sequence share each widened key and value)
    and a lone row by itself; a token's logits must be the same bits either way, or a request's
    answer would depend on how its prompt was chunked or cached. 300 tokens in blocks of 24: tiles
    of 18 rows (3 query heads a K/V head), the last ones reaching into a second span of 256
    positions, and one of 12 rows; then a verify step's 17 rows after them. With one K/V head those
    make too few tasks for the threads and go in two tiles; with two, in one. Every step runs fused,
    as on AVX2-only CPUs."""
    num_heads, num_kv_heads, hidden_size = heads
    monkeypatch.setattr(fused_decode, "dense_dtype", lambda: torch.float32)
    _, path = save_hf_model(tiny_config("llama", num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                                        hidden_size=hidden_size, max_position_embeddings=1024))
    llm = LLM(model=path, quantization="int4", dtype="float32", kv_cache_memory_gb=0.05, block_size=24)
    runner = llm.engine.runner
    prompt = torch.randint(0, 256, (317,), generator=torch.Generator().manual_seed(2)).tolist()
    assert runner.fused_decode.takes(300)
    table = list(range(-(-len(prompt) // 24)))
    with torch.inference_mode():
        together = torch.cat([runner.forward([SeqChunk(prompt[:300], 0, table, 300)]),
                              runner.forward([SeqChunk(prompt[300:], 300, table, 17)])])
        alone = torch.cat([runner.forward([SeqChunk([token], t, table, 1)]) for t, token in enumerate(prompt)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize(("arch", "method"), [("llama", "int4"), ("gemma3", "int8")])
def test_fused_decode_applies_each_rows_lora_adapter_as_the_pytorch_layers_do(save_hf_model, tmp_path,
                                                                              monkeypatch, arch, method):
    """In the row layout, whose 16-bit activations leave only float rounding between the paths;
    Gemma 3's layers (one call per layer) in Q8_0 too."""
    from hyperserve import LoRARequest

    monkeypatch.setattr(quantization, "interleaves_q41", lambda: False)
    from tests.engine.test_lora import make_adapter

    _, path = save_hf_model(tiny_config(arch))
    llm = LLM(model=path, quantization=method, dtype="float32", kv_cache_memory_gb=0.01, enable_lora=True)
    variants = [dict(rank=4), dict(rank=8, rslora=True), dict(rank=2, targets=["q_proj", "v_proj"])]
    loras = []
    for i, variant in enumerate(variants):
        make_adapter(path, tmp_path / f"a{i}", seed=i, **variant)
        loras.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
        llm.engine.check_lora(loras[-1])
    base, _ = _decode_both_ways(llm)
    for mix in ([loras[0], None, loras[1]], [loras[2], loras[1], loras[0]]):
        fused, plain = _decode_both_ways(llm, mix)
        assert (fused - plain).abs().max() <= 1e-3 * plain.abs().max()
        unchanged = [torch.allclose(fused[row], base[row], atol=1e-3) for row in (0, 1, 5)]
        assert unchanged == [lora is None for lora in mix]  # adapters change their rows, the base row stays


def test_fused_decode_reads_a_bfloat16_cache(save_hf_model, q41_layout):
    """With int4's default bfloat16 the PyTorch path rounds activations to bfloat16; the fused
    layer computes in float32 and agrees to bfloat16's precision (to 8-bit precision where the
    activations are 8-bit, see above)."""
    _, path = save_hf_model(tiny_config("llama"))
    llm = LLM(model=path, quantization="int4", kv_cache_memory_gb=0.01)
    assert llm.engine.runner.kv_caches[0].key.dtype == torch.bfloat16
    fused, plain = _decode_both_ways(llm)
    assert (fused - plain).norm() / plain.norm() < (0.02 if q41_layout == "rows" else 0.1)


MOE = {"moe_intermediate_size": 64}  # int4 takes widths in groups of 32


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_greedy_generation_is_the_same_batched_or_alone(save_hf_model, q41_layout, arch):
    _, path = save_hf_model(tiny_config(arch, **MOE))
    llm = LLM(model=path, quantization="int4", dtype="float32", kv_cache_memory_gb=0.01)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 5, 9], [2, 200, 17, 33, 4, 8], [250]]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    if q41_layout == "rows":  # with 8-bit activations a near-tie may go either way between the two paths
        llm.engine.runner.fused_decode = None
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert plain == together


# gpt_oss: its windowed layer's own pool (a window of 8) beside the full one, sinks and biased experts
@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt_oss"])
def test_where_every_step_is_fused_a_request_is_the_same_cached_chunked_or_batched(save_hf_model, monkeypatch,
                                                                                   arch):
    """With the interleaved layout (the AVX2-only class) every token runs the fused layers' 8-bit
    kernels however it is scheduled, so a request's tokens and logprobs are the same bit for bit
    computed whole, in chunks, after a prefix-cache hit (its last tokens are a step of a few rows),
    and beside other requests. Elsewhere a long prompt runs the dense path and the same few rows
    the fused one, which round differently."""
    if kernels.isa() == "portable":
        pytest.skip("the interleaved layout is chosen only where the CPU has AVX2")
    monkeypatch.setattr(quantization, "interleaves_q41", lambda: True)
    monkeypatch.setattr(fused_decode, "dense_dtype", lambda: torch.float32)  # no native bfloat16, as on AVX2
    widths = {"intermediate_size": 64} if arch == "gpt_oss" else {}  # int4 groups of 32
    _, path = save_hf_model(tiny_config(arch, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                                        head_dim=64, **widths))
    generator = torch.Generator().manual_seed(1)
    prompt, *others = (torch.randint(0, 256, (n,), generator=generator).tolist() for n in (70, 45, 30))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    options = dict(quantization="int4", kv_cache_memory_gb=0.01, block_size=16)

    def run(llm: LLM, prompts: list[list[int]]) -> tuple:
        output = llm.generate(prompts, params, use_tqdm=False)[prompts.index(prompt)]
        return output.outputs[0].token_ids, output.outputs[0].logprobs, output.metrics.num_cached_tokens

    whole = LLM(model=path, enable_prefix_caching=False, **options)
    assert whole.engine.runner.fused_decode.every_step
    tokens, logprobs, _ = run(whole, [prompt])
    chunked = LLM(model=path, max_num_batched_tokens=24, **options)
    for prompts, num_cached in (([prompt], 0), ([prompt], 64), ([others[0], prompt, others[1]], 64)):
        assert run(chunked, prompts) == (tokens, logprobs, num_cached)


@pytest.mark.parametrize(("arch", "options", "reason"), [
    ("llama", dict(kv_cache_dtype="int8"), "quantized KV cache"),
])
def test_models_the_fused_layer_cannot_run_keep_the_pytorch_path(save_hf_model, arch, options, reason,
                                                                  caplog):
    _, path = save_hf_model(tiny_config(arch))
    with caplog.at_level("INFO", logger="hyperserve.runner"):
        llm = LLM(model=path, quantization="int4", kv_cache_memory_gb=0.01, **options)
    assert llm.engine.runner.fused_decode is None
    assert reason in caplog.text
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("op", ["decode_layers", "decode_layer"])
def test_a_slot_or_block_outside_the_cache_is_refused_before_anything_is_written(save_hf_model, op):
    """The native layers write K/V at each row's slot and read its blocks: an index out of range
    would touch memory outside the cache. Both ops check the batch (decode_layers once a step)."""
    _, path = save_hf_model(tiny_config("llama"))
    llm = LLM(model=path, quantization="int4", dtype="float32", kv_cache_memory_gb=0.01)
    runner = llm.engine.runner
    fused, caches, block_size = runner.fused_decode, runner.kv_caches, runner.block_size
    num_blocks = caches[0].key.shape[0] // block_size
    before = [c.key.clone() for c in caches]

    def step(slot: int, block: int, length: int = 3) -> None:
        hidden = torch.zeros(1, fused.hidden_size)
        cos, signed_sin = fused.model.model.rotary.cos_sin_for(torch.tensor([length - 1]), torch.float32)
        batch = (torch.tensor([slot]), torch.tensor([[block]]), torch.tensor([length]), block_size, fused.num_heads,
                 fused.num_kv_heads, fused.eps, fused.scale)
        if op == "decode_layers":
            torch.ops.hyperserve.decode_layers(hidden, fused._all_layers, cos, signed_sin, [c.key for c in caches],
                                               [c.value for c in caches], *batch)
        else:
            torch.ops.hyperserve.decode_layer(hidden, fused.layers[0], cos, signed_sin, caches[0].key, caches[0].value,
                                              *batch, [], torch.tensor([-1]))

    for slot, block in ((num_blocks * block_size, 0), (-1, 0), (0, num_blocks), (0, -1)):
        with pytest.raises(RuntimeError, match="out of range"):
            step(slot, block)
    assert all(torch.equal(b, c.key) for b, c in zip(before, caches))
    step(2, 0)  # in range it runs
