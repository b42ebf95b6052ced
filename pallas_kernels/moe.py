"""The grouped expert MLP of mixture-of-experts layers, behind one entry point: `grouped_expert_mlp`. On CPU with the
native kernels it is one call of `native.expert_mlp` (each selected expert's weights read once for all its tokens,
unselected experts not read at all; fused gate|up, SwiGLU, down and the weighted combine; float weights, or int8
with per-channel scales); on XLA:CPU a step of a few (token, expert) pairs gathers the selected experts' weights
(`GATHER_MAX_PAIRS`; quantized experts the kernel does not take, on every platform); otherwise the (token, expert)
pairs are sorted by slot and run through a grouped matmul: on TPU megablox's (`jax.experimental.pallas.ops.tpu.
megablox.gmm`, the Pallas/Mosaic kernel MaxText and tpu-inference use), elsewhere (GPU, larger steps on XLA:CPU)
`jax.lax.ragged_dot`. MESHSERVE_MOE_KERNEL=ragged_dot (or gather, megablox: interpreted off TPU) forces that path
(for comparisons and tests)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels.target import target_platform

MOE_ENV_VAR = "MESHSERVE_MOE_KERNEL"  # auto (default): native where it runs | gather | ragged_dot | megablox
BACKENDS = ("native", "gather", "loop", "ragged_dot", "megablox")
# XLA:CPU without the native kernels: up to this many (token, expert) pairs (a decode step of 1-2 tokens at top-2)
# gather the selected experts' weights and apply them directly, so the step reads what the tokens selected
# (mixtral-tiny, one layer, 1 token: 0.54 ms against ragged_dot's 15.5 ms, which walks every group on XLA:CPU); at
# 8 pairs both took ~16 ms, so more pairs stay on ragged_dot.
GATHER_MAX_PAIRS = 4
# XLA:CPU without the native kernels, more pairs but at most this many tokens (a bfloat16 decode step is padded to 8
# rows there): a loop over the distinct experts the tokens selected, each applied to every row once
# (`looped_expert_mlp`). Measured on the AMD EPYC, one layer, loop vs ragged_dot: mixtral-tiny's experts (8 x 512 x
# 1024) at 8 / 64 tokens 3.4 / 8.5 ms vs 26 / 29 ms (float32), 4.2 / 4.2 vs 24 / 29 ms (bfloat16); qwen3moe-tiny's
# (64 x 512 x 128, top-8) 3.1 / 15 vs 37 / 92 ms; a 37M Mixtral-shaped model's bfloat16 batch-1 step took 32 ms on
# ragged_dot against 0.7 ms of bytes.
LOOP_MAX_ROWS = 64
# megablox gmm: the dtypes it takes (lhs and rhs), its tiles. Rows: at most MEGABLOX_TM per tile, a multiple of 16
# (bfloat16's sublane packing); K and N: the largest of these that divides the dimension, else the whole dimension
# (a block equal to the array's extent is always a legal Mosaic block). None of this was tuned on a TPU.
MEGABLOX_DTYPES = (jnp.float32, jnp.bfloat16)
MEGABLOX_TM = 128
MEGABLOX_TILES = (512, 256, 128)


def native_may_run() -> bool:
    """Whether MESHSERVE_MOE_KERNEL leaves the native kernel its choice (auto or native): engines pack their
    experts for it at load only then (`pallas_kernels.matmul.pack_experts`); a forced other path keeps them
    row-major rather than unpack them every step."""
    return os.environ.get(MOE_ENV_VAR, "auto").strip().lower() in ("", "auto", "native")


def moe_backend(x, gate, up, down, pairs: int | None = None, scales=None, group: int = 0,
                plain_swiglu: bool = True) -> str:
    """Trace-time. Which backend `grouped_expert_mlp` takes for these operands here (`pairs`: the (token, expert)
    pairs, T * k; None: many; `scales`, `group`: quantized weights' as `grouped_expert_mlp` takes them). The native
    kernel takes int8 experts with per-channel scales; quantized experts it does not take gather their weights
    for a few pairs on every platform. XLA:CPU: a few pairs gather, up to LOOP_MAX_ROWS tokens loop over the
    selected experts. TPU: megablox for float32 / bfloat16 activations (the kernel's dtypes). `plain_swiglu` False
    (experts with biases or GPT-OSS's clamped SwiGLU): never the native kernel, which computes neither."""
    pairs = GATHER_MAX_PAIRS + 1 if pairs is None else pairs
    choice = os.environ.get(MOE_ENV_VAR, "auto").strip().lower()
    if choice not in ("", "auto", *BACKENDS):
        raise ValueError(f"{MOE_ENV_VAR}={choice!r}: expected auto or one of {', '.join(BACKENDS)}")
    if choice == "native" and not plain_swiglu:
        raise ValueError(f"{MOE_ENV_VAR}=native: the native expert kernel has no expert biases or clamped SwiGLU "
                         f"(GPT-OSS); expected auto, {', '.join(BACKENDS[1:])}")
    if choice in BACKENDS[1:]:
        return choice
    if plain_swiglu and not (scales is not None and group) and native.expert_mlp_supported(x, gate, up, down,
                                                                                          scales):
        return "native"
    if (target_platform() == "cpu" or scales is not None) and pairs <= GATHER_MAX_PAIRS:
        return "gather"
    if target_platform() == "cpu" and x.shape[0] <= LOOP_MAX_ROWS:
        return "loop"
    if target_platform() == "tpu" and x.dtype in MEGABLOX_DTYPES:
        return "megablox"
    return "ragged_dot"


def grouped_expert_mlp(x, slots, weights, gate, up, down, scales=None, group=0, biases=None, act=None):
    """Pure. [T, E] in x's dtype: sum_k weights[t, k] * SwiGLU_{slots[t, k]}(x[t]), SwiGLU_s(v) =
    (silu(v @ gate[s]) * (v @ up[s])) @ down[s]; x [T, E], slots [T, k] int (< 0: padding, no work; >= S: no work),
    weights [T, k], gate/up [S, E, I], down [S, I, E] (or packed slot by slot for the native kernel,
    `native.pack_weights`). Runs on whole local arrays (under a mesh: inside shard_map).
    Quantized weights (models.quant) come with `scales` (gate, up, down): per channel [S, I], [S, I], [S, E], or per
    `group` K rows [S, G, I], [S, G, I], [S, G, E]. `biases` (GPT-OSS): (gate, up, down) biases [S, I], [S, I],
    [S, E] added to each matmul's output; `act` (alpha, limit): the clamped SwiGLU (`glu`) instead of silu(g) * u."""
    plain = biases is None and act is None
    backend = moe_backend(x, gate, up, down, slots.size, scales, group, plain_swiglu=plain)
    if backend == "native":
        return native.expert_mlp(x, slots, weights, gate, up, down, scales)
    gate, up, down = _row_major(x, gate, up, down)
    extra = {} if plain else {"biases": biases, "act": act}
    if backend == "gather":
        return gathered_expert_mlp(x, slots, weights, gate, up, down, scales, group, **extra)
    if backend == "loop":
        return looped_expert_mlp(x, slots, weights, gate, up, down, scales, group, **extra)
    if backend == "megablox":
        return megablox_expert_mlp(x, slots, weights, gate, up, down, scales, group, **extra)
    return ragged_expert_mlp(x, slots, weights, gate, up, down, scales, group, **extra)


def glu(g, u, act=None):
    """Pure. The gated unit of an expert: silu(g) * u, or with `act` = (alpha, limit) GPT-OSS's clamped SwiGLU as HF
    computes it: g clamped above at limit, u to [-limit, limit], g * sigmoid(alpha * g) * (u + 1)."""
    if act is None:
        return jax.nn.silu(g) * u
    alpha, limit = act
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    return g * jax.nn.sigmoid(alpha * g) * (u + 1)


def _bias(b, idx):
    """Pure. Bias rows `b[idx]` (None: 0)."""
    return 0 if b is None else b[idx]


def _row_major(x, gate, up, down):
    """Pure. Experts packed at load for the native kernel (`native.pack_weights`) back as [S, E, I], [S, I, E] (an
    XLA copy per call: only the other paths, forced or where the kernel does not run, take it)."""
    if not native.is_packed_experts(gate):
        return gate, up, down
    gate, up = (native.unpack_experts(w, x.shape[-1]) for w in (gate, up))
    return gate, up, native.unpack_experts(down, gate.shape[-1])


def _dequantized(w, scale, group: int, dtype):
    """Pure. Expert weights [..., K, N] (gathered or all) times their scales ([..., N] or [..., G, N]), in `dtype`."""
    if scale is None:
        return w
    s = scale[..., None, :] if not group else jnp.repeat(scale, group, axis=-2)[..., :w.shape[-2], :]
    return (w.astype(jnp.float32) * s).astype(dtype)


def gathered_expert_mlp(x, slots, weights, gate, up, down, scales=None, group=0, biases=None, act=None):
    """Pure. `grouped_expert_mlp` for a few pairs: each (token, k) pair's expert weights gathered and applied with
    batched matmuls; slots outside [0, S) weigh 0."""
    t, k = slots.shape
    n = gate.shape[0]
    flat = slots.reshape(-1)
    mine = (flat >= 0) & (flat < n)
    idx = jnp.where(mine, flat, 0)
    xs = jnp.repeat(x, k, axis=0)  # pair p = token p // k
    gs, us, ds = (None,) * 3 if scales is None else (s[idx] for s in scales)
    gw, uw, dw = (_dequantized(w[idx], s, group, x.dtype) for w, s in ((gate, gs), (up, us), (down, ds)))
    gb, ub, db = biases or (None,) * 3
    h = glu(jnp.einsum("pe,pei->pi", xs, gw) + _bias(gb, idx), jnp.einsum("pe,pei->pi", xs, uw) + _bias(ub, idx),
            act)
    out = jnp.einsum("pi,pie->pe", h, dw) + _bias(db, idx)
    w = jnp.where(mine, weights.reshape(-1), 0).astype(out.dtype)
    return (out * w[:, None]).reshape(t, k, -1).sum(axis=1)


def _slot_keys(slots, n: int):
    """Pure. The (token, k) pairs' slots, flattened, with n for a pair of no slot here (< 0: padding; >= n: another
    device's)."""
    flat = slots.reshape(-1)
    return jnp.where((flat >= 0) & (flat < n), flat, n)


def looped_expert_mlp(x, slots, weights, gate, up, down, scales=None, group=0, biases=None, act=None):
    """Pure. `grouped_expert_mlp` for a few tokens on XLA:CPU: a loop over the distinct slots the tokens selected
    (min(S, T * k) iterations, those past the selected ones skipped), each slot's expert applied to every row with the
    row's combine weight for it (0 where the row did not select it): each selected expert's weights read once, the
    others not at all; 2-D dots of x's dtype accumulated in float32 (XLA:CPU's fast bfloat16 path)."""
    t, k = slots.shape
    n = gate.shape[0]
    key = _slot_keys(slots, n)
    chosen = jnp.unique(key, size=min(n, t * k), fill_value=n)  # sorted; n: no slot
    weights = weights.astype(jnp.float32)

    def expert(s, y):
        coef = jnp.sum(jnp.where(slots == s, weights, 0), axis=1)  # [T]
        w = [jax.lax.dynamic_index_in_dim(m, s, keepdims=False) for m in (gate, up, down)]
        if scales is not None:
            w = [_dequantized(m, jax.lax.dynamic_index_in_dim(sc, s, keepdims=False), group, x.dtype)
                 for m, sc in zip(w, scales)]
        g, u = (jnp.dot(x, m, preferred_element_type=jnp.float32) for m in w[:2])
        b = [0] * 3 if biases is None else [jax.lax.dynamic_index_in_dim(m, s, keepdims=False) for m in biases]
        h = glu(g + b[0], u + b[1], act).astype(x.dtype)
        return y + coef[:, None] * (jnp.dot(h, w[2], preferred_element_type=jnp.float32) + b[2])

    def body(j, y):
        s = chosen[j]
        return jax.lax.cond(s < n, expert, lambda s, y: y, jnp.minimum(s, n - 1), y)

    y = jax.lax.fori_loop(0, chosen.shape[0], body, jnp.zeros(x.shape, jnp.float32))
    return y.astype(x.dtype)


def ragged_expert_mlp(x, slots, weights, gate, up, down, scales=None, group=0, biases=None, act=None):
    """Pure. `grouped_expert_mlp` with XLA's `ragged_dot` over the pairs sorted by slot (`sorted_expert_mlp`)."""
    def matmul(a, w, group_sizes, dtype):
        return jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=dtype)

    return sorted_expert_mlp(matmul, x, slots, weights, gate, up, down, scales, group, biases=biases, act=act)


def megablox_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) for a megablox gmm of lhs [m, k] against rhs [G, k, n], m already padded to whole row tiles
    (`megablox_rows`): tm = min(MEGABLOX_TM, m); tk, tn: the largest MEGABLOX_TILES dividing k, n, else k, n."""
    def tile(d):
        return next((c for c in MEGABLOX_TILES if d % c == 0), d)

    return min(MEGABLOX_TM, m), tile(k), tile(n)


def megablox_rows(m: int) -> int:
    """The row tile of `m` (token, expert) pairs: m rounded up to 16, at most MEGABLOX_TM; m is padded to it."""
    return min(MEGABLOX_TM, -(-m // 16) * 16)


def megablox_expert_mlp(x, slots, weights, gate, up, down, scales=None, group=0, biases=None, act=None):
    """Pure. `grouped_expert_mlp` with megablox's grouped matmul (Pallas; Mosaic on TPU, interpreted elsewhere)
    over the pairs sorted by slot (`sorted_expert_mlp`, rows padded to whole row tiles). gmm takes float32 / bfloat16
    operands only: quantized experts are converted to x's dtype (the scales then as `sorted_expert_mlp` applies
    them)."""
    from jax.experimental.pallas.ops.tpu import megablox

    interpret = target_platform() != "tpu"

    def matmul(a, w, group_sizes, dtype):
        tiling = megablox_tiling(a.shape[0], a.shape[1], w.shape[2])
        return megablox.gmm(a, w, group_sizes, dtype, tiling, None, None, False, interpret)

    return sorted_expert_mlp(matmul, x, slots, weights, gate, up, down, scales, group,
                             row_tile=megablox_rows(slots.size), biases=biases, act=act)


def sorted_expert_mlp(matmul, x, slots, weights, gate, up, down, scales=None, group=0, row_tile=1, biases=None,
                      act=None):
    """Pure. `grouped_expert_mlp` through a grouped matmul: the (token, k) pairs sorted by slot (those of no slot
    last, not computed), padded with pairs of no slot to a multiple of `row_tile` rows, `matmul(a [R, K], w [S, K,
    N], group_sizes [S], dtype) -> [R, N]` (rows past the groups: any value, not read), then scattered back with
    their weights. Quantized weights: per-channel scales multiply each row's float32 output by its expert's scales
    (the weights converted to x's dtype); group-wise ones dequantize the weights first (a copy per call: the slow
    path)."""
    t, k = slots.shape
    if t * k == 0:
        return jnp.zeros_like(x)
    n = gate.shape[0]
    key = _slot_keys(slots, n)
    rows = -(-t * k // row_tile) * row_tile
    wflat = weights.reshape(-1)
    if rows > t * k:  # pairs of no slot, no token, no weight
        key = jnp.concatenate([key, jnp.full((rows - t * k,), n, key.dtype)])
        wflat = jnp.concatenate([wflat, jnp.zeros((rows - t * k,), wflat.dtype)])
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.zeros((n + 1,), jnp.int32).at[key].add(1)[:n]
    sorted_key = key[order]
    computed = sorted_key < n
    token = jnp.minimum(order // k, t - 1)
    xs = x[token]
    row_scale = [None] * 3
    if scales is not None and group:
        gate, up, down = (_dequantized(w, s, group, x.dtype) for w, s in zip((gate, up, down), scales))
    elif scales is not None:
        gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
        expert = jnp.minimum(sorted_key, n - 1)
        row_scale = [s[expert] for s in scales]

    def dot(a, w, s):
        if s is None:
            return matmul(a, w, group_sizes, a.dtype)
        return (matmul(a, w, group_sizes, jnp.float32) * s).astype(a.dtype)

    expert_of_row = jnp.minimum(sorted_key, n - 1)
    gb, ub, db = biases or (None,) * 3
    h = glu(dot(xs, gate, row_scale[0]) + _bias(gb, expert_of_row), dot(xs, up, row_scale[1])
            + _bias(ub, expert_of_row), act).astype(xs.dtype)
    out = dot(h, down, row_scale[2]) + _bias(db, expert_of_row)
    # where, not a product: rows outside every group may hold anything (megablox leaves them unwritten: NaN in
    # interpret mode)
    out = jnp.where(computed[:, None], out * wflat[order].astype(out.dtype)[:, None], 0)
    return jnp.zeros_like(x).at[token].add(out)
