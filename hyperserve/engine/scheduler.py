"""Scheduler: iteration-level continuous batching under a token budget.

Each step shares `max_num_batched_tokens` between running requests (usually one decode token
each) and prefill chunks, running requests first, so a long prompt is prefilled a chunk per step
beside ongoing decodes. While any request decodes, prompts take at most
`max_prefill_tokens_while_decoding` of a step: each decoding request waits for the whole step.
When the KV pool runs short, the least important running request (highest priority value, latest
admitted) is preempted: its blocks are freed and it goes back to waiting to be recomputed. When
every sequence slot is taken, a waiting request more important than a running one takes the least
important one's slot the same way (batch jobs yield to interactive requests). Plain Python over ids
and counts: no tensors here.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hyperserve.engine.kv_cache_manager import KVCacheManager
from hyperserve.engine.request import Request, RequestStatus, SpecDecodeStats

if TYPE_CHECKING:  # both modules load PyTorch, which the scheduler never touches
    from hyperserve.config import SchedulerConfig
    from hyperserve.layers.lora import LoRARequest

logger = logging.getLogger("hyperserve.scheduler")


@dataclass(slots=True)
class SchedulerOutput:
    """What to run this step: each request with how many of its tokens to compute. With
    num_steps > 1 every request decodes num_steps tokens, one per forward pass, each pass's
    sampled token the next one's input (num_new_tokens then holds num_steps for each)."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_steps: int = 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 max_loras: int | None = None,
                 lora_ready: Callable[[LoRARequest], bool] | None = None) -> None:
        """lora_ready: whether an adapter is in memory, starting to load it if not (a request
        whose adapter is loading waits, while the running ones go on)."""
        self.config = config
        self.max_loras = max_loras  # distinct LoRA adapters running at once (None: no limit)
        self.lora_ready = lora_ready
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        # Both queues are sorted by (priority, sequence number): lower runs first, FCFS in a tie.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._order: dict[str, tuple[int, int]] = {}
        self._counter = itertools.count()
        self._finished_ids: list[str] = []
        self.spec_stats = SpecDecodeStats()

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._order[request.request_id] = (request.priority, next(self._counter))
        self._insert(self.waiting, request)

    def take_finished_ids(self) -> list[str]:
        """Ids of the requests finished since the last call, for per-request state elsewhere."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.kv_cache.expire_pins(time.time())
        out = SchedulerOutput()
        self._yield_slots(out)
        budget = self.config.max_num_batched_tokens
        prefill_budget = budget
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is not None and any(_is_decoding(r) for r in self.running):
            prefill_budget = min(budget, cap)

        # Running requests first, most important first; the least important yields its blocks.
        i, short_of_blocks = 0, False
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_to_compute = request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens
            num_new = min(num_to_compute, budget)
            prefilling = not _is_decoding(request)
            if prefilling:
                if prefill_budget <= 0:
                    i += 1
                    continue
                num_new = min(num_new, prefill_budget)
            self.kv_cache.release_behind_window(request.request_id, request.num_computed_tokens)
            while not self.kv_cache.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new
            ):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                short_of_blocks = True
                if victim is request:
                    break
            else:
                out.requests.append(request)
                out.num_new_tokens.append(num_new)
                budget -= num_new
                if prefilling:
                    prefill_budget -= num_new
                i += 1

        # Then admit waiting requests while blocks, budget and sequence slots allow. A cached
        # prefix costs no budget: only the tokens after it are computed. At most max_loras
        # adapters run at once; once a request waits for an adapter slot, no later request may
        # bring in another adapter ahead of it (it goes in when a running adapter's requests end).
        adapters = {r.lora_request for r in self.running if r.lora_request is not None}
        adapter_waiting = False
        for request in list(self.waiting):
            full = len(self.running) >= self.config.max_num_seqs
            if short_of_blocks or min(budget, prefill_budget) <= 0 or full:
                break
            if _waits_for_sibling(request):
                continue
            adapter = request.lora_request
            if adapter is not None and adapter not in adapters and self.max_loras is not None:
                if adapter_waiting or len(adapters) >= self.max_loras:
                    if not adapter_waiting and self.lora_ready is not None:
                        self.lora_ready(request.lora_request)  # the next adapter in line: read it meanwhile
                    adapter_waiting = True
                    continue
            if adapter is not None and self.lora_ready is not None \
                    and not self.lora_ready(request.lora_request):
                continue
            prefix = self.kv_cache.cached_prefix(request)
            num_cached = prefix.num_blocks * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_cached, budget, prefill_budget)
            if not self.kv_cache.allocate_slots(request.request_id, num_cached + num_new, prefix):
                break
            self.kv_cache.record_lookup(request.num_tokens, num_cached)
            if request.metrics.first_scheduled_time is None:
                request.metrics.num_cached_tokens = num_cached
                request.metrics.num_disk_cached_tokens = prefix.num_from_lower_tier * self.kv_cache.block_size
            request.num_computed_tokens = num_cached
            self.waiting.remove(request)
            if adapter is not None:
                adapters.add(adapter)
            request.status = RequestStatus.RUNNING
            self._insert(self.running, request)
            out.requests.append(request)
            out.num_new_tokens.append(num_new)
            budget -= num_new
            prefill_budget -= num_new
        if self.config.num_scheduler_steps > 1 and out.requests and not out.preempted:
            self._run_steps_together(out)
        return out

    def _yield_slots(self, out: SchedulerOutput) -> None:
        """While every sequence slot is taken and the first waiting request is more important than the
        least important running one, that one is preempted for it. Not for a request that would not
        start at once: one waiting for its first sample's prompt, or for a LoRA adapter's slot or load."""
        while self.waiting and self.running and len(self.running) >= self.config.max_num_seqs:
            head, tail = self.waiting[0], self.running[-1]
            if head.priority >= tail.priority or _waits_for_sibling(head) or head.lora_request is not None:
                return
            self.running.pop()
            self._preempt(tail)
            out.preempted.append(tail)

    def _run_steps_together(self, out: SchedulerOutput) -> None:
        """Make a step in which every request decodes one plain token (no drafts, no grammar, whose
        mask needs each token first, none short of min_tokens, whose stop tokens are masked until
        then) into num_scheduler_steps steps, when the pool has the slots; fewer near max_model_len."""
        num_steps = self.config.num_scheduler_steps
        for request, num_new in zip(out.requests, out.num_new_tokens):
            if (num_new != 1 or request.num_computed_tokens != request.num_tokens - 1
                    or request.spec_token_ids or request.grammar is not None
                    or request.num_output_tokens < request.sampling_params.min_tokens):
                return
            num_steps = min(num_steps, self.max_model_len - request.num_tokens + 1)
        if num_steps < 2:
            return
        for i, request in enumerate(out.requests):
            if not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_steps):
                for grown in out.requests[: i + 1]:
                    self.kv_cache.trim(grown.request_id, grown.num_tokens)
                return
        out.num_steps = num_steps
        out.num_new_tokens = [num_steps] * len(out.requests)

    def update_from_output(self, out: SchedulerOutput, new_token_ids: dict[str, list[int]]) -> list[Request]:
        """Advance computed counts, append the new tokens, finish requests that hit a stop.

        A request that verified k draft tokens and received a + 1 tokens keeps the KV of the a
        accepted ones; the other k - a are uncomputed again, and blocks that held only them go
        back to the pool. A multi-step decode counts as k - 1 drafts, all accepted. Returns the
        requests that received tokens this step.
        """
        updated = []
        for request, num_new in zip(out.requests, out.num_new_tokens):
            num_drafts = max(0, request.num_computed_tokens + num_new - request.num_tokens)
            tokens = new_token_ids.get(request.request_id)
            num_accepted = len(tokens) - 1 if tokens else 0
            request.num_computed_tokens += num_new - (num_drafts - num_accepted)
            request.spec_token_ids, request.spec_probs = [], None
            if num_drafts and out.num_steps == 1:
                self._record_speculation(request, num_drafts, num_accepted)
            self.kv_cache.register_computed(request)
            if tokens is None:
                continue
            for token_id in tokens:
                request.append_output_token(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    self.finish_request(request.request_id, status)
                    break
            if num_drafts and not request.is_finished:
                self.kv_cache.trim(request.request_id, request.num_tokens)
            updated.append(request)
        return updated

    def _record_speculation(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        (request.spec_acceptance or request.acceptance).observe(num_drafts, num_accepted)
        request.metrics.num_draft_tokens += num_drafts
        request.metrics.num_accepted_tokens += num_accepted
        if request.spec_source == "prediction":
            request.metrics.num_prediction_tokens += num_drafts
            request.metrics.num_accepted_prediction_tokens += num_accepted
        self.spec_stats.num_drafts += 1
        self.spec_stats.num_draft_tokens += num_drafts
        self.spec_stats.num_accepted_tokens += num_accepted
        counts = self.spec_stats.by_source.setdefault(request.spec_source, [0, 0])
        counts[0] += num_drafts
        counts[1] += num_accepted

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request in any state and return its blocks to the pool."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        queue = self.running if request.status == RequestStatus.RUNNING else self.waiting
        queue.remove(request)
        request.status = status
        if request.pin_until is not None and status != RequestStatus.FINISHED_ABORTED:
            self.kv_cache.pin(request, request.pin_until)
        self.kv_cache.free(request_id)
        self._order.pop(request_id)
        self._finished_ids.append(request_id)
        return request

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.is_stop_token(token_id):
            request.stop_reason = token_id if token_id in params.stop_token_ids else None  # None: EOS
            return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None:
            if not request.grammar.accept(token_id):  # the masks make this a bug, not an input error
                logger.warning("request %s: its grammar rejected token %d; stopping it",
                               request.request_id, token_id)
                return RequestStatus.FINISHED_STOPPED
            if request.grammar.is_finished:  # the output is complete: only EOS could follow
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.draft_num_computed = 0
        request.spec_token_ids, request.spec_probs = [], None
        request.metrics.num_preemptions += 1
        self._insert(self.waiting, request)

    def _insert(self, queue: list[Request], request: Request) -> None:
        bisect.insort(queue, request, key=lambda r: self._order[r.request_id])


def _waits_for_sibling(request: Request) -> bool:
    """Samples 1..n-1 of an n > 1 request start once sample 0 has computed the shared prompt, so
    they take its blocks from the prefix cache instead of computing the prompt n times."""
    first = request.wait_for
    return first is not None and not first.is_finished and first.num_computed_tokens < first.num_prompt_tokens


def _is_decoding(request: Request) -> bool:
    """Whether a running request has only its latest token left to compute (its drafts aside)."""
    return request.num_tokens - request.num_computed_tokens <= 1
