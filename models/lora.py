"""LoRA adapters in the model: the adapter slot stacks a projection carries when serving adapters (`LoRAProjection`:
A [slots, rank, in..] (PEFT's lora_A layout), B [slots, rank, out..] with PEFT's scaling folded into B, each slot's
rank), which projections take them (`lora_targets`), and PEFT checkpoints read into that layout (`read_peft_adapter`,
`AdapterError`). Details: docs/lora.md."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.safetensors_io import CheckpointError, SafetensorsFile
from pallas_kernels.lora import (INT8_RANK_ROWS, ROWS, lora_delta, lora_delta_int8, lora_delta_int8_parts,
                                 lora_delta_parts)
from sharding.axes import EMBED, HEAD_DIM, HEADS, KV_HEADS, LORA_RANK, LORA_SLOTS, MLP

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served on this model (the message names the adapter and why)."""


class LoRAWeight(nnx.Variable):
    """Adapter slot stacks (`LoRAProjection`); not a parameter: serving-only state, written slot by slot."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A projection LoRA may adapt: its input and output dims in our weight layout, and their logical axes."""
    in_shape: tuple[int, ...]
    in_axes: tuple[str, ...]
    out_shape: tuple[int, ...]
    out_axes: tuple[str, ...]

    @property
    def in_features(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_features(self) -> int:
        return math.prod(self.out_shape)


def lora_targets(cfg: ModelConfig, layer: int) -> dict[str, Target]:
    """The projections of `layer` that carry LoRA stacks: attention's q/k/v/o, and a dense layer's gate/up/down (a
    mixture-of-experts layer's experts take none)."""
    e, hq, hkv, d, i = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    out = {"q_proj": Target((e,), (EMBED,), (hq, d), (HEADS, HEAD_DIM)),
           "k_proj": Target((e,), (EMBED,), (hkv, d), (KV_HEADS, HEAD_DIM)),
           "v_proj": Target((e,), (EMBED,), (hkv, d), (KV_HEADS, HEAD_DIM)),
           "o_proj": Target((hq, d), (HEADS, HEAD_DIM), (e,), (EMBED,))}
    if not cfg.moe_layers or not cfg.moe_layers[layer]:
        out |= {"gate_proj": Target((e,), (EMBED,), (i,), (MLP,)), "up_proj": Target((e,), (EMBED,), (i,), (MLP,)),
                "down_proj": Target((i,), (MLP,), (e,), (EMBED,))}
    return out


class LoRAProjection(nnx.Module):
    """One projection's adapter slots: `a` [slots, rank, *in] (A transposed, as PEFT's lora_A: an adapter's first r
    rows are contiguous, all a rank-r adapter's update reads), `b` [slots, rank, *out] (scaling folded in), `ranks`
    [slots] (0: the slot's adapter leaves this projection alone). Split over a mesh as the weight it modifies (the
    in and out axes' rules: B of a column-parallel projection by its output, A of a row-parallel one by its input).
    `int8` (EngineConfig.lora_dtype): a, b int8 in `pallas_kernels.lora.quantize_adapter`'s layouts with `scale`
    [slots, rank] float32, on one device."""

    def __init__(self, target: Target, max_loras: int, max_rank: int, dtype, sharding=None, int8: bool = False):
        def zeros(shape, axes, dt):
            device = sharding(axes, shape) if sharding is not None else None
            return LoRAWeight(jnp.zeros(shape, dt, device=device), axes=axes)

        # The stacks' shapes as [slots, rank, *in] and [slots, rank, *out] whatever their storage (slot writes).
        self.a_shape = (max_loras, max_rank, *target.in_shape)
        self.b_shape = (max_loras, max_rank, *target.out_shape)
        self.int8 = int8
        if int8:
            k, n = math.prod(target.in_shape), math.prod(target.out_shape)
            self.a = LoRAWeight(jnp.zeros((max_loras, max_rank // INT8_RANK_ROWS, -(-k // 4), INT8_RANK_ROWS, 4),
                                          jnp.int8))
            self.b = LoRAWeight(jnp.zeros((max_loras, max_rank * n), jnp.int8))
            self.scale = LoRAWeight(jnp.zeros((max_loras, max_rank), jnp.float32))
        else:
            self.a = zeros(self.a_shape, (LORA_SLOTS, LORA_RANK, *target.in_axes), dtype)
            self.b = zeros(self.b_shape, (LORA_SLOTS, LORA_RANK, *target.out_axes), dtype)
        self.ranks = zeros((max_loras,), (LORA_SLOTS,), jnp.int32)
        # Each slot's A, B (flattened to [rank, in], [rank, out]) in that `pallas_kernels.lora.to_layout` form: set by
        # the engine where the native kernel runs the update (ModelRunner); the slot writes then store them so.
        self.a_layout = self.b_layout = ROWS

    def __call__(self, x: jax.Array, slots: jax.Array) -> jax.Array:
        """Pure. The update of x [T, in] ([T, out]) for each token's slot (`slots` [T], < 0: none)."""
        a, b = self.a[...], self.b[...]
        if self.int8:
            return lora_delta_int8(x, slots, a, b, self.scale[...], self.ranks[...])
        n, r = a.shape[:2]
        return lora_delta(x, slots, a.reshape(n, r, -1), b.reshape(n, r, -1), self.ranks[...], self.a_layout,
                          self.b_layout)


class LoRAStacks(nnx.Module):
    """A layer part's LoRAProjections, one attribute per projection name."""

    def __init__(self, targets: dict[str, Target], max_loras: int, max_rank: int, dtype, sharding=None,
                 int8: bool = False):
        for name, target in targets.items():
            setattr(self, name, LoRAProjection(target, max_loras, max_rank, dtype, sharding, int8))


def apply_lora(stacks: LoRAStacks | None, name: str, x: jax.Array, y: jax.Array, slots: jax.Array | None) -> jax.Array:
    """Pure. `y` (projection `name`'s output of x [T, in], any shape with T leading) plus its adapters' update; `y`
    as it is without stacks or slots (a step of the base model only)."""
    if stacks is None or slots is None:
        return y
    return y + getattr(stacks, name)(x.reshape(x.shape[0], -1), slots).reshape(y.shape)


def apply_lora_parts(stacks: LoRAStacks | None, names: tuple[str, ...], x: jax.Array, ys: tuple[jax.Array, ...],
                     slots: jax.Array | None) -> tuple[jax.Array, ...]:
    """Pure. `apply_lora` for projections of one x (q|k|v, gate|up): one native call for all of them
    (`pallas_kernels.lora.lora_delta_int8_parts` on int8 stacks, `lora_delta_parts` on stacks in one layout), else
    one per projection."""
    if stacks is None or slots is None:
        return ys
    projections = [getattr(stacks, name) for name in names]
    xf = x.reshape(x.shape[0], -1)
    if all(p.int8 for p in projections):
        deltas = lora_delta_int8_parts(xf, slots, [(p.a[...], p.b[...], p.scale[...], p.ranks[...])
                                                   for p in projections])
    elif not any(p.int8 for p in projections) and len({(p.a_layout, p.b_layout) for p in projections}) == 1:
        flat = lambda w: w.reshape(*w.shape[:2], -1)  # noqa: E731  ([slots, rank, ...] as [slots, rank, in or out])
        deltas = lora_delta_parts(xf, slots, [(flat(p.a[...]), flat(p.b[...]), p.ranks[...]) for p in projections],
                                  projections[0].a_layout, projections[0].b_layout)
    else:
        return tuple(apply_lora(stacks, name, x, y, slots) for name, y in zip(names, ys))
    return tuple(y + d.reshape(y.shape) for y, d in zip(ys, deltas))


# ---------------------------------------------------------------------------------------------------------
# PEFT checkpoints.

_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?"
                       r"\.weight")
# adapter_config.json options that change what the adapter computes beyond x @ A @ B * scaling: refused.
_REFUSED_OPTIONS = {"use_dora": "DoRA", "lora_bias": "LoRA bias", "fan_in_fan_out": "fan_in_fan_out (Conv1D bases)",
                    "modules_to_save": "modules_to_save (fully trained modules)",
                    "layer_replication": "layer_replication", "target_parameters": "target_parameters (MoE experts)",
                    "trainable_token_indices": "trainable_token_indices", "use_qalora": "QALoRA"}


@dataclasses.dataclass(frozen=True)
class PeftModule:
    """One adapted projection of a PEFT adapter: its tensors' names, rank and scaling."""
    layer: int
    name: str
    a_key: str
    b_key: str
    rank: int
    scaling: float


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter checked against a model (`read_peft_adapter`); `weights` reads its tensors."""
    path: str
    rank: int  # the largest rank of its projections
    modules: tuple[PeftModule, ...]

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({m.name for m in self.modules}))

    def weights(self, cfg: ModelConfig) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
        """Host-side. Per (layer, projection): A [r, *in] and B [r, *out] in our layout, float32, B times the
        scaling."""
        f = SafetensorsFile(os.path.join(self.path, ADAPTER_WEIGHTS))
        out = {}
        for m in self.modules:
            t = lora_targets(cfg, m.layer)[m.name]
            a = np.asarray(f.get(m.a_key), np.float32).reshape(m.rank, *t.in_shape)  # PEFT's lora_A: [r, in]
            b = (np.asarray(f.get(m.b_key), np.float32).T * np.float32(m.scaling)).reshape(m.rank, *t.out_shape)
            out[m.layer, m.name] = (a, b)
        return out


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern matching the module's name as a suffix."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_peft_adapter(path: str, cfg: ModelConfig, max_rank: int) -> PeftAdapter:
    """The PEFT LoRA adapter in directory `path` (adapter_config.json + adapter_model.safetensors), checked against
    model `cfg` and `max_rank` from its config and tensor headers (no tensor data read). Raises AdapterError naming
    what does not fit: a missing file, an option that changes the computation (DoRA, biases, modules_to_save, ...),
    a tensor of a module we do not adapt, a rank above `max_rank`, shapes unlike the base projection's."""
    def refuse(why: str):
        return AdapterError(f"LoRA adapter {path!r}: {why}")

    config_path = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise refuse(f"no {ADAPTER_CONFIG} (a PEFT adapter directory holds {ADAPTER_CONFIG} and "
                     f"{ADAPTER_WEIGHTS})") from None
    except (OSError, ValueError) as e:
        raise refuse(f"{ADAPTER_CONFIG} is unreadable ({e})") from None
    if not isinstance(config, dict):
        raise refuse(f"{ADAPTER_CONFIG} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    refused = [what for key, what in _REFUSED_OPTIONS.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        refused.append(f"bias={config['bias']!r} (trained biases of the base)")
    if refused:
        raise refuse(f"uses {', '.join(refused)}, which meshserve does not serve (plain LoRA only)")
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.exists(weights_path):
        bin_file = os.path.exists(os.path.join(path, "adapter_model.bin"))
        raise refuse(f"no {ADAPTER_WEIGHTS}" + (" (adapter_model.bin is a pickle: meshserve loads safetensors only;"
                                                " re-save the adapter with safe_serialization=True)" if bin_file
                                                else ""))
    try:
        f = SafetensorsFile(weights_path)
    except CheckpointError as e:
        raise refuse(str(e)) from None
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    alpha_pattern = config.get("alpha_pattern") or {}
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in f.keys():
        m = _PEFT_KEY.fullmatch(key)
        if m is None:
            raise refuse(f"tensor {key!r} is not a LoRA A/B weight of an attention or MLP projection (what "
                         f"meshserve adapts: {', '.join(LORA_TARGETS)})")
        layer, part, name, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer >= cfg.num_layers:
            raise refuse(f"tensor {key!r} is for layer {layer}; the model has {cfg.num_layers} layers")
        if name not in (ATTENTION_TARGETS if part == "self_attn" else MLP_TARGETS):
            raise refuse(f"tensor {key!r}: module {part}.{name} is not one meshserve adapts "
                         f"({', '.join(LORA_TARGETS)})")
        if name not in lora_targets(cfg, layer):
            raise refuse(f"tensor {key!r} adapts mlp.{name} of layer {layer}, a mixture-of-experts layer (LoRA on "
                         "experts is not supported)")
        pairs.setdefault((layer, f"{part}.{name}"), {})[which] = key
    if not pairs:
        raise refuse(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    modules = []
    for (layer, module), keys in sorted(pairs.items()):
        name = module.split(".")[1]
        if len(keys) != 2:
            raise refuse(f"layer {layer} {module} has only lora_{next(iter(keys))} (LoRA needs lora_A and lora_B)")
        target = lora_targets(cfg, layer)[name]
        (r, k_in), (n_out, r_b) = f.shape(keys["A"]), f.shape(keys["B"])
        if k_in != target.in_features or n_out != target.out_features or r != r_b:
            raise refuse(f"layer {layer} {name}: lora_A {list(f.shape(keys['A']))} and lora_B "
                         f"{list(f.shape(keys['B']))} do not fit the base projection [{target.out_features}, "
                         f"{target.in_features}] (out, in) (an adapter of another base model?)")
        if not 1 <= r <= max_rank:
            raise refuse(f"layer {layer} {name} has rank {r}; this engine's max_lora_rank is {max_rank} "
                         "(raise --max_lora_rank)")
        module_alpha = float(_pattern_value(alpha_pattern, f"model.layers.{layer}.{module}", alpha))
        scaling = module_alpha / math.sqrt(r) if rslora else module_alpha / r
        modules.append(PeftModule(layer, name, keys["A"], keys["B"], r, scaling))
    return PeftAdapter(path, max(m.rank for m in modules), tuple(modules))
