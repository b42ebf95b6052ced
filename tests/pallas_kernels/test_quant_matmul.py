"""Quantized matmuls, `pallas_kernels.matmul.matmul(x, w, scale=...)`: int8 weights (row-major and packed) with
float32 scales per column or per group of rows, against a float64 NumPy oracle of x @ (w * scale), on every
instruction-set path and int8 method this CPU runs (each forced in turn, in jit); the XLA path (int8 and
float8_e4m3fn, MESHSERVE_CPU_KERNELS=xla); the program GPU and TPU compilers are handed; the int8 packed layout and
`pack_groups` with scales. (The C++ self-test covers the kernels without jaxlib: test_native_selftest.py.)"""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import native
from pallas_kernels.matmul import matmul, pack_groups
from pallas_kernels.target import lowering_platform, tracing_for

pytestmark = pytest.mark.skipif(native.machine_reason() is not None,
                                reason=f"native CPU kernels cannot run here: {native.machine_reason()}")

RUNNABLE = native.runnable_isas()
# (path, int8 method) pairs this CPU runs: the widened products everywhere, the dot method where the path has int8
# dot products on this CPU.
PATHS = [(p, m) for p in RUNNABLE for m in ("widen", "dot") if m == "widen" or native.int8_dot_runs(p)]
DTYPES = [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32)]  # (x, out)


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    """These tests are about the kernels: MESHSERVE_CPU_KERNELS=xla (serving without them) does not turn them off."""
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    monkeypatch.delenv(native.INT8_ENV_VAR, raising=False)


@pytest.fixture(params=PATHS, ids=[f"{p}-{m}" for p, m in PATHS])
def path(request, monkeypatch):
    """Each (instruction-set path, int8 method) this CPU runs, forced in turn."""
    isa, method = request.param
    monkeypatch.setenv(native.ISA_ENV_VAR, isa)
    monkeypatch.setenv(native.INT8_ENV_VAR, method)
    return request.param


def put(a, dtype=None) -> jax.Array:
    """A host array on the device without a program (jnp.asarray compiles a copy for each new shape: seconds over
    this file's cases); float64 values cast as JAX casts them (to float32 first)."""
    a = np.asarray(a)
    if dtype is not None:
        a = a.astype(np.float32 if a.dtype == np.float64 else a.dtype).astype(dtype)
    return jax.device_put(a)


def zeros(shape, dtype=np.float32) -> jax.Array:
    return put(np.zeros(shape, dtype))


def quantize(rng, k: int, n: int, groups: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A random [K, N] weight quantized symmetrically to int8: (q [K, N], scale [G, N]), one scale per column and
    group of K/G rows."""
    w = rng.standard_normal((groups, k // groups, n)).astype(np.float32)
    scale = (np.abs(w).max(axis=1) / 127).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q.reshape(k, n), scale


def oracle(x, q, scale) -> tuple[np.ndarray, np.ndarray]:
    """float64 x @ (q * scale) and |x| @ |q * scale| (the accumulation error's scale), scale [N] or [G, N]."""
    k, n = q.shape
    s = np.asarray(scale, np.float64).reshape(-1, n)
    deq = (np.asarray(q, np.float64).reshape(s.shape[0], -1, n) * s[:, None]).reshape(k, n)
    x64 = np.asarray(x, np.float64)
    return x64 @ deq, np.abs(x64) @ np.abs(deq)


def dot_rounding(x, q, scale) -> np.ndarray:
    """The bound on what the dot method's two-digit x adds to each output: |x - x~| <= max|x_row| / (127 * 508) per
    element (matmul_int8.h), times sum_k |q * scale|."""
    k, n = q.shape
    s = np.asarray(scale, np.float64).reshape(-1, n)
    deq = np.abs(np.asarray(q, np.float64).reshape(s.shape[0], -1, n) * s[:, None]).reshape(k, n)
    amax = np.abs(np.asarray(x, np.float64)).max(axis=-1, keepdims=True)
    return amax / (127 * 508) * deq.sum(axis=0)


def assert_close(got, x, q, scale, *, dot: bool) -> None:
    """float32 accumulation (1e-5 of |x| @ |w|), the dot method's rounding of x where it ran, one rounding to
    bfloat16 for bfloat16 out."""
    want, mag = oracle(x, q, scale)
    tol = 1e-5 * mag + 1e-6
    if dot:
        tol = tol + dot_rounding(x, q, scale)
    if got.dtype == jnp.bfloat16:
        tol = tol + 2.0 ** -8 * np.abs(want)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= tol), f"worst: {np.max(err / tol):.3g} x tolerance"


def _call(fn, *args):
    """fn(*args) jitted from a fresh trace (the path and method are read at trace time), checking that the program
    calls the int8 kernel with the path and method forced."""
    lowered = jax.jit(fn).lower(*args)
    text = lowered.as_text()
    assert "@meshserve_cpu_matmul_int8(" in text
    assert f"isa = {native.ISAS.index(os.environ[native.ISA_ENV_VAR])} : i32" in text
    assert f"method = {native.INT8_METHODS.index(os.environ[native.INT8_ENV_VAR])} : i32" in text
    return lowered.compile()(*args)


# (rows, K, N, groups): odd K (padded to quads), groups of 64, 32 and 192 rows, one to three panels.
PACKED_CASES = [(1, 768, 192, 1), (2, 33, 64, 1), (3, 100, 128, 1), (5, 256, 128, 4), (8, 96, 64, 3),
                (13, 1, 64, 1), (16, 768, 64, 4), (17, 70, 128, 1), (33, 256, 64, 2), (40, 64, 192, 1)]


@pytest.mark.parametrize("m,k,n,groups", PACKED_CASES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=["f32", "bf16", "bf16-f32out"])
def test_packed_int8_matches_oracle(path, m, k, n, groups, dtypes):
    rng = np.random.default_rng(m * 1000 + k + n + groups)
    q, scale = quantize(rng, k, n, groups)
    x = put(rng.standard_normal((m, k)), dtypes[0])
    w = native.pack_weights([put(q)])[0]
    assert native.is_packed(w) and w.shape == (n // 64, -(-k // 4), 64, 4)
    s = put(scale if groups > 1 else scale[0])
    out = _call(lambda x, w, s: matmul(x, w, out_dtype=dtypes[1], scale=s), x, w, s)
    assert out.dtype == dtypes[1] and out.shape == (m, n)
    assert_close(out, x, q, scale, dot=path[1] == "dot")


# (rows, K, N, groups): many rows, where the widened products widen each panel once (simd.h kI8PanelMinRows /
# kI8F32PanelMinRows: 6-12 rows on the paths that do) and auto takes those panels for bfloat16 x on the paths with
# pair dot products: tiles of uneven heights, K padded to quads, groups of 128, 32 and 12 rows, two blocks of rows.
MANY_ROWS_CASES = [(12, 768, 128, 1), (16, 256, 64, 2), (41, 70, 128, 1), (230, 96, 192, 3), (64, 2048, 64, 16),
                   (7, 48, 64, 4)]
METHODS = [(p, m) for p in RUNNABLE for m in ("widen", "auto")]


@pytest.mark.parametrize("m,k,n,groups", MANY_ROWS_CASES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=["f32", "bf16", "bf16-f32out"])
@pytest.mark.parametrize("isa,method", METHODS, ids=[f"{p}-{m}" for p, m in METHODS])
def test_many_rows_match_oracle(monkeypatch, isa, method, m, k, n, groups, dtypes):
    """widen: exact products at any rows (float32 accumulation); auto: the dot method's rounding allowed for bfloat16
    x where the path has it."""
    monkeypatch.setenv(native.ISA_ENV_VAR, isa)
    monkeypatch.setenv(native.INT8_ENV_VAR, method)
    rng = np.random.default_rng(m * 1000 + k + n + groups)
    q, scale = quantize(rng, k, n, groups)
    x = put(rng.standard_normal((m, k)), dtypes[0])
    w = native.pack_weights([put(q)])[0]
    out = _call(lambda x, w, s: matmul(x, w, out_dtype=dtypes[1], scale=s), x, w, put(scale))
    assert out.dtype == dtypes[1] and out.shape == (m, n)
    assert_close(out, x, q, scale, dot=method == "auto" and native.int8_dot_runs(isa) and dtypes[0] == jnp.bfloat16)


PAIR_PATHS = ("avx512_bf16", "amx", "neon_bf16")  # bfloat16 pair dot products


@pytest.mark.parametrize("isa", RUNNABLE)
def test_auto_is_exact_where_it_should_be(monkeypatch, isa):
    """auto, bit for bit: the widened products for float32 x (exact, at any rows); for bfloat16 x the dot method
    where the path has it, except 40 rows on a path with pair dot products (the widened bfloat16 panels)."""
    monkeypatch.setenv(native.ISA_ENV_VAR, isa)
    rng = np.random.default_rng(8)
    q, scale = quantize(rng, 256, 128, 2)
    w = native.pack_weights([put(q)])[0]
    dot = native.int8_dot_runs(isa)
    for dtype, rows, twin in ((jnp.float32, 2, "widen"), (jnp.float32, 40, "widen"),
                              (jnp.bfloat16, 2, "dot" if dot else "widen"),
                              (jnp.bfloat16, 40, "dot" if dot and isa not in PAIR_PATHS else "widen")):
        x = put(rng.standard_normal((rows, 256)), dtype)
        outs = {}
        for method in ("auto", twin):
            monkeypatch.setenv(native.INT8_ENV_VAR, method)
            fn = lambda x, w, s: matmul(x, w, out_dtype=jnp.float32, scale=s)  # a fresh trace per method
            outs[method] = np.asarray(_call(fn, x, w, put(scale)))
        np.testing.assert_array_equal(outs["auto"], outs[twin])


# (rows, K, N, groups): N not whole vectors, groups of 10, 64 and 256 rows, up to MAX_INT8_ROWS rows.
ROW_MAJOR_CASES = [(1, 33, 130, 1), (3, 30, 70, 3), (7, 128, 48, 2), (13, 768, 100, 3), (16, 64, 1000, 1)]


@pytest.mark.parametrize("m,k,n,groups", ROW_MAJOR_CASES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=["f32", "bf16", "bf16-f32out"])
def test_row_major_int8_matches_oracle(path, m, k, n, groups, dtypes):
    """Row-major weights take the widened products whatever the method (the dot method needs quads)."""
    rng = np.random.default_rng(m * 1000 + k + n + groups)
    q, scale = quantize(rng, k, n, groups)
    x = put(rng.standard_normal((m, k)), dtypes[0])
    out = _call(lambda x, w, s: matmul(x, w, out_dtype=dtypes[1], scale=s), x, put(q), put(scale))
    assert out.dtype == dtypes[1] and out.shape == (m, n)
    assert_close(out, x, q, scale, dot=False)


def test_int8_takes_leading_dims_output_layout_scales_and_zero_rows(path):
    """x [2, 3, K]; scales as the model holds them ((H, D) per column, (G, H, D) per group) are flattened."""
    rng = np.random.default_rng(0)
    q, scale = quantize(rng, 128, 128, 2)
    x = put(rng.standard_normal((2, 3, 128)), jnp.float32)
    w = native.pack_weights([put(q)])[0]
    out = _call(lambda x, w, s: matmul(x, w, scale=s), x, w, put(scale.reshape(2, 4, 32)))
    assert out.shape == (2, 3, 128)
    assert_close(np.asarray(out).reshape(6, 128), np.asarray(x).reshape(6, 128), q, scale, dot=path[1] == "dot")
    out = _call(lambda x, w, s: matmul(x, w, scale=s), x, w, put(scale[0].reshape(4, 32)))
    assert_close(np.asarray(out).reshape(6, 128), np.asarray(x).reshape(6, 128), q, scale[:1], dot=path[1] == "dot")
    assert _call(lambda x, w, s: matmul(x, w, scale=s), zeros((0, 128), np.float32), w, put(scale)).shape == (0, 128)


def test_non_finite_rows_stay_non_finite(path):
    """A row holding NaN gives NaN (the dot method's scale of that row is NaN); the other rows are unaffected."""
    rng = np.random.default_rng(1)
    q, scale = quantize(rng, 64, 64)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1, 5] = np.nan
    w = native.pack_weights([put(q)])[0]
    out = np.asarray(_call(lambda x, w, s: matmul(x, w, scale=s), put(x), w, put(scale[0])))
    assert np.isnan(out[1]).all()
    assert_close(out[[0, 2]], x[[0, 2]], q, scale, dot=path[1] == "dot")


@pytest.mark.skipif(not any(m == "dot" for _, m in PATHS), reason="no path of this CPU has int8 dot products")
def test_dot_method_error_against_widened_products_is_bounded():
    """The dot method against the widened (exact-product) method on bfloat16 activations, with and without an
    outlier channel (50x the rest, as LLM activations have): within the rounding bound of its two-digit x; the
    largest difference (measured here: ~3e-5 of the largest output without the outlier, ~2.3e-4 with it) below
    the rounding of the largest output to bfloat16 (2^-9 of it), which a bfloat16 model's step applies anyway."""
    rng = np.random.default_rng(2)
    q, scale = quantize(rng, 768, 256, 6)
    w = native.pack_weights([put(q)])[0]
    isa = next(p for p, m in PATHS if m == "dot")
    for outlier, largest in ((1, 1e-4), (50, 2.0 ** -9)):
        x = rng.standard_normal((16, 768)).astype(np.float32)
        x[:, 7] *= outlier
        x = put(x, jnp.bfloat16)
        outs = {}
        for method in ("widen", "dot"):
            with native.use_isa(isa), native.env_var(native.INT8_ENV_VAR, method):
                fn = jax.jit(lambda x, w: matmul(x, w, out_dtype=jnp.float32, scale=jnp.asarray(scale)))
                outs[method] = np.asarray(fn(x, w), np.float64)
        _, mag = oracle(x, q, scale)
        diff = np.abs(outs["dot"] - outs["widen"])
        assert np.all(diff <= dot_rounding(x, q, scale) + 2e-5 * mag)
        assert diff.max() <= largest * np.abs(outs["widen"]).max()


@pytest.mark.skipif(not any(m == "dot" for _, m in PATHS), reason="no path of this CPU has int8 dot products")
@pytest.mark.parametrize("groups", [1, 3])
def test_dot_method_is_exact_on_rows_its_two_digits_hold(monkeypatch, groups):
    """x = sx (h + l / 254) (float32 nearest) with sx = max|x| / 127 = 1/64: the digits are recovered exactly, so the
    dot method's result is x @ (w * scale) to float32 accumulation (1e-5 of |x| @ |w|), without its rounding
    bound: a wrong digit weight or offset correction shows here even where that bound would hide it."""
    rng = np.random.default_rng(7)
    q, scale = quantize(rng, 96, 128, groups)
    h = rng.integers(-126, 127, (5, 96))
    h[:, 0] = 127  # the row's largest element: sx = 127 / 64 / 127
    low = rng.integers(-127, 128, (5, 96))
    low[:, 0] = 0
    x = ((h + low / 254) / 64).astype(np.float32)
    isa = next(p for p, m in PATHS if m == "dot")
    monkeypatch.setenv(native.ISA_ENV_VAR, isa)
    monkeypatch.setenv(native.INT8_ENV_VAR, "dot")
    w = native.pack_weights([put(q)])[0]
    out = _call(lambda x, w, s: matmul(x, w, scale=s), put(x), w, put(scale))
    assert_close(out, x, q, scale, dot=False)


def test_auto_method_is_the_default_and_forcing_dot_without_it_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(native.ISA_ENV_VAR, RUNNABLE[-1])
    assert native.int8_method() == "auto"
    monkeypatch.setenv(native.INT8_ENV_VAR, "sse")
    with pytest.raises(ValueError, match="expected one of auto, widen, dot"):
        native.int8_method()
    without = [p for p in RUNNABLE if not native.int8_dot_runs(p)]  # the portable path at least
    monkeypatch.setenv(native.ISA_ENV_VAR, without[0])
    monkeypatch.setenv(native.INT8_ENV_VAR, "dot")
    with pytest.raises(RuntimeError, match=f"the {without[0]} path has no int8 dot products"):
        native.int8_method()


def _custom_calls(fn, *args) -> set[str]:
    return set(re.findall(r"@(meshserve_cpu_\w+)\(", jax.jit(fn).lower(*args).as_text()))


def test_dispatch_takes_xla_where_the_kernel_does_not_and_stays_right():
    """Row-major beyond MAX_INT8_ROWS rows, packed groups of a row count that is not whole quads: XLA's dot on the
    converted weight (packed: unpacked first), same results."""
    rng = np.random.default_rng(3)
    q, scale = quantize(rng, 64, 64)
    x = put(rng.standard_normal((native.MAX_INT8_ROWS + 1, 64)), jnp.float32)
    fn = lambda x, w, s: matmul(x, w, scale=s)
    assert _custom_calls(fn, x, put(q), put(scale)) == set()
    assert_close(jax.jit(fn)(x, put(q), put(scale)), x, q, scale, dot=False)
    assert _custom_calls(fn, x[:4], put(q), put(scale)) == {"meshserve_cpu_matmul_int8"}
    q, scale = quantize(rng, 30, 64, 3)  # groups of 10 rows
    w = native.pack_weights([put(q)])[0]
    assert _custom_calls(fn, x[:4, :30], w, put(scale)) == set()
    assert_close(jax.jit(fn)(x[:4, :30], w, put(scale)), x[:4, :30], q, scale, dot=False)
    with pytest.raises(ValueError, match="does not hold per-column or per-group scales of 64 columns"):
        jax.jit(fn)(x[:4, :30], w, put(np.ones((65,), np.float32)))


@pytest.mark.parametrize("wdtype,packed", [(jnp.int8, False), (jnp.int8, True), (jnp.float8_e4m3fn, False)],
                         ids=["int8", "int8-packed", "float8_e4m3fn"])  # (float8 weights have no packed layout)
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("xdtype", [jnp.float32, jnp.bfloat16])
def test_xla_path_matches_oracle(monkeypatch, wdtype, packed, groups, xdtype):
    """MESHSERVE_CPU_KERNELS=xla (and GPU/TPU): the weight converted to x's dtype, XLA's dot with float32
    products, the scales on the products."""
    monkeypatch.setenv(native.ENV_VAR, "xla")
    rng = np.random.default_rng(4)
    q, scale = quantize(rng, 256, 128, groups)
    if wdtype != jnp.int8:  # float8 values: the int8 ones scaled into e4m3's range, rounded to it
        q = np.asarray(jnp.asarray(q.astype(np.float32) / 4, wdtype))
    x = put(rng.standard_normal((2, 5, 256)), xdtype)
    w = native.pack_weights([put(q)])[0] if packed else put(q)
    fn = lambda x, w, s: matmul(x, w, out_dtype=jnp.float32, scale=s)
    assert _custom_calls(fn, x, w, put(scale)) == set()
    out = jax.jit(fn)(x, w, put(scale))
    assert out.shape == (2, 5, 128)
    assert_close(np.asarray(out).reshape(10, 128), np.asarray(x).reshape(10, 256), np.asarray(q, np.float64), scale,
                 dot=False)


def _lowered(platform: str, k: int, n: int, groups: int, xdtype=jnp.bfloat16, wdtype=jnp.int8) -> str:
    args = (jax.ShapeDtypeStruct((16, k), xdtype), jax.ShapeDtypeStruct((k, n), wdtype),
            jax.ShapeDtypeStruct((groups, n) if groups > 1 else (n,), jnp.float32))
    with tracing_for(platform):  # the paths of that platform, not the CPU's native ones
        traced = jax.jit(lambda x, w, s: matmul(x, w, scale=s)).trace(*args)
    return traced.lower(lowering_platforms=(lowering_platform(platform),)).as_text()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("groups", [1, 6])
@pytest.mark.parametrize("wdtype", [jnp.int8, jnp.float8_e4m3fn])
def test_gpu_and_tpu_programs_convert_the_weight_only_into_the_dot(platform, groups, wdtype):
    """What the GPU and TPU compilers are handed (StableHLO lowered from CPU): the weight enters in its 8-bit type,
    its one conversion to x's dtype is read by the dot_general alone (per group: after a reshape of the 8-bit
    weight), the scales multiply the dot's float32 products ([.., N] or [.., G, N]), and no other value of the
    weight's size exists in a wider type. XLA's GPU (Triton gemm) and TPU dot fusions take such an operand
    convert into the dot, so the dequantised weight is not written out; this test cannot run those compilers and
    does not prove that they fuse it, only that the program leaves nothing that would stop them (no [K, N]
    product with the scales, no second reader of the converted weight)."""
    k, n = 768, 2304
    text = _lowered(platform, k, n, groups, wdtype=wdtype)
    assert "meshserve_cpu" not in text
    narrow = "i8" if wdtype == jnp.int8 else "f8E4M3FN"
    assert re.search(rf"%arg1: tensor<{k}x{n}x{narrow}>", text)
    weight_shape = f"{k}x{n}" if groups == 1 else f"{groups}x{k // groups}x{n}"
    converts = re.findall(rf"(%\S+) = stablehlo\.convert %\S+ : \(tensor<{weight_shape}x{narrow}>\) -> "
                          rf"tensor<{weight_shape}xbf16>", text)
    assert len(converts) == 1, text
    readers = [line for line in text.splitlines() if re.search(rf"{re.escape(converts[0])}\b", line)
               and not line.strip().startswith(converts[0])]
    assert len(readers) == 1 and "stablehlo.dot_general" in readers[0], readers
    wide = re.findall(rf"tensor<(?:{k}x{n}|{groups}x{k // groups}x{n})x(?:bf16|f32)>", text)
    assert len(wide) == 2, wide  # the convert's result and the dot's operand type: the same value
    assert re.search(rf"stablehlo\.multiply %\S+, %\S+ : tensor<16x(?:{groups}x)?{n}xf32>", text), text


# ---------------------------------------------------------------------------------------------------------
# The int8 packed layout and pack_groups with scales.

@pytest.mark.parametrize("k,n", [(64, 64), (33, 128), (1, 192), (770, 64)])
def test_int8_pack_weight_round_trips_and_pads_k_to_quads(k, n):
    q = np.random.default_rng(k + n).integers(-127, 128, (k, n)).astype(np.int8)
    p = native.pack_weight(put(q))
    kp = -(-k // 4) * 4
    assert p.dtype == jnp.int8 and p.shape == (n // 64, kp // 4, 64, 4) and native.is_packed(p)
    assert native.packed_shape(p, k) == (k, n)
    np.testing.assert_array_equal(np.asarray(native.unpack_weight(p, k)), q)
    full = np.asarray(native.unpack_weight(p, kp))
    assert not full[k:].any()  # the padding rows are zeros
    np.testing.assert_array_equal(np.asarray(native.pack_weights([put(q)])[0]), np.asarray(p))
    # element (k, n) sits at [n / 64, k / 4, n % 64, k % 4]
    assert p[(n - 1) // 64, (k - 1) // 4, (n - 1) % 64, (k - 1) % 4] == q[k - 1, n - 1]
    with pytest.raises(ValueError, match="rows of K"):
        native.packed_shape(p, kp + 4)


def test_is_packed_tells_packed_int8_from_other_4d_arrays():
    assert native.is_packed(zeros((2, 3, 64, 4), jnp.int8))
    assert not native.is_packed(zeros((2, 3, 64, 4), jnp.float32))  # f32 panels are [.., 32, 1]
    assert not native.is_packed(zeros((2, 3, 64, 4), jnp.uint8))
    assert not native.is_packed(zeros((2, 3, 64, 2), jnp.int8))  # the bf16 pair layout, in int8
    assert not native.is_packed(zeros((2, 3, 32, 4), jnp.int8))
    assert native.is_packed(zeros((2, 3, 64, 2), jnp.bfloat16)) and native.is_packed(zeros((2, 3, 32, 1)))
    assert native.can_pack(zeros((5, 128), jnp.int8)) and not native.can_pack(zeros((5, 96), jnp.int8))
    assert not native.can_pack(zeros((5, 128), jnp.float8_e4m3fn))


class _Attention(nnx.Module):
    """q/k/v int8 in the model's layout ((E, H, D), scales in output layout (H, D), or (G, H, D) per group)."""

    def __init__(self, rng, e, heads, d, groups):
        def quantized(h):
            q, s = quantize(rng, e, h * d, groups[h])
            shape = (groups[h], h, d) if groups[h] > 1 else (h, d)
            return nnx.Param(put(q.reshape(e, h, d))), nnx.Param(put(s.reshape(shape)))
        self.q_proj, self.q_proj_scale = quantized(heads[0])
        self.k_proj, self.k_proj_scale = quantized(heads[1])
        self.v_proj, self.v_proj_scale = quantized(heads[2])
        self.qkv_proj = nnx.data(None)


def _projections(owner, x, e, names):
    """The oracle of each part: x @ (q * scale), from the module as built."""
    outs = []
    for n in names:
        q = np.asarray(getattr(owner, n)[...]).reshape(e, -1)
        s = np.asarray(getattr(owner, n + "_scale")[...])
        outs.append(oracle(x, q, s.reshape(-1, q.shape[1]))[0])
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("groups", [1, 4], ids=["per-column", "per-group"])
def test_pack_groups_fuses_int8_weights_and_concatenates_their_scales(groups):
    rng = np.random.default_rng(5)
    e, d, heads = 128, 32, (4, 2, 2)  # 128 + 64 + 64 columns: 4 panels fused
    a = _Attention(rng, e, heads, d, {h: groups for h in heads})
    x = rng.standard_normal((3, e)).astype(np.float32)
    names = ["q_proj", "k_proj", "v_proj"]
    want = _projections(a, x, e, names)
    assert pack_groups([(a, "qkv_proj", names, e)]) == 1
    assert all(getattr(a, n) is None and getattr(a, n + "_scale") is None for n in names)
    assert native.is_packed(a.qkv_proj[...]) and a.qkv_proj[...].dtype == jnp.int8
    assert a.qkv_proj_scale[...].shape == ((256,) if groups == 1 else (groups, 256))
    got = np.asarray(jax.jit(lambda x: matmul(x, a.qkv_proj[...], scale=a.qkv_proj_scale[...]))(put(x)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    assert pack_groups([(a, "qkv_proj", names, e)]) == 0  # already packed: left alone


def test_pack_groups_packs_int8_parts_alone_where_their_groups_differ():
    rng = np.random.default_rng(6)
    e, d = 128, 32
    a = _Attention(rng, e, (4, 2, 2), d, {4: 1, 2: 2})  # q per column, k and v per group of 64 rows
    x = rng.standard_normal((2, e)).astype(np.float32)
    names = ["q_proj", "k_proj", "v_proj"]
    want = _projections(a, x, e, names)
    scales = {n: np.asarray(getattr(a, n + "_scale")[...]) for n in names}
    assert pack_groups([(a, "qkv_proj", names, e)]) == 3
    assert a.qkv_proj is None
    parts = []
    for n in names:
        assert native.is_packed(getattr(a, n)[...])
        np.testing.assert_array_equal(np.asarray(getattr(a, n + "_scale")[...]), scales[n])  # kept as they were
        parts.append(np.asarray(matmul(put(x), getattr(a, n)[...], scale=getattr(a, n + "_scale")[...])))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, rtol=1e-4, atol=1e-3)
