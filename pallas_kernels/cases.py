"""Test and benchmark helpers: random paged ragged batches and a dense NumPy (float64) attention oracle.

Host-side only; nothing here runs under jit.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import QuantizedKV
from pallas_kernels.metadata import ragged_layout


@dataclasses.dataclass
class PagedCase:
    q: np.ndarray  # [T, Hq, D]
    kv_pages: np.ndarray | QuantizedKV  # [P, page_size, 2*Hkv, D] (quantized: float8 values as float8_e4m3fn)
    k_dense: list  # per real sequence: [kv_len, Hkv, D] float64 (of a quantized cache: dequantised)
    v_dense: list
    arrays: dict  # ragged_layout's arrays (slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, ...)
    q_lens: list
    kv_lens: list

    def attention_args(self, platform: str = "cpu"):
        """The arguments of `ragged_paged_attention`; a quantized cache as device arrays stored as on `platform`
        (`kv_quant.values_dtype`: float8 values as uint8 bits on cpu)."""
        a = self.arrays
        kv = self.kv_pages
        if isinstance(kv, QuantizedKV):
            values, dtype = jnp.asarray(kv.values), kv_quant.values_dtype(kv.kv_cache_dtype, platform)
            kv = QuantizedKV(values if values.dtype == dtype else jax.lax.bitcast_convert_type(values, dtype),
                             jnp.asarray(kv.scales))
        return (self.q, kv, a["kv_lens"], a["page_indices"], a["cu_q_lens"], a["num_seqs"])


def make_case(rng: np.random.Generator, seqs: Sequence[tuple[int, int]], *, num_q_heads: int, num_kv_heads: int,
              head_dim: int, page_size: int, num_tokens: int | None = None, num_seq_slots: int | None = None,
              max_pages: int | None = None, dtype=np.float32, extra_pages: int = 3,
              kv_cache_dtype: str = "auto") -> PagedCase:
    """A batch of sequences given as (q_len, kv_len), with pages scattered at random over the cache; "int8" or
    "fp8_e4m3": the pages quantised (`kv_quant.quantize`) and the dense K/V the dequantised pages, so that an
    oracle on them leaves a backend only its own arithmetic's error."""
    total = sum(ql for ql, _ in seqs)
    num_tokens = num_tokens or max(total, 1)
    num_seq_slots = num_seq_slots or max(len(seqs), 1)
    need = [-(-kl // page_size) for _, kl in seqs]
    max_pages = max_pages or max(need + [1])
    num_pages = sum(need) + extra_pages
    perm = rng.permutation(num_pages)
    kv_pages = rng.standard_normal((num_pages, page_size, 2 * num_kv_heads, head_dim)).astype(dtype)
    dense = kv_pages.astype(np.float64)
    if kv_cache_dtype != "auto":
        values, scales = kv_quant.quantize(jnp.asarray(kv_pages), kv_quant.values_dtype(kv_cache_dtype, "gpu"))
        kv_pages = QuantizedKV(np.asarray(values), np.asarray(scales))
        dense = np.asarray(values.astype(jnp.float32), np.float64) * np.asarray(scales, np.float64)[..., None]
    tables = np.zeros((len(seqs), max_pages), np.int64)
    k_dense, v_dense, off = [], [], 0
    for i, ((ql, kl), n) in enumerate(zip(seqs, need)):
        table = perm[off:off + n]
        off += n
        tables[i, :n] = table
        flat = dense[table].reshape(n * page_size, num_kv_heads, 2, head_dim)[:kl]
        k_dense.append(flat[:, :, 0])
        v_dense.append(flat[:, :, 1])
    q_lens, kv_lens = np.array([ql for ql, _ in seqs], np.int64), np.array([kl for _, kl in seqs], np.int64)
    arrays = ragged_layout([1] * int(q_lens.sum()), kv_lens - q_lens, q_lens, tables, np.array(need, np.int64),
                           page_size=page_size, num_tokens=num_tokens, num_seqs=num_seq_slots)
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(dtype)
    return PagedCase(q, kv_pages, k_dense, v_dense, arrays, q_lens.tolist(), kv_lens.tolist())


def dense_attention(case: PagedCase, *, sm_scale: float, sliding_window: int | None = None,
                    logit_soft_cap: float | None = None, q: np.ndarray | None = None,
                    sinks: np.ndarray | None = None) -> np.ndarray:
    """Dense causal attention in float64, one sequence at a time; padding tokens give zeros. `sinks[Hq]`: a logit per
    query head in the softmax's denominator (GPT-OSS), as a key whose value is zero."""
    q = (case.q if q is None else q).astype(np.float64)
    t, hq, d = q.shape
    hkv = case.k_dense[0].shape[1] if case.k_dense else 1
    g = hq // hkv
    out = np.zeros((t, hq, d), np.float64)
    start = 0
    for ql, kl, k, v in zip(case.q_lens, case.kv_lens, case.k_dense, case.v_dense):
        qs = q[start:start + ql].reshape(ql, hkv, g, d)
        s = np.einsum("thgd,lhd->thgl", qs, k) * sm_scale
        if logit_soft_cap is not None:
            s = logit_soft_cap * np.tanh(s / logit_soft_cap)
        qpos = np.arange(kl - ql, kl)[:, None]
        kpos = np.arange(kl)[None, :]
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        s = np.where(mask[:, None, None, :], s, -np.inf)
        if sinks is not None:  # one more key per head, with no value: its weight is dropped after the softmax
            sink = np.broadcast_to(np.asarray(sinks, np.float64).reshape(1, hkv, g, 1), s.shape[:3] + (1,))
            s = np.concatenate([s, sink], axis=-1)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        p = p[..., :kl]
        out[start:start + ql] = np.einsum("thgl,lhd->thgd", p, v).reshape(ql, hq, d)
        start += ql
    return out


# Named ragged batches every attention backend is checked on (tests/pallas_kernels/test_attention.py, and for real on
# an accelerator by `python -m serving.bench accelerator`): name -> (sequences as (q_len, kv_len),
# dict(hq, hkv, d, ps[, t token bucket, s sequence bucket]), kernel options).
NAMED_CASES = {
    # decode-only, KV ending exactly on a page boundary (16), just past it (17), and a 1-token context
    "decode_only": ([(1, 16), (1, 17), (1, 1), (1, 40)], dict(hq=8, hkv=2, d=64, ps=8), {}),
    # prefill-only: one-token prompt, prompts ending on / just past a page boundary
    "prefill_only": ([(1, 1), (16, 16), (17, 17), (7, 7)], dict(hq=4, hkv=2, d=128, ps=16), {}),
    # decodes mixed with a fresh prompt and a chunked-prefill continuation
    "mixed_gqa8": ([(1, 33), (12, 12), (5, 37), (1, 8)], dict(hq=8, hkv=1, d=64, ps=8), {}),
    "mixed_gqa1": ([(3, 20), (1, 9), (9, 9)], dict(hq=2, hkv=2, d=64, ps=32), {}),
    "mixed_gqa4_page128": ([(1, 130), (6, 128), (2, 2)], dict(hq=8, hkv=2, d=64, ps=128), {}),
    "sliding_window_soft_cap": ([(1, 40), (20, 27), (6, 6)], dict(hq=4, hkv=2, d=64, ps=8),
                                dict(sliding_window=5, logit_soft_cap=4.0)),
    # prompts longer than the kernels' query blocks (several blocks per sequence), one a chunked continuation
    "long_prefill": ([(150, 150), (70, 200), (1, 90)], dict(hq=4, hkv=2, d=64, ps=16), {}),
    # bucket padded past the real tokens and sequences
    "padded_bucket": ([(1, 10), (4, 12)], dict(hq=4, hkv=1, d=64, ps=8, t=16, s=6), {}),
}

# (atol, rtol) of a backend's output against the float64 oracle (`dense_attention`), per dtype.
TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (3e-2, 3e-2)}


# ---------------------------------------------------------------------------------------------------------
# Quantized-cache granularity: the attention-output error of K/V quantised per token per KV head (`kv_quant`) against
# per-tensor and per-channel static scales (docs/attention.md has the figures).


def _per_tensor(x: np.ndarray, kv_cache_dtype: str, scale: float | None = None) -> np.ndarray:
    """x through one static scale for the whole tensor (its absmax / qmax unless `scale` is given), float64."""
    qmax = kv_quant.QMAX[kv_cache_dtype]
    scale = np.float32(np.abs(x).max() / qmax if scale is None else scale)
    y = np.clip(np.asarray(x, np.float32) / scale, -qmax, qmax)
    y = np.round(y) if kv_cache_dtype == "int8" else y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return y.astype(np.float64) * scale


def _per_row(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """x through `kv_quant.quantize` (one scale per row of D), float64."""
    values, scales = kv_quant.quantize(jnp.asarray(x, jnp.float32), kv_quant.values_dtype(kv_cache_dtype, "gpu"))
    return np.asarray(values.astype(jnp.float32), np.float64) * np.asarray(scales, np.float64)[..., None]


def _per_channel_int8(x: np.ndarray) -> np.ndarray:
    """x [T, Hkv, D] through int8 with one static scale per head and channel (absmax over the tokens), float64."""
    scale = np.abs(x).max(axis=0, keepdims=True) / 127
    return np.round(x / np.where(scale > 0, scale, 1)) * scale


KV_GRANULARITIES = {
    "int8, per token and head (kv_quant)": lambda x: _per_row(x, "int8"),
    "fp8_e4m3, per token and head (kv_quant)": lambda x: _per_row(x, "fp8_e4m3"),
    "int8, per tensor (absmax)": lambda x: _per_tensor(x, "int8"),
    "fp8_e4m3, per tensor (absmax)": lambda x: _per_tensor(x, "fp8_e4m3"),
    "fp8_e4m3, per tensor, scale 1.0": lambda x: _per_tensor(x, "fp8_e4m3", 1.0),
    "int8, per channel (absmax over tokens)": _per_channel_int8,
}


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One sequence's causal attention in float64: q [T, Hkv, G, D], k/v [T, Hkv, D] -> [T, Hkv, G, D]."""
    t, _, _, d = q.shape
    s = np.einsum("thgd,lhd->thgl", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool))[:, None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("thgl,lhd->thgd", p / p.sum(-1, keepdims=True), v)


def kv_granularity_errors(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> dict[str, float]:
    """For each of KV_GRANULARITIES: ||attention(q, K~, V~) - attention(q, K, V)|| / ||attention(q, K, V)||, with
    K~, V~ the cache's K/V quantised that way (q [T, Hkv, G, D], k/v [T, Hkv, D], one causal sequence)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    want = causal_attention(q, k, v)
    return {name: float(np.linalg.norm(causal_attention(q, f(k), f(v)) - want) / np.linalg.norm(want))
            for name, f in KV_GRANULARITIES.items()}
