"""HyperServe: fast LLM serving with an OpenAI-compatible API."""

from hyperserve.llm import LLM
from hyperserve.outputs import CompletionOutput, RequestOutput
from hyperserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
