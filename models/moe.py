"""Mixture of experts: top-k routing, expert weights per physical slot (replicas of hot experts in the extra slots,
see `sharding.experts`), tokens dispatched to grouped matmuls, split over the mesh's expert and tensor axes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import DEEPSEEK_FAMILIES, ModelConfig
from models.layers import MLP, linear_param, param, zeros
from models.quant import scale_name
from pallas_kernels.moe import grouped_expert_mlp
from sharding.axes import EMBED, EXPERT, MLP as MLP_AXIS
from sharding.mesh import axis_size, mesh_axis


class ExpertMap(nnx.Variable):
    """Non-trainable routing state: which physical slots hold each logical expert (see sharding.experts)."""


class ExpertCounts(nnx.Intermediate):
    """Tokens routed to each physical expert slot in the last forward (exported as expert load)."""


class MoE(nnx.Module):
    """Top-k routed experts (softmax over all experts, then top-k, optionally renormalised), plus an optional
    shared expert, sigmoid-gated (Qwen2-MoE) or not (DeepSeek's shared experts). DeepSeek's routing (`routing`):
    experts in `n_group` groups of which the best `topk_group` are eligible (V2's group_limited_greedy: a group by
    its best score; V3's noaux_tc: sigmoid scores plus a learned per-expert correction bias that only chooses, a group
    by its top-2 sum), the routed weights scaled by `routed_scaling_factor`; the router in float32, as HF keeps it.

    Expert weights are stored per physical slot ([num_slots, ...], num_slots >= num_experts; the extra slots
    hold replicas of hot experts). Tokens are dispatched by slot to grouped matmuls
    (`pallas_kernels.moe.grouped_expert_mlp`: the native CPU kernel, megablox on TPU, else `ragged_dot`), so a
    token costs k experts, not all of them, and an expert no token selected is not read. Under a mesh the slots
    are split over 'expert' (and the expert MLP over 'tensor'); each device computes the pairs routed to its
    slots and the partial outputs are summed across devices.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, num_slots: int | None = None):
        e, n, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        slots = num_slots or n
        deepseek = cfg.family in DEEPSEEK_FAMILIES
        self.router = param(rngs, (e, n), (EMBED, None), jnp.float32 if deepseek else dtype)
        self.scoring_func, self.topk_method = cfg.scoring_func, cfg.topk_method
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nnx.Param(jnp.zeros((n,), jnp.float32), axes=(None,))
        quant = cfg.weight_quant
        linear_param(self, "gate_proj", rngs, (slots, e, i), (EXPERT, EMBED, MLP_AXIS), dtype, (1,), quant)
        linear_param(self, "up_proj", rngs, (slots, e, i), (EXPERT, EMBED, MLP_AXIS), dtype, (1,), quant)
        linear_param(self, "down_proj", rngs, (slots, i, e), (EXPERT, MLP_AXIS, EMBED), dtype, (1,), quant)
        self.quant_group = quant.group if quant else 0
        self.router_bias_on, self.expert_bias_on = cfg.router_bias, cfg.expert_bias
        if cfg.router_bias:  # GPT-OSS: logits = x @ router + bias
            self.router_bias = zeros((n,), (None,), dtype)
        if cfg.expert_bias:  # GPT-OSS: each expert matmul with its bias
            self.gate_bias = zeros((slots, i), (EXPERT, MLP_AXIS), dtype)
            self.up_bias = zeros((slots, i), (EXPERT, MLP_AXIS), dtype)
            self.down_bias = zeros((slots, e), (EXPERT, EMBED), dtype)
        self.swiglu = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.swiglu_limit else None
        table = np.zeros((n, max(1, slots - n + 1)), np.int32)
        table[:, 0] = np.arange(n)
        self.replica_slots = ExpertMap(jnp.asarray(table))
        self.replica_count = ExpertMap(jnp.ones((n,), jnp.int32))
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        self.shared_gated = self.has_shared and cfg.shared_expert_gate
        if self.has_shared:
            self.shared_expert = MLP(e, cfg.shared_expert_intermediate_size, dtype, rngs, quant)
        if self.shared_gated:
            self.shared_expert_gate = param(rngs, (e, 1), (EMBED, None), dtype)

    def routing(self, x) -> tuple[jax.Array, jax.Array]:
        """Pure. Per token: the top-k expert ids [T, k] and their combine weights [T, k] (float32)."""
        router = self.router[...]
        if router.dtype == jnp.float32:
            logits = jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
        else:
            logits = (x @ router).astype(jnp.float32)
        if self.router_bias_on:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        if self.scoring_func == "sigmoid":
            scores = jax.nn.sigmoid(logits)
        else:
            scores = jax.nn.softmax(logits, axis=-1)
        if self.topk_method == "greedy":
            weights, experts = jax.lax.top_k(scores, self.top_k)
        else:
            experts, weights = self._grouped_top_k(scores)
        if self.norm_topk_prob:
            eps = 1e-20 if self.topk_method == "noaux_tc" else 0.0  # HF's V3 router adds it
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + eps)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return experts, weights

    def _grouped_top_k(self, scores) -> tuple[jax.Array, jax.Array]:
        """Pure. DeepSeek's group-limited top-k: only experts of the `topk_group` best of `n_group` groups are
        eligible. V2 (group_limited_greedy): a group's score is its best expert's, the others' scores become 0.
        V3 (noaux_tc): the correction bias is added for the choice only (weights are the unbiased scores), a group's
        score is the sum of its top two, the others' are excluded."""
        t, n = scores.shape
        choice = scores + self.e_score_correction_bias[...] if self.topk_method == "noaux_tc" else scores
        grouped = choice.reshape(t, self.n_group, n // self.n_group)
        if self.topk_method == "noaux_tc":
            group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, n // self.n_group))[0], axis=-1)
        else:
            group_scores = jnp.max(grouped, axis=-1)
        _, best = jax.lax.top_k(group_scores, self.topk_group)  # [T, topk_group]
        keep = jnp.zeros((t, self.n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
        keep = jnp.repeat(keep, n // self.n_group, axis=1)
        if self.topk_method == "noaux_tc":
            _, experts = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), self.top_k)
            return experts, jnp.take_along_axis(scores, experts, axis=-1)
        weights, experts = jax.lax.top_k(jnp.where(keep, scores, 0.0), self.top_k)
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
        scales = None
        if hasattr(self, scale_name("gate_proj")):
            scales = tuple(getattr(self, scale_name(n))[...] for n in ("gate_proj", "up_proj", "down_proj"))
        biases = tuple(getattr(self, n)[...] for n in ("gate_bias", "up_bias", "down_bias")) \
            if self.expert_bias_on else None
        y = expert_mlp(x, slots, weights.astype(x.dtype), self.gate_proj[...], self.up_proj[...],
                       self.down_proj[...], scales, self.quant_group, biases, self.swiglu)
        if self.shared_gated:
            gate = jax.nn.sigmoid(x @ self.shared_expert_gate[...])
            y = y + gate * self.shared_expert(x)
        elif self.has_shared:
            y = y + self.shared_expert(x)
        return y


def expert_mlp(x, slots, weights, gate, up, down, scales=None, group=0, biases=None, act=None):
    """Pure. sum_k weights[t, k] * SwiGLU_{slots[t, k]}(x[t]), dispatched by slot; sharded over the mesh axes the
    rules give EXPERT (slots) and MLP (expert MLP columns) when the mesh splits them. `scales`: the quantized
    weights' (gate, up, down) scales (models.quant; `group` K rows per scale, 0: per channel), or None. `biases`
    (gate, up, down) and `act` as `pallas_kernels.moe.grouped_expert_mlp` takes them (GPT-OSS)."""
    expert_axis = mesh_axis(EXPERT) if axis_size(EXPERT) > 1 else None
    mlp_axis = mesh_axis(MLP_AXIS) if axis_size(MLP_AXIS) > 1 else None
    axes = [a for a in (expert_axis, mlp_axis) if a is not None]

    def local(x, slots, weights, gate, up, down, scales, biases):
        # This device's slots [first, first + n_local): the others' pairs (and padding) become -1, no work here.
        n_local = gate.shape[0]
        first = jax.lax.axis_index(expert_axis) * n_local if expert_axis else 0
        mine = (slots >= first) & (slots < first + n_local)
        if scales is not None and group and mlp_axis:  # down's K groups: those of this device's MLP columns
            rows = down.shape[1]
            if rows % group:
                raise ValueError(f"tensor parallelism splits the expert MLP into {rows} columns per device, not "
                                 f"whole {group}-row quantization groups")
            g0 = jax.lax.axis_index(mlp_axis) * (rows // group)
            scales = scales[:2] + (jax.lax.dynamic_slice_in_dim(scales[2], g0, rows // group, axis=1),)
        if biases is not None and mlp_axis:  # the partial outputs are summed over 'tensor': down's bias added once
            first_shard = (jax.lax.axis_index(mlp_axis) == 0).astype(biases[2].dtype)
            biases = biases[:2] + (biases[2] * first_shard,)
        y = grouped_expert_mlp(x, jnp.where(mine, slots - first, -1), weights, gate, up, down, scales, group,
                               biases, act)
        return jax.lax.psum(y, tuple(axes)) if axes else y

    if not axes:
        return local(x, slots, weights, gate, up, down, scales, biases)
    P = jax.sharding.PartitionSpec
    e, m = expert_axis, mlp_axis
    scale_specs = None
    if scales is not None:  # per channel: gate/up [S, I], down [S, E]; group-wise: [S, G, I], [S, G, E]
        scale_specs = (P(e, m), P(e, m), P(e, None)) if not group else (P(e, None, m), P(e, None, m), P(e))
    bias_specs = None if biases is None else (P(e, m), P(e, m), P(e, None))
    return jax.shard_map(local, in_specs=(P(), P(), P(), P(e, None, m), P(e, None, m), P(e, m, None), scale_specs,
                                          bias_specs),
                         out_specs=P(), check_vma=False)(x, slots, weights, gate, up, down, scales, biases)
