"""The KV cache as the model declares it: one `KVCacheSpec` per layer (page-row shape, storage dtype, logical axes,
bytes per token, attention kind: full, sliding window or latent), which allocation (`init_kv_caches`), sharding (the
generic logical-axis rules) and sizing (`serving.ledger`) all read. Details: docs/models.md."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_kernels
from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import QuantizedKV
from sharding.axes import HEAD_DIM, KV_HEADS, KV_PAGES
from sharding.rules import DEFAULT_RULES, STAGE_AXIS, ShardingRules, partition_spec_for_sizes, shard_shape

FULL, SLIDING_WINDOW, LATENT = "full", "sliding_window", "latent"
ATTENTION_KINDS = (FULL, SLIDING_WINDOW, LATENT)


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One layer's paged KV cache: pages [num_pages, page_size, num_heads * rows_per_head, row_dim] with logical
    axes (KV_PAGES, -, KV_HEADS, HEAD_DIM). A quantized cache (`kv_cache_dtype`) holds its values so and a float32
    scale per row beside them ([num_pages, page_size, rows], `pallas_kernels.kv_quant.QuantizedKV`)."""
    attention: str  # FULL; SLIDING_WINDOW (reads its last `sliding_window` tokens); LATENT (one compressed row)
    num_heads: int  # KV heads cached; a latent cache: 1, read by every query head
    rows_per_head: int  # 2: K and V interleaved (row 2h: K of head h, 2h + 1: its V); 1: a latent row
    row_dim: int  # values per row: head_dim, or kv_lora_rank + qk_rope_head_dim for a latent cache
    dtype: str  # the unquantized values' dtype (the activations')
    kv_cache_dtype: str = "auto"  # "auto" (dtype), or a quantized format (pallas_kernels.kv_quant.KV_CACHE_DTYPES)
    sliding_window: int | None = None  # tokens a query reads (itself included); SLIDING_WINDOW only

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"KVCacheSpec.attention={self.attention!r}: expected one of {ATTENTION_KINDS}")
        for name in ("num_heads", "rows_per_head", "row_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")
        if (self.attention == SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError(f"KVCacheSpec: sliding_window={self.sliding_window} with attention={self.attention!r} "
                             f"(a window exactly when the attention is {SLIDING_WINDOW!r})")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"KVCacheSpec.sliding_window must be positive, got {self.sliding_window}")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        kv_quant.check_kv_cache_dtype(self.kv_cache_dtype)

    # ---- layout
    @property
    def num_rows(self) -> int:
        """Rows of one token's page row (the third axis of the pages)."""
        return self.num_heads * self.rows_per_head

    @property
    def page_row_shape(self) -> tuple[int, int]:
        """One token's entry in a page: [rows, row_dim]."""
        return (self.num_rows, self.row_dim)

    @property
    def logical_axes(self) -> tuple[str | None, ...]:
        return (KV_PAGES, None, KV_HEADS, HEAD_DIM)

    def shape(self, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        """The pages' shape (a quantized cache's values; its scales are this less the last axis)."""
        return (num_pages, page_size) + self.page_row_shape

    # ---- bytes
    @property
    def values_dtype(self) -> str:
        """The stored values' dtype by name: `dtype`, or a quantized format's values (float8 held as uint8 bits on
        CPU takes the same bytes)."""
        return self.dtype if self.kv_cache_dtype == "auto" else kv_quant.VALUE_DTYPE_NAMES[self.kv_cache_dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row: row_dim values, plus a quantized cache's float32 scale."""
        scale = 0 if self.kv_cache_dtype == "auto" else kv_quant.SCALE_BYTES
        return self.row_dim * jnp.dtype(self.values_dtype).itemsize + scale

    @property
    def bytes_per_token(self) -> int:
        """This layer's cache bytes per cached token, unsharded."""
        return self.num_rows * self.row_bytes

    def describe(self) -> str:
        """The bytes per token as a product, e.g. "2 x 8 kv heads x (128 x 2 B + 4 B scale)"."""
        scale = "" if self.kv_cache_dtype == "auto" else f" + {kv_quant.SCALE_BYTES} B scale"
        rows = "latent" if self.attention == LATENT else f"{self.rows_per_head} x {self.num_heads} kv heads"
        return f"{rows} x ({self.row_dim} x {jnp.dtype(self.values_dtype).itemsize} B{scale})"

    # ---- sharding
    def partition_spec(self, axis_sizes: Mapping[str, int], num_pages: int,
                       rules: ShardingRules = DEFAULT_RULES) -> PartitionSpec:
        """The pages' layout by the generic rules: pages over KV_PAGES' mesh axis (each data replica its own pool)
        and rows over KV_HEADS' when it divides the head count (a head's K and V rows never land on different
        devices), else replicated (a latent cache's one head always is)."""
        units = (num_pages, 1, self.num_heads, self.row_dim)  # the head axis counts heads, its unit of splitting
        return partition_spec_for_sizes(rules, self.logical_axes, units, axis_sizes)

    def sharding(self, mesh: Mesh | None, num_pages: int, *, stacked: bool = False,
                 rules: ShardingRules = DEFAULT_RULES) -> NamedSharding | None:
        """The pages' sharding on `mesh` (None without one); `stacked`: a leading [stages] axis over the pipeline's
        mesh axis (the pipeline runner's slots)."""
        if mesh is None:
            return None
        spec = self.partition_spec(dict(mesh.shape), num_pages, rules)
        return NamedSharding(mesh, PartitionSpec(STAGE_AXIS, *spec) if stacked else spec)

    def device_bytes_per_token(self, axis_sizes: Mapping[str, int], rules: ShardingRules = DEFAULT_RULES) -> int:
        """Bytes per cached token on one device of a mesh of `axis_sizes` (its share of the heads)."""
        return self.device_heads(axis_sizes, rules) * self.rows_per_head * self.row_bytes

    def device_heads(self, axis_sizes: Mapping[str, int], rules: ShardingRules = DEFAULT_RULES) -> int:
        """KV heads one device holds."""
        pages = max(1, int(axis_sizes.get(rules.rules.get(KV_PAGES) or "", 1)))
        spec = self.partition_spec(axis_sizes, pages, rules)
        return shard_shape(spec, (pages, 1, self.num_heads, self.row_dim), axis_sizes)[2]

    # ---- allocation
    def zeros(self, num_pages: int, page_size: int, sharding=None, leading: tuple[int, ...] = ()):
        """Trace-time (the attention backend picks the storage dtype: `pallas_kernels.kv_storage_dtype`). Zeroed
        pages of `leading + shape`, an array or a `QuantizedKV`, placed on `sharding` (default: the first device:
        committed from the start, so a step's output caches match its inputs and it compiles once)."""
        shape = tuple(leading) + self.shape(num_pages, page_size)
        storage = pallas_kernels.kv_storage_dtype(jnp.dtype(self.dtype), self.kv_cache_dtype)
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        values = jnp.zeros(shape, storage, device=sharding)
        if self.kv_cache_dtype == "auto":
            return values
        return QuantizedKV(values, jnp.zeros(shape[:-1], jnp.float32,
                                             device=kv_quant.scales_sharding(sharding, len(shape))))

    # ---- page liveness (the seam of a hybrid block manager)
    def first_needed_position(self, position: int) -> int:
        """The oldest token position a query at `position` or later reads in this layer: 0 for full and latent
        attention, `position - sliding_window + 1` for a sliding window. Pages wholly before it are dead for this
        layer (and for every layer of its `kv_cache_groups` group)."""
        if self.attention != SLIDING_WINDOW:
            return 0
        return max(0, position - self.sliding_window + 1)


def attention_spec(num_kv_heads: int, head_dim: int, *, dtype, kv_cache_dtype: str = "auto",
                   sliding_window: int | None = None) -> KVCacheSpec:
    """The cache of (grouped-query) attention: K and V of every KV head, full or over a sliding window."""
    return KVCacheSpec(FULL if sliding_window is None else SLIDING_WINDOW, num_kv_heads, 2, head_dim,
                       jnp.dtype(dtype).name, kv_cache_dtype, sliding_window)


def latent_spec(latent_dim: int, *, dtype, kv_cache_dtype: str = "auto") -> KVCacheSpec:
    """The cache of multi-head latent attention: per token one row of `latent_dim` values (the compressed latent
    and the decoupled RoPE key: kv_lora_rank + qk_rope_head_dim), shared by every query head."""
    return KVCacheSpec(LATENT, 1, 1, latent_dim, jnp.dtype(dtype).name, kv_cache_dtype)


def kv_cache_groups(specs: Sequence[KVCacheSpec]) -> dict[KVCacheSpec, tuple[int, ...]]:
    """Layers that share a spec, by spec (first layer order): a hybrid block manager's unit, one page liveness per
    group (vLLM's KV-cache groups)."""
    groups: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        groups.setdefault(spec, []).append(layer)
    return {spec: tuple(layers) for spec, layers in groups.items()}


def window_pools(specs: Sequence[KVCacheSpec]) -> tuple[int, ...]:
    """The sliding windows whose layers can keep a page pool of their own (a hybrid KV cache, sorted): those of a
    model that also has layers reading every page (full or latent attention), whose pages are the page table's.
    () when no layer slides, or every layer does (then the one pool is the page table's, each page kept to the end:
    not split)."""
    if all(spec.attention == SLIDING_WINDOW for spec in specs):
        return ()
    return tuple(sorted({spec.sliding_window for spec in specs if spec.attention == SLIDING_WINDOW}))


def window_pool_pages(window: int, page_size: int, max_seqs: int, max_step_tokens: int) -> int:
    """Pages a window pool needs at most: each of `max_seqs` sequences holds the blocks its next query reads
    (ceil((window - 1) / page_size) + 1 of them) and one it is filling, plus the blocks of a step's
    `max_step_tokens` new tokens (a prefill chunk writes every block it covers)."""
    return max_seqs * (-(-(window - 1) // page_size) + 2) + -(-max_step_tokens // page_size)


def init_kv_caches(specs: Sequence[KVCacheSpec], num_pages: int, page_size: int, mesh: Mesh | None = None,
                   rules: ShardingRules = DEFAULT_RULES, window_pages: Mapping[int, int] | None = None) -> list:
    """Trace-time. One zeroed cache per layer spec (`KVCacheSpec.zeros`), sharded on `mesh` by the rules; `num_pages`
    pages, or for a sliding-window layer whose window has a pool of its own (`window_pages`: window -> pages), that
    pool's."""
    window_pages = window_pages or {}
    out = []
    for spec in specs:
        n = window_pages.get(spec.sliding_window, num_pages) if spec.sliding_window is not None else num_pages
        out.append(spec.zeros(n, page_size, spec.sharding(mesh, n, rules=rules)))
    return out


def bytes_per_token(specs: Sequence[KVCacheSpec]) -> int:
    """Cache bytes per cached token over all layers, unsharded."""
    return sum(spec.bytes_per_token for spec in specs)
