"""`PipelineModelRunner`: the ModelRunner with its decoder layers split into stages over the mesh's pipeline axis,
each step's tokens flowing through them as micro-batches (the Engine takes one when config.pp > 1); layers of several
kinds (dense and MoE, as DeepSeek's) on slots of their kind, MoE experts over the expert axis within each stage (pp x
ep x tp). Details: docs/engine.md."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.batch import RaggedBatch
from models.gemma3 import soft_cap
from models.moe import ExpertCounts, MoE
from models.transformer import embed_inputs
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.target import tracing_for
from serving.core.batch import build_layout, micro_batch_tokens, split_micro_batches
from serving.core.config import EngineConfig
from serving.core.model_runner import ModelRunner
from sharding import pipeline
from sharding.mesh import serving_mesh

_MD_FIELDS = ("positions", "slot_mapping", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")


class PipelineModelRunner(ModelRunner):
    stages: list[range] | None = None  # each stage's layers (set once the model is loaded)
    slot_plan: pipeline.SlotPlan | None = None  # the layer each stage runs in each slot

    def __init__(self, config: EngineConfig, *, model=None, mesh=None):
        pp = config.pp
        self.num_micro = config.micro_batches or pp
        if config.dp > 1:
            raise ValueError("pipeline parallelism combines with tensor and expert parallelism (pp x ep x tp), not "
                             "with data-parallel replicas in one engine")
        mesh = mesh or serving_mesh(pp=pp, tp=config.tp, ep=config.ep)
        smallest = config.platform_choices().min_token_bucket
        if smallest < self.num_micro:  # a smaller bucket would pad to the same micro-batch height of 1 token
            config = dataclasses.replace(config, min_token_bucket=self.num_micro)
        super().__init__(config, model=model, mesh=mesh)
        mc = self.model_config
        # The hybrid KV cache (window pools) is off under pp: a sliding-window layer holds every page, as a global one
        # does (its slots are its own kind: plan_slots), and reads its window from them; the caches must then only
        # agree in layout (a latent cache beside a full one would not)
        caches = sorted({f"{'latent' if s.attention == 'latent' else 'kv'} {s.page_row_shape} {s.dtype} "
                         f"{s.kv_cache_dtype}" for s in self.kv_cache_specs})
        if len(caches) > 1:
            raise ValueError(f"pipeline parallelism with layers of different KV cache layouts ({caches}) is not "
                             "implemented")
        self.stages = pipeline.stage_layers(mc.num_layers, pp)
        model = nnx.merge(self.graphdef, self.state)
        # A layer's kind is its structure (dense or MoE MLP, its attention's window): slots hold layers of one kind.
        split = [nnx.split(layer) for layer in model.layers]
        self.slot_plan = pipeline.plan_slots(self.stages, [str(graphdef) for graphdef, _ in split])
        self.slot_graphdefs = [split[self.slot_plan.slot_layer(j)][0] for j in range(self.slot_plan.num_slots)]
        self.slot_moe = [isinstance(model.layers[self.slot_plan.slot_layer(j)].mlp, MoE)
                         for j in range(self.slot_plan.num_slots)]
        self.norm_graphdef = nnx.split(model.norm)[0]
        self.state = {"outer": {"embed": model.embed_tokens.get_value(), "norm": nnx.split(model.norm)[1],
                                "lm_head": None if mc.tie_word_embeddings else model.lm_head.get_value()},
                      "slots": pipeline.stack_stage_slots([state for _, state in split], self.slot_plan, mesh)}
        self.reset_kv_caches()
        self.bubble_fraction = pipeline.bubble_fraction(pp, self.num_micro)
        self._expert_slots = (mc.num_expert_slots or mc.num_experts) if mc.is_moe else 0
        self._run = pipeline.pipelined(self._stage, self.slot_plan, self.num_micro, extra_out=self._expert_slots)
        # Each MoE layer's (stage, slot): where its expert token counts come out of the pipeline.
        self._moe_slot_of = [(s, row.index(i)) for i in self.moe_layer_indices()
                             for s, row in enumerate(self.slot_plan.slot_layers) if i in row]
        del model

    def reset_kv_caches(self) -> None:
        """One cache per slot, the spec of the slot's layers with a leading [stages] axis over the pipeline's mesh
        axis (a short stage's padding slots too: the stacked buffer is even; serving.ledger counts them)."""
        if self.slot_plan is None:  # called by ModelRunner.__init__, before the stages are known
            return
        specs = [self.kv_cache_specs[self.slot_plan.slot_layer(j)] for j in range(self.slot_plan.num_slots)]
        n, page_size = self.num_pages, self.config.page_size
        with tracing_for(self.platform):
            self.kv_caches = [spec.zeros(n, page_size, spec.sharding(self.mesh, n, stacked=True),
                                         leading=(len(self.stages),)) for spec in specs]

    def _stage(self, params, caches, x, md, valid, active):
        """Pure. This device's stage layers on one micro-batch; a padding slot (`active[j]` False) writes no KV
        and passes `x` through unchanged (whatever its zero weights compute is dropped by the select). Also each
        slot's expert token counts [slots, expert slots] (zero for dense and padding slots)."""
        new, counts = [], []
        for j, (state, kv) in enumerate(zip(params, caches)):
            attention = AttentionMetadata(slot_mapping=jnp.where(valid & active[j], md["slot_mapping"], -1),
                                          kv_lens=md["kv_lens"], page_indices=md["page_indices"],
                                          cu_q_lens=md["cu_q_lens"], num_seqs=md["num_seqs"])
            batch = RaggedBatch(input_ids=md["positions"], positions=md["positions"], attention=attention,
                                logits_indices=md["kv_lens"])
            layer = nnx.merge(self.slot_graphdefs[j], state)
            if self.slot_moe[j]:  # the MoE layer sows its per-slot token counts
                (y, kv), sown = nnx.capture(layer, ExpertCounts)(x, md["positions"], kv, batch)
                counts.append(jnp.where(active[j], sown["mlp"]["counts"].get_value()[0], 0))
            else:
                y, kv = layer(x, md["positions"], kv, batch)
                counts.append(jnp.zeros((self._expert_slots,), jnp.int32))
            x = jnp.where(active[j], y, x)
            new.append(kv)
        return x, new, jnp.stack(counts) if self._expert_slots else None

    @staticmethod
    def _input_ids(batch: dict):
        return batch["input_ids"]

    @staticmethod
    def _with_input_ids(batch: dict, input_ids) -> dict:
        return dict(batch, input_ids=input_ids)

    def _forward(self, state, kv_caches, arrays, expert_load, greedy_only):
        outer, micro = state["outer"], arrays["micro"]
        m, tm = micro["positions"].shape
        x = embed_inputs(self.model_config, outer["embed"], arrays["input_ids"])  # [T, E]: the bucket's rows
        x = jnp.pad(x, ((0, m * tm - x.shape[0]), (0, 0))).reshape(m, tm, -1)  # the last micro-batch's padding
        y, kv_caches, counts = self._run(state["slots"], kv_caches, x, {k: micro[k] for k in _MD_FIELDS})
        if expert_load is not None:  # [stages, slots, expert slots] -> [MoE layers, expert slots]
            stage, slot = (jnp.asarray(a, jnp.int32) for a in zip(*self._moe_slot_of))
            expert_load = expert_load + counts[stage, slot]
        hidden = nnx.merge(self.norm_graphdef, outer["norm"])(y.reshape(m * tm, -1))[arrays["logits_indices"]]
        head = outer["embed"].T if outer["lm_head"] is None else outer["lm_head"]
        logits = soft_cap(jnp.dot(hidden, head, preferred_element_type=jnp.float32),
                          self.model_config.final_logit_softcapping)
        return logits, None, kv_caches, expert_load

    def rebalance_experts(self) -> dict[str, float]:
        raise ValueError("rebalance_experts is not implemented under pipeline parallelism (the expert weights are "
                         "stacked per stage slot); expert load is still counted (expert_load)")

    def step_batch(self, chunks, num_tokens: int, num_seqs: int) -> dict:
        """The whole step's input ids and logits rows (the bucket's), plus per-micro-batch metadata stacked on
        [M]. A bucket the micro-batch count does not divide gets M micro-batches of ceil(num_tokens / M) tokens, the
        last ones padded (the forward pads the activations likewise; padding writes no KV), so the token rows the
        engine sees, look-ahead sources included, stay the bucket's."""
        cfg = self.config
        full = build_layout(chunks, page_size=cfg.page_size, num_tokens=num_tokens, num_seqs=num_seqs,
                            max_pages=self.max_pages)
        tm = micro_batch_tokens(num_tokens, self.num_micro)
        sm = min(tm, cfg.max_num_seqs)
        parts = [build_layout(p, page_size=cfg.page_size, num_tokens=tm, num_seqs=sm, max_pages=self.max_pages)
                 for p in split_micro_batches(chunks, num_tokens, self.num_micro)]
        micro = {k: np.stack([p[k] for p in parts]) for k in _MD_FIELDS}
        return {"input_ids": full["input_ids"], "logits_indices": full["logits_indices"], "micro": micro}
