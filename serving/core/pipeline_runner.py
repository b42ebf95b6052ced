"""`PipelineModelRunner`: the ModelRunner with its decoder layers split into stages over the mesh's pipeline axis,
each step's tokens flowing through them as micro-batches (the Engine takes one when config.pp > 1).
Details: docs/engine.md."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.batch import RaggedBatch
from models.layers import embed_lookup
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

    def __init__(self, config: EngineConfig, *, model=None, mesh=None):
        pp = config.pp
        self.num_micro = config.micro_batches or pp
        if config.ep > 1 or config.dp > 1:
            raise ValueError("pipeline parallelism combines with tensor parallelism only (pp x tp)")
        mesh = mesh or serving_mesh(pp=pp, tp=config.tp)
        smallest = config.platform_choices().min_token_bucket
        if smallest < self.num_micro:  # a smaller bucket would pad to the same micro-batch height of 1 token
            config = dataclasses.replace(config, min_token_bucket=self.num_micro)
        super().__init__(config, model=model, mesh=mesh)
        mc = self.model_config
        if mc.is_moe:
            raise ValueError("pipeline parallelism is not implemented for MoE models; use ep (and tp)")
        self.stages = pipeline.stage_layers(mc.num_layers, pp)
        model = nnx.merge(self.graphdef, self.state)
        layer_graphdefs = {str(nnx.split(layer)[0]) for layer in model.layers}
        if len(layer_graphdefs) != 1:
            raise ValueError("pipeline parallelism needs identical layers (e.g. no per-layer sliding windows)")
        self.layer_graphdef = nnx.split(model.layers[0])[0]
        self.norm_graphdef = nnx.split(model.norm)[0]
        layer_states = [nnx.split(layer)[1] for layer in model.layers]
        self.state = {"outer": {"embed": model.embed_tokens.get_value(), "norm": nnx.split(model.norm)[1],
                                "lm_head": None if mc.tie_word_embeddings else model.lm_head.get_value()},
                      "slots": pipeline.stack_stage_slots(layer_states, self.stages, mesh)}
        self.reset_kv_caches()
        self.bubble_fraction = pipeline.bubble_fraction(pp, self.num_micro)
        self._run = pipeline.pipelined(self._stage, self.stages, self.num_micro)
        del model

    def reset_kv_caches(self) -> None:
        """One cache per slot, the spec of the slot's layers with a leading [stages] axis over the pipeline's mesh
        axis (a short stage's padding slots too: the stacked buffer is even; serving.ledger counts them)."""
        if self.stages is None:  # called by ModelRunner.__init__, before the stages are known
            return
        specs = [self.kv_cache_specs[self.stages[0][j]] for j in range(pipeline.stage_slots(self.stages))]
        n, page_size = self.num_pages, self.config.page_size
        with tracing_for(self.platform):
            self.kv_caches = [spec.zeros(n, page_size, spec.sharding(self.mesh, n, stacked=True),
                                         leading=(len(self.stages),)) for spec in specs]

    def _stage(self, params, caches, x, md, valid, active):
        """Pure. This device's stage layers on one micro-batch; a padding slot (`active[j]` False) writes no KV
        and passes `x` through unchanged (whatever its zero weights compute is dropped by the select)."""
        new = []
        for j, (state, kv) in enumerate(zip(params, caches)):
            attention = AttentionMetadata(slot_mapping=jnp.where(valid & active[j], md["slot_mapping"], -1),
                                          kv_lens=md["kv_lens"], page_indices=md["page_indices"],
                                          cu_q_lens=md["cu_q_lens"], num_seqs=md["num_seqs"])
            batch = RaggedBatch(input_ids=md["positions"], positions=md["positions"], attention=attention,
                                logits_indices=md["kv_lens"])
            layer = nnx.merge(self.layer_graphdef, state)
            y, kv = layer(x, md["positions"], kv, batch)
            x = jnp.where(active[j], y, x)
            new.append(kv)
        return x, new

    @staticmethod
    def _input_ids(batch: dict):
        return batch["input_ids"]

    @staticmethod
    def _with_input_ids(batch: dict, input_ids) -> dict:
        return dict(batch, input_ids=input_ids)

    def _forward(self, state, kv_caches, arrays, expert_load, greedy_only):
        outer, micro = state["outer"], arrays["micro"]
        m, tm = micro["positions"].shape
        x = embed_lookup(outer["embed"], arrays["input_ids"])  # [T, E]: the bucket's rows
        x = jnp.pad(x, ((0, m * tm - x.shape[0]), (0, 0))).reshape(m, tm, -1)  # the last micro-batch's padding
        y, kv_caches = self._run(state["slots"], kv_caches, x, {k: micro[k] for k in _MD_FIELDS})
        hidden = nnx.merge(self.norm_graphdef, outer["norm"])(y.reshape(m * tm, -1))[arrays["logits_indices"]]
        head = outer["embed"].T if outer["lm_head"] is None else outer["lm_head"]
        return jnp.dot(hidden, head, preferred_element_type=jnp.float32), None, kv_caches, expert_load

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
