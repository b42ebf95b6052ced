"""The grouped expert MLP (pallas_kernels/moe.py, native/moe.h) against a float64 NumPy oracle on every
instruction-set path this CPU runs (forced in turn, as test_native.py does), float32 and bfloat16 (and int8 experts
with per-channel scales, against the oracle on the dequantized weights): empty experts, one expert taking every
token, top-k 1..8, padding and out-of-range slots; and the ragged_dot fallback against the same oracle."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe, native
from tests.pallas_kernels.test_native import RUNNABLE, _call, _call_each

needs_native = pytest.mark.skipif(native.machine_reason() is not None,
                                  reason=f"native CPU kernels cannot run here: {native.machine_reason()}")


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    monkeypatch.delenv(moe.MOE_ENV_VAR, raising=False)


@pytest.fixture(params=RUNNABLE)
def isa(request, monkeypatch):
    monkeypatch.setenv(native.ISA_ENV_VAR, request.param)
    return request.param


def oracle(x, slots, weights, gate, up, down):
    """float64: sum_k weights[t, k] * SwiGLU_{slots[t, k]}(x[t]) over slots in [0, S)."""
    x, weights = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    gate, up, down = (np.asarray(w, np.float64) for w in (gate, up, down))
    y = np.zeros_like(x)
    for t, row in enumerate(np.asarray(slots)):
        for k, s in enumerate(row):
            if 0 <= s < gate.shape[0]:
                g, u = x[t] @ gate[s], x[t] @ up[s]
                y[t] += weights[t, k] * ((g / (1 + np.exp(-g)) * u) @ down[s])
    return y


def operands(t, e, i, s, k, dtype, seed=0, slots=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, e)).astype(np.float32)
    gate = (rng.standard_normal((s, e, i)) / np.sqrt(e)).astype(np.float32)
    up = (rng.standard_normal((s, e, i)) / np.sqrt(e)).astype(np.float32)
    down = (rng.standard_normal((s, i, e)) / np.sqrt(i)).astype(np.float32)
    if slots is None:
        slots = np.stack([rng.permutation(s)[:k] for _ in range(t)]) if k <= s else rng.integers(0, s, (t, k))
    weights = rng.random((t, k)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(x), jnp.asarray(slots, jnp.int32), jnp.asarray(weights), cast(gate), cast(up), cast(down)


def check(out, args, dtype):
    # The oracle on the operands as the kernel saw them (bf16 inputs widened exactly); bf16: h stays float32 in
    # the kernel and y is rounded once.
    want = oracle(*(np.asarray(jnp.asarray(a, jnp.float32)) if a.dtype == jnp.bfloat16 else np.asarray(a)
                    for a in args))
    got = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    scale = np.abs(want).max() + 1e-30
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=tol)
    assert out.dtype == dtype and out.shape == args[0].shape


DTYPES = [jnp.float32, jnp.bfloat16]
# Row counts per expert across every tile height (1..16 and past it), odd E and I (column and K tails).
NATIVE_SHAPES = [(1, 64, 96, 8, 2), (16, 96, 200, 8, 2), (37, 33, 17, 4, 3), (64, 128, 64, 16, 4), (3, 1, 1, 2, 1)]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_top_k_1_to_8(isa, dtype):
    cases = [operands(t=7, e=48, i=40, s=8, k=k, dtype=dtype, seed=k) for k in range(1, 9)]  # one program for all
    assert all(moe.moe_backend(*args[:1], *args[3:]) == "native" for args in cases)
    for args, out in zip(cases, _call_each(native.expert_mlp, cases)):
        check(out, args, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_shapes(isa, dtype):
    cases = [operands(t, e, i, s, k, dtype, seed=t + e) for t, e, i, s, k in NATIVE_SHAPES]  # one program for all
    for args, out in zip(cases, _call_each(native.expert_mlp, cases)):
        check(out, args, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_one_expert_takes_every_token_others_empty(isa, dtype):
    t, s = 40, 6
    slots = np.full((t, 2), 3)
    slots[:, 1] = -1  # the second choice is padding everywhere
    args = operands(t, 64, 48, s, 2, dtype, slots=slots)
    check(_call(native.expert_mlp, *args), args, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_padding_and_foreign_slots_do_no_work(isa, dtype):
    # -1: padding; >= S: another device's slot (the sharded caller maps those to -1, the kernel skips both).
    slots = np.array([[0, -1], [-1, -1], [5, 9], [2, 2], [-7, 1]])
    args = operands(5, 32, 24, 4, 2, dtype, slots=slots)
    out = _call(native.expert_mlp, *args)
    check(out, args, dtype)
    assert not np.asarray(out[1], np.float32).any()  # a token with no expert gets zeros


@needs_native
def test_native_all_padding_and_empty_inputs(isa):
    args = operands(4, 32, 24, 4, 2, jnp.float32, slots=np.full((4, 2), -1))
    assert not np.asarray(_call(native.expert_mlp, *args)).any()
    args = operands(0, 32, 24, 4, 2, jnp.float32, slots=np.zeros((0, 2), np.int32))
    assert _call(native.expert_mlp, *args).shape == (0, 32)


# ---------------------------------------------------------------------------------------------------------------
# Experts packed slot by slot (`native.pack_weights`, as single-device CPU serving holds them): E and I whole panels.

def packed(args):
    """The operands with gate/up/down in the packed layout."""
    x, slots, weights, gate, up, down = args
    return (x, slots, weights, *(native.pack_weight(w) for w in (gate, up, down)))


# One row per expert up to many (past every tile height and the widened-panel threshold), top-k 1..4.
PACKED_SHAPES = [(1, 64, 128, 8, 2), (16, 128, 64, 8, 2), (40, 64, 64, 4, 3), (64, 128, 192, 16, 4), (2, 64, 64, 2, 1)]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_packed_shapes(isa, dtype):
    cases = [operands(t, e, i, s, k, dtype, seed=t + i) for t, e, i, s, k in PACKED_SHAPES]
    pks = [packed(args) for args in cases]
    for pk in pks:
        assert all(native.is_packed_experts(w) for w in pk[3:]) and moe.moe_backend(*pk[:1], *pk[3:]) == "native"
    for args, out in zip(cases, _call_each(native.expert_mlp, pks)):  # one program for all
        check(out, args, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_packed_top_k_1_to_8(isa, dtype):
    cases = [operands(t=7, e=64, i=64, s=8, k=k, dtype=dtype, seed=k) for k in range(1, 9)]
    for args, out in zip(cases, _call_each(native.expert_mlp, [packed(args) for args in cases])):
        check(out, args, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_packed_one_expert_takes_every_token_padding_and_foreign_slots(isa, dtype):
    t = 40
    slots = np.full((t, 2), 3)
    slots[:, 1] = -1
    slots[5] = [9, -4]  # another device's slot, padding: no expert for this token
    args = operands(t, 64, 128, 6, 2, dtype, slots=slots)
    out = _call(native.expert_mlp, *packed(args))
    check(out, args, dtype)
    assert not np.asarray(out[5], np.float32).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["gather", "loop", "ragged_dot"])
def test_packed_experts_on_the_other_paths(monkeypatch, dtype, path):
    # A forced path (or one where the kernel does not run) takes packed experts back to row-major first.
    args = operands(3, 64, 128, 4, 2, dtype, seed=3)
    pk = packed(args)
    np.testing.assert_array_equal(np.asarray(native.unpack_experts(pk[3], 64)), np.asarray(args[3]))
    np.testing.assert_array_equal(np.asarray(native.unpack_experts(pk[5], 128)), np.asarray(args[5]))
    monkeypatch.setenv(moe.MOE_ENV_VAR, path)
    check(jax.jit(moe.grouped_expert_mlp)(*pk), args, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_dot_path_matches_the_oracle(monkeypatch, dtype):
    monkeypatch.setenv(moe.MOE_ENV_VAR, "ragged_dot")
    slots = np.array([[0, -1], [3, 1], [5, 2], [2, 2], [-7, 1]])
    args = operands(5, 32, 24, 4, 2, dtype, slots=slots)
    assert moe.moe_backend(*args[:1], *args[3:]) == "ragged_dot"
    out = jax.jit(moe.grouped_expert_mlp)(*args)
    if dtype == jnp.float32:
        check(out, args, dtype)
    else:  # XLA's bf16 path rounds h and every partial sum to bf16
        want = oracle(*(np.asarray(jnp.asarray(a, jnp.float32)) if a.dtype == jnp.bfloat16 else np.asarray(a)
                        for a in args))
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=0.05 * np.abs(want).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [[[0, -1]], [[3, 1], [-7, 2]], [[2, 2], [5, 0]]])
def test_gather_path_matches_the_oracle(monkeypatch, dtype, slots):
    """XLA:CPU decode steps of a few (token, expert) pairs gather the selected experts (padding and foreign slots
    weigh 0)."""
    monkeypatch.setenv(native.ENV_VAR, "xla")
    args = operands(len(slots), 32, 24, 4, 2, dtype, slots=np.array(slots))
    assert moe.moe_backend(*args[:1], *args[3:], pairs=args[1].size) == "gather"
    assert moe.moe_backend(*args[:1], *args[3:], pairs=moe.GATHER_MAX_PAIRS + 1) == "loop"
    text = jax.jit(moe.grouped_expert_mlp).lower(*args).as_text()
    assert "ragged_dot" not in text
    out = jax.jit(moe.grouped_expert_mlp)(*args)
    want = oracle(*(np.asarray(jnp.asarray(a, jnp.float32)) if a.dtype == jnp.bfloat16 else np.asarray(a)
                    for a in args))
    tol = 1e-5 if dtype == jnp.float32 else 0.05
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=tol * np.abs(want).max(), rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,i,s,k", [(1, 32, 24, 4, 2), (8, 48, 40, 8, 1), (8, 48, 40, 8, 8), (37, 33, 17, 4, 3),
                                       (64, 64, 32, 16, 2)])
def test_loop_path_matches_the_oracle(monkeypatch, dtype, t, e, i, s, k):
    """XLA:CPU steps of up to LOOP_MAX_ROWS tokens loop over the selected experts: no ragged_dot in the program,
    padding and foreign slots do no work, every row gets each of its experts once."""
    monkeypatch.setenv(native.ENV_VAR, "xla")
    args = operands(t, e, i, s, k, dtype, seed=t + k)
    slots = np.asarray(args[1]).copy()
    slots[0, 0] = -1  # padding
    if t > 1:
        slots[1, -1] = s + 3  # another device's slot
    args = (args[0], jnp.asarray(slots), *args[2:])
    if t * k > moe.GATHER_MAX_PAIRS:
        assert moe.moe_backend(*args[:1], *args[3:], pairs=t * k) == "loop"
    monkeypatch.setenv(moe.MOE_ENV_VAR, "loop")
    fn = jax.jit(lambda *a: moe.grouped_expert_mlp(*a))  # a fresh trace: the switches are read then
    text = fn.lower(*args).as_text()
    assert "ragged_dot" not in text and "while" in text
    out = fn(*args)
    want = oracle(*(np.asarray(jnp.asarray(a, jnp.float32)) if a.dtype == jnp.bfloat16 else np.asarray(a)
                    for a in args))
    tol = 1e-5 if dtype == jnp.float32 else 0.02
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=tol * np.abs(want).max(), rtol=tol)
    assert out.dtype == dtype


@pytest.mark.parametrize("group", [0, 16])
def test_loop_path_int8_experts(monkeypatch, group):
    monkeypatch.setenv(native.ENV_VAR, "xla")
    monkeypatch.setenv(moe.MOE_ENV_VAR, "loop")
    x, slots, weights, *ws = operands(8, 32, 48, 8, 2, jnp.float32, seed=3)
    if group:  # one scale per 16 K rows and column
        qs = []
        for w in ws:
            w = np.asarray(w)
            s_, kk, nn = w.shape
            sc = np.abs(w.reshape(s_, kk // group, group, nn)).max(axis=2) / 127
            q = np.clip(np.rint(w / np.repeat(sc, group, axis=1)), -127, 127).astype(np.int8)
            qs.append((q, sc.astype(np.float32)))
        deq = [q.astype(np.float64) * np.repeat(sc, group, axis=1) for q, sc in qs]
    else:
        qs = [quantized(w) for w in ws]
        deq = [q.astype(np.float64) * sc.astype(np.float64)[:, None, :] for q, sc in qs]
    scales = tuple(jnp.asarray(sc) for _, sc in qs)
    out = jax.jit(lambda *a: moe.grouped_expert_mlp(*a, group))(x, slots, weights, *(jnp.asarray(q) for q, _ in qs),
                                                                 scales)
    check(out, (x, slots, weights, *deq), jnp.float32)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_entry_point_dispatch_and_switches(monkeypatch, dtype):
    args = operands(6, 64, 32, 8, 2, dtype)
    fn = lambda *a: moe.grouped_expert_mlp(*a)
    text = jax.jit(fn).lower(*args).as_text()
    assert "meshserve_cpu_expert_mlp" in text and "ragged_dot" not in text
    native_out = jax.jit(fn)(*args)
    monkeypatch.setenv(native.ENV_VAR, "xla")
    assert moe.moe_backend(*args[:1], *args[3:]) == "loop"
    xla_text = jax.jit(lambda *a: moe.grouped_expert_mlp(*a)).lower(*args).as_text()
    assert "meshserve_cpu_expert_mlp" not in xla_text
    xla_out = jax.jit(lambda *a: moe.grouped_expert_mlp(*a))(*args)
    tol = 1e-5 if dtype == jnp.float32 else 0.05
    np.testing.assert_allclose(np.asarray(native_out, np.float32), np.asarray(xla_out, np.float32),
                               atol=tol * float(np.abs(np.asarray(xla_out, np.float32)).max()))
    monkeypatch.setenv(native.ENV_VAR, "native")
    monkeypatch.setenv(moe.MOE_ENV_VAR, "nonsense")
    with pytest.raises(ValueError, match="MESHSERVE_MOE_KERNEL"):
        moe.moe_backend(*args[:1], *args[3:])


# ---------------------------------------------------------------------------------------------------------------
# int8 experts with float32 scales per output channel and slot (models.quant's layout: gate/up [S, I], down [S, E])


def quantized(w):
    """Symmetric int8 of expert weights [S, K, N], one scale per (slot, output column): (values, scales [S, N])."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=1) / 127
    scale = np.where(scale > 0, scale, 1).astype(np.float32)
    return np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale


def int8_operands(*shape, dtype, seed=0, slots=None):
    """`operands` with int8 gate/up/down and their scales: (x, slots, weights, gate, up, down, scales)."""
    x, slots, weights, *ws = operands(*shape, jnp.float32, seed=seed, slots=slots)
    qs = [quantized(w) for w in ws]
    scales = tuple(jnp.asarray(sc) for _, sc in qs)
    return (jnp.asarray(x, dtype), slots, weights, *(jnp.asarray(q) for q, _ in qs), scales)


def check_int8(out, args, dtype):
    """Against the oracle on the dequantized weights (w * scale, exact in float64)."""
    x, slots, weights, gate, up, down, scales = args
    deq = [np.asarray(w, np.float64) * np.asarray(sc, np.float64)[:, None, :]
           for w, sc in zip((gate, up, down), scales)]
    check(out, (x, slots, weights, *deq), dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_int8_top_k_1_to_8(isa, dtype):
    cases = [int8_operands(7, 48, 40, 8, k, dtype=dtype, seed=k) for k in range(1, 9)]  # one program for all
    assert all(moe.moe_backend(args[0], *args[3:6], scales=args[6]) == "native" for args in cases)
    for args, out in zip(cases, _call_each(native.expert_mlp, cases)):
        check_int8(out, args, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_int8_shapes(isa, dtype):
    cases = [int8_operands(t, e, i, s, k, dtype=dtype, seed=t + e) for t, e, i, s, k in NATIVE_SHAPES]
    for args, out in zip(cases, _call_each(native.expert_mlp, cases)):
        check_int8(out, args, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_int8_packed_shapes(isa, dtype):
    # int8 experts packed as the int8 matmul packs (64-column panels of quads), scales as they are.
    cases = [int8_operands(t, e, i, s, k, dtype=dtype, seed=t + i) for t, e, i, s, k in PACKED_SHAPES]
    pks = [packed(args[:6]) + args[6:] for args in cases]
    for pk in pks:
        assert all(native.is_packed_experts(w) and w.dtype == jnp.int8 for w in pk[3:6])
        assert moe.moe_backend(pk[0], *pk[3:6], scales=pk[6]) == "native"
    for args, out in zip(cases, _call_each(native.expert_mlp, pks)):  # one program for all
        check_int8(out, args, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_int8_one_expert_takes_every_token_others_empty(isa, dtype):
    slots = np.full((40, 2), 3)
    slots[:, 1] = -1
    slots[::7, 1] = 9  # another device's slot: no work
    args = int8_operands(40, 64, 48, 6, 2, dtype=dtype, slots=slots)
    check_int8(_call(native.expert_mlp, *args), args, dtype)


@needs_native
@pytest.mark.parametrize("group", [0, 16])
def test_int8_experts_dispatch(monkeypatch, group):
    """The entry point: per-channel int8 experts to the native kernel (equal to it called directly), group-wise ones
    to XLA; the kernel refuses scales of the wrong shape."""
    args = int8_operands(6, 64, 32, 8, 2, dtype=jnp.float32)
    x, slots, weights, gate, up, down, scales = args
    if group:  # [S, G, N]: 64 / 16 = 4 groups for gate/up, 32 / 16 = 2 for down
        scales = tuple(jnp.repeat(sc[:, None], n, axis=1) for sc, n in zip(scales, (4, 4, 2)))
    fn = lambda *a: moe.grouped_expert_mlp(*a, scales=scales, group=group)
    text = jax.jit(fn).lower(x, slots, weights, gate, up, down).as_text()
    assert ("meshserve_cpu_expert_mlp" in text) == (not group)
    out = jax.jit(fn)(x, slots, weights, gate, up, down)
    check_int8(out, args, jnp.float32)
    if not group:
        np.testing.assert_array_equal(out, jax.jit(native.expert_mlp)(*args))
    assert not native.expert_mlp_supported(x, gate, up, down, scales[:2] + (scales[1],))  # down's: [S, E]
    assert not native.expert_mlp_supported(x, gate, up, down)  # int8 without scales


# ---------------------------------------------------------------------------------------------------------------
# megablox (TPU's grouped matmul), forced on this CPU: Pallas interpret mode, against the same oracle


def _megablox(monkeypatch, args, **kw):
    monkeypatch.setenv(moe.MOE_ENV_VAR, "megablox")
    x, gate, up, down = args[0], *args[3:6]
    assert moe.moe_backend(x, gate, up, down, **kw) == "megablox"
    return jax.jit(lambda *a: moe.grouped_expert_mlp(*a, **kw))(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,i,s,k", [(7, 48, 40, 8, 1), (7, 48, 40, 8, 8), (37, 33, 17, 4, 3), (40, 256, 128, 8, 2),
                                       (3, 1, 1, 2, 1)])
def test_megablox_path_matches_the_oracle(monkeypatch, dtype, t, e, i, s, k):
    """Top-k 1 and 8, rows past one row tile (37 * 3 = 111 -> 112; 40 * 2 = 80), odd K and N (whole-dimension
    tiles), 256 / 128 (tiles of 256 and 128)."""
    args = operands(t, e, i, s, k, dtype, seed=t + k)
    check(_megablox(monkeypatch, args), args, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_megablox_one_expert_every_token_padding_and_foreign_slots(monkeypatch, dtype):
    slots = np.full((150, 2), 3)  # 300 pairs: three row tiles of 128, the last part padding
    slots[:, 1] = -1
    slots[::7, 1] = 9  # another device's slot
    slots[5] = [-7, 1]
    slots[6] = [-1, -1]  # a token with no expert gets zeros
    args = operands(150, 64, 48, 6, 2, dtype, slots=slots)
    out = _megablox(monkeypatch, args)
    check(out, args, dtype)
    assert not np.asarray(out[6], np.float32).any()
    args = operands(4, 32, 24, 4, 2, dtype, slots=np.full((4, 2), -1))
    assert not np.asarray(_megablox(monkeypatch, args), np.float32).any()
    args = operands(0, 32, 24, 4, 2, dtype, slots=np.zeros((0, 2), np.int32))
    assert _megablox(monkeypatch, args).shape == (0, 32)


@pytest.mark.parametrize("group", [0, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_megablox_int8_experts(monkeypatch, dtype, group):
    """int8 experts: per-channel scales on the float32 output rows, group-wise ones dequantizing first."""
    slots = np.array([[0, 7], [3, -1], [5, 2], [2, 2], [-7, 1], [9, 6]])
    args = int8_operands(6, 64, 32, 8, 2, dtype=dtype, slots=slots)
    x, slots, weights, gate, up, down, scales = args
    if group:  # [S, G, N]: 64 / 16 = 4 groups for gate/up, 32 / 16 = 2 for down
        scales = tuple(jnp.repeat(sc[:, None], n, axis=1) for sc, n in zip(scales, (4, 4, 2)))
    out = _megablox(monkeypatch, (x, slots, weights, gate, up, down), scales=scales, group=group)
    check_int8(out, args, dtype)


def test_megablox_tiles():
    """Rows: a multiple of 16 up to 128 rows, padded to it; K / N: 512, 256 or 128 when one divides, else whole."""
    assert [moe.megablox_rows(m) for m in (1, 16, 17, 111, 128, 300)] == [16, 16, 32, 112, 128, 128]
    assert moe.megablox_tiling(384, 4096, 14336) == (128, 512, 512)  # Mixtral-8x7B's E and I
    assert moe.megablox_tiling(32, 2048, 768) == (32, 512, 256)  # Qwen3-30B-A3B's
    assert moe.megablox_tiling(112, 33, 17) == (112, 33, 17)


def _lower_for(platform, args, **kw):
    from pallas_kernels.target import tracing_for
    with tracing_for(platform):
        return jax.jit(lambda *a: moe.grouped_expert_mlp(*a, **kw)).trace(*args).lower(
            lowering_platforms=(platform,)).as_text()


def megablox_calls(text: str) -> int:
    """How many megablox gmm calls a lowered module makes (gmm is a jit of its own: a function per shape, gate and
    up sharing one), 0 unless it holds gmm's Mosaic kernel (a tpu_custom_call named after gmm's `kernel`)."""
    if not re.search(r'stablehlo\.custom_call @tpu_custom_call\([^\n]*kernel_name = "kernel"', text):
        return 0
    return len(re.findall(r"call @gmm(?:_\d+)?\(", text))


@pytest.mark.parametrize("quant", [None, "per_channel", "group"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_megablox_lowers_for_tpu_and_ragged_dot_for_cuda(dtype, quant):
    """Traced for TPU from this CPU the entry point takes megablox (three Mosaic kernels: gate, up, down; no
    ragged_dot), the weights staying 8-bit in the program's inputs; traced for cuda it keeps ragged_dot."""
    t, e, i, s, k = 32, 256, 512, 8, 2
    abstract = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
    wdt = dtype if quant is None else jnp.int8
    args = (abstract((t, e), dtype), abstract((t, k), jnp.int32), abstract((t, k), dtype),
            abstract((s, e, i), wdt), abstract((s, e, i), wdt), abstract((s, i, e), wdt))
    kw = {}
    if quant == "per_channel":
        kw = dict(scales=tuple(jnp.ones((s, n), jnp.float32) for n in (i, i, e)))
    elif quant == "group":
        kw = dict(scales=tuple(jnp.ones((s, g, n), jnp.float32) for g, n in ((2, i), (2, i), (4, e))), group=128)
    tpu = _lower_for("tpu", args, **kw)
    assert megablox_calls(tpu) == 3 and "call @gmm" in tpu and "ragged_dot" not in tpu
    if quant:
        assert f"tensor<{s}x{e}x{i}xi8>" in tpu
    cuda = _lower_for("cuda", args, **kw)
    assert "ragged_dot" in cuda and "tpu_custom_call" not in cuda


# ---------------------------------------------------------------------------------------------------------------
# The engine: single-device CPU serving packs float experts whose E and I are whole panels, and serves HF's tokens.

@needs_native
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_engine_packs_float_experts_and_serves_hf_tokens(tmp_path, monkeypatch, family):
    """Experts of whole panels (E = I = 64) are packed at start-up and run through the packed kernel; greedy tokens
    equal HF's on the path the engine picks and on the lowest one it would (AVX2 on an AVX-512 machine); replicas
    (spare slots) and rebalancing move packed slots and keep the tokens; int8 experts pack too, with the tokens of
    row-major int8 experts; a forced other MoE path keeps them row-major (the last two: one family)."""
    from flax import nnx

    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    from tests.pallas_kernels.test_native import ENGINE_PATHS
    from tests.support import hf_models

    cfg = hf_models.family_configs()[family]()
    setattr(cfg, "intermediate_size" if family == "mixtral" else "moe_intermediate_size", 64)
    path = hf_models.save_config(cfg, str(tmp_path / family), seed=5)
    import transformers as tf
    hf = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    prompts = [hf_models.random_prompt(n, cfg.vocab_size, seed=n) for n in (5, 23, 9)]
    expected = [hf_models.hf_greedy(hf, p, 10) for p in prompts]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    calls = []
    fn = native.expert_mlp
    monkeypatch.setattr(native, "expert_mlp", lambda *a, **k: (calls.append(native.is_packed_experts(a[3])),
                                                                fn(*a, **k))[1])

    def experts(llm):
        model = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.state)
        return [layer.mlp.gate_proj[...] for layer in model.layers if hasattr(layer.mlp, "replica_slots")]

    # No warm-up: each engine compiles only the programs these requests run (the warm-up's plan is
    # test_engine.py's test_warmup_compiles_every_program).
    small = {"warmup": False, "max_num_seqs": 4, "num_pages": 64, "max_num_batched_tokens": 64}
    for isa in ENGINE_PATHS:
        monkeypatch.setenv(native.ISA_ENV_VAR, isa)
        calls.clear()
        llm = LLM(path, **small, spare_expert_slots=2)
        assert experts(llm) and all(native.is_packed_experts(w) and w.shape[0] == 6 for w in experts(llm))
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected, isa
        assert calls and all(calls)
        llm.engine.rebalance_experts()
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected, isa
    if family != "mixtral":
        return
    # int8 experts (quantised at load, a scale per slot and output column) pack in the int8 layout; their tokens
    # equal those of the same experts left row-major.
    int8 = LLM(path, **small, quantization="int8")
    assert all(native.is_packed_experts(w) and w.dtype == jnp.int8 for w in experts(int8))
    int8_tokens = [o.token_ids for o in int8.generate(prompts, greedy)]
    from pallas_kernels import matmul
    with monkeypatch.context() as m:
        m.setattr(matmul, "pack_experts", lambda moes: 0)
        row_major = LLM(path, **small, quantization="int8")
        assert not any(native.is_packed_experts(w) for w in experts(row_major))
        assert [o.token_ids for o in row_major.generate(prompts, greedy)] == int8_tokens
    monkeypatch.setenv(moe.MOE_ENV_VAR, "loop")
    llm = LLM(path, **small)
    assert not any(native.is_packed_experts(w) for w in experts(llm))
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
