"""ModelRunner: SchedulerOutput -> flat input tensors and attention metadata -> forward -> sample.

Owns the model and the KV cache tensors. Logits are computed
only for the rows that are sampled: the last new token of each request that reaches its end, and
with speculation also the rows of its draft tokens, which are verified against them.

For int4, int8 and mxfp4 models on the CPU, steps run the fused native decoder layers (layers/fused_decode.py,
which says which steps: every step on AVX2-only CPUs, those of up to a few hundred tokens
elsewhere): one call per layer, every token a row with its own slot, block table, context length
and LoRA adapter (the PyTorch layers' projections add each row's adapter delta too:
layers/lora.py). Otherwise, with `compile`, steps that only decode (one new token per sequence,
the common step of continuous batching) run a torch.compile'd forward: elementwise ops fuse and
most per-op Python goes away, which at one token per step is as much time as the matmuls. Its
decodes attend as one group over block tables at least two blocks wide, so the graphs differ only
by batch size; three are compiled at start (one sequence, two, and more than QUANTIZED_MAX_ROWS).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from hyperserve.config import EngineConfig
from hyperserve.distributed.workers import Forward, TensorParallelWorkers
from hyperserve.engine.cuda_graphs import DecodeGraphs
from hyperserve.engine.kv_cache_manager import KVCacheManager
from hyperserve.engine.lora_manager import LoRAManager
from hyperserve.engine.rejection_sampler import verify_greedy, verify_sampled
from hyperserve.engine.request import Request
from hyperserve.engine.sampler import SamplerOutput, SamplingBatch, gather_logprobs, sample, sampling_probs
from hyperserve.engine.sampling_batch import SamplingBatchBuilder
from hyperserve.engine.scheduler import SchedulerOutput
from hyperserve.engine.structured_output import GrammarCompiler
from hyperserve.layers.attention import (
    FLASH_PREFILL_TOKENS,
    AttentionBackend,
    AttentionMetadata,
    DecodeGroup,
    KVCache,
    PrefillBatch,
    PrefillSpan,
    allowed_keys,
    padded_block_tables,
)
from hyperserve.layers.fused_decode import DecodeRows, FusedDecode
from hyperserve.layers.lora import LoRARequest
from hyperserve.layers.quantization import QUANTIZED_MAX_ROWS
from hyperserve.models.llama import LlamaForCausalLM, kv_layout

CAPTURE_GRAPHS = "capture_graphs"  # rank 0's word to the other ranks: capture with me now
HEADS_DIM = 3  # of read_blocks' tensors: [blocks, layers, block_size, K/V heads, ...]

# Decodes whose context lengths differ by more than this factor attend in separate batches.
DECODE_GROUP_SPREAD = 1.25
MIN_DECODE_GROUP = 8
VERIFY_TIMING_CONTEXT = 256  # tokens of context behind the steps verify_row_cost times

logger = logging.getLogger("hyperserve.runner")


@dataclass(slots=True)
class SeqChunk:
    """Tokens of one sequence to compute this pass, at positions start, start + 1, ..."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int  # logits are wanted for this many of its last tokens (0: none)
    lora: LoRARequest | None = None  # the adapter its tokens run with
    window_block_table: list[int] | None = None  # the windowed layers' own table, where they have one


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logit_rows: torch.Tensor  # [S] rows whose logits are computed


SCORED_ROWS = 32  # prompt rows whose log-probabilities are taken at once (SamplingParams.prompt_logprobs)


@dataclass(slots=True)
class PromptLogprobs:
    """SamplingParams.prompt_logprobs of a prefill chunk: rows of the prompt's tokens from `position` on."""

    request: Request
    position: int
    output: SamplerOutput


@dataclass(slots=True)
class StepResult:
    requests: list[Request]  # those that received tokens, in order
    token_ids: list[list[int]]  # the tokens each received: one, or with speculation up to k + 1
    logprobs: SamplerOutput | None  # one row per received token, in the same order; None: not asked for
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)

    def token_ids_by_request(self) -> dict[str, list[int]]:
        return {r.request_id: t for r, t in zip(self.requests, self.token_ids)}


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, num_blocks: int,
                 grammars: GrammarCompiler | None = None, lora: LoRAManager | None = None,
                 num_window_blocks: int | None = None, workers: TensorParallelWorkers | None = None) -> None:
        """num_window_blocks: the pool of the sliding-window layers where they have their own
        (KVCacheManager's second group); None: every layer's KV lives in num_blocks blocks.
        workers: under tensor parallelism, rank 0's handle on the other ranks, which run every
        forward pass of the model with it."""
        self.model = model
        self.workers = workers
        self.grammars = grammars
        self.lora = lora
        self.device = torch.device(config.model.device)
        self.dtype = config.model.torch_dtype
        self.block_size = config.cache.block_size
        self.kv_cache_dtype = config.cache.kv_cache_dtype
        self.num_blocks = num_blocks
        self.num_window_blocks = num_window_blocks
        self.padding_slot = num_blocks * self.block_size  # the first slot of one block past the pool's
        self.vocab_size = model.config.vocab_size
        self.max_model_len = config.model.max_model_len or model.config.max_position_embeddings
        self.kv_caches = self.allocate_kv_caches(model.config, model.window_layers,
                                                 model.model.layers[0].self_attn.num_kv_heads)
        # scores SDPA cannot take (Gemma 2's caps, GPT-OSS's sinks): prompts never take its flash path
        self.plain_scores = any(layer.self_attn.softcap or layer.self_attn.sinks is not None
                                for layer in model.model.layers)
        self.shared_generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self.sampling = SamplingBatchBuilder(self.vocab_size, self.device)
        self._compiled_decode = None
        self.decode_graphs = None
        self.fused_decode = self._fused_decode(config)
        if config.model.compile and model.has_experts:
            logger.info("compile skipped: a mixture of experts picks each step's experts on the host")
        elif config.model.compile and self.fused_decode is None:
            self._compiled_decode = torch.compile(self._decode_logits, dynamic=False)
            if model.tp.rank == 0:  # the other ranks compile as rank 0's warm-up passes reach them
                self._compile_decode_graphs()
        # the graphs take one kind of attention metadata, and no host work within the step
        if (self.device.type == "cuda" and not config.model.enforce_eager
                and model.attention_backend.ragged_decode and not model.interleaves_full_attention
                and not model.has_experts):
            max_blocks = -(-self.max_model_len // self.block_size)
            self.decode_graphs = DecodeGraphs(self._decode_logits, config.scheduler.max_num_seqs, max_blocks,
                                              self.block_size, self.padding_slot, model.sliding_window,
                                              self.device)
            if model.tp.rank == 0:  # the other ranks capture when rank 0 does (capture_graphs)
                self.capture_graphs()

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the decode graphs. Under tensor parallelism every rank captures at once (rank 0
        tells the others first): NCCL takes a captured collective as a property of all its ranks,
        and each must replay the graph of that same capture, so no rank routes batches to larger
        graphs by its own timings."""
        if self.workers is not None:
            self.workers.send(CAPTURE_GRAPHS)
        self.decode_graphs.capture(route=self.model.tp.size == 1)

    def _fused_decode(self, config: EngineConfig) -> FusedDecode | None:
        """The native one-call-per-layer decode for int4, int8 and mxfp4 models on the CPU, where it
        applies."""
        if self.device.type != "cpu" or config.model.quantization not in ("int4", "int8", "mxfp4"):
            return None
        reason = FusedDecode.unsupported(self.model, self.kv_caches)
        if reason is not None:
            logger.info("decode steps run layer by layer in PyTorch: %s", reason)
            return None
        if config.model.compile:
            logger.info("compile skipped: decode steps run the fused native layers, which are faster")
        return FusedDecode(self.model)

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
                       ) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, attn))

    @torch.inference_mode()
    def _compile_decode_graphs(self) -> None:
        """Compile every decode graph now rather than on the first requests: one sequence, a few,
        and more than quantized decode kernels take. The dummy tokens write into block 0 of the
        still-empty pool."""
        started = time.perf_counter()
        logger.info("compiling the decode step (torch.compile; cached on disk for later starts)")
        for batch in (1, 2, QUANTIZED_MAX_ROWS + 1):
            self.forward([SeqChunk([0], 0, [0], num_logits=1)] * batch)
        logger.info("decode step compiled in %.1f s", time.perf_counter() - started)

    @torch.inference_mode()
    def verify_row_cost(self, rows: int = 5, repeats: int = 10) -> float:
        """What one more token in a sequence's step costs, relative to a one-token step, timed here:
        on a CPU whose matrix kernels do integer work per row it is about 0.2-0.6, on a GPU or a
        bandwidth-bound CPU far less, and speculation pays only below the acceptance it implies.
        The steps are timed after VERIFY_TIMING_CONTEXT tokens of context, since each extra row
        attends to it too (timed at the start of a sequence, n-gram speculation slowed open chat on
        an AVX2-only CPU by 6%)."""
        pool_blocks = min(self.num_blocks, self.num_window_blocks or self.num_blocks)  # the smaller pool
        most = min(VERIFY_TIMING_CONTEXT, (pool_blocks - 1) * self.block_size, self.max_model_len)
        context = max(0, most - rows)
        one = self.time_step(1, context, repeats)
        cost = max(0.0, (self.time_step(rows, context, repeats) - one) / (rows - 1) / one)
        logger.info("speculative decoding: one more token costs a step %.2f of a one-token step", cost)
        return cost

    def time_step(self, num_tokens: int, context: int, repeats: int = 10) -> float:
        """Seconds of the fastest of `repeats` forward passes (after a warm-up) of one sequence's
        `num_tokens` tokens after `context` tokens. They write the first blocks of the pool, which
        must still be empty, as the compile warm-up does."""
        end = context + num_tokens
        chunk = SeqChunk([0] * num_tokens, context, list(range(-(-end // self.block_size))), num_tokens)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            self.forward([chunk])
            times.append(time.perf_counter() - started)
        return min(times[1:])

    def allocate_kv_caches(self, hf_config, window_layers: list[bool] | None = None,
                           num_kv_heads: int | None = None) -> list[KVCache]:
        """One KVCache per layer of a model of this config (of num_kv_heads heads, by default all
        its own; fewer on a tensor-parallel rank): its pool's blocks and one more, which padding
        rows of CUDA graph batches write into (and dropped window entries point at)."""
        def num_blocks(layer: int) -> int:
            windowed = (self.num_window_blocks is not None and window_layers is not None
                        and window_layers[layer])
            return self.num_window_blocks if windowed else self.num_blocks

        heads, width, shared = kv_layout(hf_config)
        return [KVCache.allocate(num_blocks(layer) + 1, self.block_size, num_kv_heads or heads, width,
                                 self.dtype, self.kv_cache_dtype, self.device, shared)
                for layer in range(hf_config.num_hidden_layers)]

    def read_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """Every layer's K and V (and scales) of these blocks, of all the model's K/V heads (under
        tensor parallelism gathered from every rank): [blocks, layers, block_size, heads, ...]."""
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        per_layer = [cache.read_blocks(blocks) for cache in self.kv_caches]
        local = {name: torch.stack([layer[name] for layer in per_layer], dim=1) for name in per_layer[0]}
        if self.workers is None:
            return local
        parts = [local, *self.workers.read_blocks(block_ids)]
        whole = {}
        for name, tensor in local.items():
            shape = list(tensor.shape)
            shape[HEADS_DIM] = self.model.config.num_key_value_heads
            whole[name] = tensor.new_empty(shape)
            for (start, end), part in zip(self._kv_head_ranges, parts):
                whole[name].narrow(HEADS_DIM, start, end - start).copy_(part[name])
        return whole

    def write_blocks(self, block_ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Fill these blocks from tensors as read_blocks gives them (each rank its heads): two
        copies per layer, whatever the number of blocks (one by one stalled a step by tens of ms)."""
        if self.workers is not None:
            parts = [{name: t.narrow(HEADS_DIM, start, end - start) for name, t in tensors.items()}
                     for start, end in self._kv_head_ranges]
            tensors = parts[0]
            self._write_local(block_ids, tensors)  # first: a block that does not fit fails here alone
            self.workers.write_blocks(block_ids, parts[1:])
            return
        self._write_local(block_ids, tensors)

    def _write_local(self, block_ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            cache.write_blocks(blocks, {name: t[:, layer] for name, t in tensors.items()})

    @functools.cached_property
    def _kv_head_ranges(self) -> list[tuple[int, int]]:
        config = self.model.config
        return self.model.tp.kv_head_ranges(config.num_attention_heads, config.num_key_value_heads)

    def read_block(self, block_id: int) -> dict[str, torch.Tensor]:
        """One block, stacked over layers: the disk tier's unit."""
        return {name: t[0] for name, t in self.read_blocks([block_id]).items()}

    def write_block(self, block_id: int, tensors: dict[str, torch.Tensor]) -> None:
        self.write_blocks([block_id], {name: t.unsqueeze(0) for name, t in tensors.items()})

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests' per-request state (their seeded generators)."""
        self.sampling.release(request_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv_cache: KVCacheManager) -> StepResult:
        """Run the scheduled tokens (drafts included) and decide each sampled request's new tokens."""
        if out.num_steps > 1:
            return self._execute_steps(out, kv_cache)
        chunks, rows, sampled = [], [], []
        # prompt_rows: for prompt logprobs, (request, first logits row, rows, position)
        prompt_rows, sample_rows, row = [], [], 0
        for request, num_new in zip(out.requests, out.num_new_tokens):
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            tokens = request.all_token_ids[start:end]
            num_drafts = max(0, end - request.num_tokens)  # scheduled draft tokens, verified here
            num_logits = num_drafts + 1 if end >= request.num_tokens else 0
            if num_drafts:
                tokens += request.spec_token_ids[:num_drafts]
            num_prompt = 0
            if request.needs_prompt_logprobs:
                num_prompt = max(0, min(end, request.num_prompt_tokens - 1) - start)
            if num_prompt:  # the rows whose next token is the prompt's come first, then any sampled one
                prompt_rows.append((request, row, num_prompt, start))
            sample_rows.extend(range(row + num_prompt, row + num_prompt + num_logits))
            row += num_prompt + num_logits
            chunks.append(SeqChunk(tokens, start, kv_cache.block_table(request.request_id),
                                   num_prompt + num_logits, request.lora_request,
                                   kv_cache.window_block_table(request.request_id)))
            rows.extend((request, request.spec_token_ids[:j]) for j in range(num_logits))
            if num_logits:
                sampled.append((request, num_drafts))
        masks = self.grammars.start_masks([(r.grammar, d) for r, d in rows]) if self.grammars else None
        logits = self.forward(chunks)  # while the grammars' masks are computed
        prompt_logprobs = [self._prompt_logprobs(logits[first : first + count], request, position)
                           for request, first, count, position in prompt_rows]
        if prompt_rows:
            logits = logits[sample_rows]
        if not sampled:
            return StepResult([], [], None, prompt_logprobs)
        batch = self.sampling.build(rows, None if masks is None else masks.result())
        if len(rows) == len(sampled):  # no drafts: one batched sample
            output = sample(logits, batch, self.shared_generator)
            token_ids = [[t] for t in output.token_ids.tolist()]
            logprobs = output if batch.num_logprobs is not None else None
            return StepResult([r for r, _ in sampled], token_ids, logprobs, prompt_logprobs)
        return self._verify(logits, batch, sampled)

    def _prompt_logprobs(self, logits: torch.Tensor, request: Request, position: int) -> PromptLogprobs:
        """The model's own log-probabilities (no sampling parameters) of the prompt tokens after
        `position`, one logits row each, and the top prompt_logprobs of each row. SCORED_ROWS rows
        at a time: a 512-token chunk's temporaries whole (100 MB each) were page-faulted in anew
        every time, 3x slower on the CPU."""
        targets = torch.tensor(request.prompt_token_ids[position + 1 : position + 1 + len(logits)],
                               device=self.device)
        num = request.sampling_params.prompt_logprobs
        parts = [gather_logprobs(targets[i : i + SCORED_ROWS],
                                 torch.log_softmax(logits[i : i + SCORED_ROWS].float(), dim=-1), num)
                 for i in range(0, len(logits), SCORED_ROWS)]
        output = SamplerOutput(**{f.name: torch.cat([getattr(part, f.name) for part in parts])
                                  for f in fields(SamplerOutput)})
        return PromptLogprobs(request, position + 1, output)

    def _execute_steps(self, out: SchedulerOutput, kv_cache: KVCacheManager) -> StepResult:
        """out.num_steps decode steps back to back, each step's sampled tokens the next one's
        input tokens. Through the CUDA graphs those stay on the device: the replays and samplers
        queue one behind another and the host waits once, for all the tokens."""
        requests = out.requests
        chunks = [SeqChunk([r.all_token_ids[-1]], r.num_computed_tokens, kv_cache.block_table(r.request_id),
                           1, r.lora_request, kv_cache.window_block_table(r.request_id)) for r in requests]
        batch = self.sampling.build([(r, []) for r in requests])
        on_device = (self.workers is None and self._replays(len(chunks))
                     and not (self.lora is not None and any(c.lora for c in chunks)))
        tokens: torch.Tensor | None = None
        outputs = []
        for step in range(out.num_steps):
            if on_device:
                tables = [c.block_table for c in chunks] if step == 0 else None  # unchanged after the first
                starts = [c.start + step for c in chunks]
                inputs = tokens if step else [c.token_ids[0] for c in chunks]
                logits = self.decode_graphs.run(inputs, starts, tables)
            else:
                for chunk, token in zip(chunks, tokens.tolist() if step else []):
                    chunk.token_ids, chunk.start = [token], chunk.start + 1
                logits = self.forward(chunks)
            output = sample(logits, batch, self.shared_generator)
            tokens = output.token_ids
            if batch.output_token_counts is not None:  # the penalties of the next step count this token
                column = tokens.unsqueeze(1)
                batch.output_token_counts.scatter_add_(1, column, torch.ones_like(column))
            outputs.append(output)
        token_ids = torch.stack([o.token_ids for o in outputs], dim=1).tolist()  # [B, num_steps]
        logprobs = None
        if batch.num_logprobs is not None:  # rows request by request, as StepResult orders them
            stacked = {f.name: torch.stack([getattr(o, f.name) for o in outputs], dim=1).flatten(0, 1)
                       for f in fields(SamplerOutput)}
            logprobs = SamplerOutput(**stacked)
        return StepResult(list(requests), token_ids, logprobs)

    def _replays(self, batch: int) -> bool:
        """Whether a decode step of this many sequences replays a CUDA graph."""
        return self.decode_graphs is not None and batch <= self.decode_graphs.max_batch

    def _verify(self, logits: torch.Tensor, batch: SamplingBatch,
                sampled: list[tuple[Request, int]]) -> StepResult:
        greedy, probs = sampling_probs(logits, batch)
        greedy = greedy.tolist()
        token_ids, emitted_rows, row = [], [], 0
        for request, num_drafts in sampled:
            drafts = request.spec_token_ids[:num_drafts]
            generator = self.sampling.generator(request) or self.shared_generator
            if request.sampling_params.is_greedy:
                tokens = verify_greedy(greedy[row : row + num_drafts + 1], drafts)
            else:
                draft_probs = None if request.spec_probs is None else request.spec_probs[:num_drafts]
                tokens = verify_sampled(probs[row : row + num_drafts + 1], drafts, draft_probs, generator)
            token_ids.append(tokens)
            emitted_rows.extend(range(row, row + len(tokens)))
            row += num_drafts + 1
        logprobs = None
        if batch.num_logprobs is not None:
            flat = torch.tensor([t for tokens in token_ids for t in tokens], device=self.device)
            raw = torch.log_softmax(logits[emitted_rows].float(), dim=-1)
            logprobs = gather_logprobs(flat, raw, batch.num_logprobs)
        return StepResult([r for r, _ in sampled], token_ids, logprobs)

    def forward(self, chunks: list[SeqChunk], model: LlamaForCausalLM | None = None,
                kv_caches: list[KVCache] | None = None) -> torch.Tensor:
        """Logits [sum of num_logits, V] of a flattened batch of chunks; the target model and its
        KV by default, a draft model (and its own KV, or a prefix of the target's layers) otherwise."""
        model = model or self.model
        if self.workers is not None and model is self.model:
            # the other ranks run the same pass (and replay the same graph); a self-draft's over the
            # first layers, whose caches kv_caches then is
            self.workers.send(Forward(chunks, None if kv_caches is None else len(kv_caches)))
        with_lora = self.lora is not None and model is self.model and any(c.lora for c in chunks)
        decode_only = (model is self.model and kv_caches is None and not with_lora
                       and all(len(c.token_ids) == c.num_logits == 1 for c in chunks))
        if decode_only and self._replays(len(chunks)):
            return self.decode_graphs.run([c.token_ids[0] for c in chunks], [c.start for c in chunks],
                                          [c.block_table for c in chunks])
        if (self.fused_decode is not None and model is self.model and kv_caches is None
                and self.fused_decode.takes(sum(len(c.token_ids) for c in chunks))):
            return self._fused_forward(chunks, with_lora)
        compiled = decode_only and self._compiled_decode is not None
        batch = self._prepare(chunks, model.sliding_window, model.attention_backend,
                              min_blocks=2 if compiled else 1,
                              full_attention=model.interleaves_full_attention)
        if compiled:
            group = batch.attn.decodes[0]  # batch size and context blocks vary; nothing else does
            dynamic = ((batch.input_ids, [0]), (batch.positions, [0]), (batch.attn.slot_mapping, [0]),
                       (group.context_lens, [0]), (group.block_tables, [0, 1]), (group.mask, [0, 3]))
            for tensor, dims in dynamic:
                if tensor is not None:
                    torch._dynamo.maybe_mark_dynamic(tensor, dims)
            return self._compiled_decode(batch.input_ids, batch.positions, batch.attn)
        with self._adapters(chunks, with_lora):
            caches = self.kv_caches if kv_caches is None else kv_caches
            hidden = model(batch.input_ids, batch.positions, caches, batch.attn)
        return model.compute_logits(hidden[batch.logit_rows])

    @contextlib.contextmanager
    def _adapters(self, chunks: list[SeqChunk], with_lora: bool) -> Iterator[None]:
        """Each row's adapter set for one forward pass (nothing without LoRA rows)."""
        if not with_lora:
            yield
            return
        self.lora.set_rows([c.lora for c in chunks for _ in c.token_ids])
        try:
            yield
        finally:
            self.lora.clear()

    def _fused_forward(self, chunks: list[SeqChunk], with_lora: bool) -> torch.Tensor:
        """Logits of a small step through the fused layers: one row per token, each with its slot,
        its sequence's block table, its context length and its adapter. Few host ops: with the
        caches full of weights, each small tensor op here cost 20-90 us of a 6 ms token."""
        bs = self.block_size
        rows, tables, logit_rows = [], [], []  # rows: (input id, position, cache slot, context length)
        window_slots, window_tables = [], []  # the sliding-window layers' own pool, where they have one
        for chunk in chunks:
            first = len(rows)
            for position, token in enumerate(chunk.token_ids, start=chunk.start):
                slot = chunk.block_table[position // bs] * bs + position % bs
                rows.append((token, position, slot, position + 1))
                tables.append(chunk.block_table)
                if chunk.window_block_table is not None:
                    window_slots.append(chunk.window_block_table[position // bs] * bs + position % bs)
                    window_tables.append(chunk.window_block_table)
            end = first + len(chunk.token_ids)
            logit_rows.extend(range(end - chunk.num_logits, end))
        input_ids, positions, slots, lengths = torch.from_numpy(np.array(rows, dtype=np.int64).T.copy())
        decode_rows = DecodeRows(slots, padded_block_tables(tables, max(len(t) for t in tables)), lengths)
        window_rows = None
        if window_tables:
            width = max(len(t) for t in window_tables)
            window_rows = DecodeRows(torch.tensor(window_slots), padded_block_tables(window_tables, width),
                                     lengths)
        with self._adapters(chunks, with_lora):
            hidden = self.fused_decode(input_ids, positions, decode_rows, self.kv_caches,
                                       self.lora.batch if with_lora else None, window_rows)
        return self.fused_decode.logits(hidden if len(logit_rows) == len(tables) else hidden[logit_rows])

    def _prepare(self, chunks: list[SeqChunk], sliding_window: int | None, backend: AttentionBackend,
                 min_blocks: int = 1, full_attention: bool = False) -> ForwardBatch:
        """Flat inputs and attention metadata. Decodes form one group when the backend takes ragged
        lengths, or when min_blocks > 1 (the compiled decode: one graph for any batch); otherwise
        groups of similar lengths, each padded to its longest and masked. Prefill spans come as one
        PrefillBatch where the backend takes it, else one PrefillSpan each. `full_attention`: also
        the metadata without the window, for the global layers of a model that has both."""
        lengths = [len(c.token_ids) for c in chunks]
        positions = np.concatenate([np.arange(c.start, c.start + n) for c, n in zip(chunks, lengths)])
        tokens = itertools.chain.from_iterable(c.token_ids for c in chunks)
        input_ids = np.fromiter(tokens, np.int64, len(positions))
        decode_rows: list[int] = []
        decode_chunks: list[SeqChunk] = []
        prefills: list[tuple[int, SeqChunk]] = []  # first row, chunk
        logit_rows: list[int] = []
        row = 0
        for chunk, num_new in zip(chunks, lengths):
            if num_new == 1:
                decode_rows.append(row)
                decode_chunks.append(chunk)
            else:
                prefills.append((row, chunk))
            logit_rows.extend(range(row + num_new - chunk.num_logits, row + num_new))
            row += num_new
        to = self.device

        def metadata(window: int | None) -> AttentionMetadata:
            """The windowed layers read their own tables where they have them; full attention the first."""
            def table(chunk: SeqChunk) -> list[int]:
                windowed = window is not None and chunk.window_block_table is not None
                return chunk.window_block_table if windowed else chunk.block_table

            slots = self._slots([table(c) for c in chunks], lengths, positions).to(to)
            tables = [table(c) for c in decode_chunks]
            context_lens = [c.start + 1 for c in decode_chunks]
            if not decode_rows:
                decodes = []
            elif backend.ragged_decode or min_blocks > 1:
                rows = None if len(decode_rows) == row else decode_rows
                decodes = [self._decode_group(rows, tables, context_lens, window, min_blocks,
                                              with_mask=not backend.ragged_decode)]
            else:
                decodes = self._decode_groups(decode_rows, tables, context_lens, window)
            as_span = [not backend.paged_prefill or self._flash_prefill(c, window) for _, c in prefills]
            spans = [self._prefill_span(first, c.start, c.start + len(c.token_ids), table(c), window)
                     for (first, c), alone in zip(prefills, as_span) if alone]
            paged = [prefill for prefill, alone in zip(prefills, as_span) if not alone]
            return AttentionMetadata(slots, decodes, spans, window, self._prefill_batch(paged, table))

        attn = metadata(sliding_window)
        if full_attention:
            attn.full_attention = metadata(None)
        return ForwardBatch(
            input_ids=torch.from_numpy(input_ids).to(to),
            positions=torch.from_numpy(positions).to(to),
            attn=attn,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=to),
        )

    def _slots(self, tables: list[list[int]], lengths: list[int], positions: np.ndarray) -> torch.Tensor:
        """Cache slots of a step's tokens (positions, `lengths` of them from each sequence in turn),
        each through its sequence's block table: one lookup in all the tables laid end to end (a
        tensor per sequence took 4 ms of an offline step's host time)."""
        bs = self.block_size
        first_entry = np.cumsum([0] + [len(t) for t in tables[:-1]])  # each table's first entry, end to end
        entries = np.fromiter(itertools.chain.from_iterable(tables), np.int64, sum(len(t) for t in tables))
        blocks = entries[np.repeat(first_entry, lengths) + positions // bs]
        return torch.from_numpy(blocks * bs + positions % bs)

    def _prefill_span(self, row: int, start: int, end: int, table: list[int], sliding_window: int | None
                      ) -> PrefillSpan:
        num_new = end - start
        if start == 0 and (sliding_window is None or num_new <= sliding_window):
            return PrefillSpan(row, row + num_new, None, None)
        mask = allowed_keys(torch.arange(start, end), torch.arange(end), sliding_window)
        blocks = None if start == 0 else torch.tensor(table, dtype=torch.long, device=self.device)
        return PrefillSpan(row, row + num_new, blocks, mask.to(self.device))

    def _flash_prefill(self, chunk: SeqChunk, window: int | None) -> bool:
        """A new prompt long enough to attend through SDPA on its own K/V, even for a paged_prefill
        backend (FLASH_PREFILL_TOKENS); never where the model caps its scores (Gemma 2) or has
        attention sinks (GPT-OSS), which SDPA cannot take and the paged kernel does."""
        num_new = len(chunk.token_ids)
        return (chunk.start == 0 and num_new >= FLASH_PREFILL_TOKENS and (window is None or num_new <= window)
                and not self.plain_scores)

    def _prefill_batch(self, prefills: list[tuple[int, SeqChunk]], table: Callable[[SeqChunk], list[int]]
                       ) -> PrefillBatch | None:
        if not prefills:
            return None
        return PrefillBatch.of([row for row, _ in prefills], [len(c.token_ids) for _, c in prefills],
                               [c.start for _, c in prefills], [table(c) for _, c in prefills], self.device)

    def _decode_groups(self, rows: list[int], tables: list[list[int]], lengths: list[int],
                       sliding_window: int | None) -> list[DecodeGroup]:
        """Decodes sorted by context length and cut into groups whose lengths differ by at most
        DECODE_GROUP_SPREAD, so little of each group's gathered context is padding."""
        order = sorted(range(len(rows)), key=lambda i: lengths[i])
        groups, current = [], []
        for i in order:
            if len(current) >= MIN_DECODE_GROUP and lengths[i] > DECODE_GROUP_SPREAD * lengths[current[0]]:
                groups.append(current)
                current = []
            current.append(i)
        if current:
            groups.append(current)
        return [self._decode_group([rows[i] for i in g], [tables[i] for i in g], [lengths[i] for i in g],
                                   sliding_window) for g in groups]

    def _decode_group(self, rows: list[int] | None, tables: list[list[int]], lengths: list[int],
                      sliding_window: int | None, min_blocks: int = 1, with_mask: bool = True) -> DecodeGroup:
        max_blocks = max(min_blocks, *(len(t) for t in tables))
        padded = padded_block_tables(tables, max_blocks)
        lengths_t = torch.tensor(lengths)
        mask = None
        if with_mask:
            key_positions = torch.arange(max_blocks * self.block_size).unsqueeze(0)  # [1, L]
            mask = key_positions < lengths_t.unsqueeze(1)
            if sliding_window is not None:
                mask &= key_positions >= lengths_t.unsqueeze(1) - sliding_window
            mask = mask[:, None, None, :].to(self.device)
        to = self.device
        return DecodeGroup(None if rows is None else torch.tensor(rows, device=to), padded.to(to),
                           lengths_t.to(to), mask)
