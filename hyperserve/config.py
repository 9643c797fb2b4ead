"""Engine configuration: one dataclass per concern, composed into EngineConfig.

Every field of these dataclasses is an `LLM(...)` keyword argument and a CLI flag of the same name
(`--max-num-seqs`); `add_engine_args` and `EngineConfig.from_kwargs` derive both from the fields.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch

from hyperserve.layers.attention import ATTENTION_BACKENDS


@dataclass
class ModelConfig:
    model: str = "smollm2-135m"  # registry name, .gguf file, or Hugging Face model directory
    dtype: str = "auto"  # auto: bfloat16 on cuda and with the native int4/int8 CPU kernels, else float32
    device: str | None = None  # cpu | cuda; None: cuda when available
    load_format: str = "auto"  # auto: weights from the checkpoint; random: random weights from its config
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0
    # auto: on the CPU mxfp4 for MXFP4 experts (GPT-OSS), int4 for a 4-bit GGUF, int8 for a 5- to
    # 8-bit one, else none | int4 | int8 | fp8 | mxfp4 | none
    quantization: str | None = "auto"
    compile: bool = False  # torch.compile the decode step (fused elementwise ops, less Python per token)
    # auto: Triton paged decode on CUDA, portable SDPA otherwise | torch | triton
    attention_backend: str = "auto"
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    # the chat template to use instead of the model's own: a Jinja file's path, or the template itself
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            self.chat_template = _read_chat_template(self.chat_template)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "random"):
            raise ValueError(f"load_format must be 'auto' or 'random', got {self.load_format!r}")
        if self.quantization == "none":
            self.quantization = None
        if self.quantization == "auto":
            self.quantization = self._default_quantization()
        if self.quantization is not None:
            if self.quantization not in ("int4", "int8", "fp8", "mxfp4"):
                raise ValueError(
                    f"quantization must be auto, int4, int8, fp8, mxfp4 or none, got {self.quantization!r}")
            if self.device != "cpu" and self.quantization != "fp8":
                raise ValueError(
                    f"quantization={self.quantization!r} runs on the CPU (PyTorch's CPU kernels)")
            if self.quantization == "mxfp4":
                from hyperserve import kernels

                if not kernels.available():
                    raise ValueError("quantization='mxfp4' needs the native CPU kernels, which are not built")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")

    def _default_quantization(self) -> str | None:
        """For a GGUF checkpoint on the CPU, the 8-bit or 4-bit kind nearest its own types: int4 for
        4-bit ones (exact for Q4_1, near for Q4_K), int8 for 5- to 8-bit ones (Q5_0, Q6_K, Q8_0, which
        int4 would round away: +27% perplexity on Gemma 3 270M). Either decodes several times faster
        than float32. A checkpoint whose experts are MXFP4 (GPT-OSS's own, and llama.cpp's GGUFs of
        it) keeps them so: mxfp4 (int4 without the native kernels). Anything else as stored."""
        from hyperserve import kernels
        from hyperserve.models.gguf_reader import gguf_weight_bits
        from hyperserve.models.loader import stores_mxfp4
        from hyperserve.models.registry import resolve_model

        if self.device != "cpu" or self.load_format == "random":
            return None
        source = resolve_model(self.model)
        if stores_mxfp4(source):
            return "mxfp4" if kernels.available() else "int4"
        bits = gguf_weight_bits(source.path) if source.gguf_file else None
        if bits == 8:  # through the native Q8_0 kernels only: fbgemm's int8 keeps the head in float32
            return "int8" if kernels.available() else None
        return "int4" if bits == 4 else None

    @property
    def torch_dtype(self) -> torch.dtype:
        """auto: bfloat16 on CUDA and for the native CPU kernels' int4, int8 (Q8_0) and mxfp4, which take
        16-bit activations: the KV cache takes half of float32's memory, for no loss in quality
        (Gemma 3 270M in int8: -0.2% perplexity, benchmarks/quality.py); float32 elsewhere."""
        if self.dtype == "auto":
            from hyperserve import kernels

            native_int8 = self.quantization == "int8" and self.device == "cpu" and kernels.available()
            sixteen = self.device == "cuda" or self.quantization in ("int4", "mxfp4") or native_int8
            return torch.bfloat16 if sixteen else torch.float32
        return getattr(torch, self.dtype)


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # explicit pool size; overrides the memory settings below
    # the KV pool's budget (per rank); None: 4 GB on CPU, see below on CUDA
    kv_cache_memory_gb: float | None = None
    # CUDA: the share of GPU memory for weights, activations and the KV pool
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True  # reuse the KV of prefixes seen before (--no-prefix-caching)
    disk_cache_dir: str | None = None  # a disk tier for evicted prefix blocks; None: memory only
    disk_cache_gb: float = 8.0  # the disk tier's budget
    # auto: the model's dtype; int8 or fp8: quantized with a scale per token and head
    kv_cache_dtype: str = "auto"
    max_pinned_fraction: float = 0.5  # the share of the KV pool that /v1/cache pins may hold

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto, int8 or fp8, got {self.kv_cache_dtype!r}")


# The scheduler's limits where none are given, by device: a CPU decodes a few sequences at a time
# and prefills a few hundred tokens a step; a GPU needs hundreds of sequences and thousands of
# tokens a step to keep its matrix units busy (vLLM's server takes 1,024 and 8,192 on an H100).
# device -> (max_num_seqs, max_num_batched_tokens)
SCHEDULER_DEFAULTS = {"cpu": (64, 512), "cuda": (256, 8192)}


@dataclass
class SchedulerConfig:
    max_num_seqs: int | None = None  # running sequences at most; None: 64 on CPU, 256 on CUDA
    # tokens per step, decodes and prefill chunks; None: 512 / 8,192
    max_num_batched_tokens: int | None = None
    # prompt tokens a step takes while other requests decode: every decoding request waits for the
    # whole step, so this bounds the stall a new prompt causes them, for more steps per prompt (on
    # 2 CPU cores at 16 streams, 128: ITL p99 244 -> 95 ms, output -6%); None: the step's budget
    max_prefill_tokens_while_decoding: int | None = None
    # decode steps run back to back per schedule when every scheduled request only decodes (vLLM's
    # multi-step scheduling): scheduling and output handling are paid once per this many tokens,
    # and CUDA graph replays queue without the host waiting between them. Tokens stream this many
    # at a time, and a request that stops mid-way has computed up to this many - 1 tokens for nothing.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be at least 1, got {self.num_scheduler_steps}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        for name in ("max_num_batched_tokens", "max_prefill_tokens_while_decoding"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


SPECULATIVE_METHODS = ("ngram", "draft", "self")


@dataclass
class SpeculativeConfig:
    speculative_method: str | None = None  # ngram | draft | self; None: no speculation
    # the most tokens proposed per step (fewer where acceptance is low); None: 16 for ngram, whose
    # k follows the match's length (long matches are copied text), and 4 for a draft model
    num_speculative_tokens: int | None = None
    draft_model: str | None = None  # for method=draft: a smaller model with the target's tokenizer
    self_draft_layers: int | None = None  # for method=self: the target's first layers that draft (None: half)
    ngram_max: int = 8  # for method=ngram: the longest suffix looked up in the prompt and output
    # ... and the shortest. A 1-token match's drafts were accepted 14-19% of the time on SmolLM2,
    # 2 tokens' 43%, 8 or more tokens' 88-92%: verifying 1-token matches cost more than they gave
    # (n-gram over none: 1.41-1.46x -> 1.53x input-grounded, 1.20-1.29x -> 1.27-1.33x open chat)
    ngram_min: int = 2
    # for method=ngram: earlier requests' answers kept for lookups beside a request's own text
    # (the latest this many tokens; 0: none). A repeated answer is drafted 16 tokens a step.
    ngram_history_tokens: int = 1 << 17
    speculative_max_batch: int = 4  # no speculation while more requests than this are decoding
    # A constrained request's next tokens that its grammar forces (a JSON key, a tool call's
    # opening) are drafted and verified in one step, with or without a method, at any batch size
    # (jump-forward decoding): they cost a verified row each instead of a step each.
    speculative_forced_tokens: bool = True
    # one more token's cost to a step, relative to a one-token step (None: timed at start); k per
    # request is chosen from it and the request's acceptance rate
    speculative_verify_cost: float | None = None

    def __post_init__(self) -> None:
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS}, got {self.speculative_method!r}"
            )
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 16 if self.speculative_method == "ngram" else 4
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method='draft' needs draft_model (--draft-model)")
        if self.draft_model and self.speculative_method != "draft":
            raise ValueError("draft_model is only used with speculative_method='draft'")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.ngram_history_tokens < 0:
            raise ValueError(f"ngram_history_tokens must be >= 0, got {self.ngram_history_tokens}")
        if self.speculative_verify_cost is not None and self.speculative_verify_cost < 0:
            raise ValueError(f"speculative_verify_cost must be >= 0, got {self.speculative_verify_cost}")
        if self.self_draft_layers is not None and self.self_draft_layers < 1:
            raise ValueError(f"self_draft_layers must be at least 1, got {self.self_draft_layers}")


@dataclass
class LoRAConfig:
    enable_lora: bool = False  # wrap the projections so requests can carry an adapter
    max_loras: int = 8  # distinct adapters running at once (a step's LoRA cost grows with their number)
    max_lora_rank: int = 64  # adapters of a higher rank are refused
    # adapters kept loaded in memory (least recently used evicted; reloaded from disk)
    max_cpu_loras: int = 32

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1 or self.max_cpu_loras < 1:
            raise ValueError("max_loras, max_lora_rank and max_cpu_loras must be at least 1")
        if self.max_cpu_loras <= self.max_loras:  # the running adapters and the next one in line
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must exceed max_loras ({self.max_loras})")


@dataclass
class ParallelConfig:
    # processes that each hold a slice of every layer (gloo on the CPU, NCCL on CUDA)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")


# LLM(speculative={"method": ..., "num_tokens": ...}): the dict's short keys -> SpeculativeConfig fields
_SPECULATIVE_KEYS = {"method": "speculative_method", "num_tokens": "num_speculative_tokens",
                     "model": "draft_model", "draft_model": "draft_model", "num_layers": "self_draft_layers",
                     "ngram_max": "ngram_max", "ngram_min": "ngram_min",
                     "history_tokens": "ngram_history_tokens", "max_batch": "speculative_max_batch",
                     "verify_cost": "speculative_verify_cost", "forced_tokens": "speculative_forced_tokens"}


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    SECTIONS = ("model", "cache", "scheduler", "speculative", "lora", "parallel")

    def __post_init__(self) -> None:
        max_num_seqs, max_num_batched_tokens = SCHEDULER_DEFAULTS[self.model.device]
        if self.scheduler.max_num_seqs is None:
            self.scheduler.max_num_seqs = max_num_seqs
        if self.scheduler.max_num_batched_tokens is None:
            self.scheduler.max_num_batched_tokens = max_num_batched_tokens

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Split flat keyword arguments (as `LLM(...)` takes them) into the section dataclasses.

        `speculative={"method": "ngram", "num_tokens": 4}` is the short form of the
        speculative_* fields."""
        for key, value in (kwargs.pop("speculative", None) or {}).items():
            if key not in _SPECULATIVE_KEYS:
                raise TypeError(f"unknown speculative option {key!r}; valid: {sorted(_SPECULATIVE_KEYS)}")
            kwargs[_SPECULATIVE_KEYS[key]] = value
        sections: dict[str, dict[str, Any]] = {name: {} for name in cls.SECTIONS}
        owner = {f.name: name for name, sec in _section_types().items() for f in dataclasses.fields(sec)}
        unknown = sorted(set(kwargs) - set(owner))
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(owner)}")
        for key, value in kwargs.items():
            sections[owner[key]][key] = value
        return cls(**{name: _section_types()[name](**sections[name]) for name in cls.SECTIONS})


def _section_types() -> dict[str, type]:
    return {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "speculative": SpeculativeConfig, "lora": LoRAConfig, "parallel": ParallelConfig}


def _read_chat_template(value: str) -> str:
    """A chat template's text from its file, or as given (vLLM's --chat-template takes both), checked
    to be Jinja that parses, so a bad one fails at start rather than at the first chat request."""
    import jinja2

    path = Path(value).expanduser() if len(value) < 4096 and "\n" not in value else None
    if path is not None and path.is_file():
        value = path.read_text()
    elif "{" not in value:
        raise ValueError(f"chat_template: no file {value!r}, and no Jinja template either")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat_template: line {error.lineno}: {error.message}") from None
    return value


def add_engine_args(parser: argparse.ArgumentParser, repeatable: tuple[str, ...] = ()) -> None:
    """One `--flag` per engine config field, typed from its annotation; the fields named in
    `repeatable` may be given several times (a list, None when not given)."""
    for section in _section_types().values():
        for f in dataclasses.fields(section):
            flag = "--" + f.name.replace("_", "-")
            kind = _scalar_type(f.type)
            default = f.default if f.default is not dataclasses.MISSING else None
            if f.name in repeatable:
                parser.add_argument(flag, type=kind, action="append", default=None,
                                    help=f"repeatable (default: {default})")
            elif kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
                if f.name.startswith("enable_"):  # --no-prefix-caching for --no-enable-prefix-caching
                    short = "--no-" + f.name.removeprefix("enable_").replace("_", "-")
                    parser.add_argument(short, dest=f.name, action="store_false")
            else:
                parser.add_argument(flag, type=kind, default=default)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    names = [f.name for sec in _section_types().values() for f in dataclasses.fields(sec)]
    return {name: getattr(args, name) for name in names}


def _scalar_type(annotation: Any) -> type:
    """'int | None' -> int (annotations are strings under `from __future__ import annotations`)."""
    if isinstance(annotation, str):
        first = annotation.split("|")[0].strip()
        return {"int": int, "float": float, "str": str, "bool": bool}[first]
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation
