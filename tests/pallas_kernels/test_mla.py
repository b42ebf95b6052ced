"""Latent (multi-head latent attention) paged attention: every backend against a dense float64 NumPy oracle. Backends:
the pure-JAX reference, the XLA:CPU path, the native C++ kernel on every instruction-set path this CPU runs, and
the GPU (Triton) and TPU (Mosaic) kernels in interpret mode; caches in the queries' dtype and quantized (int8,
fp8_e4m3: checked against their dequantised rows, so only the backend's arithmetic is left); the latent row write."""
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import cpu, kv_quant, mla, mla_gpu, mla_tpu, native
from pallas_kernels.kv_quant import QuantizedKV
from pallas_kernels.metadata import ragged_layout

NATIVE = [f"native-{isa}" for isa in native.runnable_isas()]
BACKENDS = {
    "reference": mla.latent_attention_reference,
    "cpu": functools.partial(cpu.ragged_paged_attention_cpu, chunk_tokens=16),
    **{name: native.latent_attention for name in NATIVE},
    # small blocks: several head blocks per item, several pages per step / chunks per item, split-K merges
    "gpu_interpret": functools.partial(mla_gpu.latent_attention_gpu, interpret=True, block_rows=8, step_tokens=16,
                                       num_splits=2),
    "tpu_interpret": functools.partial(mla_tpu.latent_attention_tpu, interpret=True, block_rows=8,
                                       chunk_tokens=16),
}
# Seconds per call (interpreters, XLA:CPU compiles): the cases that together cover them.
ONLY = {"gpu_interpret": "mixed_padded", "tpu_interpret": "long_prefill", "cpu": "mixed_padded"}
PLATFORMS = {"gpu_interpret": "gpu", "tpu_interpret": "tpu"}
# Jitted: one compile per shape instead of one per eager op.
quantize = jax.jit(kv_quant.quantize, static_argnums=1)
dequantize = jax.jit(kv_quant.dequantize)


def make_latent_case(seed, seqs, *, heads, rank, rope, page_size, num_tokens=None, num_seq_slots=None,
                     dtype=np.float32, kv_cache_dtype="auto"):
    """(q [T, H, R + Dr], pages [P, page, 1, R + Dr] (a QuantizedKV with float8 values as float8_e4m3fn), the
    ragged layout's arrays, each sequence's dense rows as float64 (of a quantized cache: dequantised), q_lens)."""
    rng = np.random.default_rng(seed)
    d = rank + rope
    need = [-(-kl // page_size) for _, kl in seqs]
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages)
    pages = rng.standard_normal((num_pages, page_size, 1, d)).astype(dtype)
    dense = pages.astype(np.float64)
    if kv_cache_dtype != "auto":
        values, scales = quantize(jnp.asarray(pages), kv_quant.values_dtype(kv_cache_dtype, "gpu"))
        pages = QuantizedKV(np.asarray(values), np.asarray(scales))
        dense = pages.values.astype(np.float64) * pages.scales.astype(np.float64)[..., None]
    tables = np.zeros((len(seqs), max(need)), np.int64)
    rows, off = [], 0
    for i, ((_, kl), n) in enumerate(zip(seqs, need)):
        tables[i, :n] = perm[off:off + n]
        rows.append(dense[perm[off:off + n]].reshape(n * page_size, d)[:kl])
        off += n
    q_lens = [ql for ql, _ in seqs]
    total = sum(q_lens)
    arrays = ragged_layout([1] * total, np.array([kl - ql for ql, kl in seqs]), np.array(q_lens), tables,
                           np.array(need), page_size=page_size, num_tokens=num_tokens or total,
                           num_seqs=num_seq_slots or len(seqs))
    q = rng.standard_normal((num_tokens or total, heads, d)).astype(dtype)
    return q, pages, arrays, rows, q_lens


def dense_latent_attention(q, rows, q_lens, sm_scale, value_dim):
    q = q.astype(np.float64)
    out = np.zeros(q.shape[:2] + (value_dim,))
    start = 0
    for ql, kv in zip(q_lens, rows):
        kl = kv.shape[0]
        s = np.einsum("thd,ld->thl", q[start:start + ql], kv) * sm_scale
        mask = np.arange(kl)[None, :] <= np.arange(kl - ql, kl)[:, None]
        s = np.where(mask[:, None, :], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[start:start + ql] = np.einsum("thl,lv->thv", p / p.sum(-1, keepdims=True), kv[:, :value_dim])
        start += ql
    return out


def _args(pages, arrays, q, platform):
    if isinstance(pages, QuantizedKV):
        values, dtype = jnp.asarray(pages.values), kv_quant.values_dtype(pages.kv_cache_dtype, platform)
        pages = QuantizedKV(values if values.dtype == dtype else jax.lax.bitcast_convert_type(values, dtype),
                            jnp.asarray(pages.scales))
    return (jnp.asarray(q), pages, *(jnp.asarray(arrays[k]) for k in
                                     ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")))


def _run(backend, case, value_dim):
    q, pages, arrays, _, _ = case
    kw = dict(sm_scale=0.2, value_dim=value_dim)
    fn = jax.jit(functools.partial(BACKENDS[backend], **kw))
    args = _args(pages, arrays, q, PLATFORMS.get(backend, "cpu"))
    if backend.startswith("native-"):
        isa = backend.removeprefix("native-")
        with native.use_isa(isa):
            lowered = fn.lower(*args)
        assert "meshserve_cpu_latent_attention" in lowered.as_text()
        assert f"isa = {native.ISAS.index(isa)} : i32" in lowered.as_text()
        return np.asarray(lowered.compile()(*args).astype(jnp.float32))
    return np.asarray(fn(*args).astype(jnp.float32))


# (sequences as (q_len, kv_len), heads, kv_lora_rank, rope dim, page size, token / sequence buckets)
CASES = {
    # decodes on and past a page boundary, a one-token context
    "decode": ([(1, 16), (1, 17), (1, 1), (1, 40)], 8, 32, 16, 8, None, None),
    # decodes beside a fresh prompt and a chunked-prefill continuation; a padded bucket
    "mixed_padded": ([(1, 33), (12, 12), (5, 37)], 4, 32, 16, 8, 24, 5),
    # a prompt longer than the query blocks; 16 heads
    "long_prefill": ([(70, 90), (1, 20)], 16, 64, 16, 16, None, None),
}


RUNS = [(b, n) for b in BACKENDS for n in CASES if ONLY.get(b, n) == n]


@pytest.mark.parametrize("backend,name", RUNS)
def test_latent_attention_matches_oracle(backend, name):
    seqs, heads, rank, rope, ps, t, s = CASES[name]
    case = make_latent_case(zlib.crc32(name.encode()), seqs, heads=heads, rank=rank, rope=rope, page_size=ps,
                            num_tokens=t, num_seq_slots=s)
    out = _run(backend, case, rank)
    q, _, _, rows, q_lens = case
    want = dense_latent_attention(q, rows, q_lens, 0.2, rank)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[sum(q_lens):], 0.0)  # padding tokens


# Both formats and dtypes on the native paths and the reference; one of each on the others.
QUANTIZED = [(b, f, dt) for b in ("reference", *NATIVE) for f in ("int8", "fp8_e4m3") for dt in ("f32", "bf16")] + \
    [("cpu", "int8", "bf16"), ("gpu_interpret", "fp8_e4m3", "f32"), ("tpu_interpret", "int8", "bf16")]


@pytest.mark.parametrize("backend,kv_cache_dtype,dtype", QUANTIZED)
def test_quantized_latent_cache(backend, kv_cache_dtype, dtype):
    """int8 / fp8 latent rows (one scale per row) dequantised inside each backend; bf16 queries within bf16's
    tolerance."""
    case = make_latent_case(5, [(1, 25), (9, 9), (4, 20)], heads=4, rank=32, rope=16, page_size=8,
                            dtype={"f32": np.float32, "bf16": jnp.bfloat16}[dtype], kv_cache_dtype=kv_cache_dtype)
    out = _run(backend, case, 32)
    q, _, _, rows, q_lens = case
    tol = 2e-5 if dtype == "f32" else 3e-2
    np.testing.assert_allclose(out, dense_latent_attention(np.asarray(q, np.float32), rows, q_lens, 0.2, 32),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["reference", *NATIVE, "gpu_interpret"])
def test_bf16_latent_cache(backend):
    case = make_latent_case(6, [(1, 25), (9, 9), (4, 20)], heads=8, rank=32, rope=16, page_size=8,
                            dtype=jnp.bfloat16)
    q, _, _, rows, q_lens = case
    np.testing.assert_allclose(_run(backend, case, 32),
                               dense_latent_attention(np.asarray(q, np.float32), rows, q_lens, 0.2, 32),
                               atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_latent_row_write(monkeypatch, platform, kv_cache_dtype):
    """`write_latent` puts each token's row in its slot (padding dropped), quantising a QuantizedKV's rows; the TPU
    path (an aliased DMA kernel) in interpret mode."""
    pages = jnp.zeros((4, 4, 1, 48), jnp.float32)
    if kv_cache_dtype != "auto":
        pages = QuantizedKV(jnp.zeros(pages.shape, jnp.int8), jnp.zeros(pages.shape[:-1], jnp.float32))
    rows = jax.random.normal(jax.random.key(0), (5, 1, 48), jnp.float32)
    slots = jnp.array([3, 9, -1, 12, 0], jnp.int32)
    if platform == "tpu":
        from pallas_kernels import tpu
        out = tpu.write_rows_tpu(pages, rows, slots, interpret=True)
    else:
        out = pallas_kernels.write_latent(pages, rows, slots)
    flat = np.asarray(out if kv_cache_dtype == "auto" else dequantize(out.values, out.scales)).reshape(16, 1, 48)
    rows = np.asarray(rows)  # NumPy from here: no eager op (and its compile) per token
    tol = 0 if kv_cache_dtype == "auto" else float(np.abs(rows).max()) / 127
    for token, slot in enumerate(np.asarray(slots)):
        if slot >= 0:
            np.testing.assert_allclose(flat[slot], rows[token], atol=tol)
    untouched = np.setdiff1d(np.arange(16), np.asarray(slots))
    np.testing.assert_array_equal(flat[untouched], 0.0)
