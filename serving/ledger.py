"""Memory ledger and layout planner (R1): per-device weights, KV cache, activations, communication buffers and runtime
reserve for a model, workload and mesh; the (dp, pp, tp, ep) layouts that fit, ranked by a decode-latency cost; an
engine's KV pages (`kv_cache_pages`) and its start-up summary (`ledger_summary`). Details: docs/ledger.md.

    python -m serving.ledger --preset=llama-3-70b --num_devices=8 --device_memory=80GB
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import re
from typing import Sequence

from models.config import ModelConfig
from models.kv_cache import KVCacheSpec, window_pool_pages, window_pools
from models.transformer import kv_cache_specs
from pallas_kernels import kv_quant
from serving.ledger_presets import PRESETS, SOURCE_70B  # the built-in models, serving.ledger.PRESETS to callers
from sharding.pipeline import SlotPlan, plan_slots, stage_layers as _stage_layers
from sharding.rules import DEFAULT_RULES, MESH_AXES, ShardingRules, partition_spec_for_sizes, shard_shape

GB, GiB, KiB, MiB = 10**9, 2**30, 2**10, 2**20
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}

# (bandwidth per direction in GB/s, latency in µs) per device link: rough public figures, override by flags.
LINK_PRESETS = {
    "nvlink": (450.0, 5.0),   # H100 NVLink 4: 900 GB/s bidirectional
    "ici": (90.0, 5.0),       # TPU v5p/v4 inter-chip interconnect, per link direction
    "pcie": (32.0, 15.0),     # PCIe Gen5 x16 without NVLink, through the host
}


def kv_dtype_of(kv_cache_dtype: str) -> str | None:
    """The ledger's KV dtype for a --kv_cache_dtype value (pallas_kernels.kv_quant: "auto" -> None, the model's
    dtype; a quantized cache -> its values' dtype, each row with a float32 scale beside)."""
    return kv_quant.VALUE_DTYPE_NAMES.get(kv_quant.check_kv_cache_dtype(kv_cache_dtype))


def kv_cache_formats(dtype: str, kv_dtype: str) -> dict[str, str]:
    """A ledger KV dtype as `models.transformer.kv_cache_specs` takes it: a quantized format's values dtype (int8,
    float8_e4m3fn) -> that format over `dtype` (each row with its scale); any other name -> a cache of that dtype."""
    formats = {values: name for name, values in kv_quant.VALUE_DTYPE_NAMES.items()}
    if kv_dtype in formats:
        return dict(dtype=dtype, kv_cache_dtype=formats[kv_dtype])
    return dict(dtype=kv_dtype, kv_cache_dtype="auto")


def itemsize(dtype: str) -> int:
    if dtype not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_ITEMSIZE)}")
    return _ITEMSIZE[dtype]


def fmt_bytes(n: float) -> str:
    return f"{n / GB:.2f} GB ({n / GiB:.2f} GiB)"


def parse_size(text: str) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '141e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*(GB|GiB|MB|MiB|TB|TiB|B)?\s*", text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}: expected e.g. '80GB' (1e9 B) or '80GiB' (2**30 B)")
    unit = {"GB": GB, "GiB": GiB, "MB": 10**6, "MiB": MiB, "TB": 10**12, "TiB": 2**40, "B": 1, None: 1}[m.group(2)]
    return int(float(m.group(1)) * unit)


def load_config(preset: str = "", model: str = "") -> tuple[str, ModelConfig]:
    """(display name, config) from a preset name or a model: an HF directory or config.json path, a GGUF file or
    directory, an Orbax checkpoint."""
    if bool(preset) == bool(model):
        raise ValueError("give exactly one of --preset and --model")
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS) + [SOURCE_70B]}")
        name, hf = PRESETS[preset]
        return name, ModelConfig.from_hf(hf)
    from models.weights import read_config
    path = os.path.abspath(model)
    name = os.path.basename(os.path.dirname(path) if path.endswith(".json") else path).removesuffix(".gguf")
    return name, read_config(model)


# ------------------------------------------------------------------------------------------------- model

@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, mesh_shape) -> "Layout":
        """From a Layout, a jax Mesh, or a mapping {'data': .., 'pipeline': .., 'tensor': .., 'expert': ..}."""
        if isinstance(mesh_shape, Layout):
            return mesh_shape
        sizes = dict(getattr(mesh_shape, "shape", mesh_shape))
        unknown = set(sizes) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"mesh axes {sorted(unknown)} are not among {MESH_AXES}")
        return cls(*(int(sizes.get(a, 1)) for a in MESH_AXES))

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(MESH_AXES, (self.dp, self.pp, self.tp, self.ep)))

    @property
    def num_devices(self) -> int:
        return self.dp * self.pp * self.tp * self.ep

    def __str__(self) -> str:
        return f"dp={self.dp} pp={self.pp} tp={self.tp} ep={self.ep}"


@dataclasses.dataclass(frozen=True)
class _Param:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    itemsize: int


class ModelMemory:
    """The model's parameters (shape, logical axes, bytes) read off the abstract CausalLM, so counts match the
    arrays the loader creates, and its KV cache as the model declares it (`kv_specs`, one per layer, as the engine
    allocates it; `hybrid`: the sliding-window layers holding only their window, as the engine's hybrid KV cache
    does, `windows` their pools); per-device bytes for any layout follow from the sharding rules."""

    def __init__(self, cfg: ModelConfig, dtype: str, kv_dtype: str | None = None,
                 rules: ShardingRules = DEFAULT_RULES, hybrid: bool = True):
        self.cfg, self.dtype, self.kv_dtype, self.rules = cfg, dtype, kv_dtype or dtype, rules
        self.act_itemsize = itemsize(dtype)
        itemsize(self.kv_dtype)  # a known name
        self.kv_specs: tuple[KVCacheSpec, ...] = kv_cache_specs(cfg, **kv_cache_formats(dtype, self.kv_dtype))
        self.windows = window_pools(self.kv_specs) if hybrid else ()
        self.top, self.layer_kinds = _abstract_params(cfg, dtype)
        params = list(self.top.values()) + [p for i in range(cfg.num_layers) for p in self.layer_kinds[cfg.moe_layers[i]]]
        self.num_params = sum(math.prod(p.shape) for p in params)
        self.weight_bytes = sum(math.prod(p.shape) * p.itemsize for p in params)  # quantized weights at their size
        self._slot_plans: dict[int, SlotPlan] = {}  # per pipeline degree

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token costs over all layers, unsharded (the layers' `KVCacheSpec.bytes_per_token`)."""
        return sum(spec.bytes_per_token for spec in self.kv_specs)

    def kv_describe(self) -> str:
        """The KV bytes per token as products, layers of one page-row layout together, e.g. "80 layers x 2 x 8 kv
        heads x (128 x 2 B)"."""
        counts: dict[str, int] = {}
        for spec in self.kv_specs:
            counts[spec.describe()] = counts.get(spec.describe(), 0) + 1
        return " + ".join(f"{n} layers x {text}" for text, n in counts.items())

    def pool_kv_bytes_per_token(self, window: int | None, layout: Layout | None = None) -> int:
        """KV bytes per token of one page pool's layers (`window` one of `windows`; None: the page table's, every
        other layer), unsharded or on one device of `layout`."""
        return sum(spec.bytes_per_token if layout is None else
                   spec.device_bytes_per_token(layout.axis_sizes, self.rules)
                   for spec in self.kv_specs if (spec.sliding_window if spec.sliding_window in self.windows
                                                 else None) == window)

    def window_tokens(self, window: int, seq_len: int, page_size: int) -> int:
        """Tokens of a `seq_len` sequence a window pool holds: at most the blocks its next query reads,
        min(seq_len, about window + page_size - 1) rounded up to pages."""
        return min(-(-seq_len // page_size), -(-(window - 1) // page_size) + 1) * page_size

    def stage_kv_bytes_per_request(self, layout: Layout, stage: int, seq_len: int, page_size: int) -> int:
        """KV bytes one `seq_len`-token request holds on one device of `stage` (a window pool's layers only its
        window; not split under a pipeline, whose stages need identical layers)."""
        tokens = -(-seq_len // page_size) * page_size
        if not self.windows or layout.pp > 1:
            return tokens * self.stage_kv_bytes_per_token(layout, stage)
        return tokens * self.pool_kv_bytes_per_token(None, layout) + sum(
            self.window_tokens(w, seq_len, page_size) * self.pool_kv_bytes_per_token(w, layout) for w in self.windows)

    def _bytes(self, p: _Param, layout: Layout) -> int:
        spec = partition_spec_for_sizes(self.rules, p.axes, p.shape, layout.axis_sizes)
        return math.prod(shard_shape(spec, p.shape, layout.axis_sizes)) * p.itemsize

    def stage_layers(self, layout: Layout) -> list[range]:
        """Each stage's real layers, the pipeline runner's split (`sharding.pipeline.stage_layers`: the first
        num_layers % pp stages one layer more)."""
        return _stage_layers(self.cfg.num_layers, layout.pp)

    def slot_plan(self, layout: Layout) -> SlotPlan:
        """The pipeline runner's slots (`sharding.pipeline.plan_slots`): layers of one kind (dense or MoE, and
        their cache) share a slot; a stage with no layer for a slot pads it."""
        if layout.pp not in self._slot_plans:
            kinds = [(self.cfg.moe_layers[i], self.kv_specs[i]) for i in range(self.cfg.num_layers)]
            self._slot_plans[layout.pp] = plan_slots(self.stage_layers(layout), kinds)
        return self._slot_plans[layout.pp]

    def stage_slots(self, layout: Layout) -> int:
        """Layer slots every stage allocates (weights and a KV buffer each), as the runner stacks slot j of all
        stages into one array split evenly over 'pipeline'."""
        return self.slot_plan(layout).num_slots

    def stage_padding_layers(self, layout: Layout, stage: int) -> int:
        """Padding slots of `stage` (no-op slots whose zero weights and KV buffer are allocated all the same)."""
        return self.slot_plan(layout).padding(stage)

    def stage_layer_weight_bytes(self, layout: Layout, stage: int) -> int:
        """Bytes of decoder-layer weights on one device of pipeline stage `stage`: a layer of each slot's kind, its
        real layers and its padding slots alike."""
        per_kind = {kind: sum(self._bytes(p, layout) for p in params) for kind, params in self.layer_kinds.items()}
        plan = self.slot_plan(layout)
        return sum(per_kind[self.cfg.moe_layers[plan.slot_layer(j)]] for j in range(plan.num_slots))

    def stage_weight_bytes(self, layout: Layout, stage: int) -> int:
        """Bytes of weights on one device of pipeline stage `stage`: its layer slots (`stage_layer_weight_bytes`)
        plus the embedding, the final norm and the LM head, which the pipeline runner keeps on every stage
        (replicated over 'pipeline': the first stage embeds, the last one samples, and one program serves all)."""
        return self.stage_layer_weight_bytes(layout, stage) + sum(self._bytes(p, layout) for p in self.top.values())

    def stage_kv_bytes_per_token(self, layout: Layout, stage: int) -> int:
        """KV bytes per cached token on one device of `stage`: its slots, padding ones included, each a cache of
        the spec of the layers in that slot (as the pipeline runner stacks them), and its share of their heads."""
        plan = self.slot_plan(layout)
        return sum(self.kv_specs[plan.slot_layer(j)].device_bytes_per_token(layout.axis_sizes, self.rules)
                   for j in range(plan.num_slots))


@functools.lru_cache(maxsize=32)
def _abstract_params(cfg: ModelConfig, dtype: str) -> tuple[dict[str, _Param], dict[bool, list[_Param]]]:
    """Top-level params by name, and one layer's params per layer kind (dense / MoE). Builds an abstract model of
    one layer per kind: every layer of a kind has the same parameters, and 80 abstract layers take seconds."""
    import jax.numpy as jnp
    from flax import nnx
    from models.weights import abstract_model

    kinds = tuple(sorted(set(cfg.moe_layers)))
    small = dataclasses.replace(cfg, num_layers=len(kinds), moe_layers=kinds, sliding_windows=())
    state = nnx.state(abstract_model(small, getattr(jnp, dtype)), nnx.Param)
    top: dict[str, _Param] = {}
    layer_kinds: dict[bool, list[_Param]] = {k: [] for k in kinds}
    for path, var in nnx.to_flat_state(state):
        p = _Param(tuple(var.shape), tuple(var.get_metadata().get("axes") or (None,) * len(var.shape)),
                   jnp.dtype(var.dtype).itemsize)
        if path[0] == "layers":
            layer_kinds[kinds[int(path[1])]].append(p)
        else:
            top[str(path[0])] = p
    return top, layer_kinds


# ---------------------------------------------------------------------------------------------- workload

@dataclasses.dataclass(frozen=True)
class Workload:
    concurrency: int = 256          # requests holding KV at once (over all replicas)
    avg_seq_len: int = 2048         # tokens per request (prompt + output), average
    page_size: int = 16
    max_batched_tokens: int = 2048  # tokens in the largest step of one replica (prefill chunk budget)
    max_seqs: int = 0               # sequences in one replica's step; 0: all its requests

    def __post_init__(self):
        for name in ("concurrency", "avg_seq_len", "page_size", "max_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Workload.{name} must be positive, got {getattr(self, name)}")

    @property
    def pages_per_request(self) -> int:
        return -(-self.avg_seq_len // self.page_size)

    def requests_per_replica(self, layout: Layout) -> int:
        return -(-self.concurrency // layout.dp)

    def seqs_per_step(self, layout: Layout) -> int:
        per = self.requests_per_replica(layout)
        return min(per, self.max_seqs) if self.max_seqs else per


@dataclasses.dataclass(frozen=True)
class Hardware:
    device_memory: int = 80 * GB
    num_devices: int = 8
    hbm_bandwidth: float = 3350 * GB   # bytes/s (H100 SXM)
    link_bandwidth: float = 450 * GB   # bytes/s per direction
    link_latency: float = 5e-6         # seconds per collective step
    reserve_fraction: float = 0.05     # runtime reserve: CUDA/XLA context, workspace, fragmentation
    moe_capacity_factor: float = 2.0   # routed tokens per expert device over the mean (imbalance, R7)


# ------------------------------------------------------------------------------------------------ ledger

@dataclasses.dataclass(frozen=True)
class DeviceLedger:
    """Bytes on one device of the fullest pipeline stage."""
    layout: Layout
    stage: int
    weights: int
    kv_cache: int
    activations: int
    comm_buffers: int
    reserve: int
    device_memory: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.comm_buffers + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory


def peak_activation_bytes(mm: ModelMemory, layout: Layout, tokens: int, seqs: int, hw: Hardware) -> int:
    """Working set of the largest step on one device: the residual stream (x and its norm) plus the biggest of
    one layer's attention (q, k, v, out), one layer's MLP (gate, up, product; routed tokens for MoE) and the
    float32 logits with the sampler's temporaries. XLA reuses buffers between layers, so layers do not add up."""
    c, a, t = mm.cfg, mm.act_itemsize, tokens
    sizes = layout.axis_sizes
    local = lambda n, axis: n // sizes[axis] if n % sizes[axis] == 0 else n  # noqa: E731 replicate if not divisible
    hq, hkv = local(c.num_heads, "tensor"), local(c.num_kv_heads, "tensor")
    residual = 2 * t * c.hidden_size * a
    attention = t * (2 * hq + 2 * hkv) * c.head_dim * a
    if c.is_mla:  # per head: q (nope + rope), q in the latent space (latent + rope), the latent output, the value
        attention = t * hq * (c.head_dim + 2 * c.kv_lora_rank + c.qk_rope_head_dim + c.v_head_dim) * a
    mlp = 3 * t * local(c.intermediate_size, "tensor") * a if not all(c.moe_layers) else 0
    if c.is_moe:
        routed = math.ceil(t * c.num_experts_per_tok * hw.moe_capacity_factor / layout.ep)
        moe = (3 * routed * local(c.moe_intermediate_size, "tensor") * a + t * c.num_experts * 4
               + 3 * t * local(c.shared_expert_intermediate_size, "tensor") * a)
        mlp = max(mlp, moe)
    logits = 2 * seqs * local(c.vocab_size, "tensor") * 4
    return residual + max(attention, mlp, logits)


def comm_buffer_bytes(mm: ModelMemory, layout: Layout, tokens: int, hw: Hardware) -> int:
    """Send + receive buffers of the largest step: TP all-reduce of [T, E], pipeline hand-off of [T, E],
    expert dispatch/combine of the routed [T*k, E]."""
    c, a = mm.cfg, mm.act_itemsize
    row = tokens * c.hidden_size * a
    total = 2 * row if layout.tp > 1 else 0
    total += 2 * row if layout.pp > 1 else 0
    if layout.ep > 1 and c.is_moe:
        total += 2 * math.ceil(c.num_experts_per_tok * hw.moe_capacity_factor) * row
    return total


def device_ledger(mm: ModelMemory, work: Workload, layout: Layout, hw: Hardware) -> DeviceLedger:
    """The per-device breakdown on the stage whose device is fullest."""
    tokens, seqs = work.max_batched_tokens, work.seqs_per_step(layout)
    act = peak_activation_bytes(mm, layout, tokens, seqs, hw)
    comm = comm_buffer_bytes(mm, layout, tokens, hw)
    reserve = int(hw.reserve_fraction * hw.device_memory)
    best = None
    for s in range(layout.pp):
        kv = work.requests_per_replica(layout) * mm.stage_kv_bytes_per_request(layout, s, work.avg_seq_len,
                                                                               work.page_size)
        led = DeviceLedger(layout, s, mm.stage_weight_bytes(layout, s), kv, act, comm, reserve, hw.device_memory)
        if best is None or led.total > best.total:
            best = led
    return best


# -------------------------------------------------------------------------------------------- latency cost

@dataclasses.dataclass(frozen=True)
class LatencyCost:
    """One decode step of one replica (every request advances one token), in seconds."""
    reads: float          # HBM reads of weights + KV (decode is memory-bound)
    tp_allreduce: float   # 2 all-reduces per layer on every token
    ep_all_to_all: float  # dispatch + combine per MoE layer
    pp_bubble: float      # pipeline fill/drain, (pp-1) extra micro-batch slots, plus stage hand-offs
    bubble_fraction: float
    micro_batches: int

    @property
    def step(self) -> float:
        return self.reads + self.tp_allreduce + self.ep_all_to_all + self.pp_bubble


def latency_cost(mm: ModelMemory, work: Workload, layout: Layout, hw: Hardware, micro_batches: int = 0) -> LatencyCost:
    """Per micro-batch of b tokens on the fullest stage:
    reads = (stage weights + KV of b requests) / HBM bandwidth;
    TP    = layers x 2 x (latency + 2(tp-1)/tp x b*E*bytes / link bandwidth)   (ring all-reduce);
    EP    = MoE layers x 2 x (latency + (ep-1)/ep x b*k*E*bytes / link bandwidth)   (all-to-all);
    step  = (m + pp - 1) x micro-batch time + (pp - 1) hand-offs, i.e. m useful slots and a bubble of
    (pp-1)/(m+pp-1). With pp = 1 there is one micro-batch and no bubble."""
    c, a = mm.cfg, mm.act_itemsize
    batch = work.requests_per_replica(layout)
    m = 1 if layout.pp == 1 else max(1, min(micro_batches or layout.pp, batch))
    b = -(-batch // m)
    led = device_ledger(mm, work, layout, hw)
    n_layers = mm.stage_slots(layout)  # every stage runs all its slots each tick (a padding slot masked)
    n_moe = sum(c.moe_layers[i] for i in mm.stage_layers(layout)[led.stage])
    kv_read = b * work.avg_seq_len * mm.stage_kv_bytes_per_token(layout, led.stage)
    if mm.windows and layout.pp == 1:  # a window layer reads its window's tokens, not the whole context
        kv_read = b * (work.avg_seq_len * mm.pool_kv_bytes_per_token(None, layout) + sum(
            min(w, work.avg_seq_len) * mm.pool_kv_bytes_per_token(w, layout) for w in mm.windows))
    reads = (led.weights + kv_read) / hw.hbm_bandwidth
    row = b * c.hidden_size * a
    tp = (n_layers * 2 * (hw.link_latency + 2 * (layout.tp - 1) / layout.tp * row / hw.link_bandwidth)
          if layout.tp > 1 else 0.0)
    ep = (n_moe * 2 * (hw.link_latency + (layout.ep - 1) / layout.ep * row * c.num_experts_per_tok
                       / hw.link_bandwidth) if layout.ep > 1 and c.is_moe else 0.0)
    per_mb = reads + tp + ep
    hop = hw.link_latency + row / hw.link_bandwidth
    bubble = (layout.pp - 1) * (per_mb + hop)
    return LatencyCost(m * reads, m * tp, m * ep, bubble, (layout.pp - 1) / (m + layout.pp - 1), m)


# ------------------------------------------------------------------------------------------------ planner

def candidate_layouts(cfg: ModelConfig, num_devices: int) -> list[Layout]:
    """Every (dp, pp, tp, ep) whose product is `num_devices`; ep > 1 only for MoE models, pp <= layers."""
    out = []
    for dp, pp, tp in itertools.product(range(1, num_devices + 1), repeat=3):
        rest, rem = divmod(num_devices, dp * pp * tp)
        if rem or pp > cfg.num_layers or (rest > 1 and (not cfg.is_moe or rest > cfg.num_experts)):
            continue
        out.append(Layout(dp, pp, tp, rest))
    return out


@dataclasses.dataclass(frozen=True)
class Plan:
    layout: Layout
    ledger: DeviceLedger
    cost: LatencyCost


def plan_layouts(mm: ModelMemory, work: Workload, hw: Hardware, micro_batches: int = 0,
                 num_devices: int | None = None) -> tuple[list[Plan], list[Plan]]:
    """(layouts that fit ranked by decode step time, layouts that do not fit by overflow)."""
    fit, no_fit = [], []
    for layout in candidate_layouts(mm.cfg, num_devices or hw.num_devices):
        led = device_ledger(mm, work, layout, hw)
        (fit if led.fits else no_fit).append(Plan(layout, led, latency_cost(mm, work, layout, hw, micro_batches)))
    fit.sort(key=lambda p: (p.cost.step, p.ledger.total))
    no_fit.sort(key=lambda p: p.ledger.total)
    return fit, no_fit


def fewest_devices(mm: ModelMemory, work: Workload, hw: Hardware, micro_batches: int = 0,
                   limit: int = 64) -> Plan | None:
    for n in range(1, limit + 1):
        fit, _ = plan_layouts(mm, work, hw, micro_batches, num_devices=n)
        if fit:
            return fit[0]
    return None


# ------------------------------------------------------------------------------------- source's example

@dataclasses.dataclass(frozen=True)
class WorkedExample:
    """The source's §3.4 arithmetic: 70B fp16 weights, 1 GB of KV per request x 256, ~60 GB of activations and
    buffers, 80 GB cards. KV per request is the source example model's (512 KiB/token x 2048 tokens = 1 GiB);
    the source writes it as 1 GB, so its total mixes units; both totals are kept."""
    params: int = 70 * 10**9
    bytes_per_param: int = 2
    concurrency: int = 256
    kv_per_request: int = 2**30          # exact: 1 GiB
    kv_per_request_as_written: int = GB  # the source's "1 GB"
    activations_and_buffers: int = 60 * GB
    card: int = 80 * GB

    @property
    def weights(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def total_as_written(self) -> int:
        return self.weights + self.concurrency * self.kv_per_request_as_written + self.activations_and_buffers

    @property
    def total_exact(self) -> int:
        return self.weights + self.concurrency * self.kv_per_request + self.activations_and_buffers

    def cards(self, total: int) -> int:
        return -(-total // self.card)


def render_worked_example(ex: WorkedExample = WorkedExample()) -> str:
    mm = ModelMemory(load_config("source-example")[1], "float16")
    per_tok = mm.kv_bytes_per_token
    kv_req = Workload(avg_seq_len=2048).pages_per_request * 16 * per_tok
    lines = [
        "meshserve memory ledger: the source's worked example (70B fp16, 256 concurrent requests, 80 GB cards)",
        "units: GB = 1e9 bytes, GiB = 2^30 bytes",
        f"  KV per token (32 layers, hidden 4096, no GQA, fp16): 2 x 32 x 4096 x 2 B = {per_tok} B = "
        f"{per_tok / KiB:.0f} KiB",
        f"  KV per 2048-token request: {per_tok / KiB:.0f} KiB x 2048 = {kv_req} B = {kv_req / GiB:g} GiB "
        f"({kv_req / GB:.3f} GB; the source rounds it to 1 GB)",
        f"  weights   {ex.params / 1e9:.0f}e9 params x {ex.bytes_per_param} B = {fmt_bytes(ex.weights)}",
        f"  KV cache  {ex.concurrency} x 1 GB (as written) = "
        f"{ex.concurrency * ex.kv_per_request_as_written / GB:.0f} GB"
        f"   [exact: {ex.concurrency} x 1 GiB = {fmt_bytes(ex.concurrency * ex.kv_per_request)}]",
        f"  activations + communication buffers (source's estimate) = {ex.activations_and_buffers / GB:.0f} GB",
        f"  total (as written) = {ex.weights / GB:.0f} + {ex.concurrency * ex.kv_per_request_as_written / GB:.0f} + "
        f"{ex.activations_and_buffers / GB:.0f} = {ex.total_as_written / GB:.0f} GB -> "
        f"ceil({ex.total_as_written / GB:.0f} / {ex.card / GB:.0f}) = {ex.cards(ex.total_as_written)} cards of "
        f"{ex.card / GB:.0f} GB",
        f"  total (exact units) = {fmt_bytes(ex.total_exact)} -> {ex.total_exact / ex.card:.2f} cards -> "
        f"{ex.cards(ex.total_exact)} cards of {ex.card / GB:.0f} GB",
        "  This is the source's aggregate arithmetic. For a real architecture (--preset=llama-3-70b) the ledger",
        "  gives the per-device breakdown and the layouts that fit.",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- report

COST_EXPLANATION = """\
Latency cost = one decode step of one replica (each of its requests advances one token), on the fullest stage:
  reads    (stage weights + KV of a micro-batch) / HBM bandwidth, per micro-batch   (decode is memory-bound)
  TP AR    2 all-reduces per layer on every token: layers x 2 x (link latency + 2(tp-1)/tp x tokens x hidden
           x bytes / link bandwidth); on the critical path of every token, so TP is kept inside a host
  EP A2A   dispatch + combine per MoE layer: MoE layers x 2 x (latency + (ep-1)/ep x tokens x top_k x hidden
           x bytes / link bandwidth)
  PP       m micro-batches over pp stages take m + pp - 1 slots: bubble fraction (pp-1)/(m+pp-1); the pp-1
           extra slots and the stage hand-offs are the PP cost. dp replicas run side by side (no latency cost).
  Prefill (compute-bound) is not ranked; tok/s = concurrency / step."""


def render_report(name: str, mm: ModelMemory, work: Workload, hw: Hardware, link: str,
                  micro_batches: int = 0, show: int = 12) -> str:
    c = mm.cfg
    fit, no_fit = plan_layouts(mm, work, hw, micro_batches)
    per_req = mm.stage_kv_bytes_per_request(Layout(), 0, work.avg_seq_len, work.page_size)
    lines = [
        f"meshserve memory ledger: {name} ({c.family}, {mm.num_params / 1e9:.2f}e9 parameters"
        f"{f', {c.num_experts} experts top-{c.num_experts_per_tok}' if c.is_moe else ''}), "
        f"weights {mm.dtype}, KV {mm.kv_dtype}",
        f"workload: {work.concurrency} concurrent requests x {work.avg_seq_len} tokens (page {work.page_size}: "
        f"{work.pages_per_request} pages each); largest step {work.max_batched_tokens} tokens per replica",
        f"devices: {hw.num_devices} x {fmt_bytes(hw.device_memory)}; HBM {hw.hbm_bandwidth / GB:.0f} GB/s; "
        f"link {link} {hw.link_bandwidth / GB:.0f} GB/s, {hw.link_latency * 1e6:.0f} us; "
        f"runtime reserve {hw.reserve_fraction:.0%} of each device",
        "units: GB = 1e9 bytes, GiB = 2^30 bytes",
        "",
        "Whole model (summed, before any layout):",
        f"  weights   {fmt_bytes(mm.weight_bytes)}  = {mm.num_params:,} params"
        + (f" ({c.quantization} matmul weights with their scales, the rest {mm.dtype})" if c.quantization
           else f" x {mm.act_itemsize} B"),
        f"  KV cache  {fmt_bytes(per_req * work.concurrency)}  = {mm.kv_bytes_per_token / KiB:g} KiB/token "
        f"({mm.kv_describe()}) x "
        f"{work.pages_per_request * work.page_size} tokens = {per_req / GiB:.3f} GiB/request, x {work.concurrency}",
    ]
    if mm.windows:  # the hybrid KV cache: a window layer holds its window's tokens only
        lines[-1] = (f"  KV cache  {fmt_bytes(per_req * work.concurrency)}  = {per_req / GiB:.3f} GiB/request x "
                     f"{work.concurrency} ({mm.kv_describe()})")
        lines.append("            a request: " + " + ".join(
            [f"{mm.pool_kv_bytes_per_token(None) / KiB:g} KiB/token x {work.pages_per_request * work.page_size} "
             "tokens (full attention)"] + [f"{mm.pool_kv_bytes_per_token(w) / KiB:g} KiB/token x "
                                           f"{mm.window_tokens(w, work.avg_seq_len, work.page_size)} tokens "
                                           f"(window {w})" for w in mm.windows]))
    naive = mm.weight_bytes + per_req * work.concurrency
    lines.append(f"  weights + KV alone need ceil({naive / GB:.1f} / {hw.device_memory / GB:.0f}) = "
                 f"{-(-naive // hw.device_memory)} devices before activations, buffers and reserve")
    best = fit[0] if fit else None
    if best:
        led = best.ledger
        lines += ["", f"Per-device breakdown, best layout {best.layout} (stage {led.stage} of {best.layout.pp}):"]
        for label, value in (("weights", led.weights), ("KV cache", led.kv_cache),
                             ("peak activations", led.activations), ("comm buffers", led.comm_buffers),
                             ("runtime reserve", led.reserve), ("total", led.total)):
            lines.append(f"  {label:<17}{fmt_bytes(value):>26}")
        lines.append(f"  free             {fmt_bytes(led.device_memory - led.total):>26}  of "
                     f"{fmt_bytes(led.device_memory)}")
    lines += ["", f"Layouts that fit on {hw.num_devices} devices ({len(fit)}), ranked by decode latency cost "
                  "(per-device GB; step ms = reads + TP AR + EP A2A + PP):",
              f"  {'#':>2} {'dp':>3} {'pp':>3} {'tp':>3} {'ep':>3} {'weights':>8} {'KV':>7} {'act':>6} {'comm':>6} "
              f"{'total':>7} {'step ms':>8} = {'reads':>6} + {'TP AR':>6} + {'EP A2A':>6} + {'PP':>6} "
              f"{'bubble':>6} {'tok/s':>8}"]
    for i, p in enumerate(fit[:show], 1):
        led, cost, lay = p.ledger, p.cost, p.layout
        lines.append(
            f"  {i:>2} {lay.dp:>3} {lay.pp:>3} {lay.tp:>3} {lay.ep:>3} {led.weights / GB:>8.2f} "
            f"{led.kv_cache / GB:>7.2f} "
            f"{led.activations / GB:>6.2f} {led.comm_buffers / GB:>6.2f} {led.total / GB:>7.2f} "
            f"{cost.step * 1e3:>8.2f} = {cost.reads * 1e3:>6.2f} + {cost.tp_allreduce * 1e3:>6.2f} + "
            f"{cost.ep_all_to_all * 1e3:>6.2f} + {cost.pp_bubble * 1e3:>6.2f} {cost.bubble_fraction:>6.0%} "
            f"{work.concurrency / cost.step:>8.0f}")
    if len(fit) > show:
        lines.append(f"  ... {len(fit) - show} more")
    if not fit:
        lines.append("  none")
    if no_fit:
        lines.append(f"Layouts that do not fit ({len(no_fit)}), per-device total GB: " + ", ".join(
            f"[{p.layout}] {p.ledger.total / GB:.1f}" for p in no_fit[:6]) + (" ..." if len(no_fit) > 6 else ""))
    least = fewest_devices(mm, work, hw, micro_batches, limit=max(64, hw.num_devices))
    lines.append("Fewest devices that fit: "
                 + (f"{least.layout.num_devices} ({least.layout}, {least.ledger.total / GB:.1f} GB per device)"
                    if least else "more than 64"))
    lines += ["", COST_EXPLANATION]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- engine-facing API

@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    free: int
    total: int
    source: str


def device_memory(device=None, fallback_bytes: int | None = None) -> DeviceMemory:
    """Free and total bytes of `device` (default: the first local device) from `memory_stats()`. The CPU backend
    reports none: then `fallback_bytes` if given, else the host's available memory split over the local
    devices (they share it), with the source saying so."""
    import jax
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        limit = int(stats["bytes_limit"])
        return DeviceMemory(limit - int(stats.get("bytes_in_use", 0)), limit, f"{device.platform} memory_stats()")
    if fallback_bytes:
        return DeviceMemory(int(fallback_bytes), int(fallback_bytes), "flag (the device reports no memory stats)")
    import psutil
    vm = psutil.virtual_memory()
    n = max(1, sum(d.platform == device.platform for d in jax.local_devices()))
    return DeviceMemory(vm.available // n, vm.total // n,
                        f"host available memory / {n} {device.platform} devices ({device.platform} reports no "
                        "memory stats)")


def window_pages(windows: Sequence[int], num_pages: int, page_size: int, max_seqs: int,
                 max_batched_tokens: int) -> dict[int, int]:
    """Each window pool's pages beside `num_pages` of the page table's (the hybrid KV cache's `windows`): what its
    sequences can hold at most (`models.kv_cache.window_pool_pages`), never more than num_pages."""
    return {w: min(num_pages, window_pool_pages(w, page_size, max_seqs, max_batched_tokens)) for w in windows}


def _pages_within(budget: float, page_bytes: int, windows: Sequence[tuple[int, int]] = ()) -> int:
    """The most pages P with P x page_bytes + sum(min(P, cap) x window_page_bytes) <= budget, `windows` as
    (window_page_bytes, cap): past its cap a window pool costs nothing more."""
    fixed, per_page = 0, page_bytes + sum(b for b, _ in windows)
    for b, cap in sorted(windows, key=lambda w: w[1]):
        if (budget - fixed) // per_page <= cap:
            break
        fixed, per_page = fixed + b * cap, per_page - b
    return int((budget - fixed) // per_page)


def plan_kv_pages(cfg: ModelConfig, *, dtype: str, page_size: int, free_bytes: int, mesh_shape,
                  weights_loaded: bool, kv_dtype: str | None = None, reserve_fraction: float = 0.05,
                  total_bytes: int | None = None, max_batched_tokens: int = 2048, max_seqs: int = 256,
                  rules: ShardingRules = DEFAULT_RULES, hybrid: bool = True) -> int:
    """How many KV pages (the global page axis of `KVCacheSpec.shape`, a multiple of dp) fit in `free_bytes` per
    device, after the runtime reserve (`reserve_fraction` of `total_bytes`, else of `free_bytes`), the largest
    step's activations and communication buffers, and the weights unless `weights_loaded` (free memory was
    measured with them resident). Uses the fullest pipeline stage. With `hybrid` (the engine's hybrid KV cache),
    the page table's pages: each window pool beside them has `window_pages`. Raises ValueError if not one page
    fits."""
    mm = ModelMemory(cfg, dtype, kv_dtype, rules, hybrid=hybrid and Layout.of(mesh_shape).pp == 1)
    layout = Layout.of(mesh_shape)
    hw = Hardware(device_memory=total_bytes or free_bytes, reserve_fraction=reserve_fraction)
    reserve = int(reserve_fraction * (total_bytes or free_bytes))
    act = peak_activation_bytes(mm, layout, max_batched_tokens, max_seqs, hw)
    comm = comm_buffer_bytes(mm, layout, max_batched_tokens, hw)
    pages = None
    for s in range(layout.pp):
        budget = free_bytes - reserve - act - comm - (0 if weights_loaded else mm.stage_weight_bytes(layout, s))
        if mm.windows:
            n = _pages_within(budget, page_size * mm.pool_kv_bytes_per_token(None, layout),
                              [(page_size * mm.pool_kv_bytes_per_token(w, layout),
                                window_pool_pages(w, page_size, max_seqs, max_batched_tokens)) for w in mm.windows])
        else:
            n = budget // (page_size * mm.stage_kv_bytes_per_token(layout, s))
        pages = n if pages is None else min(pages, n)
    if pages < 1:
        raise ValueError(
            f"no KV page fits: {fmt_bytes(free_bytes)} free per device minus reserve {fmt_bytes(reserve)}, "
            f"activations {fmt_bytes(act)}, buffers {fmt_bytes(comm)}"
            f"{'' if weights_loaded else ', weights'} leaves nothing on layout {layout}; use more devices, a "
            f"smaller max_batched_tokens or a smaller KV dtype")
    return int(pages) * layout.dp


def kv_cache_pages(cfg: ModelConfig, *, dtype: str, page_size: int, mesh_shape=None,
                   kv_cache_bytes: float | None = None, memory_fraction: float | None = None,
                   draft: ModelConfig | None = None, head_screen_bytes: int = 0, max_batched_tokens: int = 2048,
                   max_seqs: int = 256, kv_dtype: str | None = None, hybrid: bool = True) -> int:
    """An engine's KV pages, the one place they are sized (the engine and the server both call it). Either
    `kv_cache_bytes` for the whole cache (every layer, every device, the draft's pages too: a draft's cache uses the
    same page ids), or `memory_fraction` of each device's memory (vLLM's gpu_memory_utilization; at most what is
    free now) after the weights, the largest step's activations and buffers, the draft's weights and
    `head_screen_bytes` (the LM head's int8 screen), each page then paying for both caches. Raises ValueError if
    not one page fits. `kv_dtype`: a quantized cache's (`kv_dtype_of`), the draft's too; None: `dtype`. `hybrid`:
    the page table's pages of the engine's hybrid KV cache (each window pool has `window_pages` beside them)."""
    mm = ModelMemory(cfg, dtype, kv_dtype, hybrid=hybrid and Layout.of(mesh_shape or {}).pp == 1)
    if kv_cache_bytes is not None:
        draft_per_token = ModelMemory(draft, dtype, kv_dtype).kv_bytes_per_token if draft else 0
        if mm.windows:
            return max(1, _pages_within(kv_cache_bytes, page_size * (mm.pool_kv_bytes_per_token(None)
                                                                     + draft_per_token),
                                        [(page_size * mm.pool_kv_bytes_per_token(w),
                                          window_pool_pages(w, page_size, max_seqs, max_batched_tokens))
                                         for w in mm.windows]))
        per_token = mm.kv_bytes_per_token + draft_per_token
        return max(1, int(kv_cache_bytes // (page_size * per_token)))
    if memory_fraction is None:
        raise ValueError("kv_cache_pages: give kv_cache_bytes or memory_fraction")
    mem = device_memory()
    budget = min(int(memory_fraction * mem.total), mem.free) - head_screen_bytes  # this instance's share
    layout = Layout.of(mesh_shape or {})
    share = 1.0
    if draft is not None:
        one_page = draft_memory(draft, dtype=dtype, page_size=page_size, num_pages=layout.dp, mesh_shape=mesh_shape,
                                kv_dtype=kv_dtype)
        budget -= one_page["weights"]
        target_kv = mm.stage_kv_bytes_per_token(layout, 0)
        share = target_kv / (target_kv + one_page["kv_cache"] / page_size)
    return int(share * plan_kv_pages(cfg, dtype=dtype, page_size=page_size, free_bytes=budget,
                                     mesh_shape=mesh_shape or {}, weights_loaded=False, reserve_fraction=0.0,
                                     max_batched_tokens=max_batched_tokens, max_seqs=max_seqs, kv_dtype=kv_dtype,
                                     hybrid=hybrid))


def draft_memory(draft: ModelConfig, *, dtype: str, page_size: int, num_pages: int, mesh_shape=None,
                 kv_dtype: str | None = None) -> dict:
    """A speculative draft model's memory per device: weights and its KV buffers for `num_pages` pages, bytes."""
    mm = ModelMemory(draft, dtype, kv_dtype)
    layout = Layout.of(mesh_shape or {})
    weights = mm.stage_weight_bytes(layout, 0)
    kv = num_pages // layout.dp * page_size * mm.stage_kv_bytes_per_token(layout, 0)
    return dict(weights=weights, kv_cache=kv, total=weights + kv, params=mm.num_params)


def ledger_summary(cfg: ModelConfig, *, dtype: str, page_size: int, num_pages: int, mesh_shape,
                   kv_dtype: str | None = None, max_batched_tokens: int = 2048, max_seqs: int = 256,
                   device_total_bytes: int | None = None, reserve_fraction: float = 0.05,
                   rules: ShardingRules = DEFAULT_RULES, window_pages: dict[int, int] | None = None,
                   host_kv_bytes: int = 0) -> str:
    """A few lines for the server's start-up log: the per-device ledger of the running configuration, with
    `num_pages` the global page count (as returned by `plan_kv_pages`) and, with a hybrid KV cache, each window
    pool's pages (`window_pages`: window -> pages); `host_kv_bytes`: the host KV tier (host memory, per replica,
    outside the device total)."""
    mm = ModelMemory(cfg, dtype, kv_dtype, rules, hybrid=bool(window_pages))
    layout = Layout.of(mesh_shape)
    pages_per_replica = num_pages // layout.dp
    hw = Hardware(device_memory=device_total_bytes or 0, reserve_fraction=reserve_fraction)
    stage = max(range(layout.pp), key=lambda s: mm.stage_weight_bytes(layout, s)
                + pages_per_replica * page_size * mm.stage_kv_bytes_per_token(layout, s))
    weights = mm.stage_weight_bytes(layout, stage)
    kv = pages_per_replica * page_size * mm.stage_kv_bytes_per_token(layout, stage)
    pools = ""
    if mm.windows:
        kv = pages_per_replica * page_size * mm.pool_kv_bytes_per_token(None, layout) + sum(
            n // layout.dp * page_size * mm.pool_kv_bytes_per_token(w, layout) for w, n in window_pages.items())
        pools = "; window pools " + ", ".join(f"{w} tokens: {n // layout.dp} pages x "
                                              f"{mm.pool_kv_bytes_per_token(w) / KiB:g} KiB/token"
                                              for w, n in window_pages.items())
    act = peak_activation_bytes(mm, layout, max_batched_tokens, max_seqs, hw)
    comm = comm_buffer_bytes(mm, layout, max_batched_tokens, hw)
    reserve = int(reserve_fraction * device_total_bytes) if device_total_bytes else 0
    total = weights + kv + act + comm + reserve
    lines = [f"memory ledger per device ({layout}, fullest stage {stage}; GB = 1e9 B, GiB = 2^30 B):",
             f"  weights {fmt_bytes(weights)} ({mm.num_params:,} params, {dtype})",
             f"  KV cache {fmt_bytes(kv)}: {pages_per_replica} pages x {page_size} tokens per replica = "
             f"{pages_per_replica * page_size:,} tokens, {mm.pool_kv_bytes_per_token(None) / KiB:g} KiB/token "
             f"({mm.kv_dtype}){pools}",
             f"  peak activations {fmt_bytes(act)} ({max_batched_tokens} tokens, {max_seqs} seqs), comm buffers "
             f"{fmt_bytes(comm)}, runtime reserve {fmt_bytes(reserve)}",
             f"  total {fmt_bytes(total)}" + (f" of {fmt_bytes(device_total_bytes)}" if device_total_bytes else "")]
    if host_kv_bytes:
        lines.append(f"  host memory: KV tier {fmt_bytes(host_kv_bytes)} per replica (--host_kv_cache_gb; pages of "
                     f"every layer, unsharded: {fmt_bytes(page_size * mm.pool_kv_bytes_per_token(None))} per page)")
    if layout.pp > 1:
        sizes = [len(layers) for layers in mm.stage_layers(layout)]
        padded = [s for s in range(layout.pp) if mm.stage_padding_layers(layout, s)]
        lines.insert(1, f"  pipeline stages of {'+'.join(map(str, sizes))} layers, {mm.stage_slots(layout)} slots "
                        f"each" + (f" (padding slots on stages {padded}, in their weights and KV)" if padded else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI

def main(argv: Sequence[str]) -> None:
    from absl import app, flags
    f = flags.FLAGS
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if f.preset == SOURCE_70B:
        print(render_worked_example())
        return
    try:
        print(_report_from_flags(f))
    except (ValueError, OSError) as err:
        raise SystemExit(f"serving.ledger: {err}") from None  # a plain message, not the whole --help


def _report_from_flags(f) -> str:
    name, cfg = load_config(f.preset, f.model)
    dtype = f.dtype or (cfg.dtype if cfg.dtype in ("bfloat16", "float16") else "bfloat16")
    bandwidth, latency = LINK_PRESETS[f.link]
    hw = Hardware(device_memory=parse_size(f.device_memory), num_devices=f.num_devices,
                  hbm_bandwidth=f.hbm_bandwidth * GB, link_bandwidth=(f.link_bandwidth or bandwidth) * GB,
                  link_latency=(f.link_latency_us or latency) * 1e-6, reserve_fraction=f.reserve_fraction,
                  moe_capacity_factor=f.moe_capacity_factor)
    work = Workload(f.concurrency, f.avg_seq_len, f.page_size, f.max_batched_tokens, f.max_seqs)
    if f.quantization != "none":
        cfg = dataclasses.replace(cfg, quantization=f.quantization)
    kv_dtype = f.kv_dtype or kv_dtype_of(f.kv_cache_dtype) or dtype
    mm = ModelMemory(cfg, dtype, kv_dtype, hybrid=f.hybrid_kv_cache)
    return render_report(name, mm, work, hw, f.link, f.micro_batches, f.show)


def _define_flags() -> None:
    from absl import flags
    flags.DEFINE_string("preset", "", f"Built-in model: {', '.join(sorted(PRESETS))}, or {SOURCE_70B} (the "
                        "source's worked 70B example).")
    flags.DEFINE_string("model", "", "HF model directory or config.json path, GGUF file or directory, or Orbax "
                        "checkpoint (instead of --preset).")
    flags.DEFINE_string("dtype", "", "Weight/activation dtype (default: the checkpoint's, float32 -> bfloat16).")
    flags.DEFINE_enum("kv_cache_dtype", "auto", list(kv_quant.KV_CACHE_DTYPES), "KV-cache dtype, as the server's flag: "
                      "auto (--dtype) or a quantized cache (int8, fp8_e4m3: 1 B per value + a 4 B scale per row).")
    flags.DEFINE_string("kv_dtype", "", f"KV-cache dtype by name (overrides --kv_cache_dtype); one of "
                        f"{sorted(_ITEMSIZE)}.")
    flags.DEFINE_enum("quantization", "none", ["none", "int8", "fp8"], "Matmul weights quantized (1 B per value "
                      "+ a float32 scale per output channel).")
    flags.DEFINE_integer("concurrency", 256, "Requests holding KV at once, over all replicas.")
    flags.DEFINE_integer("avg_seq_len", 2048, "Average tokens per request (prompt + output).")
    flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
    flags.DEFINE_integer("max_batched_tokens", 2048, "Tokens in the largest step of one replica.")
    flags.DEFINE_integer("max_seqs", 0, "Sequences per step of one replica (0: all its requests).")
    flags.DEFINE_string("device_memory", "80GB", "Memory per device: '80GB' (1e9 B) or '80GiB' (2^30 B).")
    flags.DEFINE_integer("num_devices", 8, "Devices available.")
    flags.DEFINE_float("hbm_bandwidth", 3350.0, "Device memory bandwidth, GB/s (H100 SXM 3350, A100 2039, "
                       "H200 4800, TPU v5e 819, v5p 2765).")
    flags.DEFINE_enum("link", "nvlink", sorted(LINK_PRESETS), "Link preset: " + ", ".join(
        f"{k} {v[0]:g} GB/s {v[1]:g} us" for k, v in LINK_PRESETS.items()))
    flags.DEFINE_float("link_bandwidth", 0.0, "Override the link bandwidth per direction, GB/s.")
    flags.DEFINE_float("link_latency_us", 0.0, "Override the per-collective-step link latency, us.")
    flags.DEFINE_integer("micro_batches", 0, "Pipeline micro-batches (0: one per stage).")
    flags.DEFINE_float("reserve_fraction", 0.05, "Runtime reserve per device, as a fraction of its memory.")
    flags.DEFINE_float("moe_capacity_factor", 2.0, "Routed tokens per expert device over the mean.")
    flags.DEFINE_integer("show", 12, "How many fitting layouts to list.")
    flags.DEFINE_bool("hybrid_kv_cache", True, "As the server's flag: sliding-window layers of a model that also has "
                      "full-attention ones (Gemma 3) hold only their window's tokens (not with pipeline stages).")


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
