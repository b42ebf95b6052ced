"""`Engine`: the step loop. Each step the Scheduler plans a ragged batch, the ModelRunner launches it on the device,
and the OutputProcessor turns the tokens of the step before into text while it runs; after a greedy step it looks one
step ahead. Also the in-flight step state and `StepRecord`. Details: docs/engine.md."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import jax
import numpy as np

from models.config import ModelConfig
from models.tokenizer import Tokenizer
from models.transformer import CausalLM
from pallas_kernels.target import canonical_platform
from serving.core.config import EngineConfig
from serving.core.block_manager import BlockManager
from serving.core.host_kv import HostKVPool, host_pages_for
from serving.core.hybrid_block_manager import HybridBlockManager
from serving.core.lora import AdapterRegistry, LoRASlots, UnknownAdapterError, slot_values
from serving.core.model_runner import ModelRunner
from serving.core.output_processor import OutputProcessor, StepOutput
from serving.core.pipeline_runner import PipelineModelRunner
from serving.core.platform import DTYPES
from serving.core.request import FinishReason, Priority, Request
from serving.params import MAX_LOGPROBS, InvalidArgument, ModelLimits, SamplingParams, check_prompt
from serving.core.scheduler import PLACEHOLDER_TOKEN, RequestOutput, Scheduler, SchedulerConfig, SchedulerOutput
from serving.core.speculative import SpeculativeDecoder
from serving.core.structured import StructuredOutputs
from sharding.multihost import local_value

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _InFlight:
    """A launched step whose results have not reached the host."""
    sched: SchedulerOutput
    result: jax.Array  # greedy: int32 [token slots]; else the sampler's packed int32 [S, 2 + 2 * n] (sampling.pack)
    start: float  # time.perf_counter() at launch
    greedy: bool
    launched: float  # time.perf_counter() when the launch returned (the device has its work)


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One step whose results reached the host (Engine.last_step): what ran and when, for metrics and traces."""
    scheduled: list  # the step's ScheduledSequences (prefill chunks and decodes)
    num_scheduled_tokens: int
    start_time: float  # time.monotonic() at launch
    end_time: float  # time.monotonic() when its tokens were on the host
    device_step_times_s: dict[str, float]  # per device: launch until its share of the result was ready


class Engine:
    """Synchronous engine: `add_request`, then `step()` until idle. Not thread-safe; AsyncEngine wraps it.
    `runner` is the device side (a PipelineModelRunner when config.pp > 1). With config.enable_lora, `adapters` is
    the registry of LoRA adapters it serves (given: shared with other replicas; else its own, holding
    config.lora_modules) and `lora` its device's adapter slots."""

    def __init__(self, config: EngineConfig, *, model: CausalLM | None = None, tokenizer: Tokenizer | None = None,
                 mesh=None, adapters: AdapterRegistry | None = None):
        self.config = config
        runner_class = PipelineModelRunner if config.pp > 1 else ModelRunner
        self.runner: ModelRunner = runner_class(config, model=model, mesh=mesh)
        if tokenizer is None:
            try:
                tokenizer = Tokenizer.from_pretrained(config.model)
            except FileNotFoundError:
                log.warning("no tokenizer in %s: token ids in and out only", config.model)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer else self.model_config.eos_token_ids
        self.structured = StructuredOutputs(tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                            reasoning_parser=config.reasoning_parser)
        r = self.runner
        self.adapters: AdapterRegistry | None = None
        self.lora: LoRASlots | None = None
        if config.enable_lora:
            own = adapters is None
            self.adapters = adapters if adapters is not None else AdapterRegistry(self.model_config,
                                                                                   config.max_lora_rank)
            dtype, layout, mc = DTYPES[config.dtype], r.lora_layout, self.model_config
            self.lora = LoRASlots(config.max_loras, lambda a: slot_values(a.peft, mc, layout, dtype),
                                  r.write_lora_slot)
            if own:
                for name, path in config.lora_module_paths().items():
                    self.adapters.add(name, path)
            for adapter in self.adapters.adapters():
                self.lora.prefetch(adapter)
        block_manager = None
        if r.window_pages:  # sliding-window layers keep only their window (models.kv_cache.window_pools)
            block_manager = HybridBlockManager(r.num_pages, config.page_size, window_pages=r.window_pages,
                                               enable_prefix_caching=config.enable_prefix_caching)
            r.batch_builder.window_maps = block_manager.window_maps
        self.spec = None  # SpeculativeDecoder when speculative decoding is on (its scheduler: set below)
        if config.speculative_method:  # before the host tier: a host slot holds the draft cache's page too
            self.spec = SpeculativeDecoder(r, None, config.speculative_config())
        self.host_kv: HostKVPool | None = None  # the host tier's pages and transfers (--host_kv_cache_gb)
        if config.host_kv_cache_gb > 0:
            self._check_host_tier(config)
            draft = self.spec if self.spec is not None and self.spec.draft_kv is not None else None
            host_pages = host_pages_for(config.host_kv_cache_gb, [r.kv_caches, draft and draft.draft_kv])
            if host_pages < 1:
                raise ValueError(f"host_kv_cache_gb={config.host_kv_cache_gb} holds no KV page of this model")
            if r.window_pages:  # a host slot: a block's full-attention page and its window pages it still has
                block_manager = HybridBlockManager(r.num_pages, config.page_size, window_pages=r.window_pages,
                                                   host_pages=host_pages)
                r.batch_builder.window_maps = block_manager.window_maps
            else:
                block_manager = BlockManager(r.num_pages, config.page_size, host_pages=host_pages)
            # a step allocates at most a page per scheduled token's block, plus one per sequence it crosses into
            per_step = -(-config.max_num_batched_tokens // config.page_size) + config.max_num_seqs
            self.host_kv = HostKVPool(r, host_pages, per_step, draft=draft)
            log.info("host KV tier: %d pages (%.2f GiB) under %d device pages", host_pages,
                     self.host_kv.nbytes / (1 << 30), r.num_pages)
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=r.max_model_len, num_pages=r.num_pages, page_size=config.page_size,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            max_prefill_chunk=config.max_prefill_chunk, enable_prefix_caching=config.enable_prefix_caching,
            max_waiting_requests=config.max_waiting_requests, max_waiting_tokens=config.max_waiting_tokens,
            long_prompt_threshold=config.long_prompt_threshold, max_long_prefills=config.max_long_prefills,
            priority_ageing_s=config.priority_ageing_s), block_manager, adapters=self.lora)
        self.kv_events = None  # KVEventPublisher (--kv_events_endpoint)
        if config.kv_events_endpoint:
            from serving.core.kv_events import KVEventPublisher  # pyzmq only when the stream is on
            self.kv_events = KVEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint,
                                              allow_remote=config.kv_events_allow_remote)
            self.scheduler.block_manager.events = []
            if config.kv_events_block_hash == "vllm":
                from serving.core.block_hash import vllm_block_hasher
                self.scheduler.block_manager.use_block_hasher(vllm_block_hasher())
            log.info("KV events on %s (replay: %s)", self.kv_events.endpoint,
                     self.kv_events.replay_endpoint or "off")
        self.outputs = OutputProcessor(
            tokenizer, lambda rid, reason, stop: self.scheduler.finish_request(rid, reason, stop_reason=stop))
        self._seed_rng = np.random.default_rng(config.seed)
        self.step_count = 0
        self.last_step_time_s = 0.0
        self.last_step: StepRecord | None = None  # the step collected by the latest step() call
        self._pending: _InFlight | None = None  # the step in flight
        self._older: _InFlight | None = None  # the step before it, while the look-ahead launches _pending
        self._last_done = 0.0  # time.perf_counter() when the latest collected step's results were on the host
        # Device idle between back-to-back steps waiting on the host (launch after the previous step's results
        # arrived), summed, and the steps counted: what async scheduling removes.
        self.host_gap_s = 0.0
        self.host_gap_steps = 0
        self._pending_spec = None  # the SpecPlan of the step in flight when it speculated
        if self.spec is not None:
            self.spec.scheduler = self.scheduler
            self.spec.before_run = self._run_host_copies  # its drafts' pages are allocated after schedule()
        # One step ahead needs the plain program (not the speculative one) on one device: the previous step's
        # tokens then enter the next forward with the same placement as the stand-in every other step passes, so
        # look-ahead steps reuse the warmed-up programs.
        self.look_ahead = config.async_scheduling and self.spec is None and r.single_device
        self.look_ahead_steps = 0  # steps launched before the previous step's tokens reached the host
        self._current: SchedulerOutput | None = None  # the step being launched

    def _check_host_tier(self, config: EngineConfig) -> None:
        why = [reason for reason, bad in (
            ("--enable_prefix_caching is off", not config.enable_prefix_caching),
            ("--pp > 1", config.pp > 1)) if bad]
        if why:
            raise ValueError(f"host_kv_cache_gb={config.host_kv_cache_gb}: the host KV tier is not available here: "
                             f"{'; '.join(why)}")

    # ------------------------------------------------------------------ what the server and metrics read
    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def num_pages(self) -> int:
        return self.runner.num_pages

    @property
    def buckets(self) -> list[int]:
        return self.runner.buckets

    @property
    def compile_count(self) -> int:
        return self.runner.compile_count

    @property
    def compile_time_s(self) -> float:
        return self.runner.compile_time_s

    @property
    def devices(self) -> list:
        return sorted(jax.tree.leaves(self.runner.kv_caches[0])[0].sharding.device_set, key=lambda d: d.id)

    @property
    def bubble_fraction(self) -> float:
        return getattr(self.runner, "bubble_fraction", 0.0)

    def expert_load(self) -> np.ndarray | None:
        return self.runner.expert_load()

    def host_kv_stats(self) -> dict[str, float]:
        """The host KV tier's counters and use (`serving.telemetry.metrics.HOST_KV_COUNTERS`); {} when it is off."""
        pool = self.host_kv
        if pool is None:
            return {}
        host = self.scheduler.block_manager.host
        return dict(host_prefix_cache_hits=host.hit_blocks * self.config.page_size,
                    kv_offload_pages_to_host=host.offloaded_pages, kv_offload_pages_to_device=host.loaded_pages,
                    kv_offload_bytes_to_host=pool.bytes_to_host, kv_offload_bytes_to_device=pool.bytes_to_device,
                    kv_offload_load_wait_seconds=pool.load_wait_s, kv_offload_load_seconds=pool.load_time_s,
                    host_kv_cache_dropped_blocks=host.dropped_blocks,
                    host_kv_cache_usage=host.num_used / host.num_slots, host_kv_cache_pages=host.num_slots,
                    host_kv_cache_bytes=pool.nbytes)

    def expert_device_load(self) -> np.ndarray | None:
        return self.runner.expert_device_load()

    def moe_layer_indices(self) -> list[int]:
        return self.runner.moe_layer_indices()

    def reset_expert_load(self) -> None:
        self.runner.reset_expert_load()

    def rebalance_experts(self) -> dict[str, float]:
        return self.runner.rebalance_experts()

    def warmup(self) -> None:
        """Compiles every program a request can need, so no request ever waits on a compile."""
        if self.runner.platform != canonical_platform():
            raise RuntimeError(f"this engine's programs are for {self.runner.platform} (EngineConfig.platform) and this "
                               f"host runs {canonical_platform()}: they can be lowered (lower_programs), not run")
        t0 = time.perf_counter()
        self.runner.warmup()
        if self.spec is not None:
            self.runner.compile_count += self.spec.warmup()
            self.runner.compile_time_s = time.perf_counter() - t0
        if self.host_kv is not None:
            self.runner.compile_count += self.host_kv.warmup()
            self.runner.compile_time_s = time.perf_counter() - t0
        log.info("compiled %d programs for token buckets %s in %.1fs", self.compile_count, self.runner.buckets,
                 self.compile_time_s)

    def warmup_plan(self) -> list:
        """Every program `warmup` compiles (`model_runner.Program`): the runner's, then the speculative step's."""
        return self.runner.warmup_plan() + (self.spec.warmup_plan() if self.spec is not None else [])

    def lower_programs(self) -> dict:
        """Each program of `warmup_plan` lowered for the engine's platform (`EngineConfig.platform`; from any host),
        by name."""
        out = {}
        for program in self.warmup_plan():
            owner = self.spec if program.kind == "speculative" else self.runner
            out[program.name] = self.runner.lower(owner.trace_program(program))
        return out

    @property
    def channel(self):
        """A multi-host leader's step channel to its followers (`sharding.multihost.LeaderChannel`), else None."""
        return self.runner.channel

    def follow(self, channel) -> None:
        """Multi-host follower: runs the leader's steps (`ModelRunner.follow`)."""
        self.runner.follow(channel, self.host_kv)

    # ------------------------------------------------------------------ requests
    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                     priority: int = Priority.INTERACTIVE, deadline: float | None = None,
                     arrival_time: float | None = None, field: str = "prompt", cache_salt: str = "",
                     adapter: str | None = None) -> Request:
        """A request checked against the model, once for the process (serving.params.check_prompt: token ids in the
        vocabulary, the prompt shorter than the context; its grammar compiled or found in the cache), before anything
        is queued. Raises InvalidArgument naming `field` (the prompt, as the frontend's request names it). Requests
        share prefix-cache entries only with requests of the same `cache_salt`. `adapter`: the name of a loaded LoRA
        adapter to run it on (None: the base model; an unknown one: UnknownAdapterError)."""
        params = params or SamplingParams()
        adapter = params.adapter if adapter is None else adapter  # the frontends name it in the params
        lora = self._adapter(adapter) if adapter is not None else None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgument(f"{field}: this model has no tokenizer; send token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        check_prompt(field, prompt_ids, params, ModelLimits(self.model_config.vocab_size, self.max_model_len))
        if params.seed is None:  # (an n > 1 request's samples derive theirs from it: request.sample_seed)
            params = dataclasses.replace(params, seed=int(self._seed_rng.integers(0, 2 ** 31)))
        now = time.monotonic() if arrival_time is None else arrival_time
        request = Request(request_id, prompt_ids, params, arrival_time=now, priority=priority, deadline=deadline,
                          eos_token_ids=self.eos_token_ids, cache_salt=cache_salt)
        rope = self.model_config.rope
        original = rope.original_max_position_embeddings if rope.rope_type == "longrope" else 0
        for sample in request.samples:
            sample.adapter = lora
            sample.rope_original, sample.rope_long = original, bool(original) and len(prompt_ids) > original
        self.structured.attach(request)  # compiles (or finds) its grammar: a bad one is an InvalidSampling here
        return request

    def _adapter(self, name: str):
        if self.adapters is None:
            raise UnknownAdapterError(f"adapter {name!r}: this engine serves no LoRA adapters (start it with "
                                      "--enable_lora)")
        return self.adapters.get(name)

    # ------------------------------------------------------------------ LoRA adapters
    def load_adapter(self, name: str, path: str) -> dict:
        """Registers the PEFT adapter in directory `path` as `name` (AdapterError: it does not fit the model;
        ValueError: the name is taken) and starts loading it into an empty slot if there is one. Returns its
        info."""
        adapter = self._registry().add(name, path)
        self.lora.prefetch(adapter)
        return adapter.info()

    def unload_adapter(self, name: str) -> dict:
        """Unregisters adapter `name` (UnknownAdapterError if it is not loaded): requests naming it from now on are
        refused, requests already in flight on it finish on it (their slot is freed after the last); returns its
        info with how many such requests there are."""
        adapter = self._registry().remove(name)
        self.lora.forget(adapter)
        return adapter.info() | {"requests_in_flight": self.adapter_requests(adapter)}

    def adapter_requests(self, adapter) -> int:
        """Unfinished requests (samples) on `adapter`."""
        return sum(1 for r in self.scheduler.requests.values() if r.adapter is adapter)

    def list_adapters(self) -> list[dict]:
        """The loaded adapters' info, each with its device slot (None: not on the device now)."""
        if self.adapters is None:
            return []
        resident = self.lora.resident()
        return [a.info() | {"slot": resident.get(a.name)} for a in self.adapters.adapters()]

    def lora_requests_info(self) -> dict:
        """The adapters of the running and the waiting requests, and the slots (vLLM's lora_requests_info)."""
        s = self.scheduler
        return {"running": sorted({r.adapter.name for r in s.running if r.adapter is not None}),
                "waiting": sorted({r.adapter.name for r in s.waiting if r.adapter is not None}),
                "max_lora": self.config.max_loras if self.lora is not None else 0}

    def _registry(self) -> AdapterRegistry:
        if self.adapters is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable_lora)")
        return self.adapters

    def _poll_lora(self) -> list[StepOutput]:
        """Writes finished adapter loads into their slots; ends the requests waiting on an adapter that failed."""
        outputs = []
        for adapter, error in self.lora.poll():
            for r in [r for r in self.scheduler.waiting if r.adapter is adapter]:
                if not r.is_finished:
                    outputs += [self.outputs.final(o) for o in self.scheduler.finish_group(
                        r.request_id, FinishReason.ERROR, stop_reason=f"adapter {adapter.name!r} failed to load: "
                        f"{error}")]
        return outputs

    def add_request(self, request: Request) -> None:
        """Queues a request, with every sample of an n > 1 one (raises ValueError / PromptTooLongError /
        QueueFullError before queueing)."""
        self.scheduler.add_request(request)
        for sample in request.samples:
            self.outputs.add(sample)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> list[StepOutput]:
        """Ends the request (all its samples) now; returns the final output of each sample it ended."""
        return [self.outputs.final(o) for o in self.scheduler.finish_group(request_id, reason)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._pending is not None or self._older is not None

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        """Runs one step: collects step N-1's tokens, schedules and launches step N, then turns N-1's tokens into
        text (detokenisation, stop strings, delivery) while step N runs on the device. After a greedy step N-1
        (look-ahead), step N is scheduled and launched first and N-1's tokens are collected after."""
        results: list[tuple[RequestOutput, np.ndarray]] = []
        failed = self._poll_lora() if self.lora is not None else []
        if self._pending is not None:
            if self.look_ahead and self._pending.greedy:
                self._older, self._pending = self._pending, None
            else:
                # The scheduler needs step N-1's tokens to plan step N (decode inputs, stop checks).
                results = self._collect(self._pending)
                self._pending = None
        if self.host_kv is not None:  # host-tier loads that landed: their requests may step from this one on
            self.scheduler.block_manager.loaded(self.host_kv.poll())
        sched = self.scheduler.schedule()
        self._run_host_copies()
        if sched.scheduled:
            self._current = sched
            self._launch(sched, self._older)
            self._current = None
        if self._older is not None:
            results = self._collect(self._older)
            self._older = None
        outputs = [self.outputs.process(o, row) for o, row in results]
        outputs += [self.outputs.final(o) for o in sched.finished] + failed
        if self.kv_events is not None:
            events = self.scheduler.block_manager.events
            self.kv_events.publish(events)
            events.clear()
        if not sched.scheduled and self._pending is None and self.lora is not None and self.lora.loading:
            self.lora.wait(0.05)  # only adapter loads are under way: no busy loop while the host reads them
        if not sched.scheduled and self._pending is None and self.host_kv is not None:
            self.host_kv.wait_loads(0.01)  # only host-tier loads are under way: wait for one, not a busy loop
        return outputs

    def _run_host_copies(self) -> None:
        """Runs the host tier's copies the books already assume (offloads of evicted pages, loads of host hits) on
        the device before the next step's forward, which may overwrite or read those pages."""
        host = self.scheduler.block_manager.host
        if host is not None and host.ops:
            self.host_kv.run(host.ops)
            host.ops.clear()

    @staticmethod
    def _fast_greedy(sched: SchedulerOutput) -> bool:
        """Every sequence that samples takes the plain argmax (the forward's own tokens; no sampling program). A
        logit bias or a grammar takes the sampling program, whose argmax is the biased, masked one."""
        for s in sched.scheduled:
            p = s.request.sampling_params
            if s.sample and (not p.is_greedy or p.has_penalties or p.logprobs is not None or p.logit_bias
                             or s.request.grammar is not None):
                return False
        return True

    def _token_sources(self, sched: SchedulerOutput, t_bucket: int, prev: _InFlight | None) -> np.ndarray | None:
        """For a look-ahead step: per input token, the row of `prev` whose greedy token it is (-1: its own)."""
        src = None
        offset = 0
        for s in sched.scheduled:
            if s.token_ids[0] == PLACEHOLDER_TOKEN:
                if src is None:
                    if prev is None:
                        raise RuntimeError("a look-ahead decode was scheduled without a step in flight")
                    src = np.full(t_bucket, -1, np.int32)
                    rows = {q.request_id: i for i, q in enumerate(prev.sched.scheduled)}
                src[offset] = rows[s.request_id]
            offset += len(s.token_ids)
        return src

    def _launch(self, sched: SchedulerOutput, prev: _InFlight | None = None) -> None:
        if self.spec is not None:
            t0 = time.perf_counter()
            launched = self.spec.launch(sched)
            if launched is not None:
                packed, self._pending_spec = launched
                packed.copy_to_host_async()
                self._pending = _InFlight(sched, packed, t0, False, time.perf_counter())
                return
        runner = self.runner
        t_bucket, s_bucket = runner.bucket_for(sched.num_scheduled_tokens)
        if self.lora is None:
            batch = runner.step_batch(sched.scheduled, t_bucket, s_bucket)
        else:
            batch = runner.step_batch(sched.scheduled, t_bucket, s_bucket,
                                      [s.request.lora_slot for s in sched.scheduled])
        src = self._token_sources(sched, t_bucket, prev)
        fast_greedy = self._fast_greedy(sched)
        t0 = time.perf_counter()
        logits, tokens = runner.run_forward(batch, src, None if src is None else prev.result,
                                            fast_greedy and runner.screens(s_bucket))
        launched = time.perf_counter()
        self.look_ahead_steps += src is not None
        if fast_greedy:
            tokens.copy_to_host_async()
            self._pending = _InFlight(sched, tokens, t0, True, launched)
            return
        # The sampling inputs, and the grammars' masks, are built while the forward runs.
        sampled = sched.scheduled
        bitmask = self.structured.fill([s.request if s.sample else None for s in sampled], s_bucket)
        st = runner.sampling_tensors([s.request for s in sampled], s_bucket, bitmask)
        st = dataclasses.replace(st, valid=st.valid & np.array(
            [s.sample for s in sampled] + [False] * (s_bucket - len(sampled))))
        want_logprobs = any(s.request.sampling_params.logprobs is not None for s in sampled)
        packed = runner.run_sample(logits, st, MAX_LOGPROBS if want_logprobs else 0)
        packed.copy_to_host_async()
        self._pending = _InFlight(sched, packed, t0, False, launched)

    def _collect(self, step: _InFlight) -> list[tuple[RequestOutput, np.ndarray]]:
        sched, packed = step.sched, step.result
        # The device starts a step when it is launched or when the step before it ends, whichever is later (a
        # look-ahead step is launched while the previous one runs).
        t0 = max(step.start, self._last_done)
        gap = step.launched - self._last_done
        if gap < 1.0:  # back to back with the step before (not the first after idling)
            self.host_gap_s += max(0.0, gap)
            self.host_gap_steps += 1
        device_times = {}
        for shard in packed.addressable_shards:  # the copy to host is under way; this only waits for it
            shard.data.block_until_ready()
            device_times[str(shard.device)] = time.perf_counter() - t0
        host = local_value(packed)
        self.last_step_time_s = time.perf_counter() - t0
        if self.config.debug_step_delay_s:
            time.sleep(self.config.debug_step_delay_s)
            # A simulated slow device: its step times include the delay.
            device_times = {d: t + self.config.debug_step_delay_s for d, t in device_times.items()}
        # The step's span ends now, with its tokens on the host; the next step's starts no earlier (its t0 is at least
        # this), so consecutive spans never overlap however long the copy to host took on a busy machine.
        self._last_done = time.perf_counter()
        end = time.monotonic()
        self.last_step = StepRecord(sched.scheduled, sched.num_scheduled_tokens, end - (self._last_done - t0), end,
                                    device_times)
        self.step_count += 1
        n = len(sched.scheduled)
        if step.greedy:
            no_logprobs = np.zeros(0, np.int32)
            return [(o, no_logprobs) for o in self.scheduler.update(sched, host[:n].astype(np.int64))]
        plan, self._pending_spec = self._pending_spec, None
        if plan is not None:  # speculative step: several tokens per sequence, rejected K/V rolled back
            results = self.scheduler.update(sched, self.spec.accept(sched, plan, host))
            self.spec.after_update(plan)
            no_logprobs = np.zeros(2, np.int32)
            return [(o, no_logprobs) for o in results]
        results = self.scheduler.update(sched, host[:n, 0].astype(np.int64))
        rows = {s.request_id: i for i, s in enumerate(sched.scheduled)}
        return [(o, host[rows[o.request_id]]) for o in results]

    def fail_inflight(self, error: BaseException) -> list[StepOutput]:
        """After a failed step: ends the requests of that step with finish reason `error` (if the donated KV
        cache was lost with it, every running request too) and keeps the engine usable for the rest."""
        victims: set[str] = set()
        lost = False
        for sched in (self._older.sched if self._older else None, self._pending.sched if self._pending else None,
                      self._current):
            if sched is not None:
                victims.update(s.request_id for s in sched.scheduled)
        self._pending = None
        self._older = None
        self._pending_spec = None
        self._current = None
        if self.spec is not None:
            self.spec.on_failure()
        if any(kv.is_deleted() for kv in jax.tree.leaves(self.runner.kv_caches)):
            victims.update(self.scheduler.requests)
            lost = True
            self.runner.reset_kv_caches()
        outputs = []
        for rid in victims:  # (every sample of an n > 1 request: the K/V they share may be lost)
            for out in self.scheduler.finish_group(rid, FinishReason.ERROR,
                                                   stop_reason=f"{type(error).__name__}: {error}"):
                outputs.append(self.outputs.final(out))
        if lost:
            bm = self.scheduler.block_manager
            if self.host_kv is not None:
                bm.loaded(self.host_kv.reset())  # loads in flight are dropped with their pages' cache entries
                bm.host.ops.clear()
            bm.reset_prefix_cache()  # cached blocks pointed into the lost pages
        return outputs

    def run_until_idle(self, on_output: Callable[[StepOutput], None] | None = None) -> None:
        while self.has_unfinished():
            for o in self.step():
                if on_output:
                    on_output(o)
