"""Engine: the jit-compiled ragged step over the model, driven by the Scheduler.

One jitted function runs a RaggedBatch (prefill chunks + decode tokens) through the model, writes new K/V into
the donated per-layer page buffers, computes logits only at each sequence's last token and samples on device.
Token counts are padded to power-of-two buckets (the sequence bucket follows the token bucket), all compiled
at start-up by `warmup()`. The sampled tokens (and logprobs) are packed into one array and copied to the host
once per step, asynchronously; while step N runs on the device, the host turns step N-1's tokens into text and
delivers it.

Greedy steps (no penalties, no logprobs: the common case) skip the sampling program: the forward itself returns
each row's argmax. After such a step the engine looks one step ahead (`EngineConfig.async_scheduling`): it
schedules and launches step N+1 before step N's tokens reach the host, its decodes fed from step N's tokens on
the device, so the host's work between steps (collecting, scheduling, building inputs, dispatch) no longer
leaves the device idle. A request that step N ends (a stop token) wastes one token of step N+1, dropped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.batch import ragged_batch_from_arrays
from models.config import ModelConfig
from models.tokenizer import Tokenizer
from models.moe import ExpertCounts, MoE
from models.transformer import CausalLM, init_kv_caches
from pallas_kernels.matmul import SCREEN_MAX_ROWS
from pallas_kernels import native
from serving.core import sampling
from serving.core.batch import BatchBuilder
from serving.core.request import FinishReason, Priority, Request
from serving.core.sampling_params import MAX_LOGPROBS, SamplingParams
from sharding.multihost import local_value, to_global
from sharding.mesh import kv_cache_sharding, mesh_context, serving_mesh
from serving.core.scheduler import PLACEHOLDER_TOKEN, RequestOutput, Scheduler, SchedulerConfig, SchedulerOutput

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(slots=True)
class EngineConfig:
    model: str  # HF directory or Orbax checkpoint (models.convert)
    dtype: str = "float32"  # parameter and KV-cache dtype
    page_size: int = 16
    num_pages: int = 0  # 0: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None  # default: the model's context, capped by the page pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    min_token_bucket: int = 0  # 0: the platform's smallest efficient matmul height (`default_min_token_bucket`)
    max_prefill_chunk: int | None = None
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 22
    long_prompt_threshold: int = 8192
    max_long_prefills: int = 1
    priority_ageing_s: float = 10.0
    seed: int = 0
    # Greedy steps: launch the next step before this one's tokens reach the host (its decodes read them on device)
    async_scheduling: bool = True
    # JAX's persistent compilation cache: None = $MESHSERVE_COMPILATION_CACHE or ~/.cache/meshserve/xla; "" = off
    compilation_cache_dir: str | None = None
    # Greedy steps of few sequences on the native CPU kernels: the LM head's argmax from an int8 copy of it plus
    # the few rows its error bounds leave open (the same tokens, a quarter / an eighth of the head's read)
    greedy_head_screen: bool = True
    debug_step_delay_s: float = 0.0  # adds this much to every step (to simulate a slow device in tests)
    tp: int = 1  # tensor-parallel degree (devices on the mesh's 'tensor' axis)
    ep: int = 1  # expert-parallel degree (MoE models; devices on the 'expert' axis)
    dp: int = 1  # data-parallel replicas inside the instance (serving.core.data_parallel)
    pp: int = 1  # pipeline stages (serving.core.pipeline_engine)
    micro_batches: int = 0  # pipeline micro-batches per step; 0 = pp
    spare_expert_slots: int = 0  # MoE: extra physical slots per layer for replicas of hot experts
    # Speculative decoding (serving.core.speculative): "" = off, "draft" (speculative_model) or "ngram"
    speculative_method: str = ""
    speculative_model: str = ""
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    speculative_disable_by_batch_size: int = 0
    speculative_min_acceptance: float = -1.0  # < 0: the break-even rate for k and the draft's cost

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.min_token_bucket < 0:
            raise ValueError(f"EngineConfig.min_token_bucket must be >= 0 (0 = auto), got {self.min_token_bucket}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "tp", "ep", "dp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 0 or self.kv_cache_memory_gb <= 0:
            raise ValueError("EngineConfig.num_pages must be >= 0 and kv_cache_memory_gb > 0")
        if self.speculative_method:
            self.speculative_config()  # validates

    def speculative_config(self):
        """The SpeculativeConfig of these settings, or None when speculation is off."""
        if not self.speculative_method:
            return None
        from serving.core.speculative import SpeculativeConfig
        return SpeculativeConfig(
            method=self.speculative_method, num_speculative_tokens=self.num_speculative_tokens,
            model=self.speculative_model, prompt_lookup_min=self.prompt_lookup_min,
            prompt_lookup_max=self.prompt_lookup_max, disable_by_batch_size=self.speculative_disable_by_batch_size,
            min_acceptance=self.speculative_min_acceptance)

    def token_buckets(self) -> list[int]:
        smallest = self.min_token_bucket or default_min_token_bucket(self.dtype)
        out, t = [], min(smallest, self.max_num_batched_tokens)
        while t < self.max_num_batched_tokens:
            out.append(t)
            t *= 2
        return out + [self.max_num_batched_tokens]


COMPILATION_CACHE_ENV = "MESHSERVE_COMPILATION_CACHE"
# Programs compiling faster than this are not written to the cache (they cost less than reading it back).
COMPILATION_CACHE_MIN_SECS_ENV = "MESHSERVE_COMPILATION_CACHE_MIN_SECS"


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache, so a restart with the same model, flags and JAX build loads
    its programs instead of compiling them (start-up to ready: minutes -> seconds). `path` None: the
    MESHSERVE_COMPILATION_CACHE environment variable, else ~/.cache/meshserve/xla; "" or "off": leave it off.
    MESHSERVE_COMPILATION_CACHE_MIN_SECS (default 0.2): programs compiling faster are not cached.
    Returns the directory in use, or None."""
    if path is None:
        path = os.environ.get(COMPILATION_CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "meshserve", "xla"))
    if not path or path.lower() in ("off", "none", "0"):
        return None
    if jax.config.jax_compilation_cache_dir != path:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ.get(COMPILATION_CACHE_MIN_SECS_ENV, "0.2")))
        # An LRU bound; it also makes readers and writers take the cache's file lock, so instances started
        # together never read a half-written entry.
        jax.config.update("jax_compilation_cache_max_size", 8 << 30)
    return path


def default_min_token_bucket(dtype: str, platform: str | None = None) -> int:
    """The smallest token bucket worth compiling. On CPU a float32 step costs about its weights' read at any
    height, so a lone decode runs as 1 row (padding it to 16 costs 2.5x); XLA:CPU's bf16 matmuls (AMX, f32
    accumulation) are fast only from ~8 rows, below which they fall off to a path ~4x slower than float32 —
    unless the native CPU kernels (`pallas_kernels.native`) run those small steps. Accelerators: 8 (a sublane tile)."""
    platform = platform or jax.default_backend()
    if platform == "cpu":
        dt = jnp.dtype(DTYPES[dtype])
        if dt.itemsize == 4 or (dt == jnp.bfloat16 and native.enabled()):
            return 1  # the native kernels take bf16 below 8 rows at about its weights' read
        return 8
    return 8


@dataclasses.dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n alternatives, best first


@dataclasses.dataclass(slots=True)
class StepOutput:
    """What one request gained in one step, with its text."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    logprobs: list[Logprob] | None
    request: Request


@dataclasses.dataclass(slots=True)
class _InFlight:
    """A launched step whose results have not reached the host."""
    sched: SchedulerOutput
    result: jax.Array  # greedy: int32 [token slots]; else the sampler's packed float32 [S, 2 + 2 * n]
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


class _Detok:
    """Per-request text state: incremental detokenizer plus the stop-string search window."""
    __slots__ = ("detok", "text", "emitted", "stops", "max_stop", "include_stop")

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids, params: SamplingParams):
        self.detok = tokenizer.detokenizer(prompt_ids, params.skip_special_tokens) if tokenizer else None
        self.text = ""
        self.emitted = 0  # characters of self.text already delivered
        self.stops = params.stop
        self.max_stop = max((len(s) for s in params.stop), default=0)
        self.include_stop = params.include_stop_str_in_output

    def add(self, token_ids: list[int], final: bool) -> tuple[str, str | None]:
        """Returns (new text to deliver, the stop string hit or None)."""
        if self.detok is None:
            return "", None
        start = max(0, len(self.text) - self.max_stop + 1)
        self.text += self.detok.add(token_ids)
        if final:
            self.text += self.detok.flush()
        hit = None
        if self.stops:
            best = -1
            for s in self.stops:
                i = self.text.find(s, start)
                if i >= 0 and (best < 0 or i < best):
                    best, hit = i, s
            if hit is not None:
                self.text = self.text[:best + (len(hit) if self.include_stop else 0)]
        # Hold back a tail that could still become a stop string.
        hold = 0 if (final or hit is not None) else max(0, self.max_stop - 1)
        end = max(self.emitted, len(self.text) - hold)
        new = self.text[self.emitted:end]
        self.emitted = end
        return new, hit


class Engine:
    """Synchronous engine: `add_request`, then `step()` until idle. Not thread-safe; AsyncEngine wraps it."""

    def __init__(self, config: EngineConfig, *, model: CausalLM | None = None, tokenizer: Tokenizer | None = None,
                 mesh=None):
        self.config = config
        t0 = time.perf_counter()
        self.compilation_cache_dir = enable_compilation_cache(config.compilation_cache_dir)
        dtype = DTYPES[config.dtype]
        if mesh is None and config.tp * config.ep > 1:
            mesh = serving_mesh(tp=config.tp, ep=config.ep)
        self.mesh = mesh
        if model is None:
            from models.weights import is_orbax_dir, load_hf_model, load_model
            if config.spare_expert_slots and not is_orbax_dir(config.model):
                cfg = ModelConfig.from_pretrained(config.model)
                cfg = dataclasses.replace(cfg, num_expert_slots=cfg.num_experts + config.spare_expert_slots)
                model = load_hf_model(config.model, dtype=dtype, mesh=mesh, config=cfg)
            elif config.spare_expert_slots:
                raise ValueError("spare_expert_slots needs an HF checkpoint (Orbax stores the slots it was saved with)")
            else:
                model = load_model(config.model, dtype=dtype, mesh=mesh)
        self.model_config: ModelConfig = model.config
        if tokenizer is None:
            try:
                tokenizer = Tokenizer.from_pretrained(config.model)
            except FileNotFoundError:
                log.warning("no tokenizer in %s: token ids in and out only", config.model)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer else self.model_config.eos_token_ids
        self.load_time_s = time.perf_counter() - t0

        mc = self.model_config
        if config.num_pages:
            num_pages = config.num_pages
        else:
            per_page = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * jnp.dtype(dtype).itemsize * \
                config.page_size
            if config.speculative_method == "draft":  # the draft's pages share the budget (same page ids)
                from serving.core.speculative import draft_kv_bytes_per_page
                per_page += draft_kv_bytes_per_page(config.speculative_model, config.dtype, config.page_size)
            num_pages = max(1, int(config.kv_cache_memory_gb * (1 << 30) // per_page))
        max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings,
                            num_pages * config.page_size)
        self.max_model_len = max_model_len
        self.num_pages = num_pages
        self.max_pages = -(-max_model_len // config.page_size)
        try:
            from serving.ledger import ledger_summary
            log.info("%s", ledger_summary(mc, dtype=config.dtype, page_size=config.page_size, num_pages=num_pages,
                                          mesh_shape={"tensor": config.tp, "expert": config.ep,
                                                      "pipeline": config.pp},
                                          max_batched_tokens=config.max_num_batched_tokens,
                                          max_seqs=config.max_num_seqs))
        except Exception as e:  # noqa: BLE001 - the ledger is a report; it must never stop the engine
            log.warning("memory ledger unavailable: %s", e)
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=max_model_len, num_pages=num_pages, page_size=config.page_size,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            max_prefill_chunk=config.max_prefill_chunk, enable_prefix_caching=config.enable_prefix_caching,
            max_waiting_requests=config.max_waiting_requests, max_waiting_tokens=config.max_waiting_tokens,
            long_prompt_threshold=config.long_prompt_threshold, max_long_prefills=config.max_long_prefills,
            priority_ageing_s=config.priority_ageing_s))
        self.buckets = config.token_buckets()
        self.packed_weights = 0
        # Greedy steps of few sequences take the LM head's int8 screen (settable: the benchmark flips it to compare)
        self.screen_greedy = False
        if (mesh is None or mesh.size == 1) and jax.process_count() == 1 and native.enabled():
            # Single-device CPU serving: weights into the native kernels' panel layout (a clone: the caller's
            # model keeps its own).
            model = nnx.clone(model)
            self.screen_greedy = config.greedy_head_screen and model.add_head_screen()
            if self.screen_greedy:
                log.info("greedy steps of up to %d sequences take the LM head's int8 screen", SCREEN_MAX_ROWS)
            self.packed_weights = model.pack_for_cpu_kernels()
            log.info("packed %d weight matrices into native CPU panels", self.packed_weights)
        self.graphdef, self.state = nnx.split(model)
        self._kv_sharding = kv_cache_sharding(mc.num_kv_heads, mesh)
        self.kv_caches = init_kv_caches(mc, num_pages, config.page_size, dtype, self._kv_sharding)
        self._forward_fn = jax.jit(self._forward_flat, donate_argnums=(1, 3), static_argnames=("greedy_only",))
        # The forward's greedy tokens are padded to the widest sequence bucket, so a step can read the previous
        # step's tokens whatever its bucket (no extra programs).
        self._token_slots = max(self.seq_bucket(t) for t in self.buckets)
        self._no_src: dict[int, np.ndarray] = {}
        self._flat_state = None  # (state, leaves, treedef): the forward takes the state as a flat list
        self._placements = {}
        self._expert_load = None
        if mc.is_moe:
            from sharding.experts import identity_placement
            slots = mc.num_expert_slots or mc.num_experts
            self._placements = {i: identity_placement(mc.num_experts, slots, config.ep)
                                for i in self.moe_layer_indices()}
            self._expert_load = jnp.zeros((len(self._placements), slots), jnp.int32)
        self._sample_fn = jax.jit(self._sample, static_argnums=(2,))
        self._batch_builder = BatchBuilder(page_size=config.page_size, max_pages=self.max_pages,
                                           max_seqs=config.max_num_seqs)
        self._penalty_window = 1 << (max_model_len - 1).bit_length()
        self._num_candidates = min(256, mc.vocab_size)
        self._detoks: dict[str, _Detok] = {}
        self._seed_rng = np.random.default_rng(config.seed)
        self.compile_count = 0
        self.compile_time_s = 0.0
        self.step_count = 0
        self.last_step_time_s = 0.0
        self.last_step: StepRecord | None = None  # the step collected by the latest step() call
        self.multihost = jax.process_count() > 1
        self.channel = None  # multi-host leader: the LeaderChannel to the followers (sharding.multihost)
        self._pending: _InFlight | None = None  # the step in flight
        self._older: _InFlight | None = None  # the step before it, while the look-ahead launches _pending
        self._last_done = 0.0  # time.perf_counter() when the latest collected step's results were on the host
        # Device idle between back-to-back steps waiting on the host (launch after the previous step's results
        # arrived), summed, and the steps counted: what async scheduling removes.
        self.host_gap_s = 0.0
        self.host_gap_steps = 0
        self._pending_spec = None  # the SpecPlan of the step in flight when it speculated
        self.spec = None  # SpeculativeDecoder when speculative decoding is on
        if config.speculative_method:
            from serving.core.speculative import SpeculativeDecoder
            self.spec = SpeculativeDecoder(self, config.speculative_config())
        # One step ahead needs the plain program (not the speculative one) on one device: the previous step's
        # tokens then enter the next forward with the same placement as the stand-in every other step passes, so
        # look-ahead steps reuse the warmed-up programs.
        single = mesh is None or mesh.size == 1
        self.look_ahead = config.async_scheduling and self.spec is None and single and not self.multihost
        self._no_prev = np.zeros(self._token_slots, np.int32)
        if self.look_ahead:
            device = next(iter(jax.tree.leaves(self.state)[0].devices()))
            self._no_prev = jax.device_put(self._no_prev, device)
        self.look_ahead_steps = 0  # steps launched before the previous step's tokens reached the host
        self._current: SchedulerOutput | None = None  # the step being launched

    # ------------------------------------------------------------------ device side
    def _state_leaves(self) -> list:
        """The state's arrays as a flat list, cached: jit's C++ fast path takes a list of arrays in microseconds,
        while flattening the nnx State's ~100 Variables in Python cost ~1 ms of host time per step."""
        if self._flat_state is None or self._flat_state[0] is not self.state:
            leaves, treedef = jax.tree.flatten(self.state)
            self._flat_state = (self.state, leaves, treedef)
        return self._flat_state[1]

    def _forward_flat(self, leaves, kv_caches, arrays, expert_load, greedy_only=False):
        """The forward on the flat state, plus each sequence's greedy token [token slots]. Input tokens with a
        source row (`token_src` >= 0: look-ahead decodes) are the previous step's greedy tokens there."""
        arrays = dict(arrays)
        src, prev = arrays.pop("token_src"), arrays.pop("prev_tokens")
        arrays["input_ids"] = jnp.where(src >= 0, prev[jnp.maximum(src, 0)], arrays["input_ids"])
        logits, tokens, kv_caches, expert_load = self._forward(
            jax.tree.unflatten(self._flat_state[2], leaves), kv_caches, arrays, expert_load, greedy_only)
        if tokens is None:
            tokens = sampling.greedy(logits)
        return logits, kv_caches, expert_load, jnp.pad(tokens, (0, self._token_slots - tokens.shape[0]))

    def _forward(self, state, kv_caches, arrays, expert_load, greedy_only):
        """Pure. The model over a ragged batch: float32 logits at each sequence's last token, their greedy tokens
        (or None: the caller takes the argmax), the caches, and (MoE) the running per-slot expert token counts
        [moe_layers, slots] plus this step's. `greedy_only` (static; `_screens` says when): only the greedy
        tokens will be read, and the model's screened greedy head runs instead of the full head (no logits: an
        empty [S, 0])."""
        model = nnx.merge(self.graphdef, state)
        batch = ragged_batch_from_arrays(arrays)
        if expert_load is None:
            hidden, kv_caches = model(batch, kv_caches)
        else:  # the MoE layers sow their per-slot token counts
            (hidden, kv_caches), sown = nnx.capture(model, ExpertCounts)(batch, kv_caches)
            counts = [sown["layers"][i]["mlp"]["counts"].get_value()[0]
                      for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
            expert_load = expert_load + jnp.stack(counts)
        rows = hidden[batch.logits_indices]
        tokens = model.screened_greedy(rows, batch.attention.num_seqs) if greedy_only else None
        if tokens is not None:
            return jnp.zeros((rows.shape[0], 0), jnp.float32), tokens, kv_caches, expert_load
        return model.compute_logits(rows), None, kv_caches, expert_load  # (also if the screen cannot run here)

    @staticmethod
    def _sample(logits, sampling_tensors, max_logprobs):
        """Pure. Sampling, packed into one float32 array [S, 2 + 2 * max_logprobs] for a single host copy:
        token id, its logprob, then the top-n ids and their logprobs."""
        out = sampling.sample(logits, sampling_tensors, max_logprobs=max_logprobs)
        return jnp.concatenate([
            out.token_ids.astype(jnp.float32)[:, None], out.logprobs[:, None],
            out.top_logprob_ids.astype(jnp.float32), out.top_logprobs], axis=1)

    def _sampling_tensors(self, requests: Sequence[Request], num_slots: int) -> sampling.SamplingTensors:
        """Per-step sampling inputs, with the static variant canonicalised so that a bucket has only the few
        programs `warmup` compiles (greedy or not, penalties or not)."""
        params = [r.sampling_params for r in requests]
        penalties = any(p.has_penalties for p in params)
        st = sampling.build_sampling_tensors(
            params, vocab_size=self.model_config.vocab_size, num_slots=num_slots,
            token_ids=[r.token_ids for r in requests], num_prompt_tokens=[r.num_prompt_tokens for r in requests])
        if not penalties:
            st = dataclasses.replace(st, token_ids=None, num_prompt_tokens=None)
        else:
            window = np.full((num_slots, self._penalty_window), -1, np.int32)
            window[:, :st.token_ids.shape[1]] = st.token_ids
            st = dataclasses.replace(st, token_ids=window)
        if not st.all_greedy:
            st = dataclasses.replace(st, num_candidates=self._num_candidates, use_min_p=True)
        return st

    def _run_forward(self, arrays, token_src: np.ndarray | None = None, prev_tokens=None, greedy_only=False):
        """Launches the forward; returns (logits, greedy tokens) and keeps the new caches. `greedy_only`: the step
        reads only the greedy tokens (the logits may be left out)."""
        if "token_src" not in arrays:
            t = len(arrays["input_ids"])
            if token_src is None:
                token_src = self._no_src.get(t)
                if token_src is None:
                    token_src = self._no_src[t] = np.full(t, -1, np.int32)
            prev_tokens = self._no_prev if prev_tokens is None else prev_tokens
            arrays = dict(arrays, token_src=token_src, prev_tokens=prev_tokens)
        if self.channel is not None:  # multi-host leader: the followers run the same call
            self.channel.broadcast(("forward", arrays, greedy_only))
        if self.multihost:
            arrays = to_global(arrays, self.mesh)
        with mesh_context(self.mesh):
            logits, self.kv_caches, self._expert_load, tokens = self._forward_fn(
                self._state_leaves(), self.kv_caches, arrays, self._expert_load, greedy_only=greedy_only)
        return logits, tokens

    def follow(self, channel) -> None:
        """Multi-host follower: runs each jitted call the leader announces, until it says stop."""
        logits = None
        while True:
            message = channel.recv()
            if message[0] == "forward":
                logits, _ = self._run_forward(message[1], greedy_only=message[2])
            elif message[0] == "sample":
                self._run_sample(logits, message[1], message[2])
            elif message[0] == "stop":
                return
            else:
                raise ValueError(f"unknown step-channel message {message[0]!r}")

    # ------------------------------------------------------------------ expert load (MoE)
    def moe_layer_indices(self) -> list[int]:
        return [i for i, moe in enumerate(self.model_config.moe_layers) if moe]

    def expert_load(self) -> np.ndarray | None:
        """Tokens routed to each physical expert slot since the last reset, [moe_layers, slots]."""
        return None if self._expert_load is None else np.asarray(self._expert_load)

    def expert_device_load(self) -> np.ndarray | None:
        """Tokens per expert-parallel device since the last reset, [moe_layers, ep]."""
        load = self.expert_load()
        if load is None:
            return None
        return load.reshape(load.shape[0], self.config.ep, -1).sum(axis=2)

    def reset_expert_load(self) -> None:
        if self._expert_load is not None:
            self._expert_load = jnp.zeros_like(self._expert_load)

    def rebalance_experts(self) -> dict[str, float]:
        """Rebuilds every MoE layer's logical -> physical expert map from the load observed since the last
        reset (hot experts get the spare slots, replicas spread over devices) and moves the expert weights to
        match, between steps. Returns the per-device load variance the new placement predicts, before/after."""
        from sharding.experts import balanced_placement
        load = self.expert_load()
        if load is None:
            raise ValueError("rebalance_experts: the model has no MoE layers")
        before, after = [], []
        for row, layer in zip(load, self.moe_layer_indices()):
            old = self._placements[layer]
            logical = np.bincount(old.slot_to_expert, weights=row, minlength=old.num_experts)
            new = balanced_placement(logical, old.num_slots, old.num_devices)
            # Predicted per-slot load under the new map: each expert's load split over its replicas.
            per_replica = logical / np.bincount(new.slot_to_expert, minlength=old.num_experts)
            before.append(np.var(old.device_load(row)))
            after.append(np.var(new.device_load(per_replica[new.slot_to_expert])))
            source = np.array([np.flatnonzero(old.slot_to_expert == e)[0] for e in new.slot_to_expert], np.int32)
            mlp = self.state["layers"][layer]["mlp"]
            with mesh_context(self.mesh):
                for name in ("gate_proj", "up_proj", "down_proj"):
                    w = mlp[name].get_value()
                    gather = jax.jit(lambda w, i: w[i], out_shardings=w.sharding, donate_argnums=(0,))
                    mlp[name].set_value(gather(w, jnp.asarray(source)))
                table, count = new.replica_table(mlp["replica_slots"].get_value().shape[1])
                for name, value in (("replica_slots", table), ("replica_count", count)):
                    old_value = mlp[name].get_value()
                    mlp[name].set_value(jax.device_put(value, old_value.sharding))
            self._placements[layer] = new
        self._flat_state = None  # the expert weights were replaced in the state
        self.reset_expert_load()
        return {"variance_before": float(np.mean(before)), "variance_after": float(np.mean(after))}


    def _run_sample(self, logits, st, max_logprobs):
        if self.channel is not None:
            self.channel.broadcast(("sample", st, max_logprobs))
        if self.multihost:
            st = to_global(st, self.mesh)
        with mesh_context(self.mesh):
            return self._sample_fn(logits, st, max_logprobs)

    def _step_arrays(self, chunks, num_tokens: int, num_seqs: int) -> dict:
        """Host-side. The step's input arrays, padded to the bucket (subclasses lay them out differently)."""
        return self._batch_builder.build(chunks, num_tokens=num_tokens, num_seqs=num_seqs)

    def bucket_for(self, num_tokens: int) -> tuple[int, int]:
        """(token bucket, sequence bucket) of a step of `num_tokens` tokens."""
        for t in self.buckets:
            if t >= num_tokens:
                return t, self.seq_bucket(t)
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def seq_bucket(self, token_bucket: int) -> int:
        """Sequence slots of a token bucket: the next power of 4 (capped by max_num_seqs), so token buckets share
        sampling programs (a padded slot costs one row of logits; each sampling variant is a separate program,
        and compiling them dominated start-up)."""
        s = 1
        while s < token_bucket:
            s *= 4
        return min(s, self.config.max_num_seqs)

    def warmup(self) -> None:
        """Compiles every program a request can need (per token bucket: the forward, and the sampling variants
        greedy/random x penalties/none x logprobs/none), so no request ever waits on a compile."""
        t0 = time.perf_counter()
        variants = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0),
                    SamplingParams(temperature=0.0, repetition_penalty=1.1),
                    SamplingParams(temperature=1.0, seed=0, repetition_penalty=1.1)]
        for t in self.buckets:
            s = self.seq_bucket(t)
            arrays = self._step_arrays([], t, s)
            logits, _ = self._run_forward(arrays)
            self.compile_count += 1
            if self._screens(s):
                self._run_forward(arrays, greedy_only=True)
                self.compile_count += 1
            for params in variants:
                dummy = Request("warmup", [0], params, arrival_time=0.0)
                st = self._sampling_tensors([dummy], s)
                st = dataclasses.replace(st, valid=np.zeros_like(st.valid))
                for n in (0, MAX_LOGPROBS):
                    self._run_sample(logits, st, n).block_until_ready()
                    self.compile_count += 1
        if self.spec is not None:
            self.compile_count += self.spec.warmup()
        self.compile_time_s = time.perf_counter() - t0
        log.info("compiled %d programs for token buckets %s in %.1fs", self.compile_count, self.buckets,
                 self.compile_time_s)

    # ------------------------------------------------------------------ requests
    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                     priority: int = Priority.INTERACTIVE, deadline: float | None = None,
                     arrival_time: float | None = None) -> Request:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; send token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(self._seed_rng.integers(0, 2 ** 31)))
        now = time.monotonic() if arrival_time is None else arrival_time
        return Request(request_id, prompt_ids, params, arrival_time=now, priority=priority, deadline=deadline,
                       eos_token_ids=self.eos_token_ids)

    def add_request(self, request: Request) -> None:
        """Queues a request (raises ValueError / PromptTooLongError / QueueFullError before queueing)."""
        self.scheduler.add_request(request)
        self._detoks[request.request_id] = _Detok(self.tokenizer, request.prompt_token_ids,
                                                  request.sampling_params)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> StepOutput | None:
        out = self.scheduler.finish_request(request_id, reason)
        return self._final(out) if out else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._pending is not None or self._older is not None

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        """Runs one step: collects step N-1's tokens, schedules and launches step N, then turns N-1's tokens into
        text (detokenisation, stop strings, delivery) while step N runs on the device. After a greedy step N-1
        (look-ahead), step N is scheduled and launched first and N-1's tokens are collected after."""
        results: list[tuple[RequestOutput, np.ndarray]] = []
        if self._pending is not None:
            if self.look_ahead and self._pending.greedy:
                self._older, self._pending = self._pending, None
            else:
                # The scheduler needs step N-1's tokens to plan step N (decode inputs, stop checks).
                results = self._collect(self._pending)
                self._pending = None
        sched = self.scheduler.schedule()
        if sched.scheduled:
            self._current = sched
            self._launch(sched, self._older)
            self._current = None
        if self._older is not None:
            results = self._collect(self._older)
            self._older = None
        outputs = [self._process(o, row) for o, row in results]
        outputs += [self._final(o) for o in sched.finished]
        return outputs

    @staticmethod
    def _fast_greedy(sched: SchedulerOutput) -> bool:
        """Every sequence that samples takes the plain argmax (the forward's own tokens; no sampling program)."""
        for s in sched.scheduled:
            p = s.request.sampling_params
            if s.sample and (not p.is_greedy or p.has_penalties or p.logprobs is not None):
                return False
        return True

    def _screens(self, seq_bucket: int) -> bool:
        """Whether a greedy step with this many sequence slots takes the screened greedy head (its own program)."""
        return self.screen_greedy and seq_bucket <= SCREEN_MAX_ROWS

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
        t_bucket, s_bucket = self.bucket_for(sched.num_scheduled_tokens)
        arrays = self._step_arrays(sched.scheduled, t_bucket, s_bucket)
        src = self._token_sources(sched, t_bucket, prev)
        fast_greedy = self._fast_greedy(sched)
        t0 = time.perf_counter()
        logits, tokens = self._run_forward(arrays, src, None if src is None else prev.result,
                                           fast_greedy and self._screens(s_bucket))
        launched = time.perf_counter()
        self.look_ahead_steps += src is not None
        if fast_greedy:
            tokens.copy_to_host_async()
            self._pending = _InFlight(sched, tokens, t0, True, launched)
            return
        # The sampling inputs are built while the forward runs.
        sampled = sched.scheduled
        st = self._sampling_tensors([s.request for s in sampled], s_bucket)
        st = dataclasses.replace(st, valid=st.valid & np.array(
            [s.sample for s in sampled] + [False] * (s_bucket - len(sampled))))
        want_logprobs = any(s.request.sampling_params.logprobs is not None for s in sampled)
        packed = self._run_sample(logits, st, MAX_LOGPROBS if want_logprobs else 0)
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
        self._last_done = time.perf_counter()
        host = local_value(packed)
        self.last_step_time_s = time.perf_counter() - t0
        if self.config.debug_step_delay_s:
            time.sleep(self.config.debug_step_delay_s)
            # A simulated slow device: its step times include the delay.
            device_times = {d: t + self.config.debug_step_delay_s for d, t in device_times.items()}
        end = time.monotonic()
        self.last_step = StepRecord(sched.scheduled, sched.num_scheduled_tokens,
                                    end - (time.perf_counter() - t0), end, device_times)
        self.step_count += 1
        n = len(sched.scheduled)
        if step.greedy:
            no_logprobs = np.zeros(0, np.float32)
            return [(o, no_logprobs) for o in self.scheduler.update(sched, host[:n].astype(np.int64))]
        plan, self._pending_spec = self._pending_spec, None
        if plan is not None:  # speculative step: several tokens per sequence, rejected K/V rolled back
            results = self.scheduler.update(sched, self.spec.accept(sched, plan, host))
            self.spec.after_update(plan)
            no_logprobs = np.zeros(2, np.float32)
            return [(o, no_logprobs) for o in results]
        results = self.scheduler.update(sched, host[:n, 0].astype(np.int64))
        rows = {s.request_id: i for i, s in enumerate(sched.scheduled)}
        return [(o, host[rows[o.request_id]]) for o in results]

    def _process(self, out: RequestOutput, row: np.ndarray) -> StepOutput:
        r = out.request
        logprobs = None
        if r.sampling_params.logprobs is not None and out.new_token_ids:
            n = r.sampling_params.logprobs
            top = [(int(row[2 + j]), float(row[2 + MAX_LOGPROBS + j])) for j in range(n)]
            logprobs = [Logprob(int(row[0]), float(row[1]), top)]
        d = self._detoks.get(r.request_id)
        trimmed = False
        if d is not None and d.stops and len(out.new_token_ids) > 1:
            # speculative: several tokens, none past a stop string
            text, hit, trimmed = self._add_until_stop(d, out)
        else:
            text, hit = d.add(out.new_token_ids, out.finished) if d else ("", None)
        finished, reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
        if trimmed and finished:  # it ended on a later token (EOS, length): the stop string came first
            reason, stop_reason = r.finish_reason, r.stop_reason = FinishReason.STOP, hit
        if hit is not None and not finished:
            # The step in flight may hold a token for it; update() drops tokens of finished requests.
            self.scheduler.finish_request(r.request_id, FinishReason.STOP, stop_reason=hit)
            finished, reason, stop_reason = True, FinishReason.STOP, hit
        if finished:
            self._detoks.pop(r.request_id, None)
        return StepOutput(r.request_id, out.new_token_ids, text, finished, reason, stop_reason, logprobs, r)

    @staticmethod
    def _add_until_stop(d: _Detok, out: RequestOutput) -> tuple[str, str | None, bool]:
        """Detokenizes a multi-token step one token at a time; at a stop string the tokens after it are dropped
        (from the output and the request) so a speculative step never emits past it."""
        tokens = out.new_token_ids
        pieces = []
        for i, t in enumerate(tokens):
            text, hit = d.add([t], out.finished and i == len(tokens) - 1)
            pieces.append(text)
            if hit is not None:
                extra = len(tokens) - i - 1
                if extra:
                    r = out.request
                    del r.token_ids[len(r.token_ids) - extra:]
                    del r.metrics.token_times[len(r.metrics.token_times) - extra:]
                    del tokens[i + 1:]
                return "".join(pieces), hit, extra > 0
        return "".join(pieces), None, False

    def _final(self, out: RequestOutput) -> StepOutput:
        d = self._detoks.pop(out.request_id, None)
        text = d.add([], True)[0] if d else ""
        return StepOutput(out.request_id, [], text, True, out.finish_reason, out.stop_reason, None, out.request)

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
        if any(kv.is_deleted() for kv in self.kv_caches):
            victims.update(self.scheduler.requests)
            lost = True
            self.kv_caches = init_kv_caches(self.model_config, self.num_pages, self.config.page_size,
                                            DTYPES[self.config.dtype], self._kv_sharding)
        outputs = []
        for rid in victims:
            out = self.scheduler.finish_request(rid, FinishReason.ERROR, stop_reason=f"{type(error).__name__}: {error}")
            if out is not None:
                outputs.append(self._final(out))
        if lost:
            self.scheduler.block_manager.reset_prefix_cache()  # cached blocks pointed into the lost pages
        return outputs

    def run_until_idle(self, on_output: Callable[[StepOutput], None] | None = None) -> None:
        while self.has_unfinished():
            for o in self.step():
                if on_output:
                    on_output(o)
