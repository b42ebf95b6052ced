"""Decoder-only transformer (Llama, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen2/3-MoE) in Flax NNX.

The forward takes a RaggedBatch (prefill chunks and decode tokens mixed) and the per-layer paged KV cache, and
returns the hidden states of every token plus the updated cache. Every parameter carries its logical axes in
the `axes` metadata (names from `sharding.axes`), so sharding only adds rules. Layers are kept as a list of
per-layer arrays (slicing a stacked [L, ...] array copies it every step on CPU).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from pallas_kernels import native
from models.batch import RaggedBatch
from models.config import ModelConfig
from models.rope import apply_rope, inverse_frequencies
from sharding.axes import EMBED, EXPERT, HEAD_DIM, HEADS, KV_HEADS, MLP as MLP_AXIS, VOCAB


def matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """Pure. `x[..., K] @ w[K, N]` accumulated in float32, returned in `out_dtype` (default x's). On CPU the
    native kernel (`pallas_kernels.native`) runs it where it can; otherwise XLA, asked for bf16 x bf16 -> f32
    (its fast AMX/YNNPACK path, ~4x faster than its bf16 -> bf16 dot)."""
    out_dtype = out_dtype or x.dtype
    if native.is_packed(w):  # panels packed at load (`pack_native_weights`)
        if native.packed_supported(x, w, out_dtype):
            return native.matmul_packed(x, w, out_dtype)
        w = native.unpack_weight(w, x.shape[-1])
    if native.matmul_supported(x, w, out_dtype):
        return native.matmul(x, w, out_dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def dense_weight(param: nnx.Param, rows: int) -> jax.Array:
    """A matmul weight as `matmul` takes it: [rows, -1], or its packed panels as they are."""
    w = param[...]
    return w if native.is_packed(w) else w.reshape(rows, -1)


def pack_native_weights(model: "CausalLM") -> int:
    """Repacks the dense matmul weights into the native CPU kernel's panel layout, in place, and returns how many
    packed matrices there are now. For single-device CPU serving with the native kernels on
    (`pallas_kernels.native.enabled()`): the kernels then stream each weight sequentially. Weights that read the
    same input are fused into one matrix first (q|k|v -> `qkv_proj`, gate|up -> `gate_up_proj`): fewer, larger
    kernel calls, each with a fixed cost. The attention output, down projection and an untied LM head are
    packed alone; MoE experts, the embedding table and weights whose N is not whole panels stay as they are."""
    cfg = model.config
    e, d = cfg.hidden_size, cfg.head_dim
    groups = []  # (owner, fused attribute or None, [param names], rows)
    for layer in model.layers:
        a = layer.self_attn
        groups += [(a, "qkv_proj", ["q_proj", "k_proj", "v_proj"], e), (a, None, ["o_proj"], cfg.num_heads * d)]
        mlps = [layer.mlp] if isinstance(layer.mlp, MLP) else \
            ([layer.mlp.shared_expert] if getattr(layer.mlp, "has_shared", False) else [])
        for m in mlps:
            groups += [(m, "gate_up_proj", ["gate_proj", "up_proj"], e), (m, None, ["down_proj"], m.down_proj.shape[0])]
    if not cfg.tie_word_embeddings:
        groups.append((model, None, ["lm_head"], e))
    todo = []  # (owner, attribute to set, names it replaces, [K, N_i] blocks packed as one)
    for owner, fused, names, rows in groups:
        ws = [getattr(owner, n) for n in names]
        if any(w is None or native.is_packed(w[...]) for w in ws):
            continue
        mats = [w[...].reshape(rows, -1) for w in ws]
        whole = jax.ShapeDtypeStruct((rows, sum(m.shape[1] for m in mats)), mats[0].dtype)
        if fused and native.can_pack(whole):
            todo.append((owner, fused, names, mats))
            continue
        todo += [(owner, n, [n], [m]) for n, m in zip(names, mats) if native.can_pack(m)]
    for (owner, attr, names, _), packed in zip(todo, native.pack_weights([w for *_, w in todo])):
        for n in names:
            if n != attr:
                setattr(owner, n, None)
        if attr in names:
            getattr(owner, attr).set_value(packed)
        else:
            setattr(owner, attr, nnx.Param(packed))
    return len(todo)


class HeadScreen(nnx.Variable):
    """The int8 screen of the LM head for greedy steps (`add_head_screen`); not a parameter: serving-only."""


# Most logits rows a step may have for the screened greedy head: from ~4 rows the int8 pass costs about what the
# full-precision head read does (it converts and multiplies per row), so wider steps use the plain head.
SCREEN_MAX_ROWS = 4


def head_screen_bytes(cfg: ModelConfig) -> int:
    """Memory the LM head's int8 screen takes (`add_head_screen`): q [vocab, hidden rounded up to 64] int8 and two
    float32 per vocabulary row."""
    return cfg.vocab_size * (native.screen_width(cfg.hidden_size) + 8)


def add_head_screen(model: "CausalLM") -> bool:
    """Builds the int8 screen of the model's LM head (`pallas_kernels.native.greedy_head_screen`) for the native
    CPU kernels' greedy head: a greedy step then reads a quarter (bf16) or an eighth (f32) of the head's bytes and
    gets the same tokens. Returns whether it did (it needs the kernels and a float32 or bfloat16 head). Call it
    before `pack_native_weights`: it reads the head as loaded."""
    head = model.embed_tokens[...] if model.config.tie_word_embeddings else model.lm_head[...]
    if not native.enabled() or jnp.dtype(head.dtype) not in native.PANELS or native.is_packed(head):
        return False
    # [N, K]: the tied table as it is, an untied [K, N] head as a transposed view (converted a block of rows at a
    # time by the screen)
    head_nk = np.asarray(head) if model.config.tie_word_embeddings else np.asarray(head).T
    q, bounds = native.greedy_head_screen(head_nk)
    model.head_screen = HeadScreen(jnp.asarray(q))
    model.head_screen_bounds = HeadScreen(jnp.asarray(bounds))
    return True


def embed_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Pure. `table[ids]`. A 16-bit float table is gathered as uint16 bits: XLA:CPU otherwise fuses a convert of
    the whole table to f32 into the gather (98 MB written per step for a 32k x 768 bf16 table)."""
    if jnp.issubdtype(table.dtype, jnp.floating) and table.dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(table, jnp.uint16)[ids]
        return jax.lax.bitcast_convert_type(bits, table.dtype)
    return table[ids]


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale=0.02) -> nnx.Param:
    value = (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype)
    return nnx.Param(value, axes=axes)


def _ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), axes=axes)


def _zeros(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis_name: str, dtype):
        self.weight = _ones((dim,), (axis_name,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * xf).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _param(rngs, (e, hq, d), (EMBED, HEADS, HEAD_DIM), dtype)
        self.k_proj = _param(rngs, (e, hkv, d), (EMBED, KV_HEADS, HEAD_DIM), dtype)
        self.v_proj = _param(rngs, (e, hkv, d), (EMBED, KV_HEADS, HEAD_DIM), dtype)
        self.o_proj = _param(rngs, (hq, d, e), (HEADS, HEAD_DIM, EMBED), dtype)
        if cfg.qkv_bias:
            self.q_bias = _zeros((hq, d), (HEADS, HEAD_DIM), dtype)
            self.k_bias = _zeros((hkv, d), (KV_HEADS, HEAD_DIM), dtype)
            self.v_bias = _zeros((hkv, d), (KV_HEADS, HEAD_DIM), dtype)
        if cfg.o_bias:
            self.o_bias = _zeros((e,), (EMBED,), dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, HEAD_DIM, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, HEAD_DIM, dtype)
        self.qkv_bias, self.o_bias_on, self.qk_norm = cfg.qkv_bias, cfg.o_bias, cfg.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.qkv_proj = nnx.data(None)  # q|k|v fused and packed by `pack_native_weights` (then q/k/v_proj are None)
        self.sm_scale = 1.0 / math.sqrt(d)
        self.sliding_window = cfg.sliding_windows[layer]
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(cfg.rope, d))

    def __call__(self, x, positions, kv_pages, batch: RaggedBatch):
        t, e = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = matmul(x, self.qkv_proj[...])
            q = qkv[:, :hq * d].reshape(t, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
            v = qkv[:, (hq + hkv) * d:(hq + 2 * hkv) * d].reshape(t, hkv, d)
        else:
            q = matmul(x, dense_weight(self.q_proj, e)).reshape(t, hq, d)
            k = matmul(x, dense_weight(self.k_proj, e)).reshape(t, hkv, d)
            v = matmul(x, dense_weight(self.v_proj, e)).reshape(t, hkv, d)
        if self.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.inv_freq)
        k = apply_rope(k, positions, self.inv_freq)
        out, kv_pages = paged_attention(q, k, v, kv_pages, batch.attention, sm_scale=self.sm_scale,
                                        sliding_window=self.sliding_window)
        # As one 2-D matmul: the einsum made XLA copy o_proj into (d, h) order every step.
        y = matmul(out.reshape(t, -1), dense_weight(self.o_proj, hq * d))
        if self.o_bias_on:
            y = y + self.o_bias[...]
        return y, kv_pages


def paged_attention(q, k, v, kv_pages, md, *, sm_scale, sliding_window):
    """Pure. Writes this step's K/V into the pages, then attends. Under a mesh with a 'tensor' axis it runs per
    shard (heads are independent): q heads split over 'tensor'; KV heads split too when the degree divides
    them, else replicated, each shard reading only the KV heads its q heads use."""
    tp = tensor_parallel_size()
    hq, hkv = q.shape[1], k.shape[1]

    def local(q, k, v, kv_pages, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs):
        kv_pages = pallas_kernels.write_kv(kv_pages, k, v, slot_mapping)
        view = kv_pages
        if tp > 1 and k.shape[1] == hkv:  # KV replicated: slice the heads these q heads read
            group = hq // hkv
            hq_local = q.shape[1]
            first = jax.lax.axis_index("tensor") * hq_local // group
            view = jax.lax.dynamic_slice_in_dim(kv_pages, 2 * first, 2 * max(1, hq_local // group), axis=2)
        out = pallas_kernels.ragged_paged_attention(q, view, kv_lens, page_indices, cu_q_lens, num_seqs,
                                                    sm_scale=sm_scale, sliding_window=sliding_window)
        return out, kv_pages

    args = (q, k, v, kv_pages, md.slot_mapping, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    if tp == 1:
        return local(*args)
    if hq % tp:
        raise ValueError(f"tensor parallelism {tp} does not divide the {hq} attention heads")
    P = jax.sharding.PartitionSpec
    heads = P(None, "tensor", None)
    kv_heads = heads if hkv % tp == 0 else P()
    pages = P(None, None, "tensor", None) if hkv % tp == 0 else P()
    return jax.shard_map(local, in_specs=(heads, kv_heads, kv_heads, pages, P(), P(), P(), P(), P()),
                         out_specs=(heads, pages), check_vma=False)(*args)


def mesh_axis_size(axis: str) -> int:
    """Trace-time. Size of `axis` in the mesh in context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    return mesh.shape[axis]


def tensor_parallel_size() -> int:
    return mesh_axis_size("tensor")


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = _param(rngs, (hidden, intermediate), (EMBED, MLP_AXIS), dtype)
        self.up_proj = _param(rngs, (hidden, intermediate), (EMBED, MLP_AXIS), dtype)
        self.down_proj = _param(rngs, (intermediate, hidden), (MLP_AXIS, EMBED), dtype)
        self.intermediate = intermediate
        self.gate_up_proj = nnx.data(None)  # gate|up fused and packed by `pack_native_weights` (then gate/up_proj are None)

    def __call__(self, x):
        if self.gate_up_proj is not None:
            gu = matmul(x, self.gate_up_proj[...])
            h = jax.nn.silu(gu[:, :self.intermediate]) * gu[:, self.intermediate:]
        else:
            h = jax.nn.silu(matmul(x, self.gate_proj[...])) * matmul(x, self.up_proj[...])
        return matmul(h, self.down_proj[...])


class ExpertMap(nnx.Variable):
    """Non-trainable routing state: which physical slots hold each logical expert (see sharding.experts)."""


class ExpertCounts(nnx.Intermediate):
    """Tokens routed to each physical expert slot in the last forward (exported as expert load)."""


class MoE(nnx.Module):
    """Top-k routed experts (softmax over all experts, then top-k, optionally renormalised), plus an optional
    sigmoid-gated shared expert (Qwen2-MoE).

    Expert weights are stored per physical slot ([num_slots, ...], num_slots >= num_experts; the extra slots
    hold replicas of hot experts). Tokens are dispatched: each (token, expert) pair is sorted by slot and run
    through grouped matmuls (`ragged_dot`), so a token costs k experts, not all of them. Under a mesh the slots
    are split over 'expert' (and the expert MLP over 'tensor'); each device computes the pairs routed to its
    slots and the partial outputs are summed across devices.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, num_slots: int | None = None):
        e, n, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        slots = num_slots or n
        self.router = _param(rngs, (e, n), (EMBED, None), dtype)
        self.gate_proj = _param(rngs, (slots, e, i), (EXPERT, EMBED, MLP_AXIS), dtype)
        self.up_proj = _param(rngs, (slots, e, i), (EXPERT, EMBED, MLP_AXIS), dtype)
        self.down_proj = _param(rngs, (slots, i, e), (EXPERT, MLP_AXIS, EMBED), dtype)
        table = np.zeros((n, max(1, slots - n + 1)), np.int32)
        table[:, 0] = np.arange(n)
        self.replica_slots = ExpertMap(jnp.asarray(table))
        self.replica_count = ExpertMap(jnp.ones((n,), jnp.int32))
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(e, cfg.shared_expert_intermediate_size, dtype, rngs)
            self.shared_expert_gate = _param(rngs, (e, 1), (EMBED, None), dtype)

    def routing(self, x) -> tuple[jax.Array, jax.Array]:
        """Pure. Per token: the top-k expert ids [T, k] and their combine weights [T, k] (float32)."""
        logits = (x @ self.router[...]).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return experts, weights

    def __call__(self, x, valid=None):
        """`valid[T]` marks real tokens; padding tokens are neither computed nor counted."""
        experts, weights = self.routing(x)
        t, k = experts.shape
        num_slots = self.gate_proj.shape[0]
        # A replicated expert's tokens are split over its replicas, round robin over the token index.
        token = jnp.arange(t, dtype=jnp.int32)[:, None]
        replica = token % self.replica_count[...][experts]
        slots = self.replica_slots[...][experts, replica]  # [T, k]
        if valid is not None:
            slots = jnp.where(valid[:, None], slots, -1)
        counted = jnp.where(slots < 0, num_slots, slots).reshape(-1)  # padding -> out of range (negative wraps)
        self.sow(ExpertCounts, "counts", jnp.zeros((num_slots,), jnp.int32).at[counted].add(1, mode="drop"))
        y = expert_mlp(x, slots, weights.astype(x.dtype), self.gate_proj[...], self.up_proj[...],
                       self.down_proj[...])
        if self.has_shared:
            gate = jax.nn.sigmoid(x @ self.shared_expert_gate[...])
            y = y + gate * self.shared_expert(x)
        return y


def expert_mlp(x, slots, weights, gate, up, down):
    """Pure. sum_k weights[t, k] * SwiGLU_{slots[t, k]}(x[t]), dispatched by slot; sharded over the mesh's
    'expert' (slots) and 'tensor' (expert MLP columns) axes when present."""
    axes = [a for a in ("expert", "tensor") if mesh_axis_size(a) > 1]
    t, k = slots.shape

    def local(x, slots, weights, gate, up, down):
        n_local = gate.shape[0]
        first = jax.lax.axis_index("expert") * n_local if "expert" in axes else 0
        flat = slots.reshape(-1) - first
        mine = (flat >= 0) & (flat < n_local) & (slots.reshape(-1) >= 0)
        key = jnp.where(mine, flat, n_local)  # pairs for other devices' slots sort last and are not computed
        order = jnp.argsort(key, stable=True)
        group_sizes = jnp.zeros((n_local + 1,), jnp.int32).at[key].add(1)[:n_local]
        token = order // k
        xs = x[token]
        h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, group_sizes)) * jax.lax.ragged_dot(xs, up, group_sizes)
        out = jax.lax.ragged_dot(h, down, group_sizes)
        w = jnp.where(mine[order], weights.reshape(-1)[order], 0).astype(out.dtype)
        y = jnp.zeros_like(x).at[token].add(out * w[:, None])
        return jax.lax.psum(y, tuple(axes)) if axes else y

    if not axes:
        return local(x, slots, weights, gate, up, down)
    P = jax.sharding.PartitionSpec
    e = "expert" if "expert" in axes else None
    m = "tensor" if "tensor" in axes else None
    return jax.shard_map(local, in_specs=(P(), P(), P(), P(e, None, m), P(e, None, m), P(e, m, None)),
                         out_specs=P(), check_vma=False)(x, slots, weights, gate, up, down)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, EMBED, dtype)
        self.self_attn = Attention(cfg, layer, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, EMBED, dtype)
        if cfg.moe_layers[layer]:
            self.mlp = MoE(cfg, dtype, rngs, num_slots=cfg.num_expert_slots)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)

    def __call__(self, x, positions, kv_pages, batch):
        h, kv_pages = self.self_attn(self.input_layernorm(x), positions, kv_pages, batch)
        x = x + h
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            md = batch.attention
            valid = jnp.arange(x.shape[0]) < md.cu_q_lens[md.num_seqs[0]]
            x = x + self.mlp(h, valid)
        else:
            x = x + self.mlp(h)
        return x, kv_pages


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.config = cfg
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), (VOCAB, EMBED), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, EMBED, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), (EMBED, VOCAB), dtype)
        self.head_screen = nnx.data(None)  # int8 screen of the head, set by `add_head_screen` (serving, CPU)
        self.head_screen_bounds = nnx.data(None)

    def __call__(self, batch: RaggedBatch, kv_caches: list[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
        """Pure given the module state. Returns final-normed hidden states [T, E] and the updated caches."""
        x = embed_lookup(self.embed_tokens[...], batch.input_ids)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches):
            x, kv = layer(x, batch.positions, kv, batch)
            new_caches.append(kv)
        return self.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Pure. Float32 logits [N, vocab] of hidden states [N, E]."""
        if self.config.tie_word_embeddings:  # [V, E] used transposed: XLA's dot reads it in place
            return jnp.dot(hidden, self.embed_tokens[...].T, preferred_element_type=jnp.float32)
        return matmul(hidden, self.lm_head[...], jnp.float32)

    def screened_greedy(self, hidden: jax.Array, num_rows: jax.Array) -> jax.Array | None:
        """Pure. int32 [N]: the argmax of each row's logits (lowest id on ties) for the first `num_rows[0]` rows of
        hidden states [N, E] (the rest 0), from the head's int8 screen (`add_head_screen`); None where it cannot
        run (no screen, more than SCREEN_MAX_ROWS rows, or the native kernels unavailable in this trace)."""
        if self.head_screen is None or hidden.shape[0] > SCREEN_MAX_ROWS:
            return None
        if self.config.tie_word_embeddings:
            w, layout = self.embed_tokens[...], "nk"
        else:
            w = self.lm_head[...]
            layout = "packed" if native.is_packed(w) else "kn"
        if not native.greedy_head_supported(hidden, w):
            return None
        tokens, _ = native.greedy_head(hidden, self.head_screen[...], self.head_screen_bounds[...], w, num_rows,
                                       layout=layout)
        return tokens


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
    """Shape of one layer's KV pages: K and V interleaved on the head axis."""
    return (num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)


def init_kv_caches(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32,
                   sharding=None) -> list[jax.Array]:
    """One zeroed KV buffer per layer, in the storage dtype the attention backend wants for `dtype`
    (`pallas_kernels.kv_storage_dtype`: uint16 bits for 16-bit floats on CPU)."""
    shape = kv_cache_shape(cfg, num_pages, page_size)
    dtype = pallas_kernels.kv_storage_dtype(dtype)
    # Committed to a device from the start, so the step's output caches match its inputs (one compile).
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return [jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.num_layers)]
