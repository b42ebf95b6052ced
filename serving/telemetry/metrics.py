"""`ServerMetrics`: the Prometheus metrics of one instance server in a private registry, with their buckets, named like
vLLM's (`vllm:` -> `meshserve:`) so routers that scrape vLLM read them with only the prefix changed.
Names and details: docs/metrics.md."""
from __future__ import annotations

import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PREFIX = "meshserve:"

# Buckets follow vLLM's so dashboards built for it keep working.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 1.0, 2.5, 5.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")


STRUCTURED_COUNTERS = {
    "structured_requests": "Requests with structured outputs (a grammar).",
    "grammar_compiles": "Grammars compiled (cache misses).",
    "grammar_compile_seconds": "Time spent compiling grammars.",
    "grammar_cache_hits": "Grammars found compiled in the cache.",
    "grammar_mask_seconds": "Host time filling the grammars' token masks (while the forward runs).",
    "grammar_mask_steps": "Steps that filled token masks.",
}

# The host KV tier (serving.core.host_kv; Engine.host_kv_stats), mirrored like the counters above; zero when off.
HOST_KV_COUNTERS = {
    "host_prefix_cache_hits": "Prompt tokens found in the host KV tier (part of prefix_cache_hits).",
    "kv_offload_pages_to_host": "KV pages copied device -> host (cached blocks the device pool evicted).",
    "kv_offload_pages_to_device": "KV pages copied host -> device (host-tier prefix hits).",
    "kv_offload_bytes_to_host": "Bytes copied device -> host by the host KV tier.",
    "kv_offload_bytes_to_device": "Bytes copied host -> device by the host KV tier.",
    "kv_offload_load_wait_seconds": "Step-thread time blocked on host-tier copies (an offload a load reads, or a "
                                    "load when nothing else can step).",
    "kv_offload_load_seconds": "Host -> device loads' time from start until their pages landed (requests wait "
                               "meanwhile in the loading state; summed per load).",
    "host_kv_cache_dropped_blocks": "Cached blocks the host tier's LRU dropped (gone from both tiers).",
}


class ServerMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], dict], registry: CollectorRegistry | None = None,
                 num_speculative_tokens: int = 0, page_size: int = 0, num_pages: int = 0, cache_dtype: str = "",
                 dtype: str = "", quantization: str = "", max_lora: int = 0):
        """engine_stats() returns the scheduler's stats() (read at scrape time; plain integer reads), plus the
        speculative decoder's stats() when num_speculative_tokens > 0 (then the spec_decode_* series exist).
        page_size (tokens per KV page), num_pages (the instance's KV pages) and cache_dtype (what the cache
        holds), when given, label the cache_config_info gauge; dtype and quantization (the weights') the
        model_config_info gauge. max_lora > 0 (--enable_lora): the lora_requests_info gauge, from the stats'
        `lora_requests_info`."""
        self.registry = registry or CollectorRegistry()
        self._engine_stats = engine_stats
        self._lock = threading.Lock()
        self._stats_cache: dict = {}
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc, key):
            g = Gauge(PREFIX + name, doc, labels, registry=r)
            g.labels(model_name).set_function(lambda: float(self._stat(key)))
            return g

        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting")
        self.num_requests_running = gauge("num_requests_running", "Requests holding KV pages (in prefill or decode).",
                                          "num_running")
        self.num_waiting_tokens = gauge("num_waiting_tokens", "Prompt tokens of the waiting requests.",
                                        "num_waiting_tokens")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage: 1 = every page in use.",
                                         "kv_cache_usage")
        self.host_kv_cache_usage_perc = gauge("host_kv_cache_usage_perc", "Host KV tier usage: 1 = every host page "
                                              "holds a cached block (0 when the tier is off).", "host_kv_cache_usage")
        self.host_kv_cache_pages = gauge("host_kv_cache_pages", "Host KV tier size in pages (0: off).",
                                         "host_kv_cache_pages")
        self.host_kv_cache_bytes = gauge("host_kv_cache_bytes", "Host memory the host KV tier holds.",
                                         "host_kv_cache_bytes")
        if (page_size > 0) != (num_pages > 0):
            raise ValueError(f"ServerMetrics: page_size and num_pages go together, got {page_size}, {num_pages}")
        if page_size > 0:  # vLLM's label names, so routers (GIE / llm-d EPP) read the KV geometry unchanged
            self.cache_config_info = Gauge(PREFIX + "cache_config_info", "KV-cache configuration (value 1): "
                                           "block_size = tokens per page, num_gpu_blocks = KV pages, cache_dtype = "
                                           "what the cache holds.",
                                           labels + ["block_size", "num_gpu_blocks", "cache_dtype"], registry=r)
            self.cache_config_info.labels(model_name, str(page_size), str(num_pages), cache_dtype).set(1)
        if dtype:
            self.model_config_info = Gauge(PREFIX + "model_config_info", "Model configuration (value 1): dtype = "
                                           "parameters and activations, quantization = the matmul weights' "
                                           "(none, int8, fp8).", labels + ["dtype", "quantization"], registry=r)
            self.model_config_info.labels(model_name, dtype, quantization or "none").set(1)
        self.lora_requests_info = None
        if max_lora > 0:  # vLLM's labels and value (the time of the reading), which llm-d's LoRA-affinity scorer reads
            self.lora_requests_info = Gauge(
                PREFIX + "lora_requests_info", "LoRA adapters of the running and the waiting requests (comma-separated "
                "names) and the adapter slots; the value is the time of the reading.",
                ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
            self.lora_requests_info.labels("", "", str(max_lora)).set(time.time())
        self.draining = Gauge(PREFIX + "draining", "1 while the server is draining (admitting nothing).", labels,
                              registry=r)
        self.compile_count = Gauge(PREFIX + "compile_count", "XLA programs compiled (at start-up, by warm-up).",
                                   labels, registry=r)
        self.compile_time = Gauge(PREFIX + "compile_time_seconds", "Time spent compiling at start-up.", labels,
                                  registry=r)
        # Parallelism (sharding): pipeline bubble and expert load, read at scrape time.
        self.pipeline_bubble_fraction = gauge(
            "pipeline_bubble_fraction", "Idle share of each pipeline stage per step: (pp-1)/(micro_batches+pp-1).",
            "pipeline_bubble_fraction")
        self.expert_load_variance = gauge(
            "expert_load_variance", "Variance over expert-parallel devices of the tokens routed to each (mean over "
            "MoE layers, since start or the last rebalance).", "expert_load_variance")
        self.expert_tokens = Gauge(PREFIX + "expert_tokens", "Tokens routed to each physical expert slot since start "
                                   "or the last rebalance.", labels + ["layer", "slot"], registry=r)
        # Counters the engine keeps; mirrored at scrape time by a small collector below.
        self.prefix_cache_queries = Counter(PREFIX + "prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", labels, registry=r)
        self.prefix_cache_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                         labels, registry=r)
        self.num_preemptions = Counter(PREFIX + "num_preemptions", "Requests preempted (recomputed later).", labels,
                                       registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.request_errors = Counter(PREFIX + "request_errors",
                                      "Requests refused or failed, by gRPC status code.", labels + ["code"],
                                      registry=r)
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                                             labels, buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds",
                                             "Time between consecutive output tokens.", labels,
                                             buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
                                             labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.",
                                            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_prefill_time = Histogram(PREFIX + "request_prefill_time_seconds",
                                              "First scheduled to first token.", labels,
                                              buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_decode_time = Histogram(PREFIX + "request_decode_time_seconds", "First token to finish.",
                                             labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request.",
                                               labels, buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens",
                                                   "Generated tokens per request.", labels,
                                                   buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.step_time = Histogram(PREFIX + "step_time_seconds",
                                   "Engine step time per device: launch until the device's result was ready.",
                                   labels + ["device"], buckets=STEP_BUCKETS, registry=r)
        self.step_tokens = Counter(PREFIX + "step_tokens", "Tokens run through the model (prompt and decode).",
                                   labels, registry=r)
        self.kv_transfer_bytes = Counter(PREFIX + "kv_transfer_bytes", "KV page bytes pulled from prefill instances "
                                         "(--role=decode).", labels, registry=r)
        self.kv_transfer_seconds = Histogram(PREFIX + "kv_transfer_seconds", "Time to pull one request's KV pages "
                                             "from its prefill instance (--role=decode).", labels,
                                             buckets=STEP_BUCKETS, registry=r)
        self.kv_transfer_pieces = Counter(PREFIX + "kv_transfer_pieces", "KVPages messages with pages pulled from "
                                          "prefill instances (--role=decode), by whether the prefill still ran "
                                          "(during: a streamed transfer's chunk) or had ended (after).",
                                          labels + ["prefill"], registry=r)
        self.model_name = model_name
        # Every series exists from the start (at zero), so rates and dashboards work before the first event.
        for metric in (self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions, self.prompt_tokens,
                       self.generation_tokens, self.time_to_first_token, self.inter_token_latency,
                       self.e2e_request_latency, self.request_queue_time, self.request_prefill_time,
                       self.request_decode_time, self.request_prompt_tokens, self.request_generation_tokens,
                       self.step_tokens, self.draining, self.compile_count, self.compile_time):
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self._mirrored = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}
        # Structured outputs (serving.core.structured.StructuredOutputs.stats) and the host KV tier
        # (HOST_KV_COUNTERS), mirrored like the counters above.
        self._structured = {}
        for key, doc in STRUCTURED_COUNTERS.items():
            self._structured[key] = Counter(PREFIX + key, doc, labels, registry=r)
            self._structured[key].labels(model_name)
            self._mirrored[key] = 0
        for key, doc in HOST_KV_COUNTERS.items():
            self._structured[key] = Counter(PREFIX + key, doc, labels, registry=r)
            self._structured[key].labels(model_name)
            self._mirrored[key] = 0
        self._spec_counters: dict[str, Counter] = {}
        self._spec_per_pos = None
        if num_speculative_tokens:  # vLLM's spec-decode series (created only when speculation is on, as there)
            for key, doc in (("spec_decode_num_drafts", "Speculative rounds (sequences that proposed drafts)."),
                             ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
                             ("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.")):
                self._spec_counters[key] = Counter(PREFIX + key, doc, labels, registry=r)
                self._spec_counters[key].labels(model_name)
                self._mirrored[key] = 0
            self._spec_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft (0 = first).",
                                         labels + ["position"], registry=r)
            for pos in range(num_speculative_tokens):
                self._spec_per_pos.labels(model_name, str(pos))
            self._mirrored_per_pos = [0] * num_speculative_tokens

    def _stat(self, key: str) -> float:
        with self._lock:
            return self._stats_cache.get(key, 0)

    def refresh(self) -> None:
        """Reads the engine's gauges and counters; called before each scrape."""
        stats = self._engine_stats()
        with self._lock:
            self._stats_cache = stats
            lora = stats.get("lora_requests_info")
            if lora is not None and self.lora_requests_info is not None:
                self.lora_requests_info.clear()  # one series: the current adapters
                self.lora_requests_info.labels(",".join(lora["running"]), ",".join(lora["waiting"]),
                                               str(lora["max_lora"])).set(time.time())
            for (layer, slot), tokens in stats.get("expert_tokens", {}).items():
                self.expert_tokens.labels(self.model_name, str(layer), str(slot)).set(tokens)
            for key, counter in (("prefix_cache_queries", self.prefix_cache_queries),
                                 ("prefix_cache_hits", self.prefix_cache_hits),
                                 ("num_preemptions", self.num_preemptions)):
                delta = int(stats.get(key, 0)) - self._mirrored[key]
                if delta > 0:
                    counter.labels(self.model_name).inc(delta)
                    self._mirrored[key] += delta
            for key, counter in self._structured.items():
                delta = float(stats.get(key, 0)) - self._mirrored[key]
                if delta > 0:
                    counter.labels(self.model_name).inc(delta)
                    self._mirrored[key] += delta
            for key, counter in self._spec_counters.items():
                delta = int(stats.get(key, 0)) - self._mirrored[key]
                if delta > 0:
                    counter.labels(self.model_name).inc(delta)
                    self._mirrored[key] += delta
            if self._spec_per_pos is not None:
                for pos, value in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", ())):
                    delta = int(value) - self._mirrored_per_pos[pos]
                    if delta > 0:
                        self._spec_per_pos.labels(self.model_name, str(pos)).inc(delta)
                        self._mirrored_per_pos[pos] += delta

    def observe_step(self, num_tokens: int, device_step_times_s: dict[str, float]) -> None:
        self.step_tokens.labels(self.model_name).inc(num_tokens)
        for device, t in device_step_times_s.items():
            self.step_time.labels(self.model_name, device).observe(t)

    def observe_finished(self, *, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int,
                         arrival_time: float, first_scheduled_time: float | None, first_token_time: float | None,
                         token_times: list[float], finished_time: float | None) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.generation_tokens.labels(m).inc(num_output_tokens)
        self.request_success.labels(m, finish_reason).inc()
        self.request_prompt_tokens.labels(m).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(m).observe(num_output_tokens)
        if finished_time is not None:
            self.e2e_request_latency.labels(m).observe(max(0.0, finished_time - arrival_time))
        if first_scheduled_time is not None:
            self.request_queue_time.labels(m).observe(max(0.0, first_scheduled_time - arrival_time))
            if first_token_time is not None:
                self.request_prefill_time.labels(m).observe(max(0.0, first_token_time - first_scheduled_time))
        if first_token_time is not None:
            self.time_to_first_token.labels(m).observe(max(0.0, first_token_time - arrival_time))
            if finished_time is not None:
                self.request_decode_time.labels(m).observe(max(0.0, finished_time - first_token_time))
        itl = self.inter_token_latency.labels(m)
        for a, b in zip(token_times, token_times[1:]):
            itl.observe(max(0.0, b - a))

    def observe_kv_transfer(self, nbytes: int, seconds: float, pieces: int = 0, during_prefill: int = 0) -> None:
        self.kv_transfer_bytes.labels(self.model_name).inc(nbytes)
        self.kv_transfer_seconds.labels(self.model_name).observe(seconds)
        self.kv_transfer_pieces.labels(self.model_name, "during").inc(during_prefill)
        self.kv_transfer_pieces.labels(self.model_name, "after").inc(pieces - during_prefill)

    def observe_error(self, code: str) -> None:
        self.request_errors.labels(self.model_name, code).inc()

    def set_compile_stats(self, count: int, seconds: float) -> None:
        self.compile_count.labels(self.model_name).set(count)
        self.compile_time.labels(self.model_name).set(seconds)

    def set_draining(self, draining: bool) -> None:
        self.draining.labels(self.model_name).set(1.0 if draining else 0.0)

    def start_http_server(self, port: int, addr: str = "0.0.0.0"):
        """Serves /metrics; returns (http server, its port). Refreshes the engine's numbers on every scrape."""
        registry = self.registry
        outer = self

        class _Refreshing(CollectorRegistry):  # refresh, then let the real registry collect
            def collect(self):
                try:
                    outer.refresh()
                except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is busy
                    pass
                return registry.collect()

        server, _thread = start_http_server(port, addr=addr, registry=_Refreshing())
        return server, server.server_port
