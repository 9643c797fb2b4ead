"""HyperServe: fast LLM serving with an OpenAI-compatible API."""

from hyperserve.layers.lora import LoRARequest
from hyperserve.llm import LLM
from hyperserve.outputs import CompletionOutput, RequestOutput
from hyperserve.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutputs"]
__version__ = "0.1.0"
