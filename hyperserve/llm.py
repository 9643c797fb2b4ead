"""LLM: the offline API, named as in vLLM (generate, chat)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from hyperserve.beam_search import BeamSearch, BeamSearchParams, candidates_of
from hyperserve.engine.engine import LLMEngine
from hyperserve.layers.lora import LoRARequest
from hyperserve.outputs import RequestOutput
from hyperserve.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Load a model once, then run batches of prompts through continuous batching.

    Engine options (dtype, device, block_size, num_kv_blocks, kv_cache_memory_gb, max_num_seqs,
    max_num_batched_tokens, max_model_len, seed, load_format) are keyword arguments.
    """

    def __init__(self, model: str = "smollm2-135m", **engine_options) -> None:
        self.engine = LLMEngine.from_kwargs(model=model, **engine_options)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); they also stop at exit."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A prompt is text or a list of token ids.
        `lora_request`: one adapter for every prompt, or one per prompt (None: the base model);
        the engine needs enable_lora=True."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        # Validate everything before queueing anything, so a bad prompt leaves the engine untouched.
        request_ids = [str(next(self._ids)) for _ in prompts]
        added = []
        try:
            for request_id, prompt, p, lora in zip(request_ids, prompts, params_list, loras):
                self.engine.add_request(request_id, prompt, p, lora_request=lora, final_only=True)
                added.append(request_id)
        except ValueError:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Each prompt's beam_width best answers by beam search (hyperserve/beam_search.py), best
        first, as one finished RequestOutput each; each round runs every prompt's beams in one batch."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        searches = [BeamSearch(self.engine.inputs.process_prompt(prompt)[1], params,
                               frozenset(self.engine.eos_token_ids)) for prompt in prompts]
        step = params.step_params()
        with tqdm(total=params.max_tokens, desc="Beam search", unit="token", disable=not use_tqdm) as bar:
            while active := [s for s in searches if not s.done]:
                round_prompts = [p for s in active for p in s.round_prompts()]
                outputs = iter(self.generate(round_prompts, step, use_tqdm=False, lora_request=lora_request))
                for search in active:
                    search.advance([candidates_of(next(outputs)) for _ in search.live])
                bar.update(1)
        return [s.output(str(next(self._ids)), self.tokenizer) for s in searches]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def pin_prefix(self, prompt: Prompt, ttl_s: float) -> tuple[str, int]:
        """Cache a prompt's KV (a document, a system prompt) for `ttl_s` seconds, safe from
        eviction; returns (pin id, number of tokens pinned). Later prompts starting with it skip
        that much prefill."""
        pin_id = f"pin-{next(self._ids)}"
        self.engine.pin_prefix(pin_id, prompt, ttl_s)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return pin_id, self.engine.kv_cache.pins[pin_id].num_tokens

    def unpin_prefix(self, pin_id: str) -> bool:
        return self.engine.unpin_prefix(pin_id)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        return self.engine.apply_chat_template(messages)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]
