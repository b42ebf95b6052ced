"""On-device sampling, one token per sequence slot from float32 logits [S, V] inside the engine's jitted step:
`SamplingTensors` (per-slot parameters, built on the host by `build_sampling_tensors`), the pure `sample` (logit bias,
penalties, temperature, filters, the draw) and its `SamplerOutput`, `greedy`, and `pack` / `unpack_row` for the packed
result. Details: docs/engine.md."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from serving.params import SamplingParams
from sharding.axes import VOCAB
from sharding.mesh import mesh_axis

_BLOCK = 256  # tokens per block of the two-level inverse CDF
_MIN_CANDIDATES = 64  # smallest lax.top_k width compiled, so small top_k values share one program
_TOP_P_CANDIDATES = 256  # top-p mass is looked for among this many candidates before the bisection fallback
_MAX_CANDIDATES = 1024  # wider top_k values use the bisection (lax.top_k(K) grows ~linearly in K on CPU)
_MIN_WINDOW = 16  # smallest token-id window for penalties
VOCAB_AXIS = mesh_axis(VOCAB)  # the mesh axis that shards the LM head, hence the logits' vocabulary


@dataclasses.dataclass(slots=True)
class SamplingTensors:
    """Per-slot sampling parameters of one step, S slots (padding slots included). A pytree: the arrays are
    leaves, the `static` flags are part of the tree structure, so a jitted step recompiles per flag set."""
    temperature: jax.Array  # f32[S]; 0 = greedy (argmax of the penalised logits)
    top_k: jax.Array  # i32[S]; 0 = off (the builder maps -1, and k >= V, to 0)
    top_p: jax.Array  # f32[S]; 1 = off
    min_p: jax.Array  # f32[S]; 0 = off
    repetition_penalty: jax.Array  # f32[S]; 1 = off
    presence_penalty: jax.Array  # f32[S]; 0 = off
    frequency_penalty: jax.Array  # f32[S]; 0 = off
    seed: jax.Array  # u32[S, 2]; threefry key data (high, low word of the 64-bit seed) = key_data(key(seed))
    step: jax.Array  # i32[S]; tokens the request has generated so far, folded into the key
    valid: jax.Array  # bool[S]; False for padding slots, whose outputs are zeros
    token_ids: jax.Array | None  # i32[S, W]; prompt then output ids, -1 padded; None when no penalties
    num_prompt_tokens: jax.Array | None  # i32[S]; how many of token_ids are prompt; None when no penalties
    bias_ids: jax.Array | None = None  # i32[S, K]; logit_bias token ids, -1 padded; None when no slot has a bias
    bias_values: jax.Array | None = None  # f32[S, K]; the bias of each of bias_ids (0 where padded)
    # i32[S, ceil(V / 32)]; structured outputs: bit j of word w allows token 32w + j (all set for free slots); None
    # when no slot is constrained
    token_bitmask: jax.Array | None = None
    all_greedy: bool = False  # static: every slot is greedy; skip filters and the draw
    num_candidates: int = 0  # static: lax.top_k width for top-k / top-p; 0 = no slot uses either
    use_min_p: bool = False  # static: some slot has min_p > 0

    @property
    def use_penalties(self) -> bool:
        return self.token_ids is not None

    @property
    def num_slots(self) -> int:
        return self.temperature.shape[0]


jax.tree_util.register_dataclass(
    SamplingTensors,
    data_fields=["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "step", "valid", "token_ids", "num_prompt_tokens", "bias_ids",
                 "bias_values", "token_bitmask"],
    meta_fields=["all_greedy", "num_candidates", "use_min_p"])


@dataclasses.dataclass(slots=True)
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; log_softmax(raw logits) at token_ids
    top_logprob_ids: jax.Array  # i32[S, n]; the n most likely tokens of the raw distribution, descending
    top_logprobs: jax.Array  # f32[S, n]


jax.tree_util.register_dataclass(
    SamplerOutput, data_fields=["token_ids", "logprobs", "top_logprob_ids", "top_logprobs"], meta_fields=[])


def pack(out: SamplerOutput) -> jax.Array:
    """Pure. The sampler's output as one int32 array [S, 2 + 2n] for a single host copy: token id, its logprob, the
    top-n ids and their logprobs; token ids stay integers, logprobs travel as their float32 bits."""
    bits = lambda a: lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)  # noqa: E731
    return jnp.concatenate([out.token_ids.astype(jnp.int32)[:, None], bits(out.logprobs)[:, None],
                            out.top_logprob_ids.astype(jnp.int32), bits(out.top_logprobs)], axis=1)


def unpack_row(row: np.ndarray, n: int) -> tuple[int, float, list[tuple[int, float]]]:
    """Host-side. One `pack` row: (token id, its logprob, the first n of the top (id, logprob) pairs)."""
    row = np.ascontiguousarray(row, np.int32)
    floats = row.view(np.float32)
    width = (len(row) - 2) // 2
    return int(row[0]), float(floats[1]), [(int(row[2 + j]), float(floats[2 + width + j])) for j in range(n)]


def _next_power_of_two(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def build_sampling_tensors(params: Sequence[SamplingParams | None], *, vocab_size: int,
                           token_ids: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int],
                           num_slots: int | None = None, seeds: Sequence[int | None] | None = None,
                           max_candidates: int = _MAX_CANDIDATES, bias_width: int | None = None) -> SamplingTensors:
    """Host side, once per step: numpy `SamplingTensors` for the slots of a batch.

    params[i] is slot i's SamplingParams, or None for a padding slot; slots from len(params) to num_slots are
    padding too. seeds[i] overrides params[i].seed (the engine passes the seed it drew for a request without
    one); a sampling slot with neither raises. token_ids[i] is the request's tokens so far (prompt, then
    outputs) and num_prompt_tokens[i] its prompt length: their difference is the generation step of the PRNG,
    and the ids feed the penalties (padding slots: [] and 0). A slot's logit_bias becomes a row of bias_ids /
    bias_values, `bias_width` wide (default: the most entries, to a power of two; the engine passes one width).
    """
    num_slots = len(params) if num_slots is None else num_slots
    if num_slots < len(params):
        raise ValueError(f"num_slots must be >= len(params) ({len(params)}), got {num_slots}")
    if len(token_ids) != len(params) or len(num_prompt_tokens) != len(params):
        raise ValueError(f"token_ids and num_prompt_tokens must have one entry per params ({len(params)}), "
                         f"got {len(token_ids)} and {len(num_prompt_tokens)}")
    if seeds is not None and len(seeds) != len(params):
        raise ValueError(f"seeds must have one entry per params ({len(params)}), got {len(seeds)}")
    default = SamplingParams(temperature=0.0)
    rows = [default if p is None else p for p in params] + [default] * (num_slots - len(params))
    greedy = np.array([p.is_greedy for p in rows], bool)
    temperature = np.where(greedy, 0.0, np.array([p.temperature for p in rows], np.float32)).astype(np.float32)
    top_k = np.array([p.top_k for p in rows], np.int64)
    top_k = np.where(greedy | (top_k <= 0) | (top_k >= vocab_size), 0, top_k).astype(np.int32)
    top_p = np.where(greedy, 1.0, np.array([p.top_p for p in rows], np.float32)).astype(np.float32)
    min_p = np.where(greedy, 0.0, np.array([p.min_p for p in rows], np.float32)).astype(np.float32)
    repetition = np.array([p.repetition_penalty for p in rows], np.float32)
    presence = np.array([p.presence_penalty for p in rows], np.float32)
    frequency = np.array([p.frequency_penalty for p in rows], np.float32)
    valid = np.zeros(num_slots, bool)
    valid[:len(params)] = [p is not None for p in params]

    seed = np.zeros((num_slots, 2), np.uint32)
    for i, p in enumerate(params):
        value = seeds[i] if seeds is not None and seeds[i] is not None else (p.seed if p is not None else 0)
        if value is None:
            if not greedy[i]:
                raise ValueError(f"slot {i} samples (temperature {p.temperature}) but has no seed: pass seeds[{i}] "
                                 f"or set SamplingParams.seed")
            value = 0
        value %= 1 << 64  # negative seeds: their two's-complement bit pattern
        seed[i] = (value >> 32, value & 0xFFFFFFFF)

    lengths = np.fromiter((len(ids) for ids in token_ids), np.int64, len(params))
    prompt_lens = np.zeros(num_slots, np.int32)
    prompt_lens[:len(params)] = num_prompt_tokens
    step = np.zeros(num_slots, np.int32)
    step[:len(params)] = lengths - prompt_lens[:len(params)]
    window = None
    if np.any(valid & ((repetition != 1.0) | (presence != 0.0) | (frequency != 0.0))):
        window = np.full((num_slots, _next_power_of_two(int(lengths.max(initial=0)), _MIN_WINDOW)), -1, np.int32)
        for i, ids in enumerate(token_ids):
            if valid[i] and rows[i].has_penalties:
                window[i, :len(ids)] = ids

    bias_ids = bias_values = None
    biased = [i for i, p in enumerate(params) if p is not None and p.logit_bias]
    if biased:
        widest = max(len(params[i].logit_bias) for i in biased)
        width = _next_power_of_two(widest, _MIN_WINDOW) if bias_width is None else bias_width
        if width < widest:
            raise ValueError(f"bias_width {width} is narrower than a slot's logit_bias ({widest} entries)")
        bias_ids = np.full((num_slots, width), -1, np.int32)
        bias_values = np.zeros((num_slots, width), np.float32)
        for i in biased:
            bias = params[i].logit_bias
            bias_ids[i, :len(bias)] = list(bias)
            bias_values[i, :len(bias)] = list(bias.values())

    active = valid & ~greedy
    widest_k = int(top_k[active].max(initial=0))
    use_top_p = bool(np.any(active & (top_p < 1.0)))
    num_candidates = 0
    if widest_k or use_top_p:
        num_candidates = min(_next_power_of_two(min(widest_k, max_candidates), _MIN_CANDIDATES), vocab_size)
        if use_top_p:
            num_candidates = min(max(num_candidates, _TOP_P_CANDIDATES), vocab_size)
    return SamplingTensors(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition,
        presence_penalty=presence, frequency_penalty=frequency, seed=seed, step=step, valid=valid,
        token_ids=window, num_prompt_tokens=None if window is None else prompt_lens, bias_ids=bias_ids,
        bias_values=bias_values, all_greedy=not bool(np.any(active)), num_candidates=num_candidates,
        use_min_p=bool(np.any(active & (min_p > 0.0))))


def _local_ids(ids: jax.Array, offset: jax.Array | int, vocab: int) -> jax.Array:
    """Global token ids [S, W] (-1 = padding) as columns of the vocabulary shard starting at `offset`, `vocab`
    wide; padding and other shards' ids become `vocab`, which a mode="drop" scatter drops."""
    local = ids - offset
    return jnp.where((ids < 0) | (local < 0), vocab, local)


def apply_logit_bias(logits: jax.Array, t: SamplingTensors, offset: jax.Array | int = 0) -> jax.Array:
    """Pure, jit-able. Adds each slot's logit_bias to its logits: one scatter-add of the sparse [S, K] ids and values
    (no dense [S, V] bias). `logits` may be a vocabulary shard, as in apply_penalties."""
    if t.bias_ids is None:
        return logits
    num_slots, vocab = logits.shape
    ids = _local_ids(t.bias_ids, offset, vocab)
    return logits.at[jnp.arange(num_slots)[:, None], ids].add(t.bias_values.astype(logits.dtype), mode="drop")


def apply_penalties(logits: jax.Array, t: SamplingTensors, offset: jax.Array | int = 0) -> jax.Array:
    """Pure, jit-able. Repetition penalty (HF/vLLM: over prompt and output tokens, a positive logit is divided
    by it, a negative one multiplied), then OpenAI frequency/presence penalties over output tokens only.
    Cost: two scatters of [S, W] ids into [S, V] on device and one fused [S, V] elementwise pass.
    `logits` may be the vocabulary shard [S, V / tp] of ids offset .. offset + V / tp - 1; ids elsewhere are
    left to the shards that own them."""
    if t.token_ids is None:
        return logits
    num_slots, vocab = logits.shape
    ids = _local_ids(t.token_ids, offset, vocab)
    rows = jnp.arange(num_slots)[:, None]
    is_output = jnp.arange(ids.shape[1])[None, :] >= t.num_prompt_tokens[:, None]
    output_counts = jnp.zeros((num_slots, vocab), jnp.int32).at[rows, ids].add(
        is_output.astype(jnp.int32), mode="drop")
    seen = jnp.zeros((num_slots, vocab), bool).at[rows, ids].set(True, mode="drop")
    repetition = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return (logits - t.frequency_penalty[:, None] * output_counts.astype(logits.dtype)
            - t.presence_penalty[:, None] * (output_counts > 0).astype(logits.dtype))


def apply_token_bitmask(logits: jax.Array, t: SamplingTensors, offset: jax.Array | int = 0) -> jax.Array:
    """Pure, jit-able. Structured outputs: -inf for the tokens whose bit is clear in the slot's row of
    `token_bitmask`. `logits` may be the vocabulary shard starting at global id `offset`."""
    if t.token_bitmask is None:
        return logits
    num_slots, vocab = logits.shape
    if isinstance(offset, int) and offset % 32 == 0:  # whole words: shift every word by 0..31
        words = lax.slice_in_dim(t.token_bitmask, offset // 32, offset // 32 + -(-vocab // 32), axis=1)
        bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
        allowed = bits.reshape(num_slots, -1)[:, :vocab] != 0
    else:  # a shard whose first id is traced (inside shard_map): each column's word and bit
        ids = offset + jnp.arange(vocab, dtype=jnp.int32)
        allowed = ((t.token_bitmask[:, ids // 32] >> (ids % 32)) & 1) != 0
    return jnp.where(allowed, logits, -jnp.inf)


class _Rows:
    """Reductions over the vocabulary (axis 1) of [S, V] arrays whose rows are whole on this device."""
    offset = 0  # global id of local column 0

    def max(self, a: jax.Array) -> jax.Array:
        return jnp.max(a, axis=1)

    def sum(self, a: jax.Array) -> jax.Array:
        return jnp.sum(a, axis=1)

    def argmax(self, a: jax.Array) -> jax.Array:
        """First index of the row maximum. As max, then the smallest index equal to it: XLA:CPU's argmax is a
        variadic (value, index) reduce that does not vectorise (2x slower at [16, 32000])."""
        v = a.shape[1]
        first = jnp.min(jnp.where(a == jnp.max(a, axis=1, keepdims=True), jnp.arange(v, dtype=jnp.int32), v), axis=1)
        return jnp.minimum(first, v - 1)  # an all-NaN row has no index equal to its max

    def logsumexp(self, a: jax.Array) -> jax.Array:
        return jax.nn.logsumexp(a, axis=1)

    def top_k(self, a: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """The row's k largest values, descending (lower id first on ties), and their global ids."""
        return lax.top_k(a, k)

    def take(self, a: jax.Array, ids: jax.Array) -> jax.Array:
        """a[i, ids[i]] for global ids [S]."""
        return jnp.take_along_axis(a, ids[:, None], axis=1)[:, 0]

    def gather(self, a: jax.Array) -> jax.Array:
        """Per-shard columns [S, c] -> every shard's, in shard order [S, tp * c]."""
        return a

    def from_shard(self, shard: jax.Array, value: jax.Array) -> jax.Array:
        """value as computed on shard `shard[i]` of each row (everywhere)."""
        return value


class _ShardedRows(_Rows):
    """The same reductions inside shard_map over `axis`, each device holding the columns
    [offset, offset + V / tp) of every row; only per-row partials cross devices."""

    def __init__(self, axis: str, local_vocab: int):
        self.axis = axis
        self.index = lax.axis_index(axis)
        self.local_vocab = local_vocab
        self.offset = self.index * local_vocab

    def max(self, a):
        return lax.pmax(jnp.max(a, axis=1), self.axis)

    def sum(self, a):
        return lax.psum(jnp.sum(a, axis=1), self.axis)

    def argmax(self, a):  # the first shard holding the maximum, its first index: the global first argmax
        best = lax.all_gather(jnp.max(a, axis=1), self.axis, axis=1)
        ids = lax.all_gather(jnp.argmax(a, axis=1).astype(jnp.int32) + self.offset, self.axis, axis=1)
        return jnp.take_along_axis(ids, jnp.argmax(best, axis=1)[:, None], axis=1)[:, 0]

    def logsumexp(self, a):
        return jax.nn.logsumexp(lax.all_gather(jax.nn.logsumexp(a, axis=1), self.axis, axis=1), axis=1)

    def top_k(self, a, k):
        # The global top-k is inside the union of the shards' top-k; ties go to the lower shard, then the lower
        # local id (lax.top_k is stable), i.e. to the lower global id, as in the unsharded top_k.
        values, ids = lax.top_k(a, min(k, a.shape[1]))
        values = lax.all_gather(values, self.axis, axis=1, tiled=True)
        ids = lax.all_gather(ids + self.offset, self.axis, axis=1, tiled=True)
        values, position = lax.top_k(values, k)
        return values, jnp.take_along_axis(ids, position, axis=1)

    def take(self, a, ids):
        local = ids - self.offset
        mine = (local >= 0) & (local < self.local_vocab)
        value = jnp.take_along_axis(a, jnp.clip(local, 0, self.local_vocab - 1)[:, None], axis=1)[:, 0]
        return lax.psum(jnp.where(mine, value, 0), self.axis)

    def gather(self, a):
        return lax.all_gather(a, self.axis, axis=1, tiled=True)

    def from_shard(self, shard, value):
        return lax.psum(jnp.where(shard == self.index, value, 0), self.axis)


_LOCAL_ROWS = _Rows()


def _ordered_key(x: jax.Array) -> jax.Array:
    """uint32 whose unsigned order is the float32 order of x (for bisection over values)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_to_float(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _largest_threshold(x: jax.Array, weights: jax.Array, target: jax.Array, rows: _Rows = _LOCAL_ROWS
                       ) -> jax.Array:
    """Per row, the largest value v of x such that sum(weights[x >= v]) >= target: exact, 32 halvings of the
    uint32 key range, each one [S, V] reduction. Needs sum(weights) >= target (the smallest key satisfies it)."""
    keys = _ordered_key(x)

    def halve(_, bounds):
        lo, hi = bounds  # invariant: lo satisfies; the answer is in [lo, hi]
        span = hi - lo
        mid = lo + span // 2 + (span & 1)  # ceil of the midpoint, without overflowing uint32
        ok = rows.sum(jnp.where(keys >= mid[:, None], weights, 0)) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jnp.zeros(x.shape[:1], jnp.uint32)
    hi = jnp.full(x.shape[:1], 0xFFFFFFFF, jnp.uint32)
    lo, _ = lax.fori_loop(0, 32, halve, (lo, hi))
    return _key_to_float(lo)


def _filter_threshold(x: jax.Array, t: SamplingTensors, rows: _Rows = _LOCAL_ROWS) -> jax.Array:
    """Per-row threshold on the temperature-scaled logits x: min-p, then top-k, then top-p over the
    renormalised survivors. Tokens with x >= threshold are kept; the row maximum always is."""
    num_slots = x.shape[0]
    row_max = rows.max(x)
    threshold = jnp.full((num_slots,), -jnp.inf, x.dtype)
    if t.use_min_p:  # p >= min_p * p_max  <=>  x >= x_max + log(min_p)
        threshold = jnp.maximum(threshold, row_max + jnp.log(t.min_p))
    if not t.num_candidates:
        return threshold
    candidates = rows.top_k(x, t.num_candidates)[0]  # [S, K], descending
    k_in_candidates = t.top_k <= t.num_candidates
    kth = jnp.take_along_axis(candidates, jnp.clip(t.top_k - 1, 0, t.num_candidates - 1)[:, None], axis=1)[:, 0]
    wide_k = t.valid & (t.top_k > t.num_candidates)
    kth = lax.cond(jnp.any(wide_k),
                   lambda: jnp.where(k_in_candidates, kth, _largest_threshold(x, jnp.ones_like(x), t.top_k, rows)),
                   lambda: kth)
    threshold = jnp.where(t.top_k > 0, jnp.maximum(threshold, kth), threshold)

    # Top-p on the survivors: the largest value whose cumulative (descending) kept mass reaches top_p.
    kept = x >= threshold[:, None]
    shifted = jnp.where(kept, x - row_max[:, None], -jnp.inf)
    total = rows.sum(jnp.exp(shifted))
    num_kept = rows.sum(kept.astype(jnp.int32))
    candidate_probs = jnp.where(candidates >= threshold[:, None],
                                jnp.exp(candidates - row_max[:, None]), 0) / total[:, None]
    cumulative = jnp.cumsum(candidate_probs, axis=1)
    # All survivors among the candidates: measure top_p against their own sum, immune to rounding.
    target = t.top_p * jnp.where(num_kept <= t.num_candidates, cumulative[:, -1], 1.0)
    index = jnp.sum(cumulative < target[:, None], axis=1)
    in_candidates = index < t.num_candidates
    top_p_value = jnp.take_along_axis(
        candidates, jnp.minimum(index, t.num_candidates - 1)[:, None], axis=1)[:, 0]
    use_top_p = t.top_p < 1.0
    wide_p = t.valid & use_top_p & ~in_candidates

    def bisect_top_p():
        probs = jnp.exp(shifted) / total[:, None]
        exact = _largest_threshold(x, probs, t.top_p * rows.sum(probs), rows)
        return jnp.where(in_candidates, top_p_value, exact)

    top_p_value = lax.cond(jnp.any(wide_p), bisect_top_p, lambda: top_p_value)
    threshold = jnp.where(use_top_p, jnp.maximum(threshold, top_p_value), threshold)
    return jnp.minimum(threshold, row_max)  # never drop the most likely token, whatever the rounding


def _pick(masses: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row, the first index whose cumulative mass exceeds target (rounding: the last positive one), and the
    mass before it."""
    cumulative = jnp.cumsum(masses, axis=-1)
    index = jnp.sum(cumulative <= target[:, None], axis=-1)
    positions = jnp.arange(masses.shape[-1])
    last_positive = jnp.max(jnp.where(masses > 0, positions, 0), axis=-1)
    index = jnp.minimum(index, last_positive)
    before = jnp.take_along_axis(cumulative, jnp.maximum(index - 1, 0)[:, None], axis=-1)[:, 0]
    return index, jnp.where(index > 0, before, 0)


def _inverse_cdf(weights: jax.Array, uniform: jax.Array, rows: _Rows = _LOCAL_ROWS) -> jax.Array:
    """Per row, index i drawn with probability weights[i] / sum(weights) (weights >= 0, some > 0), by the
    cumulative sum at uniform * total: first over blocks of _BLOCK tokens, then inside the chosen block.
    Vocabulary-sharded: each shard's blocks (its last one zero-padded) are gathered, [S, V / _BLOCK], every
    shard picks the same block, and the shard owning it picks inside it."""
    num_slots, vocab = weights.shape
    num_blocks = -(-vocab // _BLOCK)
    blocks = jnp.pad(weights, ((0, 0), (0, num_blocks * _BLOCK - vocab))).reshape(num_slots, num_blocks, _BLOCK)
    block_mass = rows.gather(jnp.sum(blocks, axis=-1))
    target = uniform * jnp.sum(block_mass, axis=-1)
    block, mass_before = _pick(block_mass, target)
    shard, local_block = block // num_blocks, block % num_blocks
    inside = jnp.take_along_axis(blocks, local_block[:, None, None], axis=1)[:, 0, :]
    offset = rows.from_shard(shard, _pick(inside, target - mass_before)[0])
    return (shard * vocab + local_block * _BLOCK + offset).astype(jnp.int32)


def _row_uniforms(t: SamplingTensors) -> jax.Array:
    def one(seed, step):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), step)
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(t.seed, t.step)


def vocab_parallel_mesh(vocab_size: int):
    """Trace-time. The mesh in context when it shards the vocabulary (VOCAB_AXIS > 1, dividing vocab_size)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or VOCAB_AXIS not in mesh.axis_names:
        return None
    n = mesh.shape[VOCAB_AXIS]
    return mesh if n > 1 and vocab_size % n == 0 else None


def sample(logits: jax.Array, t: SamplingTensors, *, max_logprobs: int = 0) -> SamplerOutput:
    """Pure, jit-able (max_logprobs static). One token per slot from float32 logits [S, V].

    The logit bias is added first (as HF's sequence_bias and vLLM do), then the penalties, then the structured
    outputs' token bitmask removes what the slot's grammar forbids. Greedy slots
    (temperature 0) take exactly the argmax of the biased, penalised logits (first index on ties). Others draw from
    softmax(penalised / temperature) restricted by min-p, top-k, top-p. Padding slots return zeros. Logprobs are
    the raw model's.
    Under a mesh whose 'tensor' axis shards the vocabulary, runs per vocabulary shard (see the module notes).
    """
    mesh = vocab_parallel_mesh(logits.shape[1])
    if mesh is None:
        return _sample(logits, t, max_logprobs, _LOCAL_ROWS)
    P = jax.sharding.PartitionSpec

    def local(logits, t):
        return _sample(logits, t, max_logprobs, _ShardedRows(VOCAB_AXIS, logits.shape[1]))
    # Every output is computed identically on every shard from exchanged partials: replicated.
    return jax.shard_map(local, mesh=mesh, in_specs=(P(None, VOCAB_AXIS), P()), out_specs=P(),
                         check_vma=False)(logits, t)


def greedy(logits: jax.Array) -> jax.Array:
    """Pure, jit-able. int32 [S]: each row's argmax (first index on ties), i.e. what `sample` returns for a greedy
    slot without penalties. Vocabulary-parallel like `sample`."""
    raw = logits.astype(jnp.float32)
    mesh = vocab_parallel_mesh(raw.shape[1])
    if mesh is None:
        return _LOCAL_ROWS.argmax(raw)
    P = jax.sharding.PartitionSpec
    return jax.shard_map(lambda a: _ShardedRows(VOCAB_AXIS, a.shape[1]).argmax(a), mesh=mesh,
                         in_specs=P(None, VOCAB_AXIS), out_specs=P(), check_vma=False)(raw)


def _sample(logits: jax.Array, t: SamplingTensors, max_logprobs: int, rows: _Rows) -> SamplerOutput:
    raw = logits.astype(jnp.float32)
    # The mask comes last, so neither the bias nor a penalty can lift a token the grammar forbids.
    penalised = apply_token_bitmask(apply_penalties(apply_logit_bias(raw, t, rows.offset), t, rows.offset), t,
                                    rows.offset)
    greedy_ids = rows.argmax(penalised)
    if t.all_greedy:
        token_ids = greedy_ids
    else:
        greedy = t.temperature <= 0
        x = penalised / jnp.where(greedy, 1.0, t.temperature)[:, None]
        threshold = _filter_threshold(x, t, rows)
        row_max = rows.max(x)[:, None]
        weights = jnp.where(x >= threshold[:, None], jnp.exp(x - row_max), 0)
        token_ids = jnp.where(greedy, greedy_ids, _inverse_cdf(weights, _row_uniforms(t), rows))
    token_ids = jnp.where(t.valid, token_ids, 0)

    normaliser = rows.logsumexp(raw)
    logprobs = rows.take(raw, token_ids) - normaliser
    if max_logprobs:
        top_values, top_ids = rows.top_k(raw, max_logprobs)
        top_logprobs = top_values - normaliser[:, None]
    else:
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
        top_logprobs = jnp.zeros((raw.shape[0], 0), jnp.float32)
    valid = t.valid[:, None]
    return SamplerOutput(
        token_ids=token_ids, logprobs=jnp.where(t.valid, logprobs, 0.0),
        top_logprob_ids=jnp.where(valid, top_ids, 0).astype(jnp.int32),
        top_logprobs=jnp.where(valid, top_logprobs, 0.0))
