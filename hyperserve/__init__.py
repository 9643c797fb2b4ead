"""HyperServe: fast LLM serving with an OpenAI-compatible API.

The names below load on first use, so that a module that needs none of them (the scheduler, the
benchmark client) does not import PyTorch with the package."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyperserve.beam_search import BeamSearchParams
    from hyperserve.layers.lora import LoRARequest
    from hyperserve.llm import LLM
    from hyperserve.outputs import CompletionOutput, RequestOutput
    from hyperserve.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputs"]
_MODULES = {"LLM": "hyperserve.llm", "BeamSearchParams": "hyperserve.beam_search",
            "CompletionOutput": "hyperserve.outputs", "LoRARequest": "hyperserve.layers.lora",
            "RequestOutput": "hyperserve.outputs", "SamplingParams": "hyperserve.sampling_params",
            "StructuredOutputs": "hyperserve.sampling_params"}
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'hyperserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES[name]), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value
