"""`pd_split`: the memory ledger's advice for prefill/decode disaggregation: for an input / output length mix, how
many prefill instances one decode instance needs (prefill compute-bound at a peak FLOP rate and a utilisation;
decode memory-bound, the ledger's `latency_cost` step), and the KV bytes each request moves. Back-of-envelope, no
measurement. Details: docs/disaggregation.md ("Sizing the split")."""
from __future__ import annotations

import dataclasses

from serving.ledger import Hardware, Layout, ModelMemory, Workload, latency_cost


@dataclasses.dataclass(frozen=True)
class SplitAdvice:
    prefill_s: float  # one request's prefill on one prefill instance
    decode_s: float  # one request's share of decode time on one decode instance (its tokens x step / batch)
    prefill_per_decode: float  # prefill instances that keep one decode instance fed
    kv_bytes: int  # the KV one request moves from prefill to decode
    transfer_s: float  # those bytes over the hardware's link


def pd_split(mm: ModelMemory, layout: Layout, hw: Hardware, *, input_len: int, output_len: int, decode_batch: int,
             peak_flops: float = 989e12, utilisation: float = 0.5, page_size: int = 16) -> SplitAdvice:
    """Prefill: 2 x params FLOPs per prompt token (attention's quadratic term left out) at `utilisation` of
    `peak_flops` per device (default: an H100's dense bf16) over the layout's devices. Decode: `decode_batch`
    requests per replica at the average context (input + output / 2); each of a request's `output_len` tokens costs
    one step shared by the batch. Both instances use `layout`."""
    for name, v in (("input_len", input_len), ("output_len", output_len), ("decode_batch", decode_batch)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must be in (0, 1], got {utilisation}")
    prefill_s = 2 * mm.num_params * input_len / (peak_flops * utilisation * layout.num_devices)
    work = Workload(concurrency=decode_batch * layout.dp, avg_seq_len=input_len + output_len // 2,
                    page_size=page_size)
    decode_s = output_len * latency_cost(mm, work, layout, hw).step / decode_batch
    kv_bytes = input_len * mm.kv_bytes_per_token
    return SplitAdvice(prefill_s, decode_s, prefill_s / decode_s, kv_bytes, kv_bytes / hw.link_bandwidth)
