"""Multi-head latent attention (DeepSeek's MLA): (1) the KV cache from the memory ledger for DeepSeek-V3 (its
config.json as the ledger's preset: no download) beside standard-attention models of the same shape, and how many
32k-token requests fit on 8 devices; (2) a decode step at batch 16 and context 4k on this CPU for a small random MLA
model beside same-size GQA and MHA models, bytes read per step against the read-bandwidth roofline; (3) prefill
chunks in the absorbed form (the latent kernel) against K/V expanded from the latent. Details: docs/benchmarks.md.

    python -m serving.bench mla [--quick] [--only=ledger|decode|prefill]
"""
from __future__ import annotations

import dataclasses
import os

from absl import flags

from serving.bench.harness import BENCH_WORKDIR, cpu_path, hf_checkpoint, median_time, read_bandwidth, table

GB = 10**9
_ONLY = flags.DEFINE_list("only", [], "parts to run: ledger, decode, prefill (default: all)")
_QUICK = flags.DEFINE_bool("quick", False, "short context and few repeats (a smoke run)")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed steps per cell (the median is reported)")
_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the benchmark models are written")

REQUEST_TOKENS = 32768


def standard_attention(cfg, kv_heads: int, head_dim: int):
    """`cfg` with grouped-query attention of `kv_heads` x `head_dim` in place of its latent attention (the same
    layers, heads, experts and weights otherwise): the cache a standard-attention model of its size holds."""
    return dataclasses.replace(cfg, kv_lora_rank=0, q_lora_rank=0, num_kv_heads=kv_heads, head_dim=head_dim)


def requests_that_fit(mm, devices: int, device_bytes: int, kv_dtype: str) -> tuple[int, str]:
    """The most REQUEST_TOKENS-token requests any layout of the ledger's planner holds on `devices` devices of
    `device_bytes` (weights, the largest step's activations and buffers and the runtime reserve first), and the
    layout; (0, why) when the weights alone do not fit."""
    from serving import ledger
    hw = ledger.Hardware(device_memory=device_bytes, num_devices=devices)
    best = (0, "weights do not fit")
    for layout in ledger.candidate_layouts(mm.cfg, devices):
        work = ledger.Workload(concurrency=layout.dp, avg_seq_len=REQUEST_TOKENS)
        led = ledger.device_ledger(mm, work, layout, hw)
        free = device_bytes - (led.total - led.kv_cache)
        per_request = REQUEST_TOKENS * max(mm.stage_kv_bytes_per_token(layout, s) for s in range(layout.pp))
        n = max(0, free // per_request) * layout.dp
        if free > 0 and n > best[0]:
            best = (int(n), str(layout))
    return best


def ledger_part() -> None:
    from models.config import ModelConfig
    from serving import ledger
    v3 = ModelConfig.from_hf(ledger.PRESETS["deepseek-v3"][1])
    models = [("DeepSeek-V3, MLA (latent 512 + RoPE key 64)", v3),
              ("same shape, GQA 8 x 128", standard_attention(v3, 8, 128)),
              ("same shape, MHA 128 x 128", standard_attention(v3, 128, 128))]
    rows = []
    for name, cfg in models:
        for kv_dtype in ("bfloat16", "float8_e4m3fn"):
            mm = ledger.ModelMemory(cfg, "bfloat16", kv_dtype)
            tp8 = mm.stage_kv_bytes_per_token(ledger.Layout(tp=8), 0)
            fit80 = requests_that_fit(mm, 8, 80 * GB, kv_dtype)
            fit141 = requests_that_fit(mm, 8, 141 * GB, kv_dtype)
            rows.append([name, "bf16" if kv_dtype == "bfloat16" else "fp8 + scale", mm.kv_bytes_per_token,
                         f"{mm.kv_bytes_per_token * REQUEST_TOKENS / 2**30:.2f}", tp8,
                         f"{fit80[0]} ({fit80[1]})", f"{fit141[0]} ({fit141[1]})", f"{mm.weight_bytes / GB:.0f}"])
    table("KV cache per token from the ledger (61 layers; weights block-fp8 as V3 ships them, activations bf16)",
          ["model", "KV", "KV B/token", "GiB per 32k request", "B/token per device at tp=8",
           "32k requests on 8 x 80 GB (best layout)", "on 8 x 141 GB", "weights GB"], rows)


def _decode_models(workdir: str, quick: bool) -> dict[str, str]:
    """Three random-weight models of one shape (4 layers, hidden 1024, 16 query heads, dense MLP 2816, vocab 32000):
    MLA (latent 256 + RoPE key 32: a 288-value row), GQA (4 KV heads x 64) and MHA (16 x 64)."""
    layers = 2 if quick else 4
    common = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                  num_attention_heads=16, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    mla = dict(common, num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=None, qk_rope_head_dim=32,
               qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=layers, n_routed_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=64)
    out = {"MLA": hf_checkpoint(os.path.join(workdir, f"mla-decode-{layers}"), "DeepseekV2", mla, "bfloat16")}
    for name, kv in (("GQA", 4), ("MHA", 16)):
        out[name] = hf_checkpoint(os.path.join(workdir, f"{name.lower()}-decode-{layers}"), "Llama",
                                  dict(common, num_key_value_heads=kv), "bfloat16")
    return out


def decode_part(quick: bool, repeats: int) -> None:
    import jax

    from serving.bench.harness import decode_step_bytes
    from serving.core.batch import SeqChunk
    from serving.core.config import EngineConfig
    from serving.core.engine import Engine
    batch, context, page = 16, (512 if quick else 4096), 16
    bandwidth = read_bandwidth()
    rows = []
    for name, path in _decode_models(_WORKDIR.value, quick).items():
        pages_per_seq = context // page + 1
        engine = Engine(EngineConfig(model=path, dtype="bfloat16", page_size=page, num_pages=batch * pages_per_seq,
                                     max_num_seqs=batch, max_num_batched_tokens=batch, min_token_bucket=batch,
                                     max_model_len=context + page, enable_prefix_caching=False,
                                     compilation_cache_dir=""))
        runner = engine.runner
        # A decode token per sequence at position `context` over a full cache (its values do not change the work).
        chunks = [SeqChunk([7], context, list(range(i * pages_per_seq, (i + 1) * pages_per_seq)))
                  for i in range(batch)]
        step = runner.step_batch(chunks, batch, batch)
        seconds = median_time(lambda: jax.block_until_ready(runner.run_forward(step)), repeats)
        kv = sum(spec.bytes_per_token for spec in runner.kv_cache_specs) * batch * (context + 1)
        weights = decode_step_bytes(engine, batch)
        mc = engine.model_config
        if mc.is_mla:  # absorbed: per head and context token, scores over the row and values of the latent
            flops = 2 * (mc.kv_lora_rank + mc.qk_rope_head_dim + mc.kv_lora_rank) * mc.num_heads
        else:
            flops = 4 * mc.head_dim * mc.num_heads
        flops *= batch * (context + 1) * mc.num_layers
        rows.append([name, runner.kv_cache_specs[0].describe(), f"{kv / 1e6:.0f}", f"{weights / 1e6:.0f}",
                     f"{(kv + weights) / bandwidth * 1e3:.1f}", f"{seconds * 1e3:.1f}",
                     f"{(kv + weights) / bandwidth / seconds:.0%}", f"{flops / 1e9:.2f}",
                     f"{flops / seconds / 1e9:.1f}"])
        del engine, runner
    table(f"Decode step, batch {batch} at context {context}, bfloat16, {cpu_path()}; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s",
          ["model", "KV per token per layer", "KV MB read", "weights MB read", "roofline ms", "step ms",
           "of roofline", "attention GFLOP", "attention GFLOP/s"], rows)


def expanded_prefill(queries_nope, q_pe, latent, k_pe, w_kvb, *, sm_scale, value_dim):
    """Pure. Prefill of one chunk with K/V expanded from the latent (the alternative to the absorbed form): per head
    K = [W_UK^T c, k_pe], V = W_UV^T c for the whole context, then causal attention of the chunk's last rows."""
    import jax
    import jax.numpy as jnp
    dn = queries_nope.shape[-1]
    k_nope = jnp.einsum("lr,rhn->lhn", latent, w_kvb[..., :dn], preferred_element_type=jnp.float32)
    v = jnp.einsum("lr,rhv->lhv", latent, w_kvb[..., dn:], preferred_element_type=jnp.float32)
    scores = (jnp.einsum("thn,lhn->htl", queries_nope.astype(jnp.float32), k_nope)
              + jnp.einsum("thr,lr->htl", q_pe.astype(jnp.float32), k_pe.astype(jnp.float32))) * sm_scale
    t, l = queries_nope.shape[0], latent.shape[0]
    mask = jnp.arange(l)[None, :] <= (l - t + jnp.arange(t))[:, None]
    p = jax.nn.softmax(jnp.where(mask[None], scores, -1e30), axis=-1)
    return jnp.einsum("htl,lhv->thv", p, v).astype(queries_nope.dtype)


def prefill_part(quick: bool, repeats: int) -> None:
    """One sequence's prefill chunk of C tokens after `context` cached ones, DeepSeek-V2-Lite's attention shape (16
    heads, latent 512 + RoPE 64, nope 128, value 128): the absorbed form (queries into the latent space, the latent
    kernel, outputs out of it) against K/V expanded from the latent for the whole context."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels
    from pallas_kernels.metadata import ragged_layout
    h, rank, rope, dn, dv, page = 16, 512, 64, 128, 128, 16
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    w_kvb = jnp.asarray(rng.standard_normal((rank, h, dn + dv)) * 0.05, dtype)
    rows = []
    cases = [(16, 0), (64, 0), (256, 0)] if quick else [(16, 0), (64, 0), (256, 0), (1024, 0), (64, 2048),
                                                        (256, 2048), (1024, 2048)]
    for chunk, context in cases:
        total = context + chunk
        pages = -(-total // page)
        latent = jnp.asarray(rng.standard_normal((total, rank + rope)), dtype)
        cache = jnp.zeros((pages, page, 1, rank + rope), dtype).reshape(pages * page, 1, rank + rope)
        cache = cache.at[:total, 0].set(latent).reshape(pages, page, 1, rank + rope)
        a = ragged_layout([1] * chunk, np.array([context]), np.array([chunk]), np.arange(pages)[None],
                          np.array([pages]), page_size=page, num_tokens=chunk, num_seqs=1)
        q = jnp.asarray(rng.standard_normal((chunk, h, dn + rope)), dtype)

        @jax.jit
        def absorbed(q, cache, w_kvb):
            q_latent = jnp.einsum("thn,rhn->thr", q[..., :dn], w_kvb[..., :dn],
                                  preferred_element_type=jnp.float32).astype(dtype)
            out = pallas_kernels.ragged_paged_latent_attention(
                jnp.concatenate([q_latent, q[..., dn:]], -1), cache, a["kv_lens"], a["page_indices"],
                a["cu_q_lens"], a["num_seqs"], sm_scale=0.07, value_dim=rank)
            return jnp.einsum("thr,rhv->thv", out, w_kvb[..., dn:], preferred_element_type=jnp.float32)

        @jax.jit
        def expanded(q, latent, w_kvb):
            return expanded_prefill(q[..., :dn], q[..., dn:], latent[:, :rank], latent[:, rank:], w_kvb,
                                    sm_scale=0.07, value_dim=dv)

        t_abs = median_time(lambda: jax.block_until_ready(absorbed(q, cache, w_kvb)), repeats)
        t_exp = median_time(lambda: jax.block_until_ready(expanded(q, latent, w_kvb)), repeats)
        rows.append([chunk, context, f"{t_abs * 1e3:.2f}", f"{t_exp * 1e3:.2f}", f"{t_exp / t_abs:.2f}"])
    table(f"Prefill chunk of one sequence, absorbed (latent kernel) vs K/V expanded from the latent; 16 heads, "
          f"latent 512 + 64, bfloat16, {cpu_path()}",
          ["chunk tokens", "cached before", "absorbed ms", "expanded ms", "expanded / absorbed"], rows)


def main() -> None:
    only = set(_ONLY.value) or {"ledger", "decode", "prefill"}
    unknown = only - {"ledger", "decode", "prefill"}
    if unknown:
        raise SystemExit(f"--only: unknown parts {sorted(unknown)} (ledger, decode, prefill)")
    quick, repeats = _QUICK.value, (2 if _QUICK.value else _REPEATS.value)
    if "ledger" in only:
        ledger_part()
    if "decode" in only:
        decode_part(quick, repeats)
    if "prefill" in only:
        prefill_part(quick, repeats)
