"""Prometheus metrics, named like vLLM's (prefix `hyperserve:` for `vllm:`) so dashboards port."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hyperserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class ServerMetrics:
    """The metric families, one registry for every model the server holds (label `model_name`);
    `for_model` gives each engine its observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.models: list[ModelMetrics] = []
        self.registry.register(_EngineTotals(self.models))  # first: it updates the series read after it
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("hyperserve:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hyperserve:inter_token_latency_seconds", "Time between streamed tokens",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("hyperserve:e2e_request_latency_seconds", "Arrival to finish",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("hyperserve:request_queue_time_seconds", "Arrival to first scheduled",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        def counter(name: str, doc: str, names: list[str] = labels) -> Counter:
            return Counter(f"hyperserve:{name}", doc, names, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"hyperserve:{name}", doc, labels, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.preemptions = counter("num_preemptions", "Preemptions")
        self.request_success = counter("request_success", "Finished requests", labels + ["finished_reason"])
        self.running = gauge("num_requests_running", "Requests running")
        self.waiting = gauge("num_requests_waiting", "Requests waiting")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage, 0 to 1")
        self.kv_touched = gauge("kv_cache_touched_perc", "KV pool blocks written at least once, 0 to 1: "
                                "on the CPU, the share of the pool's cap that the process holds")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prefix_evictions = counter("prefix_cache_evictions", "Cached KV blocks evicted")
        self.disk_reads = counter("prefix_cache_disk_reads", "KV blocks loaded from the disk tier")
        self.disk_writes = counter("prefix_cache_disk_writes", "KV blocks written to the disk tier")
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Speculative verification steps (a request with draft tokens)")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_acceptance = gauge("spec_decode_acceptance_rate",
                                     "Accepted over proposed draft tokens, since start")
        self.spec_length = gauge("spec_decode_mean_accepted_length",
                                 "Tokens emitted per verification step, since start")
        # by where the drafts came from: text (the request's own), history (earlier answers), draft or
        # self (a model), grammar (tokens a grammar forces)
        by_source = labels + ["source"]
        self.spec_source_drafts = counter("spec_decode_num_draft_tokens_by_source",
                                          "Draft tokens proposed, by source", by_source)
        self.spec_source_accepted = counter("spec_decode_num_accepted_tokens_by_source",
                                            "Draft tokens accepted, by source", by_source)
        self.lora_loaded = gauge("lora_adapters_loaded", "LoRA adapters held in memory")
        self.lora_loads = counter("lora_adapter_loads", "LoRA adapters read from disk")
        self.lora_load_seconds = counter("lora_adapter_load_seconds", "Time spent reading LoRA adapters")
        self.lora_hits = counter("lora_adapter_hits", "Adapters of each step by the tier that had them: step "
                                 "(the previous step's batch; on the GPU, on the device), memory, disk",
                                 [*labels, "tier"])
        transfers = {"kv_blocks_sent": "KV blocks sent to decode servers (--role prefill)",
                     "kv_bytes_sent": "Bytes of KV sent to decode servers",
                     "kv_blocks_received": "KV blocks taken from a prefill server (--role decode), new here",
                     "kv_bytes_received": "Bytes of KV taken from a prefill server",
                     "kv_transfer_seconds": "Time waiting on the prefill server: its prefill and the "
                                            "transfer",
                     "kv_transfer_failures": "Remote prefills that failed; their prompts were computed here"}
        self.counters = {**{key: counter(key, doc) for key, doc in transfers.items()},
                         "queries": self.prefix_queries, "hits": self.prefix_hits,
                         "evictions": self.prefix_evictions, "disk_reads": self.disk_reads,
                         "disk_writes": self.disk_writes, "spec_drafts": self.spec_drafts,
                         "spec_draft_tokens": self.spec_draft_tokens,
                         "spec_accepted": self.spec_accepted_tokens,
                         "lora_loads": self.lora_loads, "lora_load_seconds": self.lora_load_seconds}

    def for_model(self, model_name: str) -> ModelMetrics:
        model = ModelMetrics(self, model_name)
        self.models.append(model)
        return model


class _EngineTotals:
    """Exports nothing itself. Registered first, it brings each model's gauges and engine-total
    counters up to date whenever the registry is read (a scrape, the web UI), so the engine thread
    does not write them every step: that took it about 1% of a SmolLM2 decode step."""

    def __init__(self, models: list[ModelMetrics]) -> None:
        self.models = models

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        for model in self.models:
            model.sync()
        return []


class ModelMetrics:
    """One engine's observer: what it has exported so far and its requests' last token times."""

    def __init__(self, families: ServerMetrics, model_name: str) -> None:
        self.families, self.model_name = families, model_name
        # this model's series, looked up once: `labels()` takes a lock and a dict lookup, and a
        # step's two dozen of them cost the engine thread 2.6% of a SmolLM2 decode step
        m = model_name
        self._running, self._waiting = families.running.labels(m), families.waiting.labels(m)
        self._kv_usage, self._kv_touched = families.kv_usage.labels(m), families.kv_touched.labels(m)
        self._itl, self._lora_loaded = families.itl.labels(m), families.lora_loaded.labels(m)
        self._spec_acceptance = families.spec_acceptance.labels(m)
        self._spec_length = families.spec_length.labels(m)
        self._counters = {key: counter.labels(m) for key, counter in families.counters.items()}
        self._sync_lock = threading.Lock()
        self.new_engine()

    def new_engine(self) -> None:
        """An engine (first or reloaded) starts: its totals count from zero, and it has no requests."""
        self._engine = None  # set by the engine's first step
        self._seen = dict.fromkeys(self.families.counters, 0)  # engine totals already exported
        self._seen_lora_hits = {"step": 0, "memory": 0, "disk": 0}
        self._seen_spec_sources: dict[str, tuple[int, int]] = {}  # source -> (drafted, accepted) exported
        self._last_token_time: dict[str, float] = {}  # request id -> when its last token came out

    def _sync_spec_sources(self, totals: dict[str, tuple[int, int]]) -> None:
        for source, (drafted, accepted) in totals.items():
            seen_drafted, seen_accepted = self._seen_spec_sources.get(source, (0, 0))
            self.families.spec_source_drafts.labels(self.model_name, source).inc(drafted - seen_drafted)
            self.families.spec_source_accepted.labels(self.model_name, source).inc(accepted - seen_accepted)
        self._seen_spec_sources = totals

    def observe_step(self, engine, outputs: list[RequestOutput]) -> None:
        """Engine-thread hook: what only the step knows (token times, finished requests)."""
        self._engine = engine
        now = time.time()
        for output in outputs:
            last = self._last_token_time.get(output.request_id)
            if last is not None:
                self._itl.observe(now - last)
            self._last_token_time[output.request_id] = now
            if output.finished:
                del self._last_token_time[output.request_id]
                self.observe_finished(output)

    def sync(self) -> None:
        """Gauges and counters from the engine's own totals, when the registry is read. Reads on
        another thread than the engine's are safe: plain ints, and dicts copied whole under the GIL."""
        with self._sync_lock:  # two readers at once would export the same increments twice
            engine = self._engine
            if engine is None:
                return
            kv = engine.kv_cache
            self._running.set(engine.num_running)
            self._waiting.set(engine.num_waiting)
            self._kv_usage.set(kv.usage)
            self._kv_touched.set(kv.pool.num_used_blocks / kv.pool.num_blocks)
            disk = kv.lower_tier.store if kv.lower_tier is not None else None
            spec = engine.scheduler.spec_stats
            lora = engine.lora
            totals = {"queries": kv.num_queried_tokens, "hits": kv.num_hit_tokens,
                      "evictions": kv.pool.num_evictions, "disk_reads": disk.num_reads if disk else 0,
                      "disk_writes": disk.num_writes if disk else 0,
                      "spec_drafts": spec.num_drafts, "spec_draft_tokens": spec.num_draft_tokens,
                      "spec_accepted": spec.num_accepted_tokens,
                      "lora_loads": lora.num_loads if lora else 0,
                      "lora_load_seconds": lora.load_seconds if lora else 0.0,
                      **{f"kv_{name}": value for name, value in vars(engine.kv_transfer.stats).items()}}
            self._lora_loaded.set(lora.num_loaded if lora else 0)
            if lora is not None:
                hits = dict(lora.hits)
                for tier, count in hits.items():
                    series = self.families.lora_hits.labels(self.model_name, tier)
                    series.inc(count - self._seen_lora_hits[tier])
                self._seen_lora_hits = hits
            if spec.num_drafts != self._seen["spec_drafts"]:
                self._spec_acceptance.set(spec.acceptance_rate)
                self._spec_length.set(spec.mean_accepted_length)
                by_source = list(spec.by_source.items())  # copied whole: the engine thread adds sources
                self._sync_spec_sources({source: tuple(counts) for source, counts in by_source})
            for key, total in totals.items():
                if total != self._seen[key]:
                    self._counters[key].inc(total - self._seen[key])
            self._seen = totals

    def observe_finished(self, output: RequestOutput) -> None:
        f, m, t = self.families, self.model_name, output.metrics
        if t.first_token_time is not None:
            f.ttft.labels(m).observe(t.first_token_time - t.arrival_time)
        if t.first_scheduled_time is not None:
            f.queue.labels(m).observe(t.first_scheduled_time - t.arrival_time)
        if t.finished_time is not None:
            f.e2e.labels(m).observe(t.finished_time - t.arrival_time)
        f.prompt_tokens.labels(m).inc(len(output.prompt_token_ids))
        f.generation_tokens.labels(m).inc(sum(len(c.token_ids) for c in output.outputs))
        f.preemptions.labels(m).inc(t.num_preemptions)
        for c in output.outputs:
            f.request_success.labels(m, c.finish_reason or "abort").inc()

    def engine_gone(self) -> None:
        """The model was unloaded: its last totals are exported, and its gauges say nothing runs."""
        self.sync()
        self._engine = None
        for gauge in (self._running, self._waiting, self._kv_usage, self._kv_touched):
            gauge.set(0)
