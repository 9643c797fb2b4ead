"""Reading GGUF files (llama.cpp's): their tensor table, their metadata saved once as ordinary
files (config, tokenizer), and their tensors under Hugging Face's names, dequantized to float32 or,
where our kernels keep the file's own layout (Q8_0 and Q4_1), its blocks reordered into their rows.
models/loader.py builds the model from them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
import transformers
from tqdm import tqdm
from transformers import PretrainedConfig

from hyperserve.models import gpt_oss
from hyperserve.models.gemma import GEMMA_TYPES

logger = logging.getLogger("hyperserve.gguf")

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",  # [E, I, H]: split per expert by loader._per_expert
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE's: [hidden], our gate's one row
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


# Gemma has four norms per layer; its ffn_norm is the one before the MLP. Phi-3's q/k/v and
# gate/up projections come fused, as ours are (its ffn_up is gate then up)
_GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# GPT-OSS's norm before the MLP is post_attention_norm; its sinks, one logit per head, come as a weight
# (of _PARAMETERS: named without a leaf)
_PARAMETERS = frozenset({"self_attn.sinks"})
_GGUF_NAMES_BY_ARCHITECTURE = {"gemma2": _GEMMA_NAMES, "gemma3_text": _GEMMA_NAMES,
                               "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                               "gpt_oss": {"post_attention_norm": "post_attention_layernorm",
                                           "attn_sinks": "self_attn.sinks"}}

_FOUR_BIT_GGUF_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "MXFP4"})
_FIVE_TO_EIGHT_BIT_GGUF_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"})
_Q4_TYPES = frozenset({"Q4_0", "Q4_1"})  # blocks of 32 weights that pack_q41's rows hold exactly
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_weight_bits(path: Path) -> int | None:
    """4 when most of a GGUF's transformer-block weights are in a 4-bit type (as in Q4_0, Q4_1 and
    Q4_K_M files, whose few 6-bit tensors do not count, and GPT-OSS's MXFP4 experts beside its
    16-bit attention); 8 when most are in a 5- to 8-bit one (Gemma 3 270M's Q4_K_M file, whose
    640-wide rows do not fit Q4_K's 256-weight blocks, is mostly Q5_0); None for float weights or
    a mix. Most by count of weights, not of tensors."""
    from gguf import GGMLQuantizationType

    tensors = gguf_index(path)["tensors"]
    sizes = [(GGMLQuantizationType(t["type"]).name, math.prod(t["shape"])) for t in tensors
             if t["name"].startswith("blk.") and len(t["shape"]) in (2, 3)]
    total = sum(size for _, size in sizes)
    for bits, kinds in ((4, _FOUR_BIT_GGUF_TYPES), (8, _FIVE_TO_EIGHT_BIT_GGUF_TYPES)):
        if total and sum(size for name, size in sizes if name in kinds) * 2 > total:
            return bits
    return None


@functools.lru_cache(maxsize=4)
def gguf_index(path: Path) -> dict:
    """What we read of a GGUF besides its config and tokenizer: its tensor table (name, type,
    shape, byte offset and size) and its EOS token ids, from the saved metadata."""
    directory = gguf_metadata_directory(path)
    if directory is None:
        return _read_gguf_index(path)
    return json.loads((directory / "gguf_index.json").read_text())


def _read_gguf_index(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = reader.fields
    architecture = fields["general.architecture"].contents() if "general.architecture" in fields else ""

    def number(key: str) -> float | None:  # architecture.key, where the file has it
        key = f"{architecture}.{key}"
        return fields[key].contents() if key in fields else None

    return {
        "tensors": [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in reversed(t.shape)],
                     "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors],
        "eos_token_ids": [int(fields[key].contents()) for key in _GGUF_EOS_KEYS if key in fields],
        "experts_per_token": number("expert_used_count"),
        # Gemma 2's caps, which transformers' GGUF config does not map
        "attn_logit_softcapping": number("attn_logit_softcapping"),
        "final_logit_softcapping": number("final_logit_softcapping"),
    }


CONFIG_ATTRIBUTES = "config_attributes.json"
_GGUF_METADATA_VERSION = 4  # of what save_gguf_metadata writes


@functools.lru_cache(maxsize=4)
def gguf_metadata_directory(path: Path) -> Path | None:
    """A GGUF's metadata saved once as ordinary files under HYPERSERVE_GGUF_CACHE (default
    ~/.cache/hyperserve/gguf), keyed by the file and the transformers version: the config and
    tokenizer transformers derives from it (config.json, tokenizer.json, the chat template) and
    gguf_index.json. Parsing a GGUF's metadata (gguf's GGUFReader, and transformers' own parses)
    builds Python objects for every vocabulary entry: SmolLM2's start-up peaked 300 MB higher and
    kept ~150 MB of it, so a child process parses, once. None where that fails: the caller then
    parses in process."""
    stat = path.stat()
    identity = (f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
                f"|{_GGUF_METADATA_VERSION}")
    root = Path(os.environ.get("HYPERSERVE_GGUF_CACHE", Path.home() / ".cache" / "hyperserve" / "gguf"))
    directory = root / hashlib.sha256(identity.encode()).hexdigest()[:16]
    if not (directory / "gguf_index.json").exists():
        convert = ("import sys; from hyperserve.models import gguf_reader; "
                   "gguf_reader.save_gguf_metadata(*sys.argv[1:])")
        done = subprocess.run([sys.executable, "-c", convert, str(path), str(directory)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            logger.warning("could not save %s's metadata as files: %s", path,
                           done.stderr.strip().splitlines()[-1:])
            return None
    return directory


def save_gguf_metadata(gguf_path: str, directory: str) -> None:
    """gguf_metadata_directory's child: writes a temporary directory, then renames it whole. One
    parse of the file by gguf's reader serves transformers' config, its tokenizer and our index,
    which would each parse it again (20-30 s apiece for Gemma 3's 262k-entry vocabulary): this
    process reads nothing else, so its GGUFReader is made to hand out that one reader.

    The reader slices its file once per vocabulary entry and field part (9.6M slices for Gemma 3),
    and a slice of an np.memmap runs NumPy's Python-level memmap hooks each time; it is given the
    same mapping as a plain array, which slices in C: Gemma 3's parse took 17.2 s, now 9.5 s
    (SmolLM2's 4.4 s, now 2.7 s), the same files written."""
    import gguf
    from transformers import AutoTokenizer

    memmap = np.memmap
    with mock.patch.object(np, "memmap", lambda *args, **kwargs: memmap(*args, **kwargs).view(np.ndarray)):
        reader = gguf.GGUFReader(gguf_path)
    gguf.GGUFReader = lambda *args, **kwargs: reader
    path, target = Path(gguf_path), Path(directory)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    config = gguf_config(path)
    config.save_pretrained(partial)
    for key in [key for key in reader.fields if key.startswith("gpt-oss.rope.scaling.")]:
        del reader.fields[key]  # read above: transformers' own reading of them fails
    # every attribute its class reads, its aliases (attribute_map) included: see loader._saved_config
    aliases = {alias: getattr(config, alias) for alias in type(config).attribute_map}
    (partial / CONFIG_ATTRIBUTES).write_text(json.dumps({**config.to_dict(), **aliases}))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(partial)
    (partial / "gguf_index.json").write_text(json.dumps(_read_gguf_index(path)))
    try:
        partial.rename(target)
    except OSError:  # another process saved it first
        shutil.rmtree(partial, ignore_errors=True)


def gguf_config(path: Path) -> PretrainedConfig:
    """A GGUF's config as transformers reads it; GPT-OSS's (`gpt-oss`) read here from the same
    metadata, as transformers' reading of its YaRN keys fails on llama.cpp's files."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    if reader.fields["general.architecture"].contents() != "gpt-oss":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    from transformers import GptOssConfig

    def field(key: str, default: Any = None) -> Any:
        return reader.fields[f"gpt-oss.{key}"].contents() if f"gpt-oss.{key}" in reader.fields else default

    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rope = {"rope_type": "default", "rope_theta": field("rope.freq_base", 150000.0)}
    if field("rope.scaling.type") == "yarn":  # llama.cpp's beta defaults, as the model's own config
        rope.update(rope_type="yarn", factor=field("rope.scaling.factor"), beta_fast=32.0, beta_slow=1.0,
                    original_max_position_embeddings=field("rope.scaling.original_context_length"),
                    truncate=False)
    return GptOssConfig(
        vocab_size=int(embedding.shape[-1]), hidden_size=field("embedding_length"),
        num_hidden_layers=field("block_count"), num_attention_heads=field("attention.head_count"),
        num_key_value_heads=field("attention.head_count_kv"), head_dim=field("attention.key_length"),
        intermediate_size=field("expert_feed_forward_length"), num_local_experts=field("expert_count"),
        num_experts_per_tok=field("expert_used_count"), sliding_window=field("attention.sliding_window"),
        rms_norm_eps=field("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=field("context_length"), rope_parameters=rope,
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors))


def gguf_tensors(path: Path, config: PretrainedConfig, q80_rows: frozenset[str] = frozenset(),
                 q41_layers: bool = False, mxfp4_rows: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, dequantized to float32, but for `q80_rows` given as Q8_0 and, with
    `q41_layers`, the decoder layers' Q4_0 and Q4_1 matrices, which come as pack_q41's rows, and with
    `mxfp4_rows` its MXFP4 experts as pack_mxfp4's (mxfp4_from_gguf)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = np.memmap(path, dtype=np.uint8, mode="r")
    permuted = config.model_type in ("llama", "mistral", "mixtral")  # llama.cpp permutes Q/K rows for these
    gemma = config.model_type in GEMMA_TYPES
    for tensor in tqdm(gguf_index(path)["tensors"], desc="Loading weights", unit="tensor", leave=False):
        name = _hf_name(tensor["name"], config.model_type)
        if name is None:
            continue
        raw = data[tensor["offset"] : tensor["offset"] + tensor["bytes"]]
        kind = GGMLQuantizationType(tensor["type"])
        if name in q80_rows and kind == GGMLQuantizationType.Q8_0:
            yield name, q80_from_gguf(raw, tensor["shape"][0])
            continue
        if mxfp4_rows and kind == GGMLQuantizationType.MXFP4 and ".experts." in name:
            yield name, mxfp4_from_gguf(raw, tensor["shape"])
            continue
        if q41_layers and kind.name in _Q4_TYPES and name.startswith("model.layers."):
            array = q41_from_gguf(raw, tensor["shape"][0], kind)
        elif kind == GGMLQuantizationType.MXFP4:  # GPT-OSS's experts: NumPy's reading took minutes for 20b
            array = dequantize_mxfp4(raw).reshape(tensor["shape"])
        else:
            array = dequantize_q8_0(raw) if kind == GGMLQuantizationType.Q8_0 else dequantize(raw, kind)
            array = array.reshape(tensor["shape"]).astype(np.float32, copy=False)
        if not array.flags.writeable:  # an F32 tensor is the file's own (read-only) map
            array = array.copy()
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = _undo_rope_permutation(array, heads)
        if gemma and name.endswith("norm.weight"):
            array = array - 1  # llama.cpp stores Gemma's norms as 1 + w; Hugging Face names mean w
        yield name, torch.from_numpy(array)


def q80_from_gguf(raw: np.ndarray, out_features: int) -> torch.Tensor:
    """A GGUF Q8_0 tensor's blocks (a float16 scale, then 32 int8 codes) as pack_q80's rows [out,
    in + in / 16]: the same bytes reordered, without the float32 copy. pack_q80 of the dequantized
    weight gives these bytes too (llama.cpp's Q8_0 gives each block's largest weight the code 127,
    whose value over 127 is the scale again), but for a scale that underflowed to zero, whose
    codes pack_q80 zeroes: the same weights either way. Copied by PyTorch a piece at a time (the
    file's map is read-only): Gemma 3's 262k-row embedding took 0.43 s in NumPy's strided copies,
    0.08 s so."""
    blocks = np.asarray(raw).reshape(out_features, -1, 34)
    groups = blocks.shape[1]
    out = torch.empty(out_features, groups * 34, dtype=torch.uint8)
    codes = out[:, : groups * 32].view(out_features, groups, 32)  # views of `out`
    scales = out[:, groups * 32 :].view(out_features, groups, 2)
    for start in range(0, out_features, 4096):  # pieces that stay in cache
        piece = torch.from_numpy(blocks[start : start + 4096].copy())
        codes[start : start + 4096] = piece[:, :, 2:]
        scales[start : start + 4096] = piece[:, :, :2]
    return out


def q41_from_gguf(raw: np.ndarray, out_features: int, kind: int) -> np.ndarray:
    """A GGUF Q4_1 or Q4_0 tensor's blocks as pack_q41's rows [out, in * 5 / 8]: each channel's
    codes, then its scales, then its minimums. A Q4_1 block holds a float16 scale and minimum, then
    16 bytes of codes (code j in the low nibble of byte j, code j + 16 in its high one); a Q4_0
    block a float16 scale d and the same codes, meaning d (q - 8): its minimum is -8 d, which
    float16 holds exactly, and scale x code + minimum gives each weight exactly as d (q - 8) does."""
    from gguf import GGMLQuantizationType

    if kind == GGMLQuantizationType.Q4_1:
        blocks = np.asarray(raw).reshape(out_features, -1, 20)
        codes, scales, minimums = blocks[:, :, 4:], blocks[:, :, :2], blocks[:, :, 2:4]
    else:
        blocks = np.asarray(raw).reshape(out_features, -1, 18)
        codes, scales = blocks[:, :, 2:], blocks[:, :, :2]
        minimums = (np.ascontiguousarray(scales).view(np.float16) * np.float16(-8)).view(np.uint8)
    return np.concatenate([part.reshape(out_features, -1) for part in (codes, scales, minimums)], axis=1)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """GGUF Q8_0 blocks (a float16 scale, then 32 int8 codes) as float32, as gguf's dequantize gives
    them, a few thousand blocks at a time: its one pass over Gemma 3's 262k-row embedding took 2.4 s
    of a 10 s load in temporaries the size of the tensor, this 0.3 s."""
    blocks = np.asarray(raw).reshape(-1, 34)  # read-only (the file's map): copied a chunk at a time
    out = torch.empty(blocks.shape[0], 32)
    for start in range(0, blocks.shape[0], 1 << 16):
        chunk = torch.from_numpy(blocks[start : start + (1 << 16)].copy())
        scale = chunk[:, :2].contiguous().view(torch.float16).float()
        out[start : start + len(chunk)] = chunk[:, 2:].contiguous().view(torch.int8).float() * scale
    return out.numpy()


def dequantize_mxfp4(raw: np.ndarray) -> np.ndarray:
    """llama.cpp's MXFP4 blocks (an E8M0 scale byte, then 16 bytes: the first 16 codes in the low
    nibbles, the next 16 in the high ones) -> float32 values, as gguf's own dequantize reads them."""
    blocks = torch.from_numpy(np.asarray(raw).reshape(-1, 17).copy())
    return gpt_oss.dequantize_mxfp4(blocks[:, 1:].unsqueeze(1), blocks[:, :1], interleaved=False).numpy()


def mxfp4_from_gguf(raw: np.ndarray, shape: list[int]) -> torch.Tensor:
    """llama.cpp's MXFP4 blocks of a tensor of `shape` [..., out, in] as pack_mxfp4's rows [..., out,
    in * 17 / 32]: the blocks' code bytes, which are in our order already, then their scale bytes.
    The bytes are moved, not dequantized (gpt-oss-20b's experts: 10 GB so, 76 GB in float32)."""
    blocks = torch.from_numpy(np.asarray(raw).reshape(-1, shape[-1] // 32, 17).copy())  # [rows, groups, 17]
    rows = torch.cat([blocks[..., 1:].flatten(1), blocks[..., 0]], dim=1)
    return rows.reshape(*shape[:-1], -1)


def experts_are_mxfp4(path: Path) -> bool:
    """Whether the file's stacked experts (ffn_*_exps) are all MXFP4: llama.cpp's GPT-OSS files."""
    from gguf import GGMLQuantizationType

    stacked = re.compile(r"blk\.\d+\.ffn_\w+_exps\.weight")
    experts = [t for t in gguf_index(path)["tensors"] if stacked.fullmatch(t["name"])]
    return bool(experts) and all(GGMLQuantizationType(t["type"]) == GGMLQuantizationType.MXFP4 for t in experts)


def _hf_name(gguf_name: str, model_type: str) -> str | None:
    names = {**_GGUF_NAMES, **_GGUF_NAMES_BY_ARCHITECTURE.get(model_type, {})}
    match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", gguf_name)
    if match is None or match.group(2) not in names:
        return None  # e.g. rope_freqs: derived from the config instead
    layer, base, leaf = match.groups()
    prefix = f"model.layers.{layer}." if layer is not None else ""
    if names[base] in _PARAMETERS:  # a GGUF "weight" that is a parameter of its own
        return f"{prefix}{names[base]}"
    return f"{prefix}{names[base]}.{leaf}"


def _undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves; restore the rotate-half row order."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def blocks_are_q4(path: Path) -> bool:
    """Whether every matrix of the file's blocks is a 2-D Q4_0 or Q4_1 tensor (llama.cpp's Q4_0 and
    Q4_1 files), each of which pack_q41's rows hold exactly (q41_from_gguf)."""
    from gguf import GGMLQuantizationType

    matrices = [t for t in gguf_index(path)["tensors"]
                if t["name"].startswith("blk.") and len(t["shape"]) >= 2]
    return bool(matrices) and all(len(t["shape"]) == 2 and GGMLQuantizationType(t["type"]).name in _Q4_TYPES
                                  for t in matrices)
