"""LLMEngine: the step loop and the streaming interface (add_request, step, abort_request).

    step():  schedule -> run the model (prepare inputs, forward, sample) -> update -> emit -> propose

With speculative decoding on, "propose" drafts tokens for the decoding requests and the next
step's forward pass verifies them beside everything else.

A step that fails after scheduling fails only the requests it ran: they finish with
finish_reason "error", their KV blocks go back to the pool, and every other request goes on.
Failures the engine cannot outlive (device errors, out of memory, or several steps failing in a
row) raise EngineDeadError instead.

Each call to `step` runs one forward pass over every scheduled token and returns a RequestOutput
for each request that made visible progress. A request with n > 1 runs as n sequences that share
its id as `parent_id`; its RequestOutput carries all n completions.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hyperserve.config import EngineConfig
from hyperserve.distributed.group import TensorParallel
from hyperserve.distributed.workers import TensorParallelWorkers
from hyperserve.engine.detokenizer import IncrementalDetokenizer
from hyperserve.engine.disk_cache import DiskKVStore, DiskTier
from hyperserve.engine.input_processor import InputProcessor
from hyperserve.engine.kv_cache_manager import KVCacheManager, tenant_salt
from hyperserve.engine.kv_transfer import KVTransfer
from hyperserve.engine.lora_manager import LoRAManager
from hyperserve.engine.memory import kv_groups, num_kv_blocks, return_freed_heap
from hyperserve.engine.model_runner import ModelRunner, StepResult
from hyperserve.engine.request import Prediction, Request, RequestStatus
from hyperserve.engine.sampler import SamplerOutput
from hyperserve.engine.scheduler import Scheduler, SchedulerOutput
from hyperserve.engine.speculative import Speculator, build_proposer
from hyperserve.engine.structured_output import GrammarCompiler
from hyperserve.layers.lora import LoRARequest
from hyperserve.layers.rotary import rope_position_limit
from hyperserve.models import loader
from hyperserve.models.llama import LlamaForCausalLM
from hyperserve.models.registry import resolve_model
from hyperserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from hyperserve.sampling_params import SamplingParams

MAX_FAILED_STEPS = 3  # steps failing in a row after which the engine is taken to be broken

logger = logging.getLogger("hyperserve.engine")


class PinLimitError(ValueError):
    """A prefix pin would take more of the KV pool than pins may hold (`max_pinned_fraction`)."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable  # it would fit once other pins expire or are released


class EngineDeadError(RuntimeError):
    """The engine cannot go on (a device error, out of memory, repeated failures): restart it."""


@dataclass
class _Group:
    """The n sequences of one user request."""

    prompt: str | None
    samples: list[Request]
    final_only: bool = False  # its output is built once, when it finishes (offline batches)

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.samples)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = resolve_model(config.model.model)
        self.hf_config = loader.load_config(source)
        self.max_model_len = _max_model_len(config.model.max_model_len, self.hf_config)
        self.source = source
        self.workers = None
        if config.parallel.tensor_parallel_size > 1:
            _check_tensor_parallel(config, self.hf_config)
            self.workers = TensorParallelWorkers(config)
        # the tokenizer before the weights, not beside them: on 2 cores Gemma 3's took 2.6-2.8 s
        # together, against 2.5-2.6 one after the other, and started the server no sooner
        self.tokenizer = loader.load_tokenizer(source, config.model.chat_template)
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _min_idle_cached(self, num_blocks: int, tokens: int | None = None) -> int | None:
        """The CPU's default pool, written on demand up to its 4 GB cap, keeps at least the blocks of
        `tokens` (one full context by default; a sliding-window group: the most one sequence holds)
        idle in the prefix cache, at most a quarter of the pool (a 128k context would be all of it),
        and more only as the running requests once needed (BlockPool); a pool sized by the user, or
        on a GPU (allocated whole), caches until full."""
        cache = self.config.cache
        sized = cache.num_kv_blocks is not None or cache.kv_cache_memory_gb is not None
        if self.config.model.device != "cpu" or sized:
            return None
        return min(-(-(tokens or self.max_model_len) // cache.block_size), num_blocks // 4)

    def _build(self, config: EngineConfig) -> None:
        source = self.source
        model = loader.load_model(config, self.workers.group if self.workers is not None else None,
                                  resolved=(source, self.hf_config))
        num_blocks = num_kv_blocks(model, self.config, self.hf_config, self.max_model_len)
        num_blocks, window, num_window_blocks = kv_groups(model, self.config, num_blocks,
                                                          self._disk_tier_enabled())
        if num_blocks * config.cache.block_size < self.max_model_len:
            raise ValueError(
                f"the KV pool ({num_blocks} blocks of {config.cache.block_size} tokens) cannot hold one "
                f"sequence of max_model_len={self.max_model_len} tokens: raise num_kv_blocks or "
                "kv_cache_memory_gb, or lower max_model_len")
        if self.workers is not None:
            self.workers.start(num_blocks, num_window_blocks)
        # before the runner, which looks through the LoRA wrappers for its fused int4 decode
        self.lora = LoRAManager.of(model, config.lora)
        self.eos_token_ids = loader.load_eos_token_ids(source, self.hf_config, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size,
                                        self._grammar_eos_token_id())
        self.inputs = InputProcessor(self.tokenizer, self.hf_config.vocab_size, self.max_model_len,
                                     self.grammars)
        self.runner = ModelRunner(model, config, num_blocks, self.grammars, self.lora, num_window_blocks,
                                  self.workers)
        cache = config.cache
        floors = [self._min_idle_cached(num_blocks)]
        if num_window_blocks is not None:  # Gemma 3's windowed group: each sequence holds 1 / max_num_seqs
            per_sequence = num_window_blocks // config.scheduler.max_num_seqs
            floors.append(self._min_idle_cached(num_window_blocks, per_sequence * cache.block_size))
        self.kv_cache = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                       self._disk_tier(), cache.max_pinned_fraction, window,
                                       num_window_blocks, floors)
        if self.kv_cache.lower_tier is not None:
            self.kv_cache.pool.on_evict = self.kv_cache.lower_tier.spill
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len,
                                   config.lora.max_loras if config.lora.enable_lora else None,
                                   self.lora.prefetch if self.lora is not None else None)
        spec = config.speculative
        draft = self._load_draft(spec.draft_model) if spec.speculative_method == "draft" else None
        verify_cost = spec.speculative_verify_cost
        if verify_cost is None and spec.speculative_method:
            verify_cost = self.runner.verify_row_cost()
        proposer = (build_proposer(spec, self.runner, self.kv_cache, draft, verify_cost)
                    if spec.speculative_method else None)
        self.speculator = Speculator(spec, proposer, verify_cost, self.kv_cache, self.max_model_len)
        self._groups: dict[str, _Group] = {}
        self.kv_transfer = KVTransfer(self.kv_cache, self.runner)
        return_freed_heap()
        self._num_failed_steps = 0

    @classmethod
    def from_kwargs(cls, **kwargs) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        if self.workers is not None:
            self.workers.close()

    # ---- the step loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        try:
            outputs = self._run(out)
        except Exception as error:
            self._num_failed_steps += 1
            # under tensor parallelism a failed step may leave the ranks out of step
            if _is_fatal(error) or self._num_failed_steps >= MAX_FAILED_STEPS or self.workers is not None:
                raise EngineDeadError(
                    f"the engine cannot continue: {type(error).__name__}: {error}") from error
            logger.exception("a step failed; failing its %d request(s)", len(out.requests))
            outputs = self._fail({_group_id(r) for r in out.requests}, f"{type(error).__name__}: {error}")
        else:
            self._num_failed_steps = 0
        self.runner.release(self.scheduler.take_finished_ids())
        return outputs

    def _run(self, out: SchedulerOutput) -> list[RequestOutput]:
        now = time.time()
        for request in out.requests:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        num_before = {r.request_id: r.num_output_tokens for r in out.requests}
        result = self.runner.execute(out, self.kv_cache)
        updated = self.scheduler.update_from_output(out, result.token_ids_by_request())
        self._process_outputs(updated, result, num_before)
        self.speculator.propose(self.scheduler.running)
        groups = dict.fromkeys(_group_id(r) for r in updated)
        return self._emit(g for g in groups if not self._groups[g].final_only or self._groups[g].finished)

    # ---- the streaming interface ---------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        final_only: bool = False,
        cache_salt: str = "",
    ) -> None:
        """Queue a request (with an adapter: `lora_request`); raises ValueError (and changes
        nothing) if it cannot be served. `final_only`: step() returns its output only once it
        has finished, as offline batches want (building every step's outputs costs host time).
        `cache_salt`: its tenant; it shares prefix-cached KV and n-gram drafts from earlier
        answers only with requests of the same salt."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self.inputs.process_prompt(prompt)
        self.inputs.check_params(params)
        predicted = self.inputs.prediction_ids(params.prediction)
        salt = (self.check_lora(lora_request) if lora_request is not None else b"") + tenant_salt(cache_salt)
        arrival_time = time.time() if arrival_time is None else arrival_time
        samples = []
        for index in range(params.n):
            sample_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(
                request_id=sample_id,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                arrival_time=arrival_time,
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                parent_id=request_id,
                index=index,
                seed=None if params.seed is None else params.seed + index,
                lora_request=lora_request,
                cache_salt=salt,
                scope=cache_salt,
            )
            if params.structured_outputs is not None:
                request.grammar = self.grammars.grammar(params.structured_outputs)
            if predicted:
                request.prediction = Prediction(predicted)
            if self.tokenizer is not None:
                request.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, prompt_ids, params.stop,
                    params.include_stop_str_in_output, params.skip_special_tokens,
                )
            if index > 0 and self.kv_cache.enable_prefix_caching:
                request.wait_for = samples[0]
            samples.append(request)
        self._groups[request_id] = _Group(prompt_text, samples, final_only)
        for request in samples:
            self.scheduler.add_request(request)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None,
                            continue_final_message: bool = False) -> list[int]:
        """Token ids of a conversation (and the tools offered, for templates that render them)
        through the model's own chat template, given the template's own variables too (Qwen3's
        enable_thinking, say); ValueError if the model has none or the conversation does not fit
        it (roles out of order, say). `continue_final_message`: the last message is left open, for
        the answer to go on with it."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False, continue_final_message=continue_final_message, **(template_kwargs or {}))
        except Exception as error:  # jinja raises its own types for template errors
            raise ValueError(f"cannot apply the chat template: {error}") from error
        return list(ids)

    def pin_prefix(self, request_id: str, prompt: str | list[int], ttl_s: float,
                   cache_salt: str = "") -> None:
        """Compute a prompt's KV and keep it cached for `ttl_s` seconds, safe from eviction, for
        requests of the same `cache_salt`.

        Runs as a one-token request; once it finishes, `kv_cache.pins[request_id]` holds the
        pinned blocks (full blocks only: at most block_size - 1 trailing tokens are not pinned)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl must be positive, got {ttl_s}")
        if not self.kv_cache.enable_prefix_caching:
            raise ValueError("pinning needs prefix caching, which is disabled")
        if request_id in self.kv_cache.pins:
            raise ValueError(f"pin id {request_id!r} is already in use")
        num_blocks = len(self.inputs.process_prompt(prompt)[1]) // self.kv_cache.block_size
        cap = self.kv_cache.max_pinned_blocks
        if num_blocks > cap - self.kv_cache.num_pinned_blocks:
            raise PinLimitError(
                f"pinning this prefix needs {num_blocks} KV blocks; pins may hold {cap} of the pool's "
                f"{self.kv_cache.pool.num_blocks} (max_pinned_fraction) and "
                f"{self.kv_cache.num_pinned_blocks} are held", retryable=num_blocks <= cap)
        params = SamplingParams(max_tokens=1, temperature=0)
        self.add_request(request_id, prompt, params, cache_salt=cache_salt)
        self._groups[request_id].samples[0].pin_until = time.time() + ttl_s

    def unpin_prefix(self, request_id: str) -> bool:
        return self.kv_cache.unpin(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request in any state; its KV blocks return to the pool at once."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        for request in group.samples:
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
                request.metrics.finished_time = time.time()
        self.runner.release(self.scheduler.take_finished_ids())
        return self._emit([request_id])[0]

    def _fail(self, group_ids: set[str], error: str) -> list[RequestOutput]:
        """Finish every sample of these requests with finish_reason "error", freeing their blocks."""
        outputs = []
        for group_id in group_ids:
            group = self._groups.pop(group_id)
            for request in group.samples:
                if not request.is_finished:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
                request.metrics.finished_time = time.time()
            first = group.samples[0]
            completions = [CompletionOutput(r.index, "", list(r.output_token_ids), r.finish_reason)
                           for r in group.samples]
            outputs.append(RequestOutput(group_id, group.prompt, first.prompt_token_ids, completions, True,
                                         first.metrics, error=error))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def memory_bytes(self) -> int:
        """What this engine holds at most: its weights and its KV pool at full size (on the CPU the
        pool is touched only as it fills)."""
        return self.weight_bytes() + self.kv_pool_bytes()

    def weight_bytes(self) -> int:
        """Every tensor of the model once (packed and memory-mapped ones included)."""
        model = self.runner.model
        tensors = [*model.parameters(), *model.buffers(),
                   *(v for module in model.modules() for v in vars(module).values()
                     if isinstance(v, torch.Tensor))]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if t.device.type != "meta"}
        return sum(storages.values())

    def kv_pool_bytes(self) -> int:
        return sum(t.nbytes for cache in self.runner.kv_caches
                   for t in (cache.key, cache.value, cache.key_scale, cache.value_scale) if t is not None)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- internals -------------------------------------------------------------------------

    def _process_outputs(self, updated: list[Request], result: StepResult,
                         num_before: dict[str, int]) -> None:
        now = time.time()
        for chunk in result.prompt_logprobs:
            request, num = chunk.request, chunk.request.sampling_params.prompt_logprobs
            for i in range(len(chunk.output.token_ids)):
                # not yet known (a recomputed prompt's are)
                if chunk.position + i == len(request.prompt_logprobs):
                    request.prompt_logprobs.append(self._logprobs(chunk.output, i, num))
        first_row, row = {}, 0
        for request, tokens in zip(result.requests, result.token_ids):
            first_row[request.request_id] = row
            row += len(tokens)
        for request in updated:
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            start = num_before[request.request_id]
            for i, token_id in enumerate(request.output_token_ids[start:]):
                if request.logprobs is not None:
                    request.logprobs.append(self._logprobs(result.logprobs, first_row[request.request_id] + i,
                                                           request.sampling_params.logprobs or 0))
                if request.detokenizer is None or request.is_stop_token(token_id):
                    continue
                # a stop string before min_tokens does not count
                past_min = start + i + 1 >= request.sampling_params.min_tokens
                if request.detokenizer.add_token(token_id, check_stop=past_min):  # does not end the answer
                    request.discard_output_after(start + i + 1)  # drafts accepted past the stop string
                    if not request.is_finished:
                        request.stop_reason = request.detokenizer.stop_reason
                        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    break
            if request.is_finished:
                request.metrics.finished_time = now
                self.speculator.finished(request)

    def _logprobs(self, out: SamplerOutput, row: int, num: int) -> dict[int, Logprob]:
        """Row `row`'s token and the top `num` of its row, each with its log-probability and rank."""
        token_id = int(out.token_ids[row])
        entries = {token_id: (float(out.sampled_logprobs[row]), int(out.sampled_ranks[row]))}
        top_ids = out.top_token_ids[row, :num].tolist()
        top_values = out.top_logprobs[row, :num].tolist()
        for rank, (tid, value) in enumerate(zip(top_ids, top_values), start=1):
            entries.setdefault(tid, (value, rank))
        return {tid: Logprob(value, rank, self._decode_token(tid)) for tid, (value, rank) in entries.items()}

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def _emit(self, group_ids) -> list[RequestOutput]:
        """The requests' outputs; finished ones are forgotten only once every output is built,
        so a failure while building leaves each request for `_fail` to finish."""
        outputs = [self._group_output(group_id) for group_id in group_ids]
        for output in outputs:
            if output.finished:
                del self._groups[output.request_id]
        return outputs

    def _group_output(self, group_id: str) -> RequestOutput:
        group = self._groups[group_id]
        finished = group.finished
        first = group.samples[0]
        completions = [
            CompletionOutput(
                index=r.index,
                text=r.detokenizer.output_text(r.is_finished) if r.detokenizer else "",
                token_ids=list(r.output_token_ids),
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                logprobs=list(r.logprobs) if r.logprobs is not None else None,
            )
            for r in group.samples
        ]
        metrics = first.metrics
        if len(group.samples) > 1:  # the group's first token and last finish
            metrics = _merge_metrics([r.metrics for r in group.samples])
        prompt_logprobs = list(first.prompt_logprobs) if first.prompt_logprobs is not None else None
        return RequestOutput(group_id, group.prompt, first.prompt_token_ids, completions, finished, metrics,
                             prompt_logprobs=prompt_logprobs)

    def check_lora(self, lora_request: LoRARequest) -> bytes:
        """Load the adapter now (ValueError if it is unusable); its prefix-cache salt."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)")
        return self.lora.check(lora_request)

    def forget_lora(self, lora_request: LoRARequest) -> None:
        """The adapter is no longer served: its memory goes once its running requests end."""
        if self.lora is not None:
            self.lora.forget(lora_request)

    def _grammar_eos_token_id(self) -> int | None:
        """The end token grammars allow once complete: the tokenizer's own EOS if it ends generation."""
        own = None if self.tokenizer is None else self.tokenizer.eos_token_id
        if own in self.eos_token_ids or not self.eos_token_ids:
            return own
        return min(self.eos_token_ids)

    @functools.cached_property
    def kv_identity(self) -> str:
        """What this engine's KV depends on (weights, dtypes, quantization, block size): blocks of
        another engine with the same identity are interchangeable with its own."""
        cache, model = self.config.cache, self.config.model
        return loader.model_identity(
            self.source, self.hf_config, model.load_format,
            model.seed if model.load_format == "random" else None, model.torch_dtype, model.quantization,
            cache.kv_cache_dtype, cache.block_size)

    def _disk_tier_enabled(self) -> bool:
        return self.config.cache.disk_cache_dir is not None and self.config.cache.enable_prefix_caching

    def _disk_tier(self) -> DiskTier | None:
        if not self._disk_tier_enabled():
            return None
        cache, model = self.config.cache, self.config.model
        namespace = f"{Path(model.model).name}-{self.kv_identity[:32]}"
        store = DiskKVStore(cache.disk_cache_dir, namespace, int(cache.disk_cache_gb * 2**30))
        return DiskTier(store, self.runner.read_block, self.runner.write_block)

    def _load_draft(self, name: str) -> LlamaForCausalLM:
        """A draft model for speculative decoding: it must share the target's tokenizer."""
        source = resolve_model(name)
        config = loader.load_config(source)
        draft_tokenizer = loader.load_tokenizer(source)
        same_vocab = config.vocab_size == self.hf_config.vocab_size and (
            draft_tokenizer is None or self.tokenizer is None
            or draft_tokenizer.get_vocab() == self.tokenizer.get_vocab()
        )
        if not same_vocab:
            raise ValueError(f"draft model {name!r} does not share the target model's tokenizer")
        return loader.load_model(self.config, max_position=self.max_model_len, seed_offset=1,
                                 resolved=(source, config))


def _max_model_len(asked: int | None, hf_config) -> int:
    """The context: as asked, else the config's, within what its rope table is right for."""
    limit = rope_position_limit(hf_config)
    if asked is not None and limit is not None and asked > limit:
        raise ValueError(f"max_model_len {asked} exceeds {limit}, the positions this model's LongRoPE runs "
                         "here (its short factors: the long ones rotate every position differently once "
                         f"a sequence is longer); start with max_model_len {limit} or less")
    if asked is not None:
        return asked
    if limit is not None and limit < hf_config.max_position_embeddings:
        logger.info("max_model_len %d: this model's LongRoPE runs here up to its "
                    "original_max_position_embeddings", limit)
        return limit
    return hf_config.max_position_embeddings


def _check_tensor_parallel(config: EngineConfig, hf_config) -> None:
    """What tensor parallelism cannot split or does not run with yet, refused before any process starts."""
    size = config.parallel.tensor_parallel_size
    # refuses more ranks than K/V heads
    TensorParallel(0, size).head_slice(hf_config.num_attention_heads, hf_config.num_key_value_heads)
    cache = config.cache
    if config.model.device == "cuda" and cache.num_kv_blocks is None and cache.kv_cache_memory_gb is None:
        # the step that measures what gpu_memory_utilization leaves runs on rank 0 alone, and its
        # all-reduces would wait for the other ranks until their timeout
        raise ValueError("tensor parallelism on CUDA sizes each rank's KV pool from kv_cache_memory_gb "
                         "(per rank) or num_kv_blocks for now, not from gpu_memory_utilization: give one")
    if config.model.device == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs as many GPUs; "
                         f"this machine has {torch.cuda.device_count()}")


def _is_fatal(error: Exception) -> bool:
    """Errors after which the device or the process is not to be trusted with more work."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "device-side assert"))


def _group_id(request: Request) -> str:
    return request.parent_id or request.request_id


def _merge_metrics(all_metrics: list[RequestMetrics]) -> RequestMetrics:
    first = all_metrics[0]
    token_times = [m.first_token_time for m in all_metrics if m.first_token_time is not None]
    finish_times = [m.finished_time for m in all_metrics if m.finished_time is not None]
    return replace(
        first,
        first_token_time=min(token_times) if token_times else None,
        finished_time=max(finish_times) if len(finish_times) == len(all_metrics) else None,
        **{name: sum(getattr(m, name) for m in all_metrics)
           for name in ("num_preemptions", "num_draft_tokens", "num_accepted_tokens", "num_prediction_tokens",
                        "num_accepted_prediction_tokens")},
    )


