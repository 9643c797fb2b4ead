"""ModelRunner: SchedulerOutput -> flat input tensors and attention metadata -> forward -> sample.

Owns the model, the KV cache tensors and the per-request random generators. Logits are computed
only for the rows that are sampled (the last new token of each request that reaches its end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperserve.config import EngineConfig
from hyperserve.engine.kv_cache_manager import KVCacheManager
from hyperserve.engine.request import Request
from hyperserve.engine.sampler import SamplerOutput, SamplingBatch, sample
from hyperserve.engine.scheduler import SchedulerOutput
from hyperserve.layers.attention import AttentionMetadata, DecodeGroup, PrefillSpan, allowed_keys
from hyperserve.models.llama import LlamaForCausalLM, head_dim_of

# Decodes whose context lengths differ by more than this factor attend in separate batches.
DECODE_GROUP_SPREAD = 1.25
MIN_DECODE_GROUP = 8


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [S] rows whose logits are sampled
    sampled_requests: list[Request]  # [S]


@dataclass(slots=True)
class StepResult:
    requests: list[Request]  # those that were sampled, in row order
    output: SamplerOutput

    def token_ids_by_request(self) -> dict[str, int]:
        ids = self.output.token_ids.tolist()
        return {r.request_id: t for r, t in zip(self.requests, ids)}


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, num_blocks: int) -> None:
        self.model = model
        self.device = torch.device(config.model.device)
        self.block_size = config.cache.block_size
        self.sliding_window = model.sliding_window
        self.vocab_size = model.config.vocab_size
        hf = model.config
        shape = (2, num_blocks, self.block_size, hf.num_key_value_heads, head_dim_of(hf))
        self.kv_caches = [
            torch.zeros(shape, dtype=config.model.torch_dtype, device=self.device)
            for _ in range(hf.num_hidden_layers)
        ]
        self.shared_generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self._generators: dict[str, torch.Generator] = {}

    def read_block(self, block_id: int) -> torch.Tensor:
        """Every layer's K and V of one block: [num_layers, 2, block_size, Hkv, D]."""
        return torch.stack([cache[:, block_id] for cache in self.kv_caches])

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        for layer, cache in enumerate(self.kv_caches):
            cache[:, block_id].copy_(kv[layer])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv_cache: KVCacheManager) -> StepResult:
        for request_id in out.finished_ids:
            self._generators.pop(request_id, None)
        batch = self._prepare(out, kv_cache)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        if not batch.sampled_requests:
            return StepResult([], SamplerOutput(torch.empty(0, dtype=torch.long), None, None, None, None))
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # [S, V]
        sampled = sample(logits, self._sampling_batch(batch.sampled_requests), self.shared_generator)
        return StepResult(batch.sampled_requests, sampled)

    def _prepare(self, out: SchedulerOutput, kv_cache: KVCacheManager) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[torch.Tensor] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prefills: list[PrefillSpan] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        row = 0
        for request, num_new in zip(out.requests, out.num_new_tokens):
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            table = kv_cache.block_table(request.request_id)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.append(self._slots(table, start, end))
            if num_new == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lengths.append(end)
            else:
                prefills.append(self._prefill_span(row, start, end, table))
            if end == request.num_tokens:
                sample_rows.append(row + num_new - 1)
                sampled.append(request)
            row += num_new

        to = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.cat(slot_mapping).to(to),
            decodes=self._decode_groups(decode_rows, decode_tables, decode_lengths),
            prefills=prefills,
        )
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=to),
            positions=torch.tensor(positions, dtype=torch.long, device=to),
            attn=attn,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=to),
            sampled_requests=sampled,
        )

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions start..end-1 of a sequence with this block table."""
        bs = self.block_size
        return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.long)

    def _prefill_span(self, row: int, start: int, end: int, table: list[int]) -> PrefillSpan:
        num_new = end - start
        if start == 0 and (self.sliding_window is None or num_new <= self.sliding_window):
            return PrefillSpan(row, row + num_new, None, None)
        mask = allowed_keys(torch.arange(start, end), torch.arange(end), self.sliding_window)
        blocks = None if start == 0 else torch.tensor(table, dtype=torch.long, device=self.device)
        return PrefillSpan(row, row + num_new, blocks, mask.to(self.device))

    def _decode_groups(self, rows: list[int], tables: list[list[int]], lengths: list[int]) -> list[DecodeGroup]:
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
        return [self._decode_group([rows[i] for i in g], [tables[i] for i in g], [lengths[i] for i in g])
                for g in groups]

    def _decode_group(self, rows: list[int], tables: list[list[int]], lengths: list[int]) -> DecodeGroup:
        max_blocks = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        lengths_t = torch.tensor(lengths).unsqueeze(1)  # [Bd, 1]
        key_positions = torch.arange(max_blocks * self.block_size).unsqueeze(0)  # [1, L]
        mask = key_positions < lengths_t
        if self.sliding_window is not None:
            mask &= key_positions >= lengths_t - self.sliding_window
        to = self.device
        return DecodeGroup(torch.tensor(rows, device=to), padded.to(to), mask[:, None, None, :].to(to))

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        params = [r.sampling_params for r in requests]
        to = self.device
        floats = lambda values: torch.tensor(values, dtype=torch.float32, device=to)
        any_penalties = any(p.has_penalties for p in params)
        counts = prompt_mask = None
        if any_penalties:
            counts = torch.zeros(len(requests), self.vocab_size, dtype=torch.long)
            prompt_mask = torch.zeros(len(requests), self.vocab_size, dtype=torch.bool)
            for i, r in enumerate(requests):
                if r.output_token_ids:
                    counts[i] = torch.bincount(torch.tensor(r.output_token_ids), minlength=self.vocab_size)
                prompt_mask[i, r.prompt_token_ids] = True
            counts, prompt_mask = counts.to(to), prompt_mask.to(to)
        requested_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            temperature=floats([p.temperature for p in params]),
            top_k=torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=to),
            top_p=floats([p.top_p for p in params]),
            min_p=floats([p.min_p for p in params]),
            presence_penalty=floats([p.presence_penalty for p in params]) if any_penalties else None,
            frequency_penalty=floats([p.frequency_penalty for p in params]) if any_penalties else None,
            repetition_penalty=floats([p.repetition_penalty for p in params]) if any_penalties else None,
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
            generators=[self._generator(r) for r in requests],
            num_logprobs=max(requested_logprobs) if requested_logprobs else None,
            all_greedy=all(p.is_greedy for p in params),
            needs_top_k_top_p=any(0 < p.top_k < self.vocab_size or p.top_p < 1 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params),
        )

    def _generator(self, request: Request) -> torch.Generator | None:
        if request.seed is None:
            return None
        if request.request_id not in self._generators:
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
            self._generators[request.request_id] = generator
        return self._generators[request.request_id]
