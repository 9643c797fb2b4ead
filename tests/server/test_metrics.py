from __future__ import annotations

from types import SimpleNamespace

from hyperserve.engine.kv_transfer import KVTransferStats
from hyperserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from hyperserve.server.metrics import ServerMetrics


def output(request_id: str, finish_reason: str | None) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "x", [3], finish_reason)],
                         finish_reason is not None, RequestMetrics(arrival_time=0.0))


def fake_engine():
    pool = SimpleNamespace(num_evictions=0, num_used_blocks=0, num_blocks=100)
    kv = SimpleNamespace(usage=0.0, num_queried_tokens=0, num_hit_tokens=0, pool=pool, lower_tier=None)
    spec = SimpleNamespace(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, acceptance_rate=0.0,
                           mean_accepted_length=0.0)
    return SimpleNamespace(num_running=0, num_waiting=0, kv_cache=kv,
                           scheduler=SimpleNamespace(spec_stats=spec), lora=None,
                           kv_transfer=SimpleNamespace(stats=KVTransferStats()))


def test_finished_and_aborted_requests_leave_no_per_request_state():
    families, engine = ServerMetrics(), fake_engine()
    metrics = families.for_model("m")
    metrics.observe_step(engine, [output("a", None), output("b", None)])
    assert set(metrics._last_token_time) == {"a", "b"}
    metrics.observe_step(engine, [output("a", "stop")])
    metrics.observe_step(engine, [output("b", "abort")])  # AsyncEngine reports aborts through the same hook
    assert metrics._last_token_time == {}
    assert families.request_success.labels("m", "abort")._value.get() == 1


def test_a_reloaded_engine_counts_on_from_the_totals_exported_before():
    """An unloaded model's next engine starts its totals at zero: the counters go on from where the
    first engine left them, never backwards (prometheus refuses a negative increment)."""
    families = ServerMetrics()
    metrics = families.for_model("m")
    first = fake_engine()
    metrics.observe_step(first, [output("a", "stop")])
    first.kv_cache.num_queried_tokens = 100
    metrics.engine_gone()  # the model was unloaded: its last totals are exported
    metrics.new_engine()  # and loaded again
    second = fake_engine()
    second.kv_cache.num_queried_tokens = 30
    metrics.observe_step(second, [output("b", "stop")])
    assert queried(families) == 130


def queried(families: ServerMetrics) -> float:
    return families.registry.get_sample_value("hyperserve:prefix_cache_queries_total", {"model_name": "m"})


def test_engine_totals_and_gauges_are_read_when_scraped():
    """The engine thread only records the engine; each read of the registry exports what its
    totals and gauges say then, each increment once however often it is read."""
    families, engine = ServerMetrics(), fake_engine()
    metrics = families.for_model("m")
    metrics.observe_step(engine, [])
    engine.num_running, engine.kv_cache.num_queried_tokens, engine.kv_cache.pool.num_used_blocks = 3, 40, 25
    assert families.registry.get_sample_value("hyperserve:num_requests_running", {"model_name": "m"}) == 3
    assert families.registry.get_sample_value("hyperserve:kv_cache_touched_perc", {"model_name": "m"}) == 0.25
    assert queried(families) == 40
    engine.kv_cache.num_queried_tokens = 50
    assert queried(families) == queried(families) == 50
