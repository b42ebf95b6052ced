"""Ragged paged attention: every backend against a dense float64 NumPy oracle.

Backends: the pure-JAX reference, the CPU fast path, the native C++ kernel on every instruction-set path this CPU
runs ("native-avx2", ...), and the GPU (Triton) and TPU (Mosaic) kernels in interpret mode. Named cases cover the
issue's list; hypothesis adds random ragged batches. Quantized caches (int8, fp8_e4m3) are checked against the
oracle on their dequantised pages, so the only error left is the backend's arithmetic.
"""
import contextlib
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pallas_kernels
from pallas_kernels import cpu, gpu, native, reference, tpu
from pallas_kernels.cases import NAMED_CASES as CASES, dense_attention, make_case
from pallas_kernels.kv_quant import QuantizedKV

NATIVE = [f"native-{isa}" for isa in native.runnable_isas()]  # none where the kernels cannot be built
BACKENDS = {
    "reference": reference.ragged_paged_attention_reference,
    "cpu": cpu.ragged_paged_attention_cpu,
    **{name: native.ragged_paged_attention for name in NATIVE},
    "gpu_interpret": functools.partial(gpu.ragged_paged_attention_gpu, interpret=True),
    "tpu_interpret": functools.partial(tpu.ragged_paged_attention_tpu, interpret=True),
}


PLATFORMS = {"gpu_interpret": "gpu", "tpu_interpret": "tpu"}  # whose cache storage a backend takes (else cpu's)


@functools.cache
def _jitted(backend, sm_scale, options):
    """One jitted function per (JAX backend, options): cases of the same shapes (the random batches' fixed buckets)
    share its compiled program."""
    return jax.jit(functools.partial(BACKENDS[backend], sm_scale=sm_scale, **dict(options)))


def _run(backend, case, options):
    sm_scale = case.q.shape[-1] ** -0.5
    if backend.startswith("native-") or any(isinstance(v, np.ndarray) for v in options.values()):
        # a fresh partial: a fresh trace, so a native path forced here is the one compiled in
        fn = jax.jit(functools.partial(BACKENDS[backend], sm_scale=sm_scale, **options))
    else:
        fn = _jitted(backend, sm_scale, tuple(sorted(options.items())))
    # device_put, not jnp.asarray: that compiles a copy program for each new shape (seconds over the file)
    args = jax.device_put(case.attention_args(PLATFORMS.get(backend, "cpu")))
    if backend.startswith("native-"):
        with native.use_isa(backend.removeprefix("native-")):
            lowered = fn.lower(*args)
        assert f"isa = {native.ISAS.index(backend.removeprefix('native-'))} : i32" in lowered.as_text()
        return np.asarray(lowered.compile()(*args)).astype(np.float32)
    return np.asarray(fn(*args)).astype(np.float32)  # on the host: no convert program


def _check(out, case, options, *, atol, rtol):
    want = dense_attention(case, sm_scale=case.q.shape[-1] ** -0.5, **options)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, atol=atol, rtol=rtol)


def _named_case(name, **kw):
    seqs, shape, options = CASES[name]
    case = make_case(np.random.default_rng(zlib.crc32(name.encode())), seqs, num_q_heads=shape["hq"],
                     num_kv_heads=shape["hkv"], head_dim=shape["d"], page_size=shape["ps"],
                     num_tokens=shape.get("t"), num_seq_slots=shape.get("s"), **kw)
    return case, options


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_named_case(backend, name):
    case, options = _named_case(name)
    _check(_run(backend, case, options), case, options, atol=2e-5, rtol=2e-5)


# Quantized caches: every named case on the best native path; on the lower native paths and the JAX backends
# (seconds per compile) cases that together cover decodes on and past page boundaries, mixed prefill/decode, GQA 2, 4
# and 8, and a sliding window with a soft cap.
JAX_BACKENDS = ("reference", "cpu", "gpu_interpret", "tpu_interpret")
QUANTIZED_RUNS = [(b, n) for b in NATIVE[-1:] for n in CASES] + \
    [(b, n) for b in NATIVE[:-1] for n in ("decode_only", "mixed_gqa8", "sliding_window_soft_cap")] + \
    [(b, n) for b in JAX_BACKENDS for n in ("mixed_gqa8", "sliding_window_soft_cap")]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend,name", QUANTIZED_RUNS)
def test_named_case_quantized_cache(backend, name, kv_cache_dtype):
    case, options = _named_case(name, kv_cache_dtype=kv_cache_dtype)
    _check(_run(backend, case, options), case, options, atol=2e-5, rtol=2e-5)


# bf16 q over a quantized cache: both formats on the native paths, one each (alternating) on the JAX backends.
BF16_QUANTIZED_RUNS = [(b, f) for b in NATIVE for f in ("int8", "fp8_e4m3")] + \
    [(b, ("int8", "fp8_e4m3")[i % 2]) for i, b in enumerate(JAX_BACKENDS)]


@pytest.mark.parametrize("backend,kv_cache_dtype", BF16_QUANTIZED_RUNS)
def test_bf16_queries_over_a_quantized_cache(backend, kv_cache_dtype):
    """bf16 q over int8 / fp8 pages: the pages dequantised to q's dtype, within bf16 tolerance."""
    case = make_case(np.random.default_rng(8), [(1, 25), (9, 9), (4, 20)], num_q_heads=8, num_kv_heads=2,
                     head_dim=128, page_size=16, dtype=jnp.bfloat16, kv_cache_dtype=kv_cache_dtype)
    options = dict(sliding_window=12, logit_soft_cap=30.0)
    _check(_run(backend, case, options), case, options, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_within_bf16_tolerance(backend):
    case = make_case(np.random.default_rng(7), [(1, 25), (9, 9), (4, 20)], num_q_heads=8, num_kv_heads=2,
                     head_dim=128, page_size=16, dtype=jnp.bfloat16)
    _check(_run(backend, case, {}), case, {}, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_sinks(backend):
    """GPT-OSS's sinks (a logit per query head in the softmax's denominator) in a sliding window with GQA 4, decodes
    and prefills, padding: sinks from far below to far above the scores, so some heads attend almost only to the
    sink and others ignore it."""
    case = make_case(np.random.default_rng(11), [(1, 40), (9, 20), (5, 5)], num_q_heads=8, num_kv_heads=2,
                     head_dim=64, page_size=8, num_tokens=24, num_seq_slots=4)
    options = dict(sinks=np.array([-30.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0, 30.0], np.float32), sliding_window=12)
    out = _run(backend, case, options)
    _check(out, case, options, atol=2e-5, rtol=2e-5)
    assert np.max(np.abs(out - dense_attention(case, sm_scale=64 ** -0.5, sliding_window=12))) > 0.1
    np.testing.assert_array_equal(out[15:], 0.0)  # padding tokens


def test_cpu_backend_runs_sinks_natively_where_the_kernels_are_on(monkeypatch):
    """The entry point's cpu backend passes sinks to the native kernel where it runs (else to the XLA:CPU path)."""
    monkeypatch.setenv(pallas_kernels.attention.ENV_VAR, "cpu")
    case = make_case(np.random.default_rng(12), [(1, 17), (6, 6)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=8)
    sinks = np.array([0.5, -0.5, 1.0, 2.0], np.float32)
    fn = jax.jit(functools.partial(pallas_kernels.ragged_paged_attention, sm_scale=0.125))
    args = jax.device_put(case.attention_args("cpu"))
    text = fn.lower(*args, sinks=jax.device_put(sinks)).as_text()
    assert ("meshserve_cpu_ragged_paged_attention" in text) == native.enabled(), text[:2000]
    _check(np.asarray(fn(*args, sinks=jax.device_put(sinks))), case, dict(sinks=sinks), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_does_not_disturb_real_sequences(backend):
    seqs = [(1, 17), (6, 14)]
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    tight = make_case(np.random.default_rng(3), seqs, **kw)
    padded = make_case(np.random.default_rng(3), seqs, num_tokens=16, num_seq_slots=5, **kw)
    out_padded = _run(backend, padded, {})
    assert np.isfinite(out_padded).all()
    np.testing.assert_array_equal(out_padded[7:], 0.0)  # padding tokens give zeros
    np.testing.assert_allclose(out_padded[:7], _run(backend, tight, {}), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_never_uses_pages_before_its_window(backend):
    """A hybrid KV cache frees a sliding-window layer's page once every query still to come starts past it (its
    page-table entry then points at whatever page: `serving.core.batch.window_arrays` gives 0). Those entries here
    point at a page of huge values: each query's result is still its window's."""
    seqs = [(1, 40), (20, 47), (6, 6), (3, 30)]
    window, ps = 5, 8
    case = make_case(np.random.default_rng(11), seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=ps,
                     extra_pages=1)
    pages = case.arrays["page_indices"]
    garbage = next(iter(set(range(case.kv_pages.shape[0])) - set(pages[:len(seqs)].ravel().tolist())))
    case.kv_pages[garbage] = 3e4 * np.sign(case.kv_pages[garbage])
    dead = 0
    for i, (q_len, kv_len) in enumerate(seqs):
        first = max(0, kv_len - q_len - window + 1) // ps  # the first block any of its queries reads
        pages[i, :first] = garbage
        dead += first
    assert dead >= 8
    options = dict(sliding_window=window, logit_soft_cap=30.0)
    _check(_run(backend, case, options), case, options, atol=2e-5, rtol=2e-5)


@st.composite
def ragged_batches(draw, max_seqs=4, max_q=12, max_kv=40, batches=1):
    """One shape and kernel options (what the compiled program depends on) and `batches` random ragged batches
    run through it: (batches as [(sequences, seed)], shape, options)."""
    g = draw(st.sampled_from([1, 2, 4, 8]))
    hkv = draw(st.sampled_from([1, 2])) if g < 8 else 1
    options = {}
    if draw(st.booleans()):
        options["sliding_window"] = draw(st.integers(1, 24))
    if draw(st.booleans()):
        options["logit_soft_cap"] = draw(st.sampled_from([2.0, 30.0]))
    shape = dict(num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=draw(st.sampled_from([64, 128])),
                 page_size=draw(st.sampled_from([8, 16])))
    runs = []
    for _ in range(batches):
        seqs = []
        for _ in range(draw(st.integers(1, max_seqs))):
            q_len = draw(st.sampled_from([1, 1, draw(st.integers(1, max_q))]))
            seqs.append((q_len, q_len + draw(st.integers(0, max_kv - q_len))))
        runs.append((seqs, draw(st.integers(0, 2**31 - 1))))
    return runs, shape, options


def _random_case_check(backend, batch, max_seqs=4, max_kv=40):
    runs, shape, options = batch
    # fixed buckets and a fixed cache size (the pages past the batch's are spare), so the batches of one shape and
    # options share one compiled program
    num_pages = max_seqs * -(-max_kv // shape["page_size"]) + 3
    for seqs, seed in runs:
        extra = num_pages - sum(-(-kv_len // shape["page_size"]) for _, kv_len in seqs)
        case = make_case(np.random.default_rng(seed), seqs, num_tokens=48, num_seq_slots=6, max_pages=6,
                         extra_pages=extra, **shape)
        _check(_run(backend, case, options), case, options, atol=3e-5, rtol=3e-5)


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


# Per JAX backend a few shapes and options (seconds of compilation each), several batches each. Each backend's draws
# take both head dims and page sizes, with and without a window and a soft cap, and three or four GQA groups.
@settings(max_examples=6, **_SETTINGS)
@given(batch=ragged_batches(batches=3))
def test_random_batches_cpu(batch):
    _random_case_check("cpu", batch)


@pytest.mark.parametrize("backend", NATIVE)
@settings(max_examples=25, **_SETTINGS)
@given(batch=ragged_batches())
def test_random_batches_native(backend, batch):
    _random_case_check(backend, batch)


def test_native_attention_is_tested_here():
    if not NATIVE:
        pytest.skip(f"native CPU kernels cannot run here: {native.machine_reason()}")
    assert NATIVE[-1] == f"native-{native.runnable_isas()[-1]}" and f"native-{native.isa()}" in NATIVE


def test_native_attention_takes_quantized_caches(monkeypatch):
    if not NATIVE:
        pytest.skip(f"native CPU kernels cannot run here: {native.machine_reason()}")
    monkeypatch.delenv(native.ENV_VAR, raising=False)  # the kernel's own test: on even where serving switched it off
    S = jax.ShapeDtypeStruct

    def cache(values, scales=jnp.float32, d=64):
        return QuantizedKV(S((3, 8, 4, d), values), S((3, 8, 4), scales))

    for q in (S((5, 8, 64), jnp.float32), S((5, 8, 64), jnp.bfloat16)):
        for values in (jnp.int8, jnp.uint8, jnp.float8_e4m3fn):
            assert native.attention_supported(q, cache(values))
        assert not native.attention_supported(q, cache(jnp.int8, jnp.bfloat16))  # scales are float32
        assert not native.attention_supported(q, cache(jnp.int8, d=128))
    assert not native.attention_supported(S((5, 8, 64), jnp.float16), cache(jnp.int8))


@settings(max_examples=4, **_SETTINGS)
@given(batch=ragged_batches(batches=2))
def test_random_batches_reference(batch):
    _random_case_check("reference", batch)


@settings(max_examples=3, **_SETTINGS)
@given(batch=ragged_batches(batches=3))
def test_random_batches_gpu_interpret(batch):
    _random_case_check("gpu_interpret", batch)


@settings(max_examples=4, **_SETTINGS)
@given(batch=ragged_batches(batches=2))
def test_random_batches_tpu_interpret(batch):
    _random_case_check("tpu_interpret", batch)


@pytest.mark.parametrize("forced", ["reference", "cpu", "gpu", "tpu"])
def test_env_var_forces_backend(monkeypatch, forced):
    monkeypatch.setenv("MESHSERVE_ATTENTION", forced)
    assert pallas_kernels.attention_backend() == forced


def test_default_backend_on_cpu_is_fast_path(monkeypatch):
    monkeypatch.delenv("MESHSERVE_ATTENTION", raising=False)
    assert pallas_kernels.attention_backend() == "cpu"
    monkeypatch.setenv("MESHSERVE_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="MESHSERVE_ATTENTION"):
        pallas_kernels.attention_backend()


def test_entry_point_matches_oracle_under_jit(monkeypatch):
    monkeypatch.delenv("MESHSERVE_ATTENTION", raising=False)
    case = make_case(np.random.default_rng(11), [(1, 9), (5, 5)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=8, num_tokens=8, num_seq_slots=3)
    fn = jax.jit(functools.partial(pallas_kernels.ragged_paged_attention, sm_scale=0.125))
    out = np.asarray(fn(*jax.device_put(case.attention_args())))
    _check(out, case, {}, atol=2e-5, rtol=2e-5)


def test_bf16_cache_is_stored_as_uint16_bits_on_cpu():
    assert pallas_kernels.kv_storage_dtype(jnp.bfloat16) == jnp.uint16  # conftest: the CPU platform
    assert pallas_kernels.kv_storage_dtype(jnp.float32) == jnp.float32
    assert reference.kv_storage_dtype(jnp.bfloat16, "tpu") == jnp.bfloat16


def _whole_cache_instructions(step, args, num_pages):
    """(dtype, opcode, name) of each instruction of `step`'s optimised XLA:CPU program (cache donated) whose array
    is as big as a cache of `num_pages` pages of 16 tokens ([num_pages, ...] or flattened to [num_pages * 16, ...]).
    Compiled as users' programs are: with XLA's fusion emitters, which the tests' XLA_FLAGS turn off for cheaper
    compiles (tests/conftest.py) and which decide whether the cache's scatter fuses in place."""
    lowered = jax.jit(step, donate_argnums=0).trace(*args).lower(lowering_platforms=("cpu",))
    hlo = lowered.compile(compiler_options={"xla_cpu_use_fusion_emitters": True}).as_text()
    return [(dtype, op, name) for name, dtype, op in re.findall(
        rf"^\s*(?:ROOT )?%(\S+) = (\w+)\[(?:{num_pages}|{num_pages * 16}),[^=]*?\s([\w-]+)\(", hlo, re.M)]


def test_bf16_cache_is_never_copied_whole_on_cpu():
    """XLA:CPU upcasts 16-bit float gathers/scatters (and materialises a whole-array bitcast-convert), i.e. it
    converted or copied each layer's whole cache on every call (the bf16 step ran ~10x slower than f32). Stored
    as uint16 bits, a step that writes and then reads the donated cache touches it only through an in-place
    scatter and page gathers: no instruction produces a whole-cache-sized array except bitcasts of it."""
    num_pages = 1000  # a size no other array in the program has

    def step(kv, k, v, slots, q, kv_lens, page_indices, cu_q_lens, num_seqs):
        kv = reference.write_kv(kv, k, v, slots)
        out = cpu.ragged_paged_attention_cpu(q, kv, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=0.125)
        return out, kv

    S = jax.ShapeDtypeStruct
    args = (S((num_pages, 16, 4, 64), jnp.uint16), S((16, 2, 64), jnp.bfloat16), S((16, 2, 64), jnp.bfloat16),
            S((16,), jnp.int32), S((16, 4, 64), jnp.bfloat16), S((4,), jnp.int32), S((4, 8), jnp.int32),
            S((5,), jnp.int32), S((1,), jnp.int32))
    made = _whole_cache_instructions(step, args, num_pages)
    assert made, "the cache should appear in the program"
    for dtype, op, _ in made:
        assert dtype == "u16", f"the cache was converted to {dtype}"
        assert op in ("parameter", "bitcast", "get-tuple-element", "fusion", "scatter"), f"whole-cache {op}"
    fusions = [name for _, op, name in made if op == "fusion"]
    assert fusions and all("scatter" in name for name in fusions), fusions


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["cpu", *NATIVE[-1:]])
def test_quantized_cache_is_never_converted_whole_on_cpu(kv_cache_dtype, backend):
    """XLA:CPU converts a whole float8 array to f16 and back around each gather and scatter, so float8 values are
    stored as uint8 bits on cpu (int8 as int8). A step that writes and then reads a donated quantized cache (pure-JAX
    path or native kernel) touches its values and scales only through in-place scatters, page gathers and the
    kernel's operands: every whole-cache-sized array is the stored dtype, never a conversion."""
    num_pages = 1000
    storage = pallas_kernels.kv_storage_dtype(jnp.bfloat16, kv_cache_dtype)
    assert storage == (jnp.int8 if kv_cache_dtype == "int8" else jnp.uint8)

    def step(kv, k, v, slots, q, kv_lens, page_indices, cu_q_lens, num_seqs):
        kv = reference.write_kv(kv, k, v, slots)
        out = BACKENDS[backend](q, kv, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=0.125)
        return out, kv

    S = jax.ShapeDtypeStruct
    cache = QuantizedKV(S((num_pages, 16, 4, 64), storage), S((num_pages, 16, 4), jnp.float32))
    args = (cache, S((16, 2, 64), jnp.bfloat16), S((16, 2, 64), jnp.bfloat16), S((16,), jnp.int32),
            S((16, 4, 64), jnp.bfloat16), S((4,), jnp.int32), S((4, 8), jnp.int32), S((5,), jnp.int32),
            S((1,), jnp.int32))
    with native.use_isa(backend.removeprefix("native-")) if backend in NATIVE else contextlib.nullcontext():
        made = _whole_cache_instructions(step, args, num_pages)
    assert {dtype for dtype, _, _ in made} == {{"int8": "s8", "fp8_e4m3": "u8"}[kv_cache_dtype], "f32"}
    for _, op, name in made:
        assert op in ("parameter", "bitcast", "get-tuple-element", "scatter", "custom-call") or \
            (op == "fusion" and "scatter" in name), f"whole-cache {op} {name}"


def _kernel_out(fn, case, **kw):
    args = jax.device_put(case.attention_args())
    return np.asarray(jax.jit(functools.partial(fn, sm_scale=case.q.shape[-1] ** -0.5, **kw))(*args)).astype(
        np.float32)


@pytest.mark.parametrize("options", [{}, dict(sliding_window=100, logit_soft_cap=20.0)])
@pytest.mark.parametrize("split_kw", [{}, dict(num_splits=8), dict(num_splits=3, step_tokens=32),
                                      dict(num_splits=4, step_tokens=8)])  # 8: half a page per step
def test_gpu_split_k_at_batch_1_short_context_in_a_long_block_table(options, split_kw):
    """A 300-token context in a 4096-token block table: the splits share the real pages (from kv_len at run
    time), and the merged result is the oracle's."""
    case = make_case(np.random.default_rng(5), [(1, 300)], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                     max_pages=256)
    out = _kernel_out(gpu.ragged_paged_attention_gpu, case, interpret=True, **split_kw, **options)
    _check(out, case, options, atol=2e-5, rtol=2e-5)


def test_gpu_split_k_with_sinks():
    """Sinks applied to the merged splits (from their merged log-sum-exp), a sequence whose splits are all empty."""
    case = make_case(np.random.default_rng(6), [(1, 300), (2, 2)], num_q_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, max_pages=32, num_seq_slots=3)
    options = dict(sinks=np.linspace(-3.0, 5.0, 8).astype(np.float32))
    out = _kernel_out(gpu.ragged_paged_attention_gpu, case, interpret=True, num_splits=4, step_tokens=32, **options)
    _check(out, case, options, atol=2e-5, rtol=2e-5)


def test_gpu_splits_share_the_real_steps():
    """Every split's steps, for ranges of every length: disjoint, in order, covering exactly the range; with a
    wide table and a short context (3 steps, 8 splits) the work is spread, not left to split 0."""
    # every (lo, hi) pair at once: [lo, hi, split] arrays through the (elementwise) function
    lo = np.array([0, 1, 127, 128, 700], np.int32)[:, None, None]
    hi = np.r_[np.arange(0, 1300, 37), 300].astype(np.int32)[None, :, None]
    s_lo, s_hi = lo // 128, np.maximum(-(-hi // 128), lo // 128)
    for num_splits, min_steps in [(1, 1), (3, 1), (8, 1), (8, 2), (16, 4)]:
        steps = jax.jit(functools.partial(gpu.split_steps, block_k=128, num_splits=num_splits,
                                          min_split_steps=min_steps))  # one program, not one per op
        b, e = steps(lo, hi, np.arange(num_splits, dtype=np.int32))
        b, e = np.asarray(b), np.asarray(e)
        assert b.shape == e.shape == (lo.size, hi.size, num_splits)
        assert (b <= e).all() and (b[..., 0:1] == s_lo).all() and (e[..., -1:] == s_hi).all()
        assert (b[..., 1:] == e[..., :-1]).all()
        per = np.maximum(-(-(s_hi - s_lo) // num_splits), min_steps)
        np.testing.assert_array_equal((e - b).max(-1, keepdims=True), np.minimum(per, s_hi - s_lo))
        if (num_splits, min_steps) == (8, 1):  # lo 0, hi 300
            assert (e - b)[0, -1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("dtype,hkv,d", [(jnp.bfloat16, 1, 64), (jnp.bfloat16, 3, 128), (jnp.float16, 2, 64)])
def test_tpu_16bit_kv_read_as_uint32_pairs(dtype, hkv, d):
    """16-bit K/V reach the TPU kernel as uint32 (K | V << 16) rows: through the ref bitcast the compiled kernel
    uses (JAX's generic interpreter) and through the Mosaic interpreter's stand-in, the same bits and the oracle's
    result."""
    case = make_case(np.random.default_rng(hkv * d), [(1, 25), (9, 9), (4, 40)], num_q_heads=2 * hkv,
                     num_kv_heads=hkv, head_dim=d, page_size=16, dtype=dtype)
    mosaic = _kernel_out(tpu.ragged_paged_attention_tpu, case, interpret=True)
    generic = _kernel_out(tpu.ragged_paged_attention_tpu, case, interpret="generic")
    np.testing.assert_array_equal(generic, mosaic)
    _check(generic, case, {}, atol=3e-2, rtol=3e-2)
