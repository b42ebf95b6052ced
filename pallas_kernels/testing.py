"""Test and benchmark helpers: random paged ragged batches and a dense NumPy (float64) attention oracle.

Host-side only; nothing here runs under jit.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from models.batch import SeqChunk, build_ragged_batch


@dataclasses.dataclass
class PagedCase:
    q: np.ndarray  # [T, Hq, D]
    kv_pages: np.ndarray  # [P, page_size, 2*Hkv, D]
    k_dense: list  # per real sequence: [kv_len, Hkv, D] float64
    v_dense: list
    arrays: dict  # build_ragged_batch output (slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, ...)
    q_lens: list
    kv_lens: list

    def attention_args(self):
        a = self.arrays
        return (self.q, self.kv_pages, a["kv_lens"], a["page_indices"], a["cu_q_lens"], a["num_seqs"])


def make_case(rng: np.random.Generator, seqs: Sequence[tuple[int, int]], *, num_q_heads: int, num_kv_heads: int,
              head_dim: int, page_size: int, num_tokens: int | None = None, num_seq_slots: int | None = None,
              max_pages: int | None = None, dtype=np.float32, extra_pages: int = 3) -> PagedCase:
    """A batch of sequences given as (q_len, kv_len), with pages scattered at random over the cache."""
    total = sum(ql for ql, _ in seqs)
    num_tokens = num_tokens or max(total, 1)
    num_seq_slots = num_seq_slots or max(len(seqs), 1)
    need = [-(-kl // page_size) for _, kl in seqs]
    max_pages = max_pages or max(need + [1])
    num_pages = sum(need) + extra_pages
    perm = rng.permutation(num_pages)
    kv_pages = rng.standard_normal((num_pages, page_size, 2 * num_kv_heads, head_dim)).astype(dtype)
    chunks, k_dense, v_dense, off = [], [], [], 0
    for (ql, kl), n in zip(seqs, need):
        table = perm[off:off + n]
        off += n
        chunks.append(SeqChunk(token_ids=[1] * ql, start=kl - ql, block_table=list(table)))
        flat = kv_pages[table].reshape(n * page_size, num_kv_heads, 2, head_dim)[:kl].astype(np.float64)
        k_dense.append(flat[:, :, 0])
        v_dense.append(flat[:, :, 1])
    arrays = build_ragged_batch(chunks, page_size=page_size, num_tokens=num_tokens, num_seqs=num_seq_slots,
                                max_pages=max_pages)
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(dtype)
    return PagedCase(q, kv_pages, k_dense, v_dense, arrays, [ql for ql, _ in seqs], [kl for _, kl in seqs])


def dense_attention(case: PagedCase, *, sm_scale: float, sliding_window: int | None = None,
                    logit_soft_cap: float | None = None, q: np.ndarray | None = None) -> np.ndarray:
    """Dense causal attention in float64, one sequence at a time; padding tokens give zeros."""
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
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[start:start + ql] = np.einsum("thgl,lhd->thgd", p, v).reshape(ql, hq, d)
        start += ql
    return out
