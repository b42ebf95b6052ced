"""A minimal paged-KV generation loop over the model forward, for model tests (the serving engine is the real
one). Runs several sequences together in one ragged step, mixing prefill chunks and decodes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from serving.core.batch import SeqChunk, build_batch
from models.moe import ExpertCounts
from models.kv_cache import init_kv_caches


class PagedRunner:
    def __init__(self, model, *, page_size=8, num_pages=128, max_pages=64, cache_dtype=None, kv_cache_dtype="auto"):
        self.cfg = model.config
        self.page_size, self.max_pages = page_size, max_pages
        self.graphdef, self.state = nnx.split(model)
        dtype = cache_dtype or jax.tree.leaves(self.state)[0].dtype
        self.kv = init_kv_caches(model.kv_cache_specs(dtype=dtype, kv_cache_dtype=kv_cache_dtype), num_pages, page_size)
        self.next_free = 0

        def forward(m, batch, kv):  # MoE layers sow expert counts, which only nnx.capture may collect
            (hidden, kv), _ = nnx.capture(m, ExpertCounts)(batch, kv)
            return hidden, kv

        def step(state, kv, batch):
            m = nnx.merge(self.graphdef, state)
            hidden, kv = forward(m, batch, kv)
            return m.compute_logits(hidden[batch.logits_indices]), kv

        def all_logits(state, kv, batch):
            m = nnx.merge(self.graphdef, state)
            hidden, kv = forward(m, batch, kv)
            return m.compute_logits(hidden), kv

        self._step = jax.jit(step, donate_argnums=(1,))
        self._all_logits = jax.jit(all_logits, donate_argnums=(1,))

    def alloc(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // self.page_size)
        pages = list(range(self.next_free, self.next_free + n))
        self.next_free += n
        return pages

    def _arrays(self, chunks, num_tokens, num_seqs):
        total = sum(len(c.token_ids) for c in chunks)
        batch = build_batch(chunks, page_size=self.page_size,
                            num_tokens=num_tokens or max(8, 1 << (total - 1).bit_length()),
                            num_seqs=num_seqs or max(2, len(chunks) + 1), max_pages=self.max_pages)
        return jax.tree.map(jnp.asarray, batch)

    def step(self, chunks: list[SeqChunk], num_tokens: int | None = None, num_seqs: int | None = None):
        """Logits at the last token of each chunk, [len(chunks), vocab]."""
        logits, self.kv = self._step(self.state, self.kv, self._arrays(chunks, num_tokens, num_seqs))
        return np.asarray(logits)[:len(chunks)]

    def token_logits(self, chunks: list[SeqChunk], num_tokens: int | None = None, num_seqs: int | None = None):
        """Logits at every token of the step, [num_real_tokens, vocab] (`num_tokens` / `num_seqs` as in `generate`)."""
        logits, self.kv = self._all_logits(self.state, self.kv, self._arrays(chunks, num_tokens, num_seqs))
        return np.asarray(logits)[:sum(len(c.token_ids) for c in chunks)]

    def prefill_errors(self, prompt: list[int], ref) -> tuple[float, float]:
        """Max |logit - ref| for `prompt` prefilled whole, and in 5-token chunks through the paged cache beside
        another sequence's prefill (the prompt reversed)."""
        n = len(prompt)
        shape = {"num_tokens": max(8, 1 << (n - 1).bit_length()), "num_seqs": 3}  # one program for every step
        full = self.token_logits([SeqChunk(prompt, 0, self.alloc(n))], **shape)
        table, other = self.alloc(n), self.alloc(n)
        chunked = []
        for start in range(0, n, 5):
            logits = self.token_logits([SeqChunk(prompt[start:start + 5], start, table),
                                        SeqChunk(prompt[::-1][start:start + 5], start, other)], **shape)
            chunked.append(logits[:min(5, n - start)])
        return float(np.max(np.abs(full - ref))), float(np.max(np.abs(np.concatenate(chunked) - ref)))

    def generate(self, prompts: list[list[int]], steps: int, chunk: int | None = None, num_tokens: int | None = None,
                 num_seqs: int | None = None) -> list[list[int]]:
        """Greedy. Prompts are prefilled in chunks of `chunk` tokens (staggered: sequence i starts one step after
        i-1, so prefills and decodes share steps). `num_tokens` / `num_seqs`: one padded shape for every step (one
        compilation) instead of the smallest bucket that fits each step's tokens and sequences."""
        tables = [self.alloc(len(p) + steps) for p in prompts]
        done = [0] * len(prompts)  # tokens in KV
        outs: list[list[int]] = [[] for _ in prompts]
        started = 0
        while any(len(o) < steps for o in outs):
            started = min(started + 1, len(prompts))
            chunks, who = [], []
            for i in range(started):
                if len(outs[i]) >= steps:
                    continue
                seq = prompts[i] + outs[i]
                if done[i] < len(prompts[i]):
                    n = len(prompts[i]) - done[i] if chunk is None else min(chunk, len(prompts[i]) - done[i])
                    toks = seq[done[i]:done[i] + n]
                else:
                    toks = seq[done[i]:done[i] + 1]
                chunks.append(SeqChunk(toks, done[i], tables[i]))
                who.append(i)
            logits = self.step(chunks, num_tokens, num_seqs)
            for row, i in enumerate(who):
                done[i] += len(chunks[row].token_ids)
                if done[i] >= len(prompts[i]):
                    outs[i].append(int(np.argmax(logits[row])))
        return outs
