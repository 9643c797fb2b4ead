"""Loading the real SmolLM2 GGUF: weights as transformers reads them, greedy tokens identical."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyperserve import LLM, SamplingParams, kernels
from hyperserve.layers.attention import TorchPagedAttention
from hyperserve.layers.quantization import pack_q80
from hyperserve.models.gguf_reader import dequantize_q8_0, gguf_metadata_directory, q80_from_gguf
from hyperserve.models.loader import build_model, load_config
from hyperserve.models.registry import resolve_model
from tests.conftest import FLOAT32, assert_config_reads_as, gguf_config_by_class, tiny_config

pytestmark = pytest.mark.slow


def test_gguf_weights_equal_transformers_dequantization(smollm2_source, hf_smollm2):
    config = load_config(smollm2_source)
    ours = build_model(config, smollm2_source, TorchPagedAttention(), 64, torch.float32, "cpu")
    layer, reference = ours.model.layers[3], hf_smollm2.model.layers[3]
    q, k, v = layer.self_attn.qkv_proj.weight.split(layer.self_attn.shard_sizes)
    assert torch.equal(q, reference.self_attn.q_proj.weight)  # Q/K rows un-permuted like transformers
    assert torch.equal(k, reference.self_attn.k_proj.weight)
    assert torch.equal(v, reference.self_attn.v_proj.weight)
    assert torch.equal(ours.model.embed_tokens.weight, hf_smollm2.model.embed_tokens.weight)


def test_smollm2_greedy_matches_transformers(hf_smollm2, chat_prompt_ids):
    llm = LLM(num_kv_blocks=512, max_model_len=2048, **FLOAT32)
    params = SamplingParams(temperature=0, max_tokens=64)
    outputs = llm.generate(chat_prompt_ids, params, use_tqdm=False)  # all 8 in one batch
    for prompt, output in zip(chat_prompt_ids, outputs):
        with torch.no_grad():
            reference = hf_smollm2.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=64, do_sample=False,
            )[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == reference


def test_a_chat_template_given_replaces_the_models_own(smollm2_source):
    from hyperserve.models import loader

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    tokenizer = loader.load_tokenizer(smollm2_source, template)
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "[user] hi\n"
    assert "<|im_start|>" in loader.load_tokenizer(smollm2_source).apply_chat_template(chat, tokenize=False)


def test_unknown_model_lists_the_available_ones():
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model("no-such-model")


def test_an_assembled_gguf_is_hashed_once_then_known_by_its_size_and_time(tmp_path, monkeypatch):
    """A package that ships its GGUF in parts verifies the joined file by SHA-256 on every assemble();
    the registry asks it once, and again only when the file changed."""
    import types

    from hyperserve.models import registry

    target = tmp_path / "model.gguf"
    calls = []

    def assemble():
        calls.append(1)
        target.write_bytes(b"GGUF" * 4)
        return target

    package = types.SimpleNamespace(default_output_path=lambda: target, assemble=assemble,
                                    EXPECTED_SHA256="ab")
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(registry.importlib, "import_module", lambda name: package)
    assert registry._assembled_file("parts") == target
    assert registry._assembled_file("parts") == target
    assert len(calls) == 1
    target.write_bytes(b"GGUF" * 5)  # changed: verified again
    registry._assembled_file("parts")
    assert len(calls) == 2


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels could not be built here")
def test_int4_holds_the_gguf_weights_exactly(smollm2_source, hf_smollm2):
    """Q4_1 projections and the Q8_0 embedding (also the tied head) are re-packed, not re-quantized."""
    config = load_config(smollm2_source)
    ours = build_model(config, smollm2_source, TorchPagedAttention(), 64, torch.bfloat16, "cpu",
                       quantization="int4")
    embedding = ours.model.embed_tokens
    assert embedding.q80 is ours.lm_head.q80  # tied: one copy
    reference = hf_smollm2.model.embed_tokens.weight
    assert torch.equal(torch.ops.hyperserve.dequantize(embedding.q80, config.hidden_size, "q8_0"), reference)
    ids = torch.tensor([0, 504, 49151])
    assert torch.equal(embedding(ids), reference[ids].bfloat16())
    down = ours.model.layers[3].mlp.down_proj
    assert torch.equal(torch.ops.hyperserve.dequantize(down.q41, down.in_features, "q4_1"),
                       hf_smollm2.model.layers[3].mlp.down_proj.weight)


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels could not be built here")
def test_q4_1_blocks_load_as_the_bytes_quantizing_their_weights_again_gives(smollm2_source, monkeypatch):
    """SmolLM2's projections come as the GGUF's own Q4_1 blocks, without a float32 pass; the slower
    way, quantizing their dequantized weights again, gives every projection the same bytes."""
    from hyperserve.layers.quantization import Int4Linear
    from hyperserve.models import loader

    config = load_config(smollm2_source)
    assert loader._keeps_q41_blocks(smollm2_source, config)
    build = lambda: build_model(config, smollm2_source, TorchPagedAttention(), 64, torch.bfloat16, "cpu",
                                quantization="int4")
    direct = build()
    monkeypatch.setattr(loader, "_keeps_q41_blocks", lambda *args: False)
    requantized = build()
    ours = {name: m.q41 for name, m in direct.named_modules() if isinstance(m, Int4Linear)}
    theirs = {name: m.q41 for name, m in requantized.named_modules() if isinstance(m, Int4Linear)}
    assert ours.keys() == theirs.keys() and len(ours) == 4 * config.num_hidden_layers
    for name, q41 in ours.items():
        assert torch.equal(q41, theirs[name]), name


def test_gguf_metadata_is_parsed_once_into_files_that_read_back_the_same(smollm2_source, tmp_path,
                                                                         monkeypatch):
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from hyperserve.models import gguf_reader, loader

    monkeypatch.setenv("HYPERSERVE_GGUF_CACHE", str(tmp_path))
    gguf_reader.gguf_metadata_directory.cache_clear()
    gguf_reader.gguf_index.cache_clear()
    try:
        directory = gguf_reader.gguf_metadata_directory(smollm2_source.path)
        assert directory.parent == tmp_path
        assert {p.name for p in directory.iterdir()} >= {"config.json", "tokenizer.json", "gguf_index.json"}
        reader = gguf.GGUFReader(smollm2_source.path)  # the references below share one parse of the file
        monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: reader)
        path = smollm2_source.path
        assert gguf_reader.gguf_index(path) == gguf_reader._read_gguf_index(path)
        reference = AutoConfig.from_pretrained(smollm2_source.directory, gguf_file=smollm2_source.gguf_file)
        assert_config_reads_as(loader.load_config(smollm2_source), reference)
        tokenizer = loader.load_tokenizer(smollm2_source)
        original = AutoTokenizer.from_pretrained(smollm2_source.directory, gguf_file=smollm2_source.gguf_file)
        chat = [{"role": "user", "content": "Ünïcode, code ```x = 1``` and <|im_end|>?"}]
        assert tokenizer.apply_chat_template(chat) == original.apply_chat_template(chat)
        assert tokenizer.eos_token_id == original.eos_token_id
    finally:
        gguf_reader.gguf_metadata_directory.cache_clear()
        gguf_reader.gguf_index.cache_clear()


def _write_gguf(hf_model, path, tokenizer_gguf, quant: str | None = "Q8_0") -> None:
    """hf_model (Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, Phi-3 or Gemma 2) as llama.cpp's converter
    writes it: its names, its metadata, the experts stacked per layer (Qwen2-MoE's shared expert
    beside them, its gate a vector), weights in `quant` (a GGML type gguf's numpy quantizer writes)
    or float32 (norms, biases and the routers in float32), Mixtral as a `llama` with experts and its
    Q/K rows permuted, Gemma's norms as 1 + w and its head as the embedding alone, and the
    tokenizer of `tokenizer_gguf`."""
    import gguf
    from gguf.quants import quantize

    config = hf_model.config
    kind = None if quant is None else gguf.GGMLQuantizationType[quant]
    moe = config.model_type in ("qwen3_moe", "qwen2_moe", "mixtral")
    arch = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
            "phi3": "phi3", "gemma2": "gemma2"}[config.model_type]
    gemma = arch == "gemma2"
    writer = gguf_writer(path, arch, config, tokenizer_gguf)
    if gemma:
        writer.add_sliding_window(config.sliding_window)
        writer.add_float32("gemma2.attn_logit_softcapping", config.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", config.final_logit_softcapping)
    if moe:
        writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(config, "moe_intermediate_size",
                                                      config.intermediate_size))
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "mlp.gate": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
             "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
    if gemma:
        names.update({"post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"})

    def permuted(array, heads):  # llama.cpp's row order of each head's rotary halves (the loader undoes it)
        halves = array.reshape(heads, 2, array.shape[0] // heads // 2, array.shape[-1])
        return halves.swapaxes(1, 2).reshape(array.shape)

    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = permuted(array, heads)
        if name.endswith("experts.gate_up_proj"):  # transformers' [E, 2I, H] -> ffn_gate_exps, ffn_up_exps
            gate, up = array[:, : array.shape[1] // 2], array[:, array.shape[1] // 2 :]
            stacked = {"ffn_gate_exps": gate, "ffn_up_exps": up}
        elif name.endswith("experts.down_proj"):
            stacked = {"ffn_down_exps": array}
        else:
            stacked = None
        layer = name.split(".")[2] if ".layers." in name else None
        if stacked is not None:
            for base, part in stacked.items():
                tensor_name = f"blk.{layer}.{base}.weight"
                if kind is not None:
                    writer.add_tensor(tensor_name, quantize(part.copy(), kind), raw_dtype=kind)
                else:
                    writer.add_tensor(tensor_name, part.copy())
            continue
        if gemma and "norm" in name:
            array = array + 1
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            module, _, leaf = name.removeprefix("model.").rpartition(".")  # leaf: weight or bias
            module = module.split(".", 2)[2] if layer is not None else module
            gguf_name = f"{names[module]}.{leaf}" if layer is None else f"blk.{layer}.{names[module]}.{leaf}"
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            array = array[0]  # [1, hidden] -> [hidden], as llama.cpp stores it
        if kind is not None and array.ndim == 2 and "ffn_gate_inp" not in gguf_name:
            writer.add_tensor(gguf_name, quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)
    close_gguf(writer)


def random_model(config):
    """A transformers model of `config` with weights to write into a GGUF: norms in [0.5, 1.5] (so
    that 1 + w and w differ), the rest N(0, 0.15)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name else torch.randn_like(p) * 0.15)
    return model


def gguf_writer(path, arch: str, config, tokenizer_gguf):
    """A GGUFWriter with the metadata llama.cpp's converter writes for every architecture, and the
    tokenizer of `tokenizer_gguf`."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    reader = gguf.GGUFReader(tokenizer_gguf)
    writer.add_tokenizer_model(reader.fields["tokenizer.ggml.model"].contents())
    writer.add_token_list(reader.fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(reader.fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(reader.fields["tokenizer.ggml.merges"].contents())
    writer.add_eos_token_id(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    writer.add_chat_template(reader.fields["tokenizer.chat_template"].contents())
    return writer


def close_gguf(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen2_moe", "phi3", "gemma2"])
def test_qwen3_gguf_matches_transformers_on_its_dequantized_weights(arch, smollm2_source, tmp_path,
                                                                    monkeypatch):
    """A Qwen3, a Qwen3-MoE, a Qwen2-MoE, a Phi-3 and a Gemma 2 GGUF as llama.cpp writes them (Q8_0,
    stacked experts, QK norms, Qwen2-MoE's shared expert and Q/K/V biases, Phi-3's fused q/k/v and
    gate/up, an untied head; Gemma 2's norms as 1 + w, its window and caps in the metadata): our
    model from the GGUF against transformers' own GGUF loading of the same file, and our reading of
    its saved config against the config's own class."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_llama import _check_against_transformers

    monkeypatch.setenv("HYPERSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    config = tiny_config(arch, vocab_size=49152, moe_intermediate_size=64, max_position_embeddings=256)
    model = random_model(config)
    _write_gguf(model, tmp_path / "model.gguf", smollm2_source.path)
    # transformers' GGUF config leaves Qwen3's head size at 128 (it skips attention.key_length): given ours
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", config=config,
                                                     dtype=torch.float32).eval()
    # float32 weights: a Q8_0 GGUF would run in int8 by default, whose 16-bit activations differ by more
    llm = LLM(model=str(tmp_path / "model.gguf"), num_kv_blocks=64, block_size=4, max_model_len=128,
              dtype="float32", quantization=None)
    assert llm.engine.hf_config.model_type == arch
    assert_config_reads_as(llm.engine.hf_config, gguf_config_by_class(tmp_path / "model.gguf"))
    assert llm.engine.tokenizer.decode(llm.engine.tokenizer("Hello world").input_ids) == "Hello world"
    _check_against_transformers(llm, reference, abs_tol=2e-4)


def test_a_phi3_gguf_with_longrope_factors_is_refused_not_rotated_by_the_default_rope():
    from hyperserve.models import loader

    tensors = [{"name": "token_embd.weight", "shape": [256, 64]},
               {"name": "rope_factors_short.weight", "shape": [8]}]
    with pytest.raises(ValueError, match="LongRoPE factors"):
        loader._complete_gguf_config(tiny_config("phi3"), {"tensors": tensors})


@pytest.mark.parametrize(("arch", "layers", "scalar"), [
    ("gemma2", 26, 16), ("gemma2", 46, 24), ("gemma3", 62, 24), ("gemma3", 26, 16)])
def test_gemma_ggufs_scale_queries_by_head_size_but_the_27b_models_by_width_per_head(arch, layers, scalar):
    """A GGUF does not store query_pre_attn_scalar: as llama.cpp, the 27B models (46 layers in Gemma
    2, 62 in Gemma 3) take hidden_size / heads (144 and 168 in theirs), the others head_dim."""
    from hyperserve.models import loader

    config = tiny_config(arch, num_hidden_layers=layers, hidden_size=96, num_attention_heads=4,
                         layer_types=None, query_pre_attn_scalar=256)  # 256: what a GGUF reads as
    index = {"tensors": [{"name": "token_embd.weight", "shape": [256, 96]}]}
    config = loader._complete_gguf_config(config, index)
    assert config.query_pre_attn_scalar == scalar


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels could not be built here")
def test_int4_holds_a_q4_0_ggufs_weights_exactly(smollm2_source, tmp_path, monkeypatch):
    """A Qwen3 GGUF in Q4_0 (its embedding and head too) loads in int4 with every projection the
    file's own weights, as the float32 load dequantizes them: Q4_0's d (q - 8) as a scale and a
    minimum of -8 d. Quantizing those weights again, the way before, changes most of them."""
    from transformers import AutoModelForCausalLM

    from hyperserve.layers.quantization import Int4Linear
    from hyperserve.models import loader

    dequantize = torch.ops.hyperserve.dequantize
    monkeypatch.setenv("HYPERSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    config = tiny_config("qwen3", vocab_size=49152, hidden_size=128, intermediate_size=256,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _write_gguf(model, tmp_path / "model.gguf", smollm2_source.path, quant="Q4_0")
    source = resolve_model(str(tmp_path / "model.gguf"))
    config = load_config(source)
    assert loader._keeps_q41_blocks(source, config)
    build = lambda quantization: build_model(config, source, TorchPagedAttention(), 64, torch.float32,
                                             "cpu", quantization=quantization)
    exact = build(None)
    for way in ("direct", "again"):
        if way == "again":
            monkeypatch.setattr(loader, "_keeps_q41_blocks", lambda *args: False)
        int4 = {name: m for name, m in build("int4").named_modules() if isinstance(m, Int4Linear)}
        assert len(int4) == 4 * config.num_hidden_layers
        same = [torch.equal(dequantize(m.q41, m.in_features, "q4_1")[: m.out_features],
                            exact.get_submodule(name).weight) for name, m in int4.items()]
        assert all(same) if way == "direct" else not any(same)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_int4_quantizes_each_layer_as_it_is_read_to_the_same_weights(arch, save_hf_model, monkeypatch):
    """Quantizing while loading gives the bytes quantizing the loaded model gives, and holds no more
    than one decoder layer in float32 at a time (its projections are quantized as soon as its last
    tensor is in); the rest are still on the meta device or already int4."""
    from hyperserve.layers.quantization import Int4Linear, quantize_model
    from hyperserve.models import loader
    from tests.conftest import tiny_config

    config = tiny_config(arch, num_hidden_layers=4, moe_intermediate_size=64, mlp_only_layers=[1])
    _, path = save_hf_model(config)
    source = resolve_model(path)
    config_read, layers, held = load_config(source), [], []
    load_checkpoint, quantize_linears = loader._load_checkpoint, loader.quantize_linears

    def loading(model, *args):
        layers.extend(model.model.layers)
        load_checkpoint(model, *args)

    def quantizing(layer, method):  # how many layers hold float32 projections right now
        held.append(sum(any(isinstance(m, torch.nn.Linear) and not m.weight.is_meta for m in other.modules())
                        for other in layers))
        quantize_linears(layer, method)

    monkeypatch.setattr(loader, "_load_checkpoint", loading)
    monkeypatch.setattr(loader, "quantize_linears", quantizing)
    streamed = build_model(config_read, source, TorchPagedAttention(), 64, torch.float32, "cpu",
                           quantization="int4")
    assert held == [1, 1, 1, 1]
    reference = build_model(config_read, source, TorchPagedAttention(), 64, torch.float32, "cpu")
    quantize_model(reference, "int4", torch.float32)
    ours = {name: m for name, m in streamed.named_modules() if isinstance(m, Int4Linear)}
    theirs = {name: m for name, m in reference.named_modules() if isinstance(m, Int4Linear)}
    assert ours.keys() == theirs.keys() and len(ours) > 8
    for name, module in ours.items():
        assert torch.equal(module.dense(), theirs[name].dense()), name
    for name, param in reference.named_parameters():
        assert torch.equal(param, streamed.get_parameter(name)), name


def test_a_mixtral_gguf_is_read_as_mixtral(smollm2_source, tmp_path, monkeypatch):
    """llama.cpp writes Mixtral as a `llama` with experts (transformers then reads a dense Llama):
    ours is a Mixtral of the GGUF's expert count and width, experts per token from its metadata,
    Q/K rows un-permuted; in float32 its answers are the original model's."""
    from tests.models.test_llama import _check_against_transformers

    monkeypatch.setenv("HYPERSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    config = tiny_config("mixtral", vocab_size=49152, num_local_experts=6, num_experts_per_tok=3,
                         max_position_embeddings=256)
    model = random_model(config)
    _write_gguf(model, tmp_path / "mixtral.gguf", smollm2_source.path, quant=None)
    llm = LLM(model=str(tmp_path / "mixtral.gguf"), num_kv_blocks=64, block_size=4, max_model_len=128,
              dtype="float32")
    read = llm.engine.hf_config
    assert (read.model_type, read.num_local_experts, read.num_experts_per_tok) == ("mixtral", 6, 3)
    _check_against_transformers(llm, model, abs_tol=2e-4)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_checkpoint_missing_one_part_of_a_fused_projection_is_refused(save_hf_model, quantization):
    """k_proj of one layer gone: q and v still fill part of qkv_proj, which must not count as loaded."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import tiny_config

    _, path = save_hf_model(tiny_config("llama"))
    weights = Path(path) / "model.safetensors"
    missing = "model.layers.1.self_attn.k_proj.weight"
    save_file({k: v for k, v in load_file(weights).items() if k != missing}, weights)
    source = resolve_model(path)
    with pytest.raises(ValueError, match="lacks weights.*layers.1.self_attn.qkv_proj"):
        build_model(load_config(source), source, TorchPagedAttention(), 64, torch.float32, "cpu",
                    quantization=quantization)


_BUILD_WITHOUT_DYNAMO = """
import sys, torch
from hyperserve import LLM
llm = LLM(model=sys.argv[1], dtype="float32", quantization="int4")
init = torch.nn.init.normal_(torch.zeros(1000))  # restored after the build
print("torch._dynamo" in sys.modules, "triton" in sys.modules, bool(init.std() > 0.5))
"""


def test_building_a_model_imports_no_compiler(save_hf_model):
    """Modules built on the meta device skip torch.nn.init, whose meta path imports torch._dynamo
    and Triton: ~100 MB of a CPU server's memory and most of a second of start-up. In a fresh
    process, as other tests import the compiler."""
    _, path = save_hf_model(tiny_config("llama"))
    result = subprocess.run([sys.executable, "-c", _BUILD_WITHOUT_DYNAMO, str(path)], capture_output=True,
                            text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.stdout.split() == ["False", "False", "True"]


_GGUF_START = """
import sys
from hyperserve import LLM
llm = LLM("smollm2-135m")
print("transformers.models.auto.configuration_auto" in sys.modules, "sympy" in sys.modules)
"""


def test_a_ggufs_start_imports_neither_transformers_model_registry_nor_its_loading_stack(smollm2_source):
    """A GGUF's saved config and tokenizer read without transformers' model registry (0.26-0.30 s)
    or LlamaConfig's module, which imports transformers' weight loading and sympy (0.6-0.8 s).
    In a fresh process, as other tests import both."""
    gguf_metadata_directory(smollm2_source.path)  # parsed once already, as at a start
    result = subprocess.run([sys.executable, "-c", _GGUF_START], capture_output=True, text=True, check=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.stdout.split() == ["False", "False"]


def test_q8_0_tensors_read_as_ggufs_own_dequantize_reads_them():
    """Our chunked Q8_0 reader (the embeddings of Gemma 3 and SmolLM2) against gguf's, bit for bit,
    over more blocks than one chunk holds, with zero, tiny and large scales; and the same blocks as
    pack_q80's rows without the float32 pass."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    scales = rng.choice([0.0, 1e-6, 0.05, 30.0], (2100, 1))
    weight = (rng.standard_normal((2100, 1024)) * scales).astype(np.float32)
    raw = quantize(weight, GGMLQuantizationType.Q8_0).reshape(-1)
    expected = dequantize(raw, GGMLQuantizationType.Q8_0).reshape(-1)
    assert np.array_equal(dequantize_q8_0(raw).reshape(-1), expected)
    assert not np.array_equal(expected, 0)
    # the embedding kept in Q8_0: the blocks reordered, as pack_q80 packs their dequantized weights,
    # but for scales below float16's range (1e-6 here), which keep their codes: zero weights either way
    ours, packed = q80_from_gguf(raw, 2100), pack_q80(torch.from_numpy(expected.reshape(2100, 1024)))

    def values(rows: torch.Tensor) -> torch.Tensor:
        codes = rows[:, :1024].contiguous().view(torch.int8).float().reshape(2100, 32, 32)
        return codes * rows[:, 1024:].contiguous().view(torch.float16).float()[..., None]

    assert torch.equal(values(ours), values(packed))
    normal = torch.from_numpy(scales[:, 0] != 1e-6)
    assert torch.equal(ours[normal], packed[normal]) and not torch.equal(ours, packed)
