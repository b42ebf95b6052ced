"""`ModelRunner`: the device side of one engine: model load (packed for the native CPU kernels on one CPU device), the
paged KV caches (`kv_cache_pages`), the forward and sampling programs compiled per bucket at start-up and launched,
the multi-host follower, expert load; the compilation cache switch. Details: docs/engine.md."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.batch import RaggedBatch
from models.config import ModelConfig
from models.lora import ATTENTION_TARGETS
from models.moe import ExpertCounts, MoE
from models.kv_cache import init_kv_caches, window_pools
from models.transformer import CausalLM, kv_cache_specs
from models.weights import is_orbax_dir, load_model, param_sharding, read_config
from pallas_kernels import native
from pallas_kernels.attention import unsupported_reason
from pallas_kernels.lora import PAIR_COLUMNS, int8_fits, stack_layouts
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.matmul import SCREEN_MAX_ROWS, head_screen_bytes
from pallas_kernels.target import canonical_platform, lowering_platform, tracing_for
from serving import ledger
from serving.core import sampling
from serving.core.batch import BatchBuilder
from serving.core.config import EngineConfig
from serving.core.platform import DTYPES, default_compilation_cache_dir
from serving.core.request import Request
from serving.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutput
from sharding.experts import balanced_placement, identity_placement
from sharding.mesh import mesh_context, serving_mesh
from sharding.multihost import to_global
from sharding.rules import DEFAULT_RULES

log = logging.getLogger(__name__)

# Programs compiling faster than this are not written to the cache (they cost less than reading it back).
COMPILATION_CACHE_MIN_SECS_ENV = "MESHSERVE_COMPILATION_CACHE_MIN_SECS"
# The cache's bound in GiB (default 8; 0: unbounded, JAX's own default). A bound is an LRU under a file lock: every
# write then lists the whole directory and reads each entry's access time (jax's LRUCache), ~75 ms of CPU per
# program written at 1,000 entries and ~225 ms at 3,000 (Zen 3), so a directory that gathers thousands of small
# programs (the test suite's) pays for it quadratically; unbounded, a write is one file and takes no lock.
COMPILATION_CACHE_MAX_GIB_ENV = "MESHSERVE_COMPILATION_CACHE_MAX_GIB"


def _env_float(name: str, default: str, meaning: str) -> float:
    value = os.environ.get(name, default)
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number ({meaning})") from None


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache, so a restart with the same model, flags and JAX build loads
    its programs instead of compiling them (start-up to ready: minutes -> seconds). `path` None: the default
    backend's (`platform.default_compilation_cache_dir`); "" or "off": leave it off.
    MESHSERVE_COMPILATION_CACHE_MIN_SECS (default 0: every program is written; with a floor, the programs that
    compile faster than it were compiled again at every start: 8-19 of 46 for the 125M model, by CPU and load);
    MESHSERVE_COMPILATION_CACHE_MAX_GIB (default 8; 0: unbounded). A value that is not a number is a ValueError
    naming the variable, before anything is set. Returns the directory in use, or None."""
    if path is None:
        path = default_compilation_cache_dir(canonical_platform())
    if not path or path.lower() in ("off", "none", "0"):
        return None
    if jax.config.jax_compilation_cache_dir != path:
        min_secs = _env_float(COMPILATION_CACHE_MIN_SECS_ENV, "0", "seconds")
        max_gib = _env_float(COMPILATION_CACHE_MAX_GIB_ENV, "8", "GiB; 0: unbounded")
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
        # An LRU bound; it also makes readers and writers take the cache's file lock, so instances started
        # together never read a half-written entry (unbounded, such a read is a warning and a compile).
        jax.config.update("jax_compilation_cache_max_size", int(max_gib * (1 << 30)) if max_gib > 0 else -1)
    return path


def hybrid_kv_cache(config: EngineConfig, model_config: ModelConfig) -> tuple[int, ...]:
    """The sliding windows whose layers keep a page pool of their own (`models.kv_cache.window_pools`), or () when
    the cache is not split (--hybrid_kv_cache off, a pipeline, or no model with both kinds of layers)."""
    if not config.hybrid_kv_cache or config.pp > 1:
        return ()
    return window_pools(kv_cache_specs(model_config, dtype=config.dtype))


def kv_cache_pages(config: EngineConfig, model_config: ModelConfig, *, head_screen: bool,
                   memory_fraction: float | None = None) -> int:
    """The engine's KV pages (`serving.ledger.kv_cache_pages`): `config.num_pages`, else `memory_fraction` of each
    device's memory when given (the server's --kv_cache_memory_fraction), else `config.kv_cache_memory_gb`; a draft
    model's cache shares them (same page ids), and the LM head's screen comes out of a fraction's budget. With a
    hybrid KV cache (`hybrid_kv_cache`), the page table's pages: each window pool has `ledger.window_pages` beside
    them."""
    if config.num_pages:
        return config.num_pages
    draft = None
    if config.speculative_method == "draft":
        draft = ledger.load_config(model=config.speculative_model)[1]
    gb = None if memory_fraction is not None else config.kv_cache_memory_gb * (1 << 30)
    screen = head_screen_bytes(model_config.vocab_size, model_config.hidden_size) if head_screen else 0
    return ledger.kv_cache_pages(model_config, dtype=config.dtype, page_size=config.page_size,
                                 kv_dtype=ledger.kv_dtype_of(config.kv_cache_dtype),
                                 mesh_shape={"tensor": config.tp, "expert": config.ep, "pipeline": config.pp},
                                 kv_cache_bytes=gb,
                                 memory_fraction=memory_fraction, draft=draft, head_screen_bytes=screen,
                                 max_batched_tokens=config.max_num_batched_tokens, max_seqs=config.max_num_seqs,
                                 hybrid=bool(hybrid_kv_cache(config, model_config)))


def _load_model(config: EngineConfig, dtype, mesh) -> CausalLM:
    if config.spare_expert_slots and not is_orbax_dir(config.model):
        cfg = read_config(config.model)
        cfg = dataclasses.replace(cfg, num_expert_slots=cfg.num_experts + config.spare_expert_slots)
        return load_model(config.model, dtype=dtype, mesh=mesh, config=cfg, quantization=config.quantization)
    if config.spare_expert_slots:
        raise ValueError("spare_expert_slots needs an HF or GGUF checkpoint (Orbax stores the slots it was saved "
                         "with)")
    return load_model(config.model, dtype=dtype, mesh=mesh, quantization=config.quantization)


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of the engine: `kind` 'forward' (a token bucket's model step; `greedy_only`: with the
    screened greedy head), 'sample' (a sampling variant of a sequence bucket) or 'speculative' (the speculative
    decoder's step for `params`' greedy/random variant); `lora`: the variant of a step in which some sequence has a
    LoRA adapter (--enable_lora)."""
    kind: str
    tokens: int
    seqs: int
    greedy_only: bool = False
    params: SamplingParams | None = None
    max_logprobs: int = 0
    lora: bool = False

    @property
    def name(self) -> str:
        parts = [f"s={self.seqs}"] if self.kind == "sample" else [f"t={self.tokens}", f"s={self.seqs}"]
        if self.greedy_only:
            parts.append("screened-greedy")
        if self.lora:
            parts.append("lora")
        if self.params is not None:
            parts.append("greedy" if self.params.temperature == 0 else "random")
            parts += ["penalties"] if self.params.has_penalties else []
            parts += ["logit-bias"] if self.params.logit_bias else []
            parts += ["masked"] if self.params.structured else []
        parts += [f"logprobs={self.max_logprobs}"] if self.max_logprobs else []
        return f"{self.kind}[{','.join(parts)}]"


# The sampling variants a bucket compiles: greedy / random x with / without penalties, each without and with logprobs.
WARMUP_SAMPLING = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0),
                   SamplingParams(temperature=0.0, repetition_penalty=1.1),
                   SamplingParams(temperature=1.0, seed=0, repetition_penalty=1.1))
# A step with a logit bias takes one more variant per bucket: the general one (random, penalties, logprobs) with the
# bias, whatever its sequences ask (greedy slots take its biased argmax).
WARMUP_LOGIT_BIAS = SamplingParams(temperature=1.0, seed=0, repetition_penalty=1.1, logit_bias={0: 1.0})
LOGIT_BIAS_SLOTS = 1 << (MAX_LOGIT_BIAS - 1).bit_length()  # the bias variant's static K: [S, K] ids and values
# The dataclasses a follower takes from the step channel (its schema admits no other type).
STEP_RECORDS = (RaggedBatch, AttentionMetadata, sampling.SamplingTensors)
# Structured outputs: a step with a constrained sequence and no penalty or bias takes the masked variant (random,
# logprobs, the token bitmask); with penalties or a bias, the general one above, which always carries a bitmask.
WARMUP_MASKED = SamplingParams(temperature=1.0, seed=0, structured=StructuredOutput(json_object=True))


class ModelRunner:
    """The device side of an engine: model state, KV caches, the compiled programs and their launches."""

    def __init__(self, config: EngineConfig, *, model: CausalLM | None = None, mesh=None):
        self.config = config
        t0 = time.perf_counter()
        dtype = DTYPES[config.dtype]
        if mesh is None and config.tp * config.ep > 1:
            mesh = serving_mesh(tp=config.tp, ep=config.ep)
        self.mesh = mesh
        # Every platform-dependent path (serving.core.platform); programs are traced for choices.platform.
        self.choices = config.platform_choices(1 if mesh is None else mesh.size, jax.process_count())
        self.platform = self.choices.platform
        self.compilation_cache_dir = enable_compilation_cache(self.choices.compilation_cache_dir or "")
        model = model if model is not None else _load_model(config, dtype, mesh)
        self.model_config: ModelConfig = model.config
        self.load_time_s = time.perf_counter() - t0
        mc = self.model_config
        reason = unsupported_reason(self.choices.attention_backend, mc.head_dim, config.page_size,
                                    latent_dims=(mc.kv_lora_rank, mc.qk_rope_head_dim) if mc.is_mla else None)
        if reason:
            raise ValueError(f"{config.model}: {reason}")
        cpu_panels = self.choices.native_kernels
        self.num_pages = kv_cache_pages(config, mc, head_screen=self.choices.greedy_head_screen)
        # Hybrid KV cache: each sliding window's layers index a pool of their own (window -> pages), the block
        # manager's `HybridBlockManager` keeping its pages; {}: every layer indexes the page table's pages
        self.window_pages = ledger.window_pages(hybrid_kv_cache(config, mc), self.num_pages, config.page_size,
                                                config.max_num_seqs, config.max_num_batched_tokens)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings,
                                 self.num_pages * config.page_size)
        self.max_pages = -(-self.max_model_len // config.page_size)
        try:
            log.info("%s", ledger.ledger_summary(
                mc, dtype=config.dtype, page_size=config.page_size, num_pages=self.num_pages,
                kv_dtype=ledger.kv_dtype_of(config.kv_cache_dtype),
                mesh_shape={"tensor": config.tp, "expert": config.ep, "pipeline": config.pp},
                max_batched_tokens=config.max_num_batched_tokens, max_seqs=config.max_num_seqs,
                window_pages=self.window_pages, host_kv_bytes=int(config.host_kv_cache_gb * (1 << 30))))
        except Exception as e:  # noqa: BLE001 - the ledger is a report; it must never stop the engine
            log.warning("memory ledger unavailable: %s", e)
        self.buckets = list(self.choices.token_buckets)
        self.packed_weights = 0
        # Greedy steps of few sequences take the LM head's int8 screen (settable: the benchmark flips it to compare)
        self.screen_greedy = False
        if cpu_panels or config.enable_lora:
            model = nnx.clone(model)  # (the caller's model keeps its own weights and no adapter slots)
        # LoRA: (layer, projection, A stack shape, B stack shape, A in pairs, B in pairs, int8) of each projection's
        # slots (models.lora; the shapes as [slots, rank, *in] and [slots, rank, *out] whatever the storage)
        self.lora_layout: list[tuple] = []
        if config.enable_lora:
            if jax.process_count() > 1:
                raise ValueError("enable_lora: multi-host engines do not serve LoRA adapters yet")
            int8 = config.lora_dtype == "int8"
            if int8 and mesh is not None and mesh.size > 1:
                raise ValueError(f"lora_dtype=int8 runs on one device in this version (this mesh has {mesh.size})")
            model.add_lora_slots(config.max_loras, config.max_lora_rank, dtype,
                                 lambda axes, shape: param_sharding(axes, shape, mesh, DEFAULT_RULES), int8=int8)
            for i, name, p in model.lora_projections():
                if int8 and not int8_fits(config.max_lora_rank, math.prod(p.b_shape[2:])):
                    raise ValueError(f"lora_dtype=int8: layer {i} {name} has {math.prod(p.b_shape[2:])} outputs, "
                                     f"not a multiple of {PAIR_COLUMNS}; use the model's dtype (--lora_dtype='')")
                # A and B in the native kernel's forms where it runs the update (bfloat16; pallas_kernels.lora)
                if cpu_panels and not int8:
                    p.a_layout, p.b_layout = stack_layouts(dtype, p.b.shape[1], math.prod(p.a.shape[2:]),
                                                           math.prod(p.b.shape[2:]))
            self.lora_layout = [(i, name, p.a_shape, p.b_shape, p.a_layout, p.b_layout, p.int8)
                                for i, name, p in model.lora_projections()]
            log.info("LoRA: %d adapter slots of rank %d on %d projections", config.max_loras, config.max_lora_rank,
                     len(self.lora_layout))
            if int8 and not (cpu_panels and native.int8_dot_runs(native.isa())):
                log.warning("lora_dtype=int8: %s has no int8 dot products, so the update dequantizes or widens the "
                            "stacks: half the memory, but no faster than the model's dtype (docs/lora.md)",
                            f"the native path {native.isa()}" if cpu_panels else "this platform")
        if cpu_panels:
            # Weights into the native kernels' panel layout.
            self.screen_greedy = self.choices.greedy_head_screen and model.add_head_screen()
            if self.screen_greedy:
                log.info("greedy steps of up to %d sequences take the LM head's int8 screen", SCREEN_MAX_ROWS)
            self.packed_weights = model.pack_for_cpu_kernels()
            log.info("packed %d weight matrices into native CPU panels", self.packed_weights)
        # The cache the model declares, one spec per layer (the ledger sized the pages from the same declaration).
        self.kv_cache_specs = model.kv_cache_specs(dtype=dtype, kv_cache_dtype=config.kv_cache_dtype)
        self.graphdef, self.state = nnx.split(model)
        self.kv_caches: list = []
        self.reset_kv_caches()
        donate = (1, 5) if self.choices.donate_kv_cache else ()
        self._forward_fn = jax.jit(self._forward_flat, donate_argnums=donate, static_argnames=("greedy_only",))
        self._lora_write_fn = jax.jit(self._write_slot, donate_argnums=(0,))
        self._sample_fn = jax.jit(self._sample, static_argnums=(2,))
        # The forward's greedy tokens are padded to the widest sequence bucket, so a step can read the previous
        # step's tokens whatever its bucket (no extra programs).
        self.token_slots = max(self.seq_bucket(t) for t in self.buckets)
        self._no_src: dict[int, np.ndarray] = {}
        self._flat_state = None  # (state, leaves, treedef): the forward takes the state as a flat list
        self._placements = {}
        self._expert_load = None
        if mc.is_moe:
            slots = mc.num_expert_slots or mc.num_experts
            self._placements = {i: identity_placement(mc.num_experts, slots, config.ep)
                                for i in self.moe_layer_indices()}
            self._expert_load = jnp.zeros((len(self._placements), slots), jnp.int32)
        self.batch_builder = BatchBuilder(page_size=config.page_size, max_pages=self.max_pages,
                                          max_seqs=config.max_num_seqs)
        # longrope: the original context (0: the model is not longrope); batches carry each token's factor set
        self.rope_original = mc.rope.original_max_position_embeddings if mc.rope.rope_type == "longrope" else 0
        self._penalty_window = 1 << (self.max_model_len - 1).bit_length()
        self._num_candidates = min(256, mc.vocab_size)
        self.compile_count = 0
        self.compile_time_s = 0.0
        self.multihost = jax.process_count() > 1
        self.channel = None  # multi-host leader: the LeaderChannel to the followers (sharding.multihost)
        # Stand-in for "the previous step's greedy tokens" when a step reads none. On one device it lives there, as
        # a look-ahead step's real ones do, so both run the same warmed-up program.
        self.no_prev = np.zeros(self.token_slots, np.int32)
        if self.single_device:
            self.no_prev = jax.device_put(self.no_prev, next(iter(jax.tree.leaves(self.state)[0].devices())))

    @property
    def single_device(self) -> bool:
        return (self.mesh is None or self.mesh.size == 1) and not self.multihost

    # ------------------------------------------------------------------ the programs
    def _state_leaves(self) -> list:
        """The state's arrays as a flat list, cached: jit's C++ fast path takes a list of arrays in microseconds,
        while flattening the nnx State's ~100 Variables in Python cost ~1 ms of host time per step."""
        if self._flat_state is None or self._flat_state[0] is not self.state:
            leaves, treedef = jax.tree.flatten(self.state)
            self._flat_state = (self.state, leaves, treedef)
        return self._flat_state[1]

    def _forward_flat(self, leaves, kv_caches, batch, token_src, prev_tokens, expert_load, greedy_only=False):
        """The forward on the flat state, plus each sequence's greedy token [token slots]. Input tokens with a
        source row (`token_src` >= 0: look-ahead decodes) are the previous step's greedy tokens there."""
        fed = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], self._input_ids(batch))
        logits, tokens, kv_caches, expert_load = self._forward(
            jax.tree.unflatten(self._flat_state[2], leaves), kv_caches, self._with_input_ids(batch, fed),
            expert_load, greedy_only)
        if tokens is None:
            tokens = sampling.greedy(logits)
        return logits, kv_caches, expert_load, jnp.pad(tokens, (0, self.token_slots - tokens.shape[0]))

    @staticmethod
    def _input_ids(batch: RaggedBatch):
        return batch.input_ids

    @staticmethod
    def _with_input_ids(batch: RaggedBatch, input_ids) -> RaggedBatch:
        return dataclasses.replace(batch, input_ids=input_ids)

    def _forward(self, state, kv_caches, batch: RaggedBatch, expert_load, greedy_only):
        """Pure. The model over a ragged batch: float32 logits at each sequence's last token, their greedy tokens
        (or None: the caller takes the argmax), the caches, and (MoE) the running per-slot expert token counts
        [moe_layers, slots] plus this step's. `greedy_only` (static; `screens` says when): only the greedy
        tokens will be read, and the model's screened greedy head runs instead of the full head (no logits: an
        empty [S, 0])."""
        model = nnx.merge(self.graphdef, state)
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
        """Pure. Sampling, packed into one int32 array [S, 2 + 2 * max_logprobs] for a single host copy
        (`sampling.pack`)."""
        return sampling.pack(sampling.sample(logits, sampling_tensors, max_logprobs=max_logprobs))

    def sampling_tensors(self, requests: Sequence[Request], num_slots: int,
                         bitmask: np.ndarray | None = None) -> sampling.SamplingTensors:
        """Per-step sampling inputs, with the static variant canonicalised so that a bucket has only the few
        programs `warmup` compiles (greedy or not, penalties or not; with a logit bias, the one general variant:
        penalties, the bias, the draw and a token bitmask included, neutral where a slot asks for none of them, and
        logprobs, see `run_sample`; with a `bitmask` (structured outputs) and no penalties, the masked variant)."""
        params = [r.sampling_params for r in requests]
        penalties = any(p.has_penalties or p.logit_bias for p in params)
        bias = any(p.logit_bias for p in params) or (bitmask is not None and penalties)  # the general variant
        st = sampling.build_sampling_tensors(
            params, vocab_size=self.model_config.vocab_size, num_slots=num_slots,
            token_ids=[r.token_ids for r in requests], num_prompt_tokens=[r.num_prompt_tokens for r in requests],
            bias_width=LOGIT_BIAS_SLOTS)
        if not penalties:
            st = dataclasses.replace(st, token_ids=None, num_prompt_tokens=None)
        else:
            window = np.full((num_slots, self._penalty_window), -1, np.int32)
            if st.token_ids is not None:
                window[:, :st.token_ids.shape[1]] = st.token_ids
            prompt_lens = st.num_prompt_tokens if st.num_prompt_tokens is not None else np.zeros(num_slots, np.int32)
            st = dataclasses.replace(st, token_ids=window, num_prompt_tokens=prompt_lens)
        if bias and st.bias_ids is None:
            st = dataclasses.replace(st, bias_ids=np.full((num_slots, LOGIT_BIAS_SLOTS), -1, np.int32),
                                     bias_values=np.zeros((num_slots, LOGIT_BIAS_SLOTS), np.float32))
        if bias or bitmask is not None:
            words = -(-self.model_config.vocab_size // 32)
            st = dataclasses.replace(st, all_greedy=False, token_bitmask=(
                np.full((num_slots, words), -1, np.int32) if bitmask is None else bitmask))
        if not st.all_greedy:
            st = dataclasses.replace(st, num_candidates=self._num_candidates, use_min_p=True)
        return st

    def run_forward(self, batch, token_src: np.ndarray | None = None, prev_tokens=None, greedy_only=False):
        """Launches the forward on `step_batch`'s batch; returns (logits, greedy tokens) and keeps the new caches.
        `token_src`/`prev_tokens`: a look-ahead step's decodes read their input token from the previous step's
        greedy tokens. `greedy_only`: the step reads only the greedy tokens (the logits may be left out)."""
        if self.channel is not None:  # multi-host leader: the followers run the same call (never a look-ahead)
            self.channel.broadcast(("forward", batch, greedy_only))
        if token_src is None:
            t = len(self._input_ids(batch))
            token_src = self._no_src.get(t)
            if token_src is None:
                token_src = self._no_src[t] = np.full(t, -1, np.int32)
        prev_tokens = self.no_prev if prev_tokens is None else prev_tokens
        if self.multihost:
            batch, token_src, prev_tokens = to_global((batch, token_src, prev_tokens), self.mesh)
        with mesh_context(self.mesh), tracing_for(self.platform):
            logits, self.kv_caches, self._expert_load, tokens = self._forward_fn(
                self._state_leaves(), self.kv_caches, batch, token_src, prev_tokens, self._expert_load,
                greedy_only=greedy_only)
        return logits, tokens

    def run_sample(self, logits, st, max_logprobs):
        """Launches the sampling program; a step with a logit bias or a token bitmask always returns logprobs (its
        one variant)."""
        if st.bias_ids is not None or st.token_bitmask is not None:
            max_logprobs = MAX_LOGPROBS
        if self.channel is not None:
            self.channel.broadcast(("sample", st, max_logprobs))
        if self.multihost:
            st = to_global(st, self.mesh)
        with mesh_context(self.mesh), tracing_for(self.platform):
            return self._sample_fn(logits, st, max_logprobs)

    def follow(self, channel, host_kv=None) -> None:
        """Multi-host follower: runs each jitted call the leader announces, until it says stop (`host_kv`: the host
        KV tier's, serving.core.host_kv.HostKVPool.follow)."""
        logits = None
        while True:
            message = channel.recv(records=STEP_RECORDS)
            if host_kv is not None and message[0].startswith("host_"):
                host_kv.follow(message)
            elif message[0] == "forward":
                logits, _ = self.run_forward(message[1], greedy_only=message[2])
            elif message[0] == "sample":
                self.run_sample(logits, message[1], message[2])
            elif message[0] == "stop":
                return
            else:
                raise ValueError(f"unknown step-channel message {message[0]!r}")

    def reset_kv_caches(self) -> None:
        """Fresh zeroed caches (after a failed step lost the donated ones)."""
        with tracing_for(self.platform):
            self.kv_caches = init_kv_caches(self.kv_cache_specs, self.num_pages, self.config.page_size, self.mesh,
                                            window_pages=self.window_pages)

    # ------------------------------------------------------------------ buckets and warm-up
    def step_batch(self, chunks, num_tokens: int, num_seqs: int, lora_slots=None) -> RaggedBatch:
        """Host-side. The step's input, padded to the bucket, as the forward takes it (a pipelined runner lays it
        out its own way); `lora_slots`: each chunk's adapter slot (-1: none). A longrope model's batches always
        carry each token's factor set (one program structure): a scheduled request's (`Request.rope_long`), else
        long once the chunk ends past the original context."""
        rope_long = None
        if self.rope_original:
            rope_long = [c.request.rope_long if hasattr(c, "request") else c.start + len(c.token_ids) >
                         self.rope_original for c in chunks]
        return self.batch_builder.build(chunks, num_tokens=num_tokens, num_seqs=num_seqs, lora_slots=lora_slots,
                                        rope_long=rope_long)

    def _program_batch(self, program: Program) -> RaggedBatch:
        """An empty step of `program`'s bucket (its LoRA variant: every token of no adapter)."""
        batch = self.step_batch([], program.tokens, program.seqs)
        if program.lora:
            batch = dataclasses.replace(batch, lora_slots=np.full(program.tokens, -1, np.int32))
        return batch

    # ------------------------------------------------------------------ LoRA adapter slots
    def _lora_variables(self) -> list:
        """The state's LoRA stacks in `lora_layout` order: A, B, ranks (and int8 stacks' scales) of each
        projection."""
        out = []
        for layer, name, *_, int8 in self.lora_layout:
            part = "self_attn" if name in ATTENTION_TARGETS else "mlp"
            stacks = self.state["layers"][layer][part]["lora"][name]
            out += [stacks["a"], stacks["b"], stacks["ranks"]] + ([stacks["scale"]] if int8 else [])
        return out

    @staticmethod
    def _write_slot(stacks, slot, values):
        """Pure. Every LoRA stack with slot `slot` replaced by `values` (one per stack, without the slot axis)."""
        return [s.at[slot].set(v.astype(s.dtype)) for s, v in zip(stacks, values)]

    def write_lora_slot(self, slot: int, values: list) -> None:
        """Writes one adapter's host arrays (`serving.core.lora.slot_values`) into slot `slot` of every LoRA stack:
        one small jitted scatter, launched between steps (a step already launched reads the stacks it was given)."""
        variables = self._lora_variables()
        with mesh_context(self.mesh), tracing_for(self.platform):
            new = self._lora_write_fn([v.get_value() for v in variables], np.int32(slot), values)
        for v, x in zip(variables, new):
            v.set_value(x)
        self._flat_state = None  # the forward's flat state holds the old stacks

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

    def screens(self, seq_bucket: int) -> bool:
        """Whether a greedy step with this many sequence slots takes the screened greedy head (its own program)."""
        return self.screen_greedy and seq_bucket <= SCREEN_MAX_ROWS

    def warmup_plan(self) -> list[Program]:
        """Every program a request can need, in the order `warmup` compiles them: per token bucket the forward
        (and its screened greedy variant), then the sampling variants greedy/random x penalties/none x
        logprobs/none, the logit-bias (general) variant and the masked one. The lowering tests enumerate programs
        from this list."""
        plan, sampled = [], set()
        for t in self.buckets:
            s = self.seq_bucket(t)
            for lora in (False, True) if self.lora_layout else (False,):
                plan.append(Program("forward", t, s, lora=lora))
                if self.screens(s):
                    plan.append(Program("forward", t, s, greedy_only=True, lora=lora))
            if s not in sampled:  # token buckets of one sequence bucket share its sampling programs
                sampled.add(s)
                plan += [Program("sample", t, s, params=p, max_logprobs=n)
                         for p in WARMUP_SAMPLING for n in (0, MAX_LOGPROBS)]
                plan += [Program("sample", t, s, params=p, max_logprobs=MAX_LOGPROBS)
                         for p in (WARMUP_LOGIT_BIAS, WARMUP_MASKED)]
        return plan

    def _warmup_sampling_tensors(self, program: Program) -> sampling.SamplingTensors:
        masked = program.params.structured is not None
        words = -(-self.model_config.vocab_size // 32)
        st = self.sampling_tensors([Request("warmup", [0], program.params, arrival_time=0.0)], program.seqs,
                                   np.full((program.seqs, words), -1, np.int32) if masked else None)
        return dataclasses.replace(st, valid=np.zeros_like(st.valid))

    def warmup(self) -> int:
        """Compiles (by running, on empty batches) every program of `warmup_plan`, so no request ever waits on a
        compile. Returns how many."""
        t0 = time.perf_counter()
        plan = self.warmup_plan()
        logits = {}
        for program in plan:
            if program.kind == "forward":
                out, _ = self.run_forward(self._program_batch(program), greedy_only=program.greedy_only)
                if not program.greedy_only:
                    logits[program.tokens] = out
            else:
                st = self._warmup_sampling_tensors(program)
                self.run_sample(logits[program.tokens], st, program.max_logprobs).block_until_ready()
        if self.lora_layout:  # the slot write: slot 0 rewritten as it is
            self.write_lora_slot(0, [np.asarray(v.get_value()[0]) for v in self._lora_variables()])
            plan = plan + [None]
        self.compile_count += len(plan)
        self.compile_time_s += time.perf_counter() - t0
        return len(plan)

    def trace_program(self, program: Program) -> jax.stages.Traced:
        """`program` traced for this runner's platform without running it (abstract KV caches and state)."""
        with mesh_context(self.mesh), tracing_for(self.platform):
            forward_args = (self._state_leaves(), self.kv_caches, self._program_batch(program),
                            np.full(program.tokens, -1, np.int32), self.no_prev, self._expert_load)
            if program.kind == "forward":
                return self._forward_fn.trace(*forward_args, greedy_only=program.greedy_only)
            logits = self._forward_fn.trace(*forward_args).out_info[0]
            return self._sample_fn.trace(logits, self._warmup_sampling_tensors(program), program.max_logprobs)

    def lower(self, traced: jax.stages.Traced) -> jax.stages.Lowered:
        """A program traced by this runner (or its speculative decoder) lowered for the runner's platform, from any
        host (`EngineConfig.platform`)."""
        with mesh_context(self.mesh), tracing_for(self.platform):
            return traced.lower(lowering_platforms=(lowering_platform(self.platform),))

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
                for name in ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias"):
                    if name not in mlp:  # the expert biases: GPT-OSS only
                        continue
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
