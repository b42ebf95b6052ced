"""RaggedBatch: the input of one forward step, a pytree.

One step runs `T` tokens from `S` sequences (prefill chunks and decode tokens mixed), padded to bucket sizes so
the number of compiled programs stays bounded; `serving.core.batch` builds its arrays.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_kernels.metadata import AttentionMetadata


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["input_ids", "positions", "attention", "logits_indices", "lora_slots"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attention: AttentionMetadata
    logits_indices: jax.Array  # [S] int32: index in T of each sequence's last token this step
    # [T] int32: each token's LoRA adapter slot (-1: the base model, and padding); None when no token of the step
    # has an adapter (the step then runs the program without LoRA, whose cost is nil)
    lora_slots: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seq_slots(self) -> int:
        return self.logits_indices.shape[0]

    @classmethod
    def from_layout(cls, a: dict) -> "RaggedBatch":
        """A ragged batch's arrays (`pallas_kernels.metadata.ragged_layout`; numpy or device arrays) as a
        RaggedBatch."""
        return cls(input_ids=a["input_ids"], positions=a["positions"], logits_indices=a["logits_indices"],
                   lora_slots=a.get("lora_slots"),
                   attention=AttentionMetadata(slot_mapping=a["slot_mapping"], kv_lens=a["kv_lens"],
                                               page_indices=a["page_indices"], cu_q_lens=a["cu_q_lens"],
                                               num_seqs=a["num_seqs"]))
