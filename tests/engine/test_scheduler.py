"""The scheduler on fake requests and block counts: no model, no tensors."""

from __future__ import annotations

import subprocess
import sys

from hyperserve.config import SchedulerConfig
from hyperserve.engine.kv_cache_manager import KVCacheManager
from hyperserve.engine.request import Request, RequestStatus
from hyperserve.engine.scheduler import Scheduler
from hyperserve.sampling_params import SamplingParams


def make_scheduler(num_blocks=100, block_size=4, max_num_seqs=8, budget=32, max_model_len=1000, prefill_cap=None):
    kv = KVCacheManager(num_blocks, block_size)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_prefill_tokens_while_decoding=prefill_cap)
    return Scheduler(config, kv, max_model_len)


def make_request(request_id: str, num_prompt: int, priority: int = 0, max_tokens: int = 100) -> Request:
    return Request(request_id, list(range(num_prompt)), SamplingParams(max_tokens=max_tokens), 0.0,
                   priority=priority)


def run_step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    sampled = {
        r.request_id: [token]
        for r, n in zip(out.requests, out.num_new_tokens)
        if r.num_computed_tokens + n == r.num_tokens
    }
    scheduler.update_from_output(out, sampled)
    return out


def test_long_prompt_is_prefilled_in_chunks_beside_decodes():
    s = make_scheduler(budget=10)
    s.add_request(make_request("short", 3))
    run_step(s)  # short prefilled and sampled its first token
    s.add_request(make_request("long", 25))
    chunks = []
    for _ in range(3):
        out = run_step(s)
        counts = dict(zip([r.request_id for r in out.requests], out.num_new_tokens))
        assert counts["short"] == 1  # the decode goes first, every step
        chunks.append(counts["long"])
        assert out.num_batched_tokens <= 10
    assert chunks == [9, 9, 7]
    assert s.requests["long"].num_output_tokens == 1  # sampled once, after the last chunk


def test_prompts_take_at_most_their_cap_of_a_step_while_others_decode():
    s = make_scheduler(budget=32, prefill_cap=6)
    s.add_request(make_request("first", 20))
    assert run_step(s).num_new_tokens == [20], "nobody decodes yet: the whole budget"
    for request_id, first_token in (("second", 100), ("third", 200)):  # nothing in common to cache
        s.add_request(Request(request_id, list(range(first_token, first_token + 8)), SamplingParams(), 0.0))
    counts = []
    for _ in range(3):
        out = run_step(s)
        counts.append(dict(zip([r.request_id for r in out.requests], out.num_new_tokens)))
    assert counts == [{"first": 1, "second": 6}, {"first": 1, "second": 2, "third": 4},
                      {"first": 1, "second": 1, "third": 4}]


def test_max_num_seqs_bounds_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(str(i), 2))
    out = run_step(s)
    assert [r.request_id for r in out.requests] == ["0", "1"]
    assert len(s.waiting) == 1


def test_preemption_takes_the_latest_admitted_and_frees_its_blocks():
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4))
    a, b = s.requests["a"], s.requests["b"]
    for _ in range(10):
        out = run_step(s)
        if out.preempted:
            break
    assert out.preempted == [b]  # a reached 9 tokens and needed a third block
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.metrics.num_preemptions == 1 and a.metrics.num_preemptions == 0
    assert len(s.kv_cache.block_table("a")) == 3 and s.kv_cache.num_free_blocks == 1
    assert b.num_output_tokens == 5  # kept: recomputed when it is resumed


def test_lower_priority_value_is_admitted_first_fcfs_within_a_priority():
    s = make_scheduler(max_num_seqs=2)
    s.add_request(make_request("late-low", 2, priority=5))
    s.add_request(make_request("first-high", 2, priority=0))
    s.add_request(make_request("second-high", 2, priority=0))
    out = run_step(s)
    assert [r.request_id for r in out.requests] == ["first-high", "second-high"]


def test_least_important_running_request_is_preempted_first():
    s = make_scheduler(num_blocks=3, block_size=4, budget=64)
    s.add_request(make_request("low", 4, priority=9))
    s.add_request(make_request("high", 4, priority=0))
    run_step(s)
    s.add_request(make_request("mid", 4, priority=1))
    for _ in range(4):
        run_step(s)
    assert s.requests["low"].metrics.num_preemptions >= 1
    assert s.requests["high"].metrics.num_preemptions == 0


def test_abort_in_any_state_returns_every_block():
    s = make_scheduler(num_blocks=10, max_num_seqs=1)
    s.add_request(make_request("running", 6))
    s.add_request(make_request("waiting", 6))
    run_step(s)
    assert s.kv_cache.num_free_blocks < 10
    s.finish_request("running", RequestStatus.FINISHED_ABORTED)
    s.finish_request("waiting", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache.num_free_blocks == 10
    assert not s.has_unfinished_requests()
    assert s.finish_request("running", RequestStatus.FINISHED_ABORTED) is None  # idempotent


def test_max_tokens_and_context_end_finish_with_length():
    s = make_scheduler(max_model_len=6)
    s.add_request(make_request("ctx", 4, max_tokens=100))
    s.add_request(make_request("mt", 2, max_tokens=1))
    run_step(s)
    run_step(s)
    assert s.kv_cache.num_free_blocks == 100
    assert not s.has_unfinished_requests()


def test_rejected_draft_tokens_are_uncomputed_and_their_blocks_returned():
    s = make_scheduler(num_blocks=20, block_size=4)
    s.add_request(make_request("a", 6))
    run_step(s)  # prefill 6 tokens, sample the 7th
    request = s.running[0]
    request.spec_token_ids = [11, 12, 13, 14, 15]  # positions 7..11: blocks 1 and 2 needed
    s.kv_cache.allocate_slots("a", request.num_tokens + 5)
    out = s.schedule()
    assert out.num_new_tokens == [6]  # the last sampled token and five drafts
    assert len(s.kv_cache.block_table("a")) == 3
    s.update_from_output(out, {"a": [99]})  # the first draft rejected and replaced: the rest go too
    assert request.output_token_ids == [7, 99]
    assert request.num_computed_tokens == 7  # the prompt and 7; 99 is the next step's input
    assert request.spec_token_ids == []
    assert len(s.kv_cache.block_table("a")) == 2  # 8 tokens: the drafts' third block went back
    assert (request.metrics.num_draft_tokens, request.metrics.num_accepted_tokens) == (5, 0)
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache.num_free_blocks == 20


def test_at_most_max_loras_adapters_run_at_once_and_a_waiting_adapter_is_not_overtaken():
    from hyperserve.layers.lora import LoRARequest

    kv = KVCacheManager(100, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, 1000, max_loras=2)

    def request(request_id: str, adapter: str | None, max_tokens: int = 100) -> Request:
        r = make_request(request_id, 3, max_tokens=max_tokens)
        r.lora_request = LoRARequest(adapter, 1, "/x") if adapter else None
        return r

    for r in (request("a1", "a", max_tokens=2), request("b1", "b"), request("c1", "c"), request("base", None),
              request("a2", "a"), request("d1", "d")):
        s.add_request(r)
    admitted = {r.request_id for r in run_step(s).requests}
    assert admitted == {"a1", "b1", "base", "a2"}  # c waits for a slot; d may not pass it
    run_step(s)
    run_step(s)  # a1 finishes; a2 still runs adapter a
    assert "c1" not in {r.request_id for r in s.running}
    s.finish_request("a2", RequestStatus.FINISHED_ABORTED)  # adapter a is done: c goes next, not d
    admitted = {r.request_id for r in run_step(s).requests}
    assert "c1" in admitted and "d1" not in admitted


def test_decode_steps_run_together_when_every_request_decodes_plainly():
    kv = KVCacheManager(100, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, num_scheduler_steps=4), kv, 1000)
    s.add_request(make_request("a", 6))
    assert run_step(s).num_steps == 1  # the prompt's step
    out = s.schedule()
    assert out.num_steps == 4 and out.num_new_tokens == [4]
    assert len(kv.block_table("a")) == 3  # room for tokens 6..9: computed here, sampled from 7..10
    s.update_from_output(out, {"a": [11, 12, 13, 14]})
    a = s.requests["a"]
    assert a.output_token_ids == [7, 11, 12, 13, 14] and a.num_computed_tokens == a.num_tokens - 1
    assert s.spec_stats.num_drafts == 0  # not speculation
    a.grammar = object()  # a grammar's mask needs each token before the next step
    assert s.schedule().num_steps == 1


def test_stop_inside_a_multi_step_decode_finishes_there_and_frees_the_blocks():
    kv = KVCacheManager(100, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, num_scheduler_steps=4), kv, 1000)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=100, stop_token_ids=[9]), 0.0))
    run_step(s)
    out = s.schedule()
    s.update_from_output(out, {"a": [5, 9, 6, 6]})
    assert "a" not in s.requests and kv.num_free_blocks == 100


def test_multi_step_needs_room_for_every_request_or_none_runs_together():
    kv = KVCacheManager(4, 4)  # 16 slots
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, num_scheduler_steps=4), kv, 1000)
    s.add_request(make_request("a", 7))
    s.add_request(make_request("b", 7))
    run_step(s)  # 2 blocks each: full
    out = s.schedule()
    assert out.num_steps == 1 and out.num_new_tokens == [1, 1]
    assert kv.num_free_blocks == 0 and all(len(kv.block_table(r)) == 2 for r in "ab")


def test_num_scheduler_steps_is_validated():
    import pytest

    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)


def test_scheduler_limits_default_by_device_and_keep_given_values():
    from hyperserve.config import EngineConfig

    def limits(**kwargs):
        scheduler = EngineConfig.from_kwargs(load_format="random", **kwargs).scheduler
        return scheduler.max_num_seqs, scheduler.max_num_batched_tokens

    assert limits(device="cpu") == (64, 512)
    assert limits(device="cuda") == (256, 8192)  # only configured: nothing here needs a GPU
    assert limits(device="cuda", max_num_seqs=32, max_num_batched_tokens=1024) == (32, 1024)


def test_the_scheduler_and_the_kv_cache_manager_load_without_pytorch():
    code = ("import sys, hyperserve.engine.scheduler, hyperserve.engine.kv_cache_manager; "
            "assert 'torch' not in sys.modules, 'plain Python over ids and counts'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_more_important_request_takes_the_slot_of_the_least_important_running_one():
    """Every slot taken by batch-like requests (priority 100): an interactive one (0) starts at once
    in the least important's slot, which is recomputed later; one as important as the running ones
    waits for a slot."""
    s = make_scheduler(max_num_seqs=2)
    s.add_request(make_request("batch-1", 4, priority=100))
    s.add_request(make_request("batch-2", 4, priority=100))
    run_step(s)
    s.add_request(make_request("batch-3", 4, priority=100))
    out = run_step(s)
    assert not out.preempted and [r.request_id for r in s.waiting] == ["batch-3"]
    s.add_request(make_request("chat", 4, priority=0))
    out = run_step(s)
    assert [r.request_id for r in out.preempted] == ["batch-2"]
    assert "chat" in [r.request_id for r in out.requests] and "batch-1" in [r.request_id for r in out.requests]
    assert [r.request_id for r in s.waiting] == ["batch-2", "batch-3"]  # FCFS among the batch ones
    assert s.requests["batch-2"].num_computed_tokens == 0 and s.requests["batch-2"].metrics.num_preemptions == 1
