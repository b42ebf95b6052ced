"""The batched LoRA update (`pallas_kernels.lora.lora_delta`) on every backend against a float64 reference: tokens of
several adapters, of none (-1) and padding in one call, slots of different ranks (zero past their rank, as the slot
stacks hold them), float32 and bfloat16."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora, native


def _case(dtype, tokens: int, seed: int = 0, k: int = 48, r: int = 16, n: int = 40):
    rng = np.random.default_rng(seed)
    s = 4
    ranks = np.array([r, 4, 0, 9], np.int32)
    a = rng.standard_normal((s, r, k)).astype(np.float32)
    b = rng.standard_normal((s, r, n)).astype(np.float32)
    for i, rank in enumerate(ranks):
        a[i, rank:], b[i, rank:] = 0, 0
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    slots = rng.integers(-1, s, tokens).astype(np.int32)
    cast = lambda v: np.asarray(jnp.asarray(v, dtype).astype(jnp.float32), np.float64)  # noqa: E731
    xd, ad, bd = cast(x), cast(a), cast(b)
    want = np.stack([xd[t] @ ad[sl].T @ bd[sl] if sl >= 0 else np.zeros(n) for t, sl in enumerate(slots)])
    return [jnp.asarray(v, dtype) for v in (x,)] + [jnp.asarray(slots)] + [jnp.asarray(v, dtype) for v in (a, b)] + \
        [jnp.asarray(ranks)], want


@pytest.mark.parametrize("backend", lora.BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_backend_matches_the_reference(backend, dtype, monkeypatch):
    if backend == "native":
        if native.machine_reason() is not None:
            pytest.skip(f"native CPU kernels cannot run here: {native.machine_reason()}")
        monkeypatch.delenv(native.ENV_VAR, raising=False)  # (MESHSERVE_CPU_KERNELS=xla: this test is the kernel's)
    monkeypatch.setenv(lora.LORA_ENV_VAR, backend)
    for tokens in (1, 3, 13):
        args, want = _case(dtype, tokens, seed=tokens)
        assert lora.lora_backend(args[0], args[2], args[3]) == backend
        got = np.asarray(jax.jit(lambda *z: lora.lora_delta(*z))(*args).astype(jnp.float32))
        tol = 1e-4 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=f"T={tokens}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_kernel_on_its_thread_pool(dtype, monkeypatch):
    """A call past the kernel's serial threshold (`kLoraSerialMacs` in native/lora.h: 128K multiply-adds; one
    token's rank-8 update stays under it) runs its A and B passes on the thread pool (here the two-pass form: one slot
    holds most of the work): same answer."""
    if native.machine_reason() is not None:
        pytest.skip(f"native CPU kernels cannot run here: {native.machine_reason()}")
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    monkeypatch.setenv(lora.LORA_ENV_VAR, "native")
    args, want = _case(dtype, 256, seed=5, k=512, r=64, n=384)
    slots, ranks = np.asarray(args[1]), np.asarray(args[4])
    macs = sum(int(ranks[sl]) * (512 + 384) for sl in slots if sl >= 0)
    assert macs > 1 << 21, macs
    got = np.asarray(jax.jit(lambda *z: lora.lora_delta(*z))(*args).astype(jnp.float32))
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_stack_layouts():
    """`to_layout` puts element (j, c) of a slot's [R, C] where native/lora.h reads it in each form, `from_layout`
    undoes it (numpy and jax), and `stack_layouts` picks the forms each native path reads."""
    r = 8
    w = np.arange(2 * r * 80).reshape(2, r, 80)  # strips: a whole one of 64 columns and a narrow one of 16
    where = {lora.PAIRS: (80, lambda j, k, c: (j // 2) * 2 * c + 2 * k + j % 2),
             lora.BLOCKS: (64, lambda j, k, c: (j // 4) * 4 * c + (k // 32) * 128 + (j % 4) * 32 + k % 32),
             lora.STRIPS: (80, lambda j, k, c: (k // 64 * 64) * r + (j // 2) * 2 * min(64, c - k // 64 * 64)
                           + 2 * (k % 64) + j % 2)}
    for form, (c, at) in where.items():
        v = w[..., :c]
        got = lora.to_layout(v, form)
        assert got.shape == v.shape
        for s, j, k in ((0, 0, 0), (0, 1, 0), (0, 2, 17), (1, 5, c - 1), (1, 3, 15), (1, 7, 40), (0, 6, c - 9)):
            assert got[s].reshape(-1)[at(j, k, c)] == v[s, j, k], (form, j, k)
        np.testing.assert_array_equal(lora.from_layout(got, form), v)
        np.testing.assert_array_equal(np.asarray(lora.from_layout(jnp.asarray(got), form)), v)
    assert lora.to_layout(w, lora.ROWS) is w
    with pytest.raises(ValueError, match="unknown LoRA stack layout 'panels'"):
        lora.to_layout(w, "panels")
    if native.machine_reason() is None:
        for path in native.runnable_isas():
            with native.use_isa(path):
                a = lora.BLOCKS if native.pair_dot(path) else lora.PAIRS
                assert lora.stack_layouts(jnp.bfloat16, 16, 64, 48) == (a, lora.STRIPS), path
                assert lora.stack_layouts(jnp.bfloat16, 16, 48, 48)[1] == lora.STRIPS, path
                assert lora.stack_layouts(jnp.bfloat16, 16, 72, 48) == (lora.ROWS, lora.STRIPS), path
                assert lora.stack_layouts(jnp.bfloat16, 6, 64, 48) == (
                    lora.ROWS if native.pair_dot(path) else lora.PAIRS, lora.STRIPS), path
                assert lora.stack_layouts(jnp.bfloat16, 9, 64, 48) == (lora.ROWS, lora.ROWS), path
                assert lora.stack_layouts(jnp.bfloat16, 16, 64, 40) == (lora.BLOCKS if native.pair_dot(path)
                                                                       else lora.ROWS, lora.ROWS), path
                assert lora.stack_layouts(jnp.float32, 16, 64, 48) == (lora.ROWS, lora.ROWS), path
        assert [p for p in native.runnable_isas() if native.pair_dot(p)] == \
            [p for p in native.runnable_isas() if p in ("avx512_bf16", "amx", "neon_bf16")]


def _native_paths(backend):
    """The native kernel's paths this CPU runs (each forced in turn), or [None] for an XLA backend."""
    if backend != "native":
        return [None]
    if native.machine_reason() is not None:
        pytest.skip(f"native CPU kernels cannot run here: {native.machine_reason()}")
    return list(native.runnable_isas())


def _each_path(backend, monkeypatch):
    """Runs under `backend` (MESHSERVE_LORA_KERNEL; native: whatever MESHSERVE_CPU_KERNELS says): yields each native
    path this CPU runs, forced in turn, or None once for an XLA backend."""
    if backend == "native":
        monkeypatch.delenv(native.ENV_VAR, raising=False)
    monkeypatch.setenv(lora.LORA_ENV_VAR, backend)
    for path in _native_paths(backend):
        with native.use_isa(path) if path else contextlib.nullcontext():
            yield path


def _forms(path, a, b):
    """The (A form, B form) pairs the native path `path` (None: an XLA backend, which undoes them all) reads for
    stacks a [S, R, K] and b [S, R, N]."""
    r, k, n = a.shape[1], a.shape[2], b.shape[2]
    a_forms = [lora.ROWS] + ([lora.PAIRS] if r % 2 == 0 and k % 16 == 0 else [])
    if r % 4 == 0 and k % 32 == 0 and (path is None or native.pair_dot(path)):
        a_forms.append(lora.BLOCKS)
    b_forms = [lora.ROWS] + ([lora.STRIPS] if r % 2 == 0 and n % 16 == 0 else [])
    return [(af, bf) for af in a_forms for bf in b_forms if (af, bf) != (lora.ROWS, lora.ROWS)]


@pytest.mark.parametrize("backend", lora.BACKENDS)
def test_stack_forms(backend, monkeypatch):
    """bfloat16 stacks in the native kernel's forms (`to_layout`: A in pairs or blocks, B in strips, as the engine
    stores them where the native kernel runs): the kernel reads them as they are, on every path this CPU runs. A path
    that widens bfloat16 gives bit for bit its row-major answer (the same sums in the same order; odd ranks read the
    row past their rank, weighted by zero), also on its thread pool; so does a path with pair dot products for A in
    blocks, which rounds x @ A^T to bfloat16 before B in strips (as PEFT's bfloat16 lora_A output is). The XLA paths
    undo the forms first."""
    cases = [dict(tokens=13, seed=7, n=80, k=64), dict(tokens=5, seed=8, n=48, k=40), dict(tokens=6, seed=9, r=20)]
    if backend == "native":
        cases.append(dict(tokens=256, seed=5, k=512, r=64, n=400))
    for path in _each_path(backend, monkeypatch):
        f = jax.jit(lambda *z, a_layout, b_layout: lora.lora_delta(*z, a_layout=a_layout, b_layout=b_layout),
                    static_argnames=("a_layout", "b_layout"))
        for case in cases:
            (x, slots, a, b, ranks), want = _case(jnp.bfloat16, case["tokens"], **{
                k: v for k, v in case.items() if k != "tokens"})
            plain = np.asarray(f(x, slots, a, b, ranks, a_layout=lora.ROWS, b_layout=lora.ROWS).astype(jnp.float32))
            forms = _forms(path, a, b)
            assert forms, case
            for a_form, b_form in forms:
                got = np.asarray(f(x, slots, lora.to_layout(a, a_form), lora.to_layout(b, b_form), ranks,
                                   a_layout=a_form, b_layout=b_form).astype(jnp.float32))
                msg = f"{path} A {a_form} B {b_form} {case}"
                # (a path with pair dot products: A in blocks takes the row-major form's dot products in its order;
                # A in pairs is widened, B in strips takes x @ A^T rounded)
                if not (path and native.pair_dot(path)) or (a_form != lora.PAIRS and b_form == lora.ROWS):
                    np.testing.assert_array_equal(got, plain, err_msg=msg)
                np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(), err_msg=msg)


@pytest.mark.parametrize("bad", ["float32", "odd rank", "A's K", "B's N", "blocks' K", "blocks widened", "A strips"])
def test_native_kernel_refuses_misplaced_forms(bad, monkeypatch):
    """The FFI call refuses stacks in forms it cannot read (the engine never sends them: `stack_layouts` guards it),
    naming why."""
    if native.machine_reason() is not None:
        pytest.skip(f"native CPU kernels cannot run here: {native.machine_reason()}")
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    dtype = jnp.float32 if bad == "float32" else jnp.bfloat16
    shape = dict(k=40 if bad == "A's K" else 48 if bad == "blocks' K" else 64, n=40 if bad == "B's N" else 48,
                 r=9 if bad == "odd rank" else 16)
    (x, slots, a, b, ranks), _ = _case(dtype, 4, **shape)
    a_layout, b_layout = {"A's K": (lora.PAIRS, lora.ROWS), "B's N": (lora.ROWS, lora.STRIPS),
                          "blocks' K": (lora.BLOCKS, lora.ROWS), "blocks widened": (lora.BLOCKS, lora.ROWS),
                          "A strips": (lora.STRIPS, lora.ROWS)}.get(bad, (lora.PAIRS, lora.STRIPS))
    why = {"float32": "stacks in pairs, blocks or strips need bfloat16", "A strips": "A's layout must be rows, pairs",
           "blocks' K": "A in blocks needs", "blocks widened": "A in blocks needs",
           "B's N": "B in strips needs an even R and N", "odd rank": "(A in pairs|B in strips) needs an even R"
           }.get(bad, "A in pairs needs an even R and K")
    paths = [p for p in native.runnable_isas() if not native.pair_dot(p)] if bad == "blocks widened" else [None]
    for path in paths:  # (blocks on a path that widens bfloat16: every x86-64 CPU runs one)
        with native.use_isa(path) if path else contextlib.nullcontext():
            with pytest.raises(Exception, match=f"lora: {why}"):
                jax.block_until_ready(jax.jit(lambda *z: native.lora(*z, a_layout=a_layout, b_layout=b_layout))(
                    x, slots, a, b, ranks))


def test_automatic_choice():
    """Native on one CPU device where the kernels run; else a few tokens gather, more loop over the slots
    (XLA:CPU)."""
    args, _ = _case(jnp.float32, 13)
    few, _ = _case(jnp.float32, 2)
    if native.enabled():
        assert lora.lora_backend(args[0], args[2], args[3]) == "native"
    with native.env_var(native.ENV_VAR, "xla"):
        assert lora.lora_backend(few[0], few[2], few[3]) == "gather"
        assert lora.lora_backend(args[0], args[2], args[3]) == "loop"


def _int8_case(dtype, tokens: int, seed: int, k: int, n: int, r: int = 32):
    """`_case` with slots of r rank rows (a multiple of 32) and its stacks quantized (`lora.quantize_adapter`); the
    reference in float64 on the dequantized stacks (the kernel's own arithmetic), and on the float stacks."""
    (x, slots, a, b, ranks), want = _case(jnp.float32, tokens, seed=seed, k=k, r=r, n=n)
    aq, bq, scale = lora.quantize_adapter(np.asarray(a), np.asarray(b))
    ad, bd = (np.asarray(v, np.float64) for v in lora.dequantize_adapter(aq, bq, scale, k))
    xd = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
    exact = np.stack([xd[t] @ ad[s].T @ bd[s] if s >= 0 else np.zeros(n) for t, s in enumerate(np.asarray(slots))])
    args = (jnp.asarray(x, dtype), slots, jnp.asarray(aq), jnp.asarray(bq), jnp.asarray(scale), ranks)
    return args, exact, want


@pytest.mark.parametrize("backend", lora.BACKENDS)
def test_int8_stacks(backend, monkeypatch):
    """int8 stacks (EngineConfig.lora_dtype = "int8") on every backend and every native path this CPU runs: against
    the dequantized stacks, to float32 rounding where the path widens the int8 weights (and on the XLA paths, which
    dequantize), within 1% of the update's range where it has int8 dot products (x to ~15 bits and x @ A^T to 8,
    quantized per token); and within 2% of the float stacks' update. Tails of K (not whole quads) and of N, ranks
    inside a panel and a quad, tokens of no slot, calls on the thread pool."""
    cases = [dict(tokens=13, seed=7, k=70, n=48), dict(tokens=5, seed=8, k=64, n=80)]
    if backend == "native":
        cases.append(dict(tokens=256, seed=5, k=517, r=64, n=384))
    for path in _each_path(backend, monkeypatch):
        f = jax.jit(lambda *z: lora.lora_delta_int8(*z))
        for dtype in (jnp.float32, jnp.bfloat16):
            for case in cases:
                args, exact, want = _int8_case(dtype, **case)
                got = np.asarray(f(*args).astype(jnp.float32), np.float64)
                msg = f"{path} {dtype.__name__} {case}"
                span = np.abs(exact).max()
                close = 1e-2 if path and native.int8_dot_runs(path) else 1e-5
                close += 8e-3 if dtype == jnp.bfloat16 else 0
                np.testing.assert_allclose(got, exact, rtol=0, atol=close * span, err_msg=msg)
                np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * span, err_msg=msg)


# Three projections of one x (q|k|v-like): each part's N and its slots' ranks (slot 2 left alone by the first part,
# slot 1 by the second; a rank of 5 inside a quad), and the slots of a call's tokens: a few (on the caller's thread),
# spread evenly over the slots, and most on one slot.
_PART_SHAPES = [(96, [32, 16, 0, 32]), (48, [32, 0, 16, 5]), (16, [16, 32, 32, 32])]
_PART_SLOTS = {"few": np.array([0, 1, -1, 2, 3], np.int32), "even": np.arange(64, dtype=np.int32) % 5 - 1,
               "skewed": np.where(np.arange(64) % 4 == 0, np.arange(64) % 5 - 1, 2).astype(np.int32)}


def _part_stacks(rng, k: int, r: int, s: int):
    """_PART_SHAPES's A [s, r, k] and B [s, r, N] (float64, zero past each slot's rank) and ranks, per part."""
    out = []
    for n, ranks in _PART_SHAPES:
        a, b = rng.standard_normal((s, r, k)) / np.sqrt(k), rng.standard_normal((s, r, n)) * 0.1
        for slot, rank in enumerate(ranks):
            a[slot, rank:], b[slot, rank:] = 0, 0
        out.append((a, b, ranks))
    return out


@pytest.mark.parametrize("backend", ["native", "gather"])
def test_parts(backend, monkeypatch):
    """Projections of one x in one call (`lora_delta_parts`: the engine's q|k|v and gate|up), each with its own N and
    ranks (one slot left alone by the second part), in every form of the stacks the path reads: each part's update is
    bit for bit the one call of its own gives, on every native path this CPU runs (alone on the caller's thread, and
    over the pool; the self-test checks both parallel forms at 3 threads) and on an XLA backend; a part's rows of the
    slot it leaves alone are zero."""
    rng = np.random.default_rng(12)
    k, r, s = 64, 32, 4
    stacks = [(a, b, jnp.asarray(ranks, jnp.int32)) for a, b, ranks in _part_stacks(rng, k, r, s)]
    shapes, layouts = _PART_SHAPES, _PART_SLOTS
    fused = jax.jit(lambda x, slots, parts, a_layout, b_layout: lora.lora_delta_parts(x, slots, parts, a_layout,
                                                                                      b_layout),
                    static_argnames=("a_layout", "b_layout"))
    alone = jax.jit(lambda x, slots, a, b, ranks, a_layout, b_layout: lora.lora_delta(x, slots, a, b, ranks, a_layout,
                                                                                      b_layout),
                    static_argnames=("a_layout", "b_layout"))
    for path in _each_path(backend, monkeypatch):
        for dtype in (jnp.float32, jnp.bfloat16):
            one = jnp.zeros((s, r, k), dtype), jnp.zeros((s, r, 16), dtype)
            forms = [(lora.ROWS, lora.ROWS)] + (_forms(path, *one) if dtype == jnp.bfloat16 else [])
            for a_form, b_form in forms:
                parts = [(lora.to_layout(jnp.asarray(a, dtype), a_form), lora.to_layout(jnp.asarray(b, dtype), b_form),
                          ranks) for a, b, ranks in stacks]
                for layout, slots in layouts.items():
                    x = jnp.asarray(rng.standard_normal((len(slots), k)), dtype)
                    got = fused(x, jnp.asarray(slots), parts, a_layout=a_form, b_layout=b_form)
                    for i, (part, (n, ranks)) in enumerate(zip(parts, shapes)):
                        want = np.asarray(alone(x, jnp.asarray(slots), *part, a_layout=a_form,
                                                b_layout=b_form).astype(jnp.float32))
                        part_got = np.asarray(got[i].astype(jnp.float32))
                        msg = f"{path} {dtype.__name__} A {a_form} B {b_form} {layout} part {i}"
                        assert part_got.shape == (len(slots), n), msg
                        np.testing.assert_array_equal(part_got, want, err_msg=msg)
                        assert np.abs(want).max() > 0, msg
                        left_alone = np.isin(slots, [sl for sl, rank in enumerate(ranks) if rank == 0]) | (slots < 0)
                        assert not part_got[left_alone].any(), msg


@pytest.mark.parametrize("backend", ["native", "gather"])
def test_int8_parts(backend, monkeypatch):
    """Projections of one x in one call (`lora_delta_int8_parts`: the engine's q|k|v and gate|up), each with its own
    N and ranks (one slot left alone by the second part): each part's update is the one call of its own gives, on
    every native path this CPU runs (the same sums: alone on the caller's thread, and over the pool in both its
    forms) and on an XLA backend; a part's rows of the slot it leaves alone are zero."""
    rng = np.random.default_rng(11)
    k = 70
    parts = [tuple(map(jnp.asarray, lora.quantize_adapter(a, b))) + (jnp.asarray(ranks, jnp.int32),)
             for a, b, ranks in _part_stacks(rng, k, 32, 4)]
    shapes, layouts = _PART_SHAPES, _PART_SLOTS
    fused = jax.jit(lambda x, slots, parts: lora.lora_delta_int8_parts(x, slots, parts))
    alone = jax.jit(lambda x, slots, part: lora.lora_delta_int8(x, slots, *part))
    for path in _each_path(backend, monkeypatch):
        for dtype in (jnp.float32, jnp.bfloat16):
            for layout, slots in layouts.items():
                x = jnp.asarray(rng.standard_normal((len(slots), k)), dtype)
                got = fused(x, jnp.asarray(slots), parts)
                for i, (part, (n, ranks)) in enumerate(zip(parts, shapes)):
                    want = np.asarray(alone(x, jnp.asarray(slots), part).astype(jnp.float32))
                    part_got = np.asarray(got[i].astype(jnp.float32))
                    msg = f"{path} {dtype.__name__} {layout} part {i}"
                    assert part_got.shape == (len(slots), n), msg
                    np.testing.assert_allclose(part_got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=msg)
                    assert np.abs(want).max() > 0, msg
                    left_alone = np.isin(slots, [slot for slot, rank in enumerate(ranks) if rank == 0]) | (slots < 0)
                    assert not part_got[left_alone].any(), msg


def test_int8_stacks_round_trip():
    """`dequantize_adapter` undoes `quantize_adapter`'s layouts (B's strips: a whole one and a narrower last one): each
    rank row within half a step of its scale; a zero row stays zero."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 32, 37)), rng.standard_normal((2, 32, 112))  # B: a strip of 64 columns and 48
    a[1, 20:], b[1, 20:] = 0, 0
    aq, bq, scale = lora.quantize_adapter(a, b)
    assert aq.shape == (2, 1, 10, 32, 4) and bq.shape == (2, 32 * 112) and scale.shape == (2, 32)
    ad, bd = (np.asarray(v) for v in lora.dequantize_adapter(aq, bq, scale, 37))
    sb = np.abs(b).max(-1, keepdims=True) / 127
    np.testing.assert_allclose(bd * sb, b, atol=0.5 * sb.max() + 1e-6)
    np.testing.assert_allclose(ad / np.where(sb > 0, sb, 1), a, atol=0.5 * np.abs(a).max() / 127 + 1e-6)
    assert not ad[1, 20:].any() and not bd[1, 20:].any()


@pytest.mark.parametrize("bad", ["N", "R", "K"])
def test_native_kernel_refuses_misshapen_int8_stacks(bad, monkeypatch):
    """The FFI call refuses int8 stacks whose shapes disagree, naming why (the engine never sends them)."""
    if native.machine_reason() is not None:
        pytest.skip(f"native CPU kernels cannot run here: {native.machine_reason()}")
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    (x, slots, aq, bq, scale, ranks), _, _ = _int8_case(jnp.float32, 4, seed=1, k=40, n=48)
    if bad == "N":
        bq = bq[:, :32 * 40]
    elif bad == "R":
        scale = scale[:, :16]
    else:
        x = x[:, :36]
    why = "N must be a multiple of 16" if bad == "N" else "disagree"
    with pytest.raises(Exception, match=f"int8 lora: .*{why}"):
        jax.block_until_ready(jax.jit(lambda *z: native.lora_int8(*z))(x, slots, aq, bq, scale, ranks))
    if bad == "R":  # two parts of different R
        (x, slots, aq, bq, scale, ranks), _, _ = _int8_case(jnp.float32, 4, seed=1, k=40, n=48)
        (_, _, aq2, bq2, scale2, ranks2), _, _ = _int8_case(jnp.float32, 4, seed=2, k=40, n=32, r=64)
        with pytest.raises(Exception, match="int8 lora: .*the parts' S and R"):
            jax.block_until_ready(jax.jit(lambda x, s, p: native.lora_int8_parts(x, s, p))(
                x, slots, [(aq, bq, scale, ranks), (aq2, bq2, scale2, ranks2)]))
