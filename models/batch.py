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
    data_fields=["input_ids", "positions", "attention", "logits_indices", "lora_slots", "window_pages", "rope_long"],
    meta_fields=["windows"],
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
    # Hybrid KV cache (serving.core.hybrid_block_manager): per window pool, (slot_mapping [T], page_indices
    # [S, max_pages]) into the pages of the sliding-window layers of that window (`windows`, static); empty: every
    # layer reads `attention`'s pages
    window_pages: tuple = ()
    windows: tuple[int, ...] = ()
    # Longrope: [T] bool, the tokens whose sequence's K/V is rotated by the long factors (the engine's batches:
    # decided per sequence by its length, as HF does, `Request.rope_long`); None: decided in the step from each
    # sequence's KV length after it (models.rope.longrope_long_tokens)
    rope_long: jax.Array | None = None

    def attention_for(self, sliding_window: int | None) -> AttentionMetadata:
        """The metadata a layer of `sliding_window` (None: full attention) reads its pages by: its window pool's
        slots and page table when the batch carries them, else `attention`'s."""
        if sliding_window is None or sliding_window not in self.windows:
            return self.attention
        slot_mapping, page_indices = self.window_pages[self.windows.index(sliding_window)]
        return dataclasses.replace(self.attention, slot_mapping=slot_mapping, page_indices=page_indices)

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
        windows = tuple(a.get("windows", ()))
        return cls(input_ids=a["input_ids"], positions=a["positions"], logits_indices=a["logits_indices"],
                   lora_slots=a.get("lora_slots"), rope_long=a.get("rope_long"),
                   attention=AttentionMetadata(slot_mapping=a["slot_mapping"], kv_lens=a["kv_lens"],
                                               page_indices=a["page_indices"], cu_q_lens=a["cu_q_lens"],
                                               num_seqs=a["num_seqs"]),
                   window_pages=tuple((a[f"window_slot_mapping_{w}"], a[f"window_page_indices_{w}"]) for w in windows),
                   windows=windows)
