"""Speculative decoding (`SpeculativeDecoder`): proposers (a draft model, prompt-lookup n-grams), the fused propose ->
verify -> accept device program (`rejection_sample`) and the host-side plan / roll-back around the scheduler.
Details: docs/engine.md."""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from models.batch import RaggedBatch
from models.kv_cache import init_kv_caches
from models.weights import load_model
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.target import tracing_for
from serving.core import sampling
from serving.core.batch import BatchBuilder, build_batch
from serving.core.config import SpeculativeConfig
from serving.core.platform import DTYPES
from serving.core.model_runner import Program
from sharding.mesh import mesh_context
from serving.core.request import Request, RequestStatus
from serving.params import SamplingParams

log = logging.getLogger(__name__)

_TAG_ACCEPT, _TAG_RESAMPLE, _TAG_DRAFT = 1, 2, 3  # fold_in tags: independent uniforms per purpose


def break_even_acceptance(k: int, cost_per_draft: float) -> float:
    """The per-token acceptance rate a below which speculation loses: a step then emits sum_{j<=k} a^j tokens
    on average and costs 1 + k * cost_per_draft plain steps."""
    target = 1.0 + k * cost_per_draft
    if target >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def ngram_propose(token_ids: Sequence[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the `k` tokens after an earlier occurrence of the longest suffix n-gram (n_max down to
    n_min) of `token_ids`: the latest one with k tokens after it, else the earliest; [] if none occurs."""
    tokens = np.asarray(token_ids, np.int64)
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= length]  # the latest match followed by k tokens, else the earliest
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


# ------------------------------------------------------------------------------------------------ device side
def _expand_rows(t: sampling.SamplingTensors, repeats: int) -> sampling.SamplingTensors:
    """Pure. Each slot's parameters repeated for `repeats` consecutive positions (step + j for position j)."""
    rep = lambda x: None if x is None else jnp.repeat(x, repeats, axis=0)  # noqa: E731
    step = (t.step[:, None] + jnp.arange(repeats, dtype=t.step.dtype)[None, :]).reshape(-1)
    return dataclasses.replace(
        t, temperature=rep(t.temperature), top_k=rep(t.top_k), top_p=rep(t.top_p), min_p=rep(t.min_p),
        repetition_penalty=rep(t.repetition_penalty), presence_penalty=rep(t.presence_penalty),
        frequency_penalty=rep(t.frequency_penalty), seed=rep(t.seed), step=step, valid=rep(t.valid),
        token_ids=None, num_prompt_tokens=None, bias_ids=None, bias_values=None)


def _uniforms(t: sampling.SamplingTensors, tag: int) -> jax.Array:
    """Pure. One uniform per row from fold_in(fold_in(key(seed), step), tag): per request, not per slot."""
    def one(seed, step):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), step)
        return jax.random.uniform(jax.random.fold_in(key, tag), (), jnp.float32)
    return jax.vmap(one)(t.seed, t.step)


def processed_probs(logits: jax.Array, t: sampling.SamplingTensors) -> jax.Array:
    """Pure. The distribution `sampling.sample` draws from (temperature, min-p, top-k, top-p; no penalties),
    as probabilities [R, V]. Meaningless for greedy rows (callers use argmax there)."""
    greedy = t.temperature <= 0
    x = logits / jnp.where(greedy, 1.0, t.temperature)[:, None]
    threshold = sampling._filter_threshold(x, t)
    weights = jnp.where(x >= threshold[:, None], jnp.exp(x - jnp.max(x, axis=1, keepdims=True)), 0.0)
    return weights / jnp.sum(weights, axis=1, keepdims=True)


def draft_sample(logits: jax.Array, t: sampling.SamplingTensors, position: int | jax.Array):
    """Pure. A draft token per row (greedy rows: argmax) and, unless all greedy, the draft's distribution."""
    greedy_ids = jnp.argmax(logits, axis=1).astype(jnp.int32)
    if t.all_greedy:
        return greedy_ids, None
    t = dataclasses.replace(t, step=t.step + position)
    probs = processed_probs(logits, t)
    drawn = sampling._inverse_cdf(probs, _uniforms(t, _TAG_DRAFT))
    return jnp.where(t.temperature <= 0, greedy_ids, drawn), probs


def rejection_sample(target_logits: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array | None,
                     num_draft: jax.Array, t: sampling.SamplingTensors) -> tuple[jax.Array, jax.Array]:
    """Pure, jit-able. Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for S rows.

    target_logits [S, K+1, V]: the target at a row's last token and after each of its drafts; draft_tokens
    [S, K]; draft_probs [S, K, V] (None: deterministic proposals, i.e. one-hot at the draft token);
    num_draft [S] (k_i <= K; 0 = plain decode). Draft j is accepted with probability min(1, p(d)/q(d)); at the
    first rejection one token is drawn from normalise(max(0, p - q)); if all k_i are accepted, a bonus token from
    p at position k_i. Greedy rows: accept while the draft equals the target's argmax, then its argmax.
    Returns (tokens [S, K+1], num_emitted [S] = accepted + 1); tokens past num_emitted are 0.
    """
    s, k1, vocab = target_logits.shape
    k = k1 - 1
    positions = jnp.arange(k1, dtype=jnp.int32)
    in_draft = positions[None, :k] < num_draft[:, None]
    greedy_ids = jnp.argmax(target_logits, axis=2).astype(jnp.int32)  # [S, K+1]
    accept_greedy = (draft_tokens == greedy_ids[:, :k]) & in_draft
    if t.all_greedy:
        num_accepted = jnp.sum(jnp.cumprod(accept_greedy.astype(jnp.int32), axis=1), axis=1)
        tokens = greedy_ids
    else:
        rows = _expand_rows(t, k1)
        p = processed_probs(target_logits.reshape(s * k1, vocab), rows).reshape(s, k1, vocab)
        p_draft = jnp.take_along_axis(p[:, :k], draft_tokens[:, :, None], axis=2)[:, :, 0]
        is_draft = jnp.arange(vocab)[None, None, :] == draft_tokens[:, :, None]  # [S, K, V]
        if draft_probs is None:
            q_draft = jnp.ones_like(p_draft)
            q = is_draft.astype(p.dtype)
        else:
            q_draft = jnp.take_along_axis(draft_probs, draft_tokens[:, :, None], axis=2)[:, :, 0]
            q = draft_probs
        q = jnp.where(in_draft[:, :, None], q, 0.0)
        q = jnp.concatenate([q, jnp.zeros((s, 1, vocab), q.dtype)], axis=1)  # no draft at the bonus position
        u = _uniforms(rows, _TAG_ACCEPT).reshape(s, k1)[:, :k]
        accept_random = (u * q_draft < p_draft) & in_draft
        greedy = (t.temperature <= 0)[:, None]
        accept = jnp.where(greedy, accept_greedy, accept_random)
        num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
        at = num_accepted[:, None, None]
        p_at = jnp.take_along_axis(p, at, axis=1)[:, 0]
        residual = jnp.maximum(jnp.take_along_axis(p, at, axis=1)[:, 0] - jnp.take_along_axis(q, at, axis=1)[:, 0],
                               0.0)
        # p == q exactly leaves no residual mass, but then a rejection has probability 0: rounding only.
        residual = jnp.where(jnp.sum(residual, axis=1, keepdims=True) > 0, residual, p_at)
        step_at = dataclasses.replace(t, step=t.step + num_accepted)
        final = sampling._inverse_cdf(residual, _uniforms(step_at, _TAG_RESAMPLE))
        final = jnp.where(t.temperature <= 0, jnp.take_along_axis(greedy_ids, num_accepted[:, None], 1)[:, 0], final)
        padded_drafts = jnp.concatenate([draft_tokens, jnp.zeros((s, 1), jnp.int32)], axis=1)
        tokens = jnp.where(positions[None, :] < num_accepted[:, None], padded_drafts, final[:, None])
    num_emitted = jnp.where(t.valid, num_accepted + 1, 0)
    tokens = jnp.where(positions[None, :] < num_emitted[:, None], tokens, 0)
    return tokens, num_emitted


# ------------------------------------------------------------------------------------------------ host side
@dataclasses.dataclass(slots=True)
class _SeqState:
    draft_computed: int = -1  # tokens whose draft K/V is in the draft cache; -1 = not seen yet
    preemptions: int = 0  # the request's preemption count when draft_computed was set
    acceptance: float = 1.0  # EMA of accepted / drafted per round
    off_until: int = 0  # engine step from which it may speculate again
    backoff: int = 8  # steps of the next switch-off (doubles each time, up to 256)


@dataclasses.dataclass(slots=True)
class _Row:
    index: int  # in SchedulerOutput.scheduled
    seq: object  # the ScheduledSequence
    num_draft: int  # k_i
    draft_end: int = 0  # draft cache end after this step's proposals (method "draft")


@dataclasses.dataclass(slots=True)
class SpecPlan:
    rows: list[_Row]  # in batch order: speculating sequences first
    num_spec: int


@dataclasses.dataclass(slots=True)
class _SpecSeqChunk:
    token_ids: list[int]
    start: int
    block_table: list[int]


class SpeculativeDecoder:
    """Owned by the Engine (`engine.spec`), on its ModelRunner and Scheduler. `launch` replaces the plain step when
    this step can speculate, `accept` turns the packed device result into per-sequence token lists and rolls back
    rejected K/V, and `after_update` restores the accepted K/V length once the scheduler has appended the
    tokens."""

    def __init__(self, runner, scheduler, config: SpeculativeConfig):
        if runner.config.pp > 1:
            raise ValueError("speculative decoding does not run with pipeline parallelism (pp > 1) yet")
        self.runner, self.scheduler = runner, scheduler
        self.config = config
        self.steps = 0  # steps this decoder planned (launch calls): the clock of per-request back-off
        self.before_run = None  # called just before a launch (the engine: the host KV tier's queued copies)
        self.k = config.num_speculative_tokens
        mc = runner.model_config
        self.draft_graphdef = self.draft_state = None
        self.draft_kv = None
        self.draft_config = None
        target_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.state))
        cost = 0.02  # per draft: the extra query token in the target's step
        if config.method == "draft":
            dtype = DTYPES[runner.config.dtype]
            draft = load_model(config.model, dtype=dtype, mesh=runner.mesh)
            dc = draft.config
            if dc.vocab_size != mc.vocab_size:
                raise ValueError(f"speculative_model {config.model!r} has vocab_size {dc.vocab_size}; the target has "
                                 f"{mc.vocab_size} (the draft must share the target's tokenizer)")
            if dc.max_position_embeddings < runner.max_model_len:
                raise ValueError(f"speculative_model context {dc.max_position_embeddings} < max_model_len "
                                 f"{runner.max_model_len}")
            self.draft_config = dc
            self.draft_graphdef, self.draft_state = nnx.split(draft)
            self.draft_kv_specs = draft.kv_cache_specs(dtype=dtype, kv_cache_dtype=runner.config.kv_cache_dtype)
            self._init_draft_kv()
            draft_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.draft_state))
            cost += draft_bytes / max(1, target_bytes)
            self._draft_builder = BatchBuilder(page_size=runner.config.page_size, max_pages=runner.max_pages,
                                               max_seqs=runner.config.max_num_seqs)
        self.min_acceptance = (config.min_acceptance if config.min_acceptance >= 0
                               else min(0.8, break_even_acceptance(self.k, cost)))
        self._states: dict[str, _SeqState] = {}
        self._step_fn = jax.jit(self._spec_step, donate_argnums=(1, 3) if runner.choices.donate_kv_cache else ())
        # counters (Prometheus, vLLM's spec_decode_* names)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.num_spec_steps = 0
        log.info("speculative decoding: %s, k=%d, switch-off below acceptance %.2f", config.method, self.k,
                 self.min_acceptance)

    def _init_draft_kv(self) -> None:
        e = self.runner
        with tracing_for(e.platform):
            self.draft_kv = init_kv_caches(self.draft_kv_specs, e.num_pages, e.config.page_size, e.mesh)

    @property
    def draft_kv_bytes(self) -> int:
        return 0 if self.draft_kv is None else sum(x.nbytes for x in jax.tree.leaves(self.draft_kv))

    @property
    def draft_weight_bytes(self) -> int:
        return 0 if self.draft_state is None else sum(x.nbytes for x in jax.tree_util.tree_leaves(self.draft_state))

    def stats(self) -> dict:
        drafted = self.num_draft_tokens
        return dict(spec_decode_num_drafts=self.num_drafts, spec_decode_num_draft_tokens=drafted,
                    spec_decode_num_accepted_tokens=self.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=list(self.accepted_per_pos),
                    spec_decode_acceptance_rate=self.num_accepted_tokens / drafted if drafted else 0.0,
                    spec_decode_num_steps=self.num_spec_steps)

    # ---- device program ----------------------------------------------------------------------------------
    def _spec_step(self, target_state, target_kv, draft_state, draft_kv, verify: RaggedBatch,
                   draft_batch: RaggedBatch | None, spec, st):
        """Pure. Draft proposals (draft model: catch-up chunk, then k-1 one-token steps), the target over the
        verify batch, logits at k+1 positions per row, rejection sampling. Returns (packed int32 [S, K+2]:
        emitted count then tokens, target caches, draft caches)."""
        k = self.k
        s = spec["num_draft"].shape[0]
        if draft_state is not None:
            draft_tokens, draft_probs, draft_kv = self._propose(draft_state, draft_kv, draft_batch,
                                                                verify.attention.page_indices, spec, st)
            input_ids = verify.input_ids.at[spec["draft_slot"].reshape(-1)].set(draft_tokens.reshape(-1), mode="drop")
            verify = dataclasses.replace(verify, input_ids=input_ids)
        else:
            draft_tokens, draft_probs = spec["draft_tokens"], None
        model = nnx.merge(self.runner.graphdef, target_state)
        hidden, target_kv = model(verify, target_kv)
        logits = model.compute_logits(hidden[spec["verify_index"].reshape(-1)]).reshape(s, k + 1, -1)
        tokens, emitted = rejection_sample(logits, draft_tokens, draft_probs, spec["num_draft"], st)
        return jnp.concatenate([emitted[:, None], tokens], axis=1), target_kv, draft_kv

    def _propose(self, draft_state, draft_kv, batch: RaggedBatch, page_indices, spec, st):
        """Pure. Runs the draft over its catch-up batch (rows 0..num_spec-1 end at the speculating sequences' last
        tokens), then k-1 one-token steps. Returns drafts [S, K], their distributions [S, K, V] or None, caches."""
        k = self.k
        ps = self.runner.config.page_size
        model = nnx.merge(self.draft_graphdef, draft_state)
        hidden, draft_kv = model(batch, draft_kv)
        token, probs = draft_sample(model.compute_logits(hidden[batch.logits_indices]), st, 0)
        s = token.shape[0]
        tokens = jnp.zeros((s, k), jnp.int32).at[:, 0].set(token)
        all_probs = None
        if probs is not None:
            all_probs = jnp.zeros((s, k) + probs.shape[1:], probs.dtype).at[:, 0].set(probs)
        num_spec = spec["num_spec"]
        rows = jnp.arange(s, dtype=jnp.int32)
        active = rows < num_spec[0]
        cu_q_lens = jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), num_spec[0])
        max_pages = page_indices.shape[1]

        def body(j, carry):
            kv, tokens, all_probs = carry
            pos = spec["draft_pos"] + j  # draft j-1 (0-based) sits at last position + j
            page = page_indices[rows, jnp.minimum(pos // ps, max_pages - 1)]
            write = active & (j < spec["num_draft"])  # only drafts whose successor is needed are fed
            md = AttentionMetadata(slot_mapping=jnp.where(write, page * ps + pos % ps, -1),
                                   kv_lens=jnp.where(active, pos + 1, 0), page_indices=page_indices,
                                   cu_q_lens=cu_q_lens, num_seqs=num_spec)
            step_batch = RaggedBatch(input_ids=tokens[:, j - 1], positions=pos, attention=md, logits_indices=rows)
            h, kv = model(step_batch, kv)
            token, probs = draft_sample(model.compute_logits(h), st, j)
            tokens = tokens.at[:, j].set(token)
            if probs is not None:
                all_probs = all_probs.at[:, j].set(probs)
            return kv, tokens, all_probs

        if k > 1:
            draft_kv, tokens, all_probs = lax.fori_loop(1, k, body, (draft_kv, tokens, all_probs))
        return tokens, all_probs, draft_kv

    def _run(self, verify, draft_batch, spec, st):
        e = self.runner
        if self.before_run is not None:  # copies the books assume (drafts' pages may evict cached blocks)
            self.before_run()
        with mesh_context(e.mesh), tracing_for(e.platform):
            packed, e.kv_caches, self.draft_kv = self._step_fn(e.state, e.kv_caches, self.draft_state, self.draft_kv,
                                                               verify, draft_batch, spec, st)
        return packed

    def warmup_plan(self) -> list[Program]:
        """The speculative step of every token bucket, greedy and sampling (and with LoRA their LoRA variants)."""
        e = self.runner
        return [Program("speculative", t, e.seq_bucket(t), params=p, lora=lora) for t in e.buckets
                for lora in ((False, True) if e.lora_layout else (False,))
                for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0))]

    def _warmup_args(self, program: Program) -> tuple:
        """(verify batch, draft batch, speculation arrays, sampling tensors) of an empty step of `program`."""
        e = self.runner
        t, s = program.tokens, program.seqs
        empty = build_batch([], page_size=e.config.page_size, num_tokens=t, num_seqs=s, max_pages=e.max_pages)
        verify = e._program_batch(program) if program.lora else empty
        st = e.sampling_tensors([Request("warmup", [0], program.params, arrival_time=0.0)], s)
        st = dataclasses.replace(st, valid=np.zeros_like(st.valid))
        return verify, empty if self.draft_state is not None else None, self._spec_arrays([], s, t), st

    def warmup(self) -> int:
        """Compiles (by running on empty batches) every program of `warmup_plan`. Returns the count."""
        plan = self.warmup_plan()
        for program in plan:
            self._run(*self._warmup_args(program)).block_until_ready()
        return len(plan)

    def trace_program(self, program: Program) -> jax.stages.Traced:
        """`program` traced for the runner's platform without running it."""
        e = self.runner
        with mesh_context(e.mesh), tracing_for(e.platform):
            return self._step_fn.trace(e.state, e.kv_caches, self.draft_state, self.draft_kv,
                                       *self._warmup_args(program))


    # ---- host: plan and launch ---------------------------------------------------------------------------
    def _state(self, r: Request) -> _SeqState:
        state = self._states.get(r.request_id)
        if state is None:
            state = self._states[r.request_id] = _SeqState()
        return state

    def launch(self, sched) -> tuple | None:
        """Plans and launches this step speculatively; None if it must run the plain program (a sampling
        sequence wants logprobs or penalties, a sequence has a logit bias or a grammar, or, n-grams, nothing to
        propose).
        Returns (packed, plan)."""
        e, cfg, k = self.runner, self.config, self.k
        self.steps += 1
        seqs = sched.scheduled
        for s in seqs:
            p = s.request.sampling_params
            if (s.sample and (p.logprobs is not None or p.has_penalties) or p.logit_bias
                    or s.request.grammar is not None):  # structured outputs: drafts are not checked by the grammar
                return None
        scheduler = self.scheduler
        bm, ps = scheduler.block_manager, e.config.page_size
        max_tokens = e.buckets[-1]
        if self.steps % 64 == 0 and len(self._states) > 2 * len(scheduler.requests):
            self._states = {rid: st for rid, st in self._states.items() if rid in scheduler.requests}
        batch_on = not cfg.disable_by_batch_size or len(scheduler.running) < cfg.disable_by_batch_size
        use_draft = self.draft_state is not None
        verify_total = sum(len(s.token_ids) for s in seqs)
        catchup_total = 0
        spec_rows: list[_Row] = []
        other_rows: list[_Row] = []
        catchup: dict[int, list[int]] = {}  # index -> (first token position, tokens) for the draft
        ngram_drafts: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            r = s.request
            state = self._state(r)
            end = s.start + len(s.token_ids)
            caught_up = True
            if use_draft:
                dc = state.draft_computed
                if dc < 0 or state.preemptions != r.metrics.num_preemptions or dc > s.start:
                    dc = s.start  # first seen or recomputed: pages from the prefix cache hold mirrored draft K/V
                    state.preemptions = r.metrics.num_preemptions
                take = min(end - dc, max_tokens - catchup_total)
                if take > 0:
                    catchup[i] = [dc, r.token_ids[dc:dc + take]]
                    catchup_total += take
                state.draft_computed = dc + max(take, 0)
                caught_up = dc + take == end
            k_i = 0
            if (batch_on and caught_up and s.sample and len(s.token_ids) == 1 and end == len(r.token_ids)
                    and self.steps >= state.off_until):
                k_i = min(k, r.max_num_tokens - len(r.token_ids) - 1, max_tokens - verify_total)
                if r.rope_original and not r.rope_long:  # longrope: no draft past the original context, where the
                    k_i = min(k_i, r.rope_original - end)  # scheduler recomputes the sequence with the long set
                if k_i > 0 and not use_draft:
                    drafts = ngram_propose(r.token_ids, k_i, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                    k_i = len(drafts)
                    ngram_drafts[i] = drafts
                if k_i > 0 and not bm.allocate(r, end + k_i):
                    k_i = min(k_i, len(r.block_table) * ps - end)  # no preemption for speculation
                if k_i > 0:
                    verify_total += k_i
                    r.num_computed_tokens = end + k_i
                    ngram_drafts[i] = ngram_drafts.get(i, [])[:k_i]
            (spec_rows if k_i > 0 else other_rows).append(_Row(i, s, k_i))
        if not spec_rows and not use_draft:
            return None  # nothing proposed: the plain program (n-grams keep no state)
        rows = spec_rows + other_rows
        t_bucket, s_bucket = e.bucket_for(max(verify_total, catchup_total, 1))
        verify_chunks = []
        for row in rows:
            s = row.seq
            drafts = ngram_drafts.get(row.index) or [0] * row.num_draft
            verify_chunks.append(_SpecSeqChunk(list(s.token_ids) + drafts, s.start, s.request.block_table)
                                 if row.num_draft else s)
        verify = e.batch_builder.build(verify_chunks, num_tokens=t_bucket, num_seqs=s_bucket,
                                       lora_slots=[row.seq.request.lora_slot for row in rows],
                                       rope_long=[row.seq.request.rope_long for row in rows] if e.rope_original
                                       else None)
        draft_batch = None
        if use_draft:
            draft_chunks = []
            for row in rows:
                if row.index in catchup:
                    start, tokens = catchup[row.index]
                    draft_chunks.append(_SpecSeqChunk(tokens, start, row.seq.request.block_table))
                if row.num_draft:
                    end = row.seq.start + len(row.seq.token_ids)
                    row.draft_end = end + row.num_draft - 1
            draft_batch = self._draft_builder.build(draft_chunks, num_tokens=t_bucket, num_seqs=s_bucket)
        spec = self._spec_arrays(rows, s_bucket, t_bucket, ngram_drafts)
        st = e.sampling_tensors([row.seq.request for row in rows], s_bucket)
        st = dataclasses.replace(st, valid=st.valid & np.array(
            [row.seq.sample for row in rows] + [False] * (s_bucket - len(rows))))
        packed = self._run(verify, draft_batch, spec, st)
        self.num_spec_steps += bool(spec_rows)
        return packed, SpecPlan(rows, len(spec_rows))

    def _spec_arrays(self, rows: list[_Row], num_seqs: int, num_tokens: int,
                     ngram_drafts: dict | None = None) -> dict[str, np.ndarray]:
        k = self.k
        verify_index = np.zeros((num_seqs, k + 1), np.int32)
        num_draft = np.zeros(num_seqs, np.int32)
        draft_tokens = np.zeros((num_seqs, k), np.int32)
        draft_slot = np.full((num_seqs, k), num_tokens, np.int32)
        draft_pos = np.zeros(num_seqs, np.int32)
        offset = 0
        j = np.arange(k + 1)
        for i, row in enumerate(rows):
            n = len(row.seq.token_ids) + row.num_draft
            verify_index[i] = offset + np.minimum(n - 1 - row.num_draft + j, n - 1)
            if row.num_draft:
                num_draft[i] = row.num_draft
                draft_slot[i, :row.num_draft] = offset + 1 + np.arange(row.num_draft)
                draft_pos[i] = row.seq.start
                drafts = (ngram_drafts or {}).get(row.index)
                if drafts:
                    draft_tokens[i, :len(drafts)] = drafts
            offset += n
        num_spec = np.array([sum(1 for row in rows if row.num_draft)], np.int32)
        return dict(verify_index=verify_index, num_draft=num_draft, draft_tokens=draft_tokens, draft_slot=draft_slot,
                    draft_pos=draft_pos, num_spec=num_spec)

    # ---- host: results -----------------------------------------------------------------------------------
    def accept(self, sched, plan: SpecPlan, host: np.ndarray) -> list:
        """Per scheduled sequence (scheduler order) the tokens it emitted; rolls rejected drafts' K/V back.
        Call `after_update(plan)` after `Scheduler.update`."""
        tokens: list = [0] * len(sched.scheduled)
        running = RequestStatus.RUNNING
        for i, row in enumerate(plan.rows):
            n = int(host[i, 0])
            if row.seq.sample:
                tokens[row.index] = host[i, 1:1 + n].tolist()
            r = row.seq.request
            if not row.num_draft or r.status is not running:
                continue
            accepted = n - 1
            self.num_drafts += 1
            self.num_draft_tokens += row.num_draft
            self.num_accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_per_pos[j] += 1
            state = self._state(r)
            state.acceptance = 0.8 * state.acceptance + 0.2 * accepted / row.num_draft
            if state.acceptance < self.min_acceptance:
                state.off_until = self.steps + state.backoff
                state.backoff = min(256, state.backoff * 2)
                state.acceptance = 1.0  # a fresh start after the pause
            end = row.seq.start + 1
            kept = self.scheduler.truncate_computed(r.request_id, end + accepted)
            assert kept == end + accepted, f"roll-back of {r.request_id} stopped at {kept}, not {end + accepted}"
            r.num_computed_tokens = end  # update() registers full blocks of known tokens only; see after_update
            if row.draft_end:
                state.draft_computed = min(row.draft_end, end + accepted)
        return tokens

    def after_update(self, plan: SpecPlan) -> None:
        running = RequestStatus.RUNNING
        for row in plan.rows[:plan.num_spec]:
            r = row.seq.request
            if r.status is running:
                # The accepted drafts' K/V is valid: everything but the newest token is computed.
                r.num_computed_tokens = len(r.token_ids) - 1

    def on_failure(self) -> None:
        """After a failed step: a lost draft cache is rebuilt (its requests re-run their draft catch-up)."""
        if self.draft_kv is not None and any(kv.is_deleted() for kv in self.draft_kv):
            self._init_draft_kv()
        self._states.clear()
