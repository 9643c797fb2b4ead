"""Build a model and fill its weights from a GGUF file, a Hugging Face directory, or at random.

The model is built on the meta device and materialised once at its final dtype; checkpoint
tensors are then read (and dequantized) one at a time and copied into place, so peak memory
stays near the size of the weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from hyperserve import kernels
from hyperserve.config import EngineConfig
from hyperserve.distributed.group import TensorParallel
from hyperserve.layers.attention import AttentionBackend, attention_backend
from hyperserve.layers.huge_pages import move_to_huge_pages
from hyperserve.layers.quantization import (
    pack_q80,
    packs_embeddings_q80,
    quantize_linears,
    quantize_model,
)
from hyperserve.models import gemma, gguf_reader, gpt_oss
from hyperserve.models.gemma import GemmaForCausalLM
from hyperserve.models.llama import LlamaForCausalLM, head_dim_of, kv_layout
from hyperserve.models.registry import SUPPORTED_ARCHITECTURES, ModelSource, resolve_model

logger = logging.getLogger("hyperserve.loader")
_BUILD_LOCK = threading.Lock()  # see _without_init


def _metadata_source(source: ModelSource) -> tuple[Path, str | None]:
    """Where config and tokenizer are read from: a GGUF's saved metadata, else the model's files."""
    if source.gguf_file and (directory := gguf_reader.gguf_metadata_directory(source.path)) is not None:
        return directory, None
    return source.directory, source.gguf_file


def load_config(source: ModelSource) -> PretrainedConfig:
    directory, gguf_file = _metadata_source(source)
    if source.gguf_file and gguf_file is None:  # the GGUF's config as gguf_metadata_directory saved it
        config = _saved_config(directory)
    else:
        # imported here, as AutoTokenizer and MixtralConfig are: the first of them imports
        # transformers' model registry (0.26-0.30 s), which a GGUF's start does not use
        from transformers import AutoConfig

        config = (gguf_reader.gguf_config(source.path) if gguf_file
                  else AutoConfig.from_pretrained(directory))
    if source.gguf_file:
        config = _complete_gguf_config(config, gguf_reader.gguf_index(source.path))
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {config.model_type!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
        )
    return config


def _saved_config(directory: Path) -> PretrainedConfig:
    """A GGUF's saved config as plain attributes of transformers' base class, which is all our
    models read. Through its own class it took 0.8 s more for SmolLM2: LlamaConfig's module
    imports transformers' weight-loading stack (torch.distributed.tensor, sympy), which serving
    never uses. tests/models/test_loader.py checks each attribute against the class's reading."""
    attributes = json.loads((directory / gguf_reader.CONFIG_ATTRIBUTES).read_text())
    # the constructor converts dtype, and drops generation settings (use_cache among them): those
    # are set as given
    config = PretrainedConfig(**attributes)
    for name in attributes.keys() - vars(config).keys():
        setattr(config, name, attributes[name])
    return config


def _complete_gguf_config(config: PretrainedConfig, index: dict) -> PretrainedConfig:
    """What transformers' GGUF config leaves at its class defaults, read from the tensors' shapes:
    Qwen3's head size (it does not map attention.key_length), Qwen3-MoE's, Qwen2-MoE's and GPT-OSS's
    expert widths (nor expert_feed_forward_length and its shared expert's), whether the LM head is the
    embedding (no output.weight); and Mixtral, which llama.cpp writes as a `llama` with experts and
    transformers reads as a dense Llama; Gemma's attention scale and caps (`_complete_gemma_config`).
    A Phi-3 GGUF with LongRoPE factors (rope_factors_*, which transformers does not map) is refused
    rather than rotated by the default rope."""
    shapes = {t["name"]: t["shape"] for t in index["tensors"]}
    if any(name.startswith("rope_factors") for name in shapes):
        raise ValueError("this GGUF's LongRoPE factors (rope_factors_long, rope_factors_short) are not "
                         "read from GGUFs yet: serve the model's Hugging Face directory instead")
    if "blk.0.attn_k.weight" in shapes:
        config.head_dim = shapes["blk.0.attn_k.weight"][0] // config.num_key_value_heads
    experts = next((shape for name, shape in shapes.items() if name.endswith("ffn_down_exps.weight")), None)
    if experts is not None and config.model_type in ("qwen3_moe", "qwen2_moe"):
        config.moe_intermediate_size = experts[-1]  # [E, hidden, width]
    if experts is not None and config.model_type in gpt_oss.GPT_OSS_TYPES:
        config.intermediate_size = experts[-1]
    if "blk.0.ffn_down_shexp.weight" in shapes:  # Qwen2-MoE's shared expert, [hidden, width]
        config.shared_expert_intermediate_size = shapes["blk.0.ffn_down_shexp.weight"][-1]
    if experts is not None and config.model_type == "llama":
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        from transformers import MixtralConfig

        config = MixtralConfig(**{**fields, "num_local_experts": experts[0], "intermediate_size": experts[-1],
                                  "num_experts_per_tok": index.get("experts_per_token") or 2})
    config.tie_word_embeddings = "output.weight" not in shapes
    if config.model_type in gemma.GEMMA_TYPES:
        _complete_gemma_config(config, index)
    return config


# Gemma's 27B models, by their layer count (llama.cpp's rule): their queries scale by
# (hidden_size / heads)^-0.5, every other size's by head_dim^-0.5
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def _complete_gemma_config(config: PretrainedConfig, index: dict) -> None:
    """Gemma's query_pre_attn_scalar, which a GGUF does not store (transformers' GGUF config leaves
    it at 256, wrong for the 27B models), and Gemma 2's caps, where the file gives them."""
    if config.num_hidden_layers == _GEMMA_27B_LAYERS[config.model_type]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if index.get(name) is not None:
            setattr(config, name, float(index[name]))


def load_tokenizer(source: ModelSource, chat_template: str | None = None) -> PreTrainedTokenizerBase | None:
    """The model's own tokenizer and chat template (or `chat_template`); None for a bare config
    (token ids only)."""
    has_files = source.gguf_file or any(
        (source.directory / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    )
    if not has_files:
        if chat_template is not None:
            raise ValueError("chat_template: this model has no tokenizer to apply it with")
        return None
    directory, gguf_file = _metadata_source(source)
    if source.gguf_file and gguf_file is None:  # the GGUF's tokenizer as gguf_metadata_directory saved it
        tokenizer = _saved_tokenizer(directory)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif not tokenizer.chat_template and load_config(source).model_type in gemma.GEMMA_TYPES:
        tokenizer.chat_template = gemma.CHAT_TEMPLATE  # Gemma's turn format, which its GGUF may lack
    return tokenizer


# tokenizer_config.json's records of its own loading, and its added tokens (tokenizer.json has them)
_LOADING_KEYS = ("tokenizer_class", "backend", "is_local", "local_files_only", "name_or_path",
                 "added_tokens_decoder")


def _saved_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A saved tokenizer.json and its settings read by `tokenizers` alone. Through AutoTokenizer,
    Gemma 3's 262k-entry vocabulary took 3.3 s: its class parses the JSON in Python again to
    rebuild the same tokenizer (the tokens, special tokens and vocabulary come out the same,
    tests/models/test_gemma3.py); this takes 1.0 s."""
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings = {key: value for key, value in settings.items() if key not in _LOADING_KEYS}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                        name_or_path=str(directory), **settings)
    if (template := directory / "chat_template.jinja").exists():
        tokenizer.chat_template = template.read_text()
    return tokenizer


def load_eos_token_ids(source: ModelSource | None, config: PretrainedConfig,
                       tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """Every token id that ends generation: the tokenizer's EOS, the config's and the generation
    config's (a list in Llama 3: end of text, end of turn, end of message), and a GGUF's EOS, EOT
    and EOM ids."""
    found: list[int | list[int] | None] = [getattr(config, "eos_token_id", None)]
    if tokenizer is not None:
        found.append(tokenizer.eos_token_id)
        if config.model_type in gemma.GEMMA_TYPES:  # a chat turn ends with <end_of_turn>, not <eos>
            end_of_turn = tokenizer.convert_tokens_to_ids(gemma.END_OF_TURN)
            found.append(None if end_of_turn == tokenizer.unk_token_id else end_of_turn)
    if source is not None and source.gguf_file:
        found += gguf_reader.gguf_index(source.path)["eos_token_ids"]
    elif source is not None and (source.directory / "generation_config.json").exists():
        found.append(GenerationConfig.from_pretrained(source.directory).eos_token_id)
    ids = set()
    for value in found:
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(i for i in ids if 0 <= i < config.vocab_size)


def model_identity(source: ModelSource | None, config: PretrainedConfig, *settings: object) -> str:
    """A SHA-256 over what decides a model's KV: its config, its weight files (name, size, and the
    first and last MiB of each, which change with any re-quantization or fine-tune without
    reading gigabytes) and the settings given (dtypes, quantization, block size, seed)."""
    digest = hashlib.sha256(config.to_json_string(use_diff=False).encode())
    digest.update(json.dumps([str(s) for s in settings]).encode())
    files = [] if source is None else (
        [source.path] if source.gguf_file else sorted(source.directory.glob("*.safetensors")))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as file:
            digest.update(file.read(2**20))
            file.seek(max(0, size - 2**20))
            digest.update(file.read(2**20))
    return digest.hexdigest()


def build_model(
    config: PretrainedConfig,
    source: ModelSource | None,
    backend: AttentionBackend,
    max_position: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    quantization: str | None = None,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Materialise the model (with `tp`, this rank's slice of it) and fill it from `source`, or
    randomly when `source` is None (each rank drawing its own slice); then quantize its weights if
    asked. A checkpoint quantized to int4, int8 or mxfp4 is quantized a decoder layer at a time as it is
    read, so loading holds the float32 weights of a layer or two, not of the model (for an 8B
    model, about 5 GB at its peak rather than 32). On the CPU the weights end in 2 MiB pages
    (layers/huge_pages.py)."""
    # int4/int8/mxfp4 quantize from the checkpoint's own values (exact for Q4_1 and MXFP4); fp8 loses
    # nothing to bfloat16
    load_dtype = torch.float32 if quantization in ("int4", "int8", "mxfp4") else dtype
    with torch.device("meta"), _without_init():
        model = model_class(config)(config, backend, max_position, tp).to(load_dtype)
    by_layer = (source is not None and load_dtype == torch.float32 and quantization is not None
                and (tp is None or tp.size == 1))
    if by_layer:  # the decoder layers are materialised as their weights arrive
        inside = {id(m) for m in model.model.layers.modules()}
        for module in model.modules():
            if id(module) not in inside:
                _materialise(module, device, recurse=False)
    else:
        _materialise(model, device)
    packed = {}  # weights the checkpoint gave as Q8_0 rows (pack_q80's)
    if source is None:
        _init_random(model, config, seed)
    else:
        packed = _load_checkpoint(model, source, quantization if by_layer else None, device)
    model.reset_rotary()
    model = model.eval().requires_grad_(False)
    if quantization is not None:
        quantize_model(model, quantization, dtype, packed)
    if torch.device(device).type == "cpu":
        move_to_huge_pages(model)
    return model


@contextlib.contextmanager
def _without_init() -> Iterator[None]:
    """torch.nn.init's functions do nothing while the model is built on the meta device: every
    tensor is filled later anyway, and a meta tensor's init runs through torch._refs, whose first
    call imports torch._dynamo, Triton and sympy: 0.9 s of start-up and ~100 MB of a CPU server's
    memory that it never uses (150 MB of the load's peak). One build at a time, as the functions
    are the module's (engines of a multi-model server load in threads)."""
    names = [name for name in torch.nn.init.__all__ if name.endswith("_")]
    with _BUILD_LOCK:
        originals = {name: getattr(torch.nn.init, name) for name in names}
        for name in names:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, function in originals.items():
                setattr(torch.nn.init, name, function)


def _materialise(module: torch.nn.Module, device: str, recurse: bool = True) -> None:
    """Module.to_empty without its torch.empty_like: from a meta tensor that runs through torch._refs,
    whose first call imports sympy (0.42 s of start-up) for a tensor torch.empty makes alike."""
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), recurse=recurse)


def load_model(config: EngineConfig, tp: TensorParallel | None = None, max_position: int | None = None,
               seed_offset: int = 0, resolved: tuple[ModelSource, PretrainedConfig] | None = None
               ) -> LlamaForCausalLM:
    """The model an engine of this config serves (this rank's slice of it, with `tp`), or with
    `resolved` (a source and its config, already read) another built alike: a draft model, its own
    random weights drawn with seed_offset."""
    if resolved is None:
        source = resolve_model(config.model.model)
        resolved = source, load_config(source)
    source, hf_config = resolved
    return build_model(
        hf_config,
        None if config.model.load_format == "random" else source,
        backend=attention_backend(config.model.device, config.model.attention_backend,
                                  config.cache.block_size, head_dim_of(hf_config),
                                  latent=kv_layout(hf_config)[2]),
        max_position=max_position or config.model.max_model_len or hf_config.max_position_embeddings,
        dtype=config.model.torch_dtype,
        device=config.model.device,
        seed=config.model.seed + seed_offset,
        quantization=config.model.quantization,
        tp=tp,
    )


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM | GemmaForCausalLM]:
    return GemmaForCausalLM if config.model_type in gemma.GEMMA_TYPES else LlamaForCausalLM


_EMBEDDINGS = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def _load_checkpoint(model: LlamaForCausalLM, source: ModelSource, quantization: str | None = None,
                     device: str = "cpu") -> dict[str, torch.Tensor]:
    """Copy every checkpoint tensor into place. With `quantization`, the decoder layers are still on
    the meta device: each is materialised when its first tensor comes and quantized once its
    last has, so float32 weights are held for the layers being read only (checkpoints keep a
    layer's tensors together: GGUF in order, safetensors by name). Where it keeps them in Q8_0,
    the embedding and an untied head are packed as they come (a GGUF's Q8_0 blocks reordered,
    not dequantized): returned by name, for quantize_model. Gemma 3's embedding in float32 took
    671 MB twice over while it loaded (the load's peak RSS: 2.1 GB, against 0.85 after)."""
    embeddings = _EMBEDDINGS if packs_embeddings_q80(quantization) else frozenset()
    q41_layers = quantization == "int4" and _keeps_q41_blocks(source, model.config)
    if q41_layers:
        _expect_rows(model.model.layers, 20, experts_only=False)
    mxfp4_experts = (quantization == "mxfp4" and model.config.model_type in gpt_oss.GPT_OSS_TYPES
                     and stores_mxfp4(source))
    if mxfp4_experts:
        _expect_rows(model.model.layers, 17, experts_only=True)
    tensors = (gguf_reader.gguf_tensors(source.path, model.config, embeddings, q41_layers, mxfp4_experts)
               if source.gguf_file else _safetensors(source.directory))
    if model.config.model_type in gpt_oss.GPT_OSS_TYPES:
        tensors = gpt_oss.expert_tensors(tensors, keep_mxfp4=mxfp4_experts)
    rows = {name: param.shape[0] for name, param in model.named_parameters()}
    written = dict.fromkeys(rows, 0)  # rows of each parameter written so far (fused ones take several)
    layers = model.model.layers
    unfilled = [sum(1 for _ in layer.parameters()) for layer in layers]  # per layer: parameters not yet whole
    materialised: set[int] = set()
    packed: dict[str, torch.Tensor] = {}
    for checkpoint_name, checkpoint_tensor in tensors:
        for name, tensor in _per_expert(checkpoint_name, checkpoint_tensor):
            if name in embeddings:
                if name in rows:  # not a tied head's copy of the embedding
                    # a GGUF's Q8_0 blocks come as pack_q80's rows (uint8), anything else as weights
                    packed[name] = tensor if tensor.dtype == torch.uint8 else pack_q80(tensor)
                    written[name] = rows[name]
                continue
            index = _layer_index(name)
            if index is not None and index >= len(layers):
                continue  # a layer past the decoder's (DeepSeek-V3's multi-token prediction): not served
            by_layer = index is not None and quantization is not None
            if by_layer and index not in materialised:  # its first tensor
                _materialise(layers[index], device)
                materialised.add(index)
            target = model.load_weight(name, tensor)
            if target != name and name == "lm_head.weight":
                continue  # a tied head is the embedding: nothing written
            was_whole = written[target] >= rows[target]
            written[target] += tensor.shape[0]
            if by_layer and not was_whole and written[target] >= rows[target]:
                unfilled[index] -= 1
                if unfilled[index] == 0:
                    quantize_linears(layers[index], quantization)  # its last
    missing = {name for name in rows if written[name] < rows[name]}
    if missing:
        raise ValueError(f"checkpoint {source.path} lacks weights: {sorted(missing)[:5]}")
    return packed


def _keeps_q41_blocks(source: ModelSource, config: PretrainedConfig) -> bool:
    """Whether int4 takes the decoder layers' projections as the GGUF's own Q4_0 or Q4_1 blocks
    (pack_q41's rows: the same weights, exactly) rather than quantizing their float32 values again:
    where the native kernels run, every matrix of every block is Q4_0 or Q4_1 (llama.cpp's files of
    those types: SmolLM2's is Q4_1), and no weight is rescaled as it loads (Granite's). For Q4_1 the
    bytes come out the same either way (llama.cpp gives each group's least and greatest weight the
    codes 0 and 15), and SmolLM2's load took 1.0 s, 0.4 s of it in gguf's dequantization to float32
    and 0.4 s in quantizing that again. Q4_0's codes need not reach 0 and 15, and quantizing its
    weights again kept 29% of them exact (random weights; errors up to 5% of a tensor's largest)."""
    return (source.gguf_file is not None and kernels.available() and config.model_type != "granite"
            and gguf_reader.blocks_are_q4(source.path))


def stores_mxfp4(source: ModelSource) -> bool:
    """Whether the checkpoint's experts are MXFP4: GPT-OSS's own (its config's quantization_config
    says so, as vLLM reads it) or llama.cpp's GGUF of it."""
    if source.gguf_file:
        return gguf_reader.experts_are_mxfp4(source.path)
    config = json.loads((source.directory / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def _expect_rows(layers: torch.nn.Module, bytes_per_group: int, experts_only: bool) -> None:
    """The layers' projections (the experts' only, with experts_only), still on the meta device,
    take packed rows of bytes_per_group bytes per 32 inputs in place of float weights: pack_q41's
    (20: codes, then float16 scales and minimums) or pack_mxfp4's (17: codes, then E8M0 scales).
    load_weight writes a fused projection's parts as rows either way, and Int4Linear and Mxfp4Linear
    keep the rows they are given."""
    for name, module in layers.named_modules():
        if isinstance(module, torch.nn.Linear) and (".experts." in name or not experts_only):
            shape = (module.out_features, module.in_features * bytes_per_group // 32)
            module.weight = torch.nn.Parameter(torch.empty(shape, dtype=torch.uint8, device="meta"),
                                               requires_grad=False)


# Mixtral's names for its MoE block and its experts' projections -> Qwen's (and ours)
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                  ".w2.": ".down_proj."}
_STACKED_EXPERTS = re.compile(
    r"(.*\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.(weight|bias))?")


def _per_expert(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint tensor under the names the model loads: Mixtral's renamed as Qwen3-MoE's, and
    experts stacked in one tensor (transformers' fused [E, 2I, H] gate_up_proj, GGUF's
    ffn_*_exps and, for GPT-OSS, their [E, out] biases) split into each expert's projection."""
    if ".block_sparse_moe." in name:
        for old, new in _MIXTRAL_NAMES.items():
            name = name.replace(old, new)
    stacked = _STACKED_EXPERTS.fullmatch(name)
    leaf = "weight" if stacked is None else stacked.group(3) or "weight"
    if stacked is None or tensor.dim() != (3 if leaf == "weight" else 2):
        yield name, tensor
        return
    prefix, projection = stacked.group(1), stacked.group(2)
    for expert, part in enumerate(tensor):
        if projection == "gate_up_proj":
            gate, up = part.chunk(2, dim=0)
            yield f"{prefix}.{expert}.gate_proj.{leaf}", gate
            yield f"{prefix}.{expert}.up_proj.{leaf}", up
        else:
            yield f"{prefix}.{expert}.{projection}.{leaf}", part


def _layer_index(name: str) -> int | None:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def _safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    handles = [safe_open(f, "pt") for f in files]
    names = [(handle, name) for handle in handles for name in handle.keys()]
    for handle, name in tqdm(names, desc="Loading weights", unit="tensor", leave=False):
        if "rotary_emb" not in name:
            yield name, handle.get_tensor(name)


@torch.no_grad()
def _init_random(model: LlamaForCausalLM, config: PretrainedConfig, seed: int) -> None:
    """Drawn on the model's device (seconds for 8B parameters on a GPU, not minutes on the CPU)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0, std, generator=generator)


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                       num_kv_heads: int | None = None) -> int:
    """Bytes of K and V of one token over all layers (of num_kv_heads heads, by default all the
    model's; one tensor for both where the model shares them); a quantized cache adds a float32
    scale per head."""
    heads, width, shared = kv_layout(config)
    per_head = width * torch.empty((), dtype=dtype).element_size() if kv_cache_dtype == "auto" else width + 4
    return (1 if shared else 2) * config.num_hidden_layers * (num_kv_heads or heads) * per_head
