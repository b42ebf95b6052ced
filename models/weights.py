"""Weights: HF safetensors -> model, tensor by tensor onto each parameter's target sharding (`load_hf_model`,
`load_checkpoint`); Orbax save/restore (`save_orbax`, `load_orbax_model`); `load_model` and `read_config` for any
format (HF, GGUF through models.gguf, Orbax). Details: docs/models.md."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from models.config import DEEPSEEK_FAMILIES, ModelConfig
from models.gguf_files import is_gguf
from models.mxfp4 import dequantize_mxfp4
from models.quant import WEIGHT_QUANTIZATIONS, is_quantized, num_groups, quantize, scale_name
from models.quantized_checkpoint import CheckpointQuantization, QuantizedWeight, element_scales
from models.safetensors_io import CheckpointError, SafetensorsCheckpoint
from models.transformer import CausalLM
from sharding.experts import identity_placement
from sharding.rules import DEFAULT_RULES, ShardingRules

log = logging.getLogger(__name__)

_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")
Source = tuple[list[str], Callable[..., np.ndarray]]


def _hf_source(cfg: ModelConfig, path: tuple) -> Source:
    """The HF tensor names a parameter is built from, and how (numpy, our layout)."""
    e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = tuple(str(x) for x in path)
    ident = lambda w: w  # noqa: E731
    transpose = lambda w: w.T  # noqa: E731  HF Linear is [out, in]; ours is [in, out]
    if p == ("embed_tokens",):
        return ["model.embed_tokens.weight"], ident
    if p == ("lm_head",):
        return ["lm_head.weight"], transpose
    if p == ("norm", "weight"):
        return ["model.norm.weight"], ident
    if p[0] != "layers":
        raise CheckpointError(f"no HF source known for parameter {'/'.join(p)}")
    i, rest = int(p[1]), p[2:]
    pre = f"model.layers.{i}"
    if rest[0] in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm"):
        return [f"{pre}.{rest[0]}.weight"], ident
    if rest[0] == "self_attn" and cfg.is_mla:
        return _mla_source(cfg, f"{pre}.self_attn", rest[1])
    if rest[0] == "self_attn":
        a = f"{pre}.self_attn"
        heads = {"q": hq, "k": hkv, "v": hkv}
        name = rest[1]
        if name in ("q_proj", "k_proj", "v_proj"):
            h = heads[name[0]]
            if cfg.family == "phi3":  # fused qkv_proj [(hq + 2 hkv) d, e]: q rows, then k, then v
                start = {"q": 0, "k": hq * d, "v": (hq + hkv) * d}[name[0]]
                return [f"{a}.qkv_proj.weight"], \
                    lambda w: w[start:start + h * d].reshape(h, d, e).transpose(2, 0, 1)
            return [f"{a}.{name}.weight"], lambda w: w.reshape(h, d, e).transpose(2, 0, 1)
        if name == "o_proj":
            return [f"{a}.o_proj.weight"], lambda w: w.reshape(e, hq, d).transpose(1, 2, 0)
        if name in ("q_bias", "k_bias", "v_bias"):
            h = heads[name[0]]
            return [f"{a}.{name[0]}_proj.bias"], lambda b: b.reshape(h, d)
        if name == "o_bias":
            return [f"{a}.o_proj.bias"], ident
        if name in ("q_norm", "k_norm"):
            return [f"{a}.{name}.weight"], ident
        if name == "sinks":  # GPT-OSS
            return [f"{a}.sinks"], ident
    if rest[0] == "mlp":
        if not cfg.moe_layers[i]:
            if rest[1] == "shared_expert":
                raise CheckpointError(f"unexpected shared expert in dense layer {i}")
            if cfg.family == "phi3" and rest[1] in ("gate_proj", "up_proj"):  # fused gate_up_proj [2I, e]: gate first
                half = 0 if rest[1] == "gate_proj" else 1
                return [f"{pre}.mlp.gate_up_proj.weight"], lambda w: np.split(w, 2, axis=0)[half].T
            return [f"{pre}.mlp.{rest[1]}.weight"], transpose
        return _moe_source(cfg, i, rest[1:])
    raise CheckpointError(f"no HF source known for parameter {'/'.join(p)}")


def _rope_order(cfg: ModelConfig, width: int) -> np.ndarray:
    """Row order of a projection's output [.., width] whose last qk_rope_head_dim values are RoPE values: DeepSeek's
    interleaved pairs (x0, x1), (x2, x3), ... made rotate-half order (x0, x2, ..., x1, x3, ...), as HF's interleaved
    rotation outputs them; identity for a checkpoint already in rotate-half order."""
    order = np.arange(width)
    if cfg.rope_interleave:
        dr = cfg.qk_rope_head_dim
        rope = order[width - dr:]
        order[width - dr:] = np.concatenate([rope[0::2], rope[1::2]])
    return order


def _mla_source(cfg: ModelConfig, a: str, name: str) -> Source:
    """Multi-head latent attention's weights (models/mla.py layout) from DeepSeek's HF names."""
    e, h = cfg.hidden_size, cfg.num_heads
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if name in ("q_a_layernorm", "kv_a_layernorm"):
        return [f"{a}.{name}.weight"], lambda w: w
    if name == "q_a_proj":
        return [f"{a}.q_a_proj.weight"], lambda w: w.T
    if name in ("q_proj", "q_b_proj"):  # [H (Dn + Dr), K] -> [K, H, Dn + Dr], each head's RoPE part de-interleaved
        order = _rope_order(cfg, dn + dr)
        return [f"{a}.{name}.weight"], lambda w: w.reshape(h, dn + dr, -1)[:, order].transpose(2, 0, 1)
    if name == "kv_a_proj_with_mqa":  # [R + Dr, E] -> [E, R + Dr]
        order = _rope_order(cfg, r + dr)
        return [f"{a}.kv_a_proj_with_mqa.weight"], lambda w: w[order].T
    if name == "kv_b_proj":  # [H (Dn + Dv), R] -> [R, H, Dn + Dv]
        return [f"{a}.kv_b_proj.weight"], lambda w: w.reshape(h, dn + dv, r).transpose(2, 0, 1)
    if name == "o_proj":  # [E, H Dv] -> [H, Dv, E]
        return [f"{a}.o_proj.weight"], lambda w: w.reshape(e, h, dv).transpose(1, 2, 0)
    raise CheckpointError(f"no HF source known for multi-head latent attention parameter {name} ({a})")


def _gpt_oss_moe_source(cfg: ModelConfig, i: int, name: str) -> Source:
    """GPT-OSS's MoE as transformers stores it: router weight [N, E] and bias; the experts fused, gate_up_proj
    [N, E, 2I] with gate and up interleaved by column (gate the even ones), down_proj [N, I, E], and their biases."""
    m = f"model.layers.{i}.mlp"
    slots = np.arange(cfg.num_expert_slots or cfg.num_experts) % cfg.num_experts  # spare slots: replicas
    if name == "router":
        return [f"{m}.router.weight"], lambda w: w.T
    if name == "router_bias":
        return [f"{m}.router.bias"], lambda b: b
    half = {"gate_proj": 0, "up_proj": 1, "gate_bias": 0, "up_bias": 1}.get(name)
    if name in ("gate_proj", "up_proj", "down_proj") and cfg.mxfp4_experts:  # dequantised here (models.mxfp4)
        fused = "gate_up_proj" if name != "down_proj" else "down_proj"
        cols = slice(None) if name == "down_proj" else slice(half, None, 2)
        return [f"{m}.experts.{fused}_blocks", f"{m}.experts.{fused}_scales"], \
            lambda b, s: dequantize_mxfp4(b[slots], s[slots])[..., cols]
    if name in ("gate_proj", "up_proj"):
        return [f"{m}.experts.gate_up_proj"], lambda w: w[slots, :, half::2]
    if name in ("gate_bias", "up_bias"):
        return [f"{m}.experts.gate_up_proj_bias"], lambda b: b[slots, half::2]
    if name == "down_proj":
        return [f"{m}.experts.down_proj"], lambda w: w[slots]
    if name == "down_bias":
        return [f"{m}.experts.down_proj_bias"], lambda b: b[slots]
    raise CheckpointError(f"no HF source known for GPT-OSS MoE parameter {name} of layer {i}")


def _moe_source(cfg: ModelConfig, i: int, rest: tuple[str, ...]) -> Source:
    if cfg.family == "gpt_oss":
        return _gpt_oss_moe_source(cfg, i, rest[0])
    n = cfg.num_experts
    stack_t = lambda *ws: np.stack([w.T for w in ws])  # noqa: E731
    if cfg.family == "mixtral":
        m = f"model.layers.{i}.block_sparse_moe"
        per_expert = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
        router = f"{m}.gate.weight"
    else:
        m = f"model.layers.{i}.mlp"
        per_expert = {k: k for k in ("gate_proj", "up_proj", "down_proj")}
        router = f"{m}.gate.weight"
    name = rest[0]
    if name == "router":
        return [router], lambda w: w.T
    if name == "e_score_correction_bias":  # DeepSeek-V3's routing bias
        return [f"{m}.gate.e_score_correction_bias"], lambda b: b
    if name in per_expert:
        # Physical slots beyond the experts start as replicas of experts 0, 1, ... (sharding.experts).
        slots = cfg.num_expert_slots or n
        fill = lambda *ws: stack_t(*ws)[np.arange(slots) % n]  # noqa: E731
        return [f"{m}.experts.{j}.{per_expert[name]}.weight" for j in range(n)], fill
    if name == "shared_expert":
        shared = "shared_experts" if cfg.family in DEEPSEEK_FAMILIES else "shared_expert"
        return [f"{m}.{shared}.{rest[1]}.weight"], lambda w: w.T
    if name == "shared_expert_gate":
        return [f"{m}.shared_expert_gate.weight"], lambda w: w.T
    raise CheckpointError(f"no HF source known for MoE parameter {name} of layer {i}")


def contracting_axes(cfg: ModelConfig, path: tuple) -> tuple[int, ...]:
    """The contracting axes of the matmul weight at `path` in our layout (what its scales reduce over): the MoE
    expert stacks [S, K, N] contract axis 1, o_proj [Hq, D, E] axes 0-1, the others [K, ...] axis 0."""
    p = tuple(str(x) for x in path)
    if p[-1] == "o_proj":
        return (0, 1)
    if len(p) == 4 and p[0] == "layers" and p[2] == "mlp" and cfg.moe_layers[int(p[1])]:
        return (1,)
    return (0,)


def _alternative_source(ckpt: SafetensorsCheckpoint, names: list[str], fn, param: str) -> Source:
    """transformers >= 5 in-memory MoE layout: `mlp.` instead of `block_sparse_moe.`, and experts fused as
    gate_up_proj [N, 2I, E] (gate rows first) and down_proj [N, E, I]."""
    renamed = [n.replace(".block_sparse_moe.", ".mlp.") for n in names]
    if all(n in ckpt for n in renamed):
        return renamed, fn
    m = re.match(r"(.*)\.experts\.0\.", renamed[0])
    if m:
        gate_up, down = f"{m.group(1)}.experts.gate_up_proj", f"{m.group(1)}.experts.down_proj"
        n = len(names)
        if param in ("gate_proj", "up_proj") and gate_up in ckpt:
            half = 0 if param == "gate_proj" else 1
            return [gate_up], lambda w: fn(*np.split(w, 2, axis=1)[half][:n])
        if param == "down_proj" and down in ckpt:
            return [down], lambda w: fn(*w[:n])
    return names, fn


# A multimodal checkpoint's parts other than its language model (Gemma 3's SigLIP tower and projector): not loaded.
_VISION = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")


def _language_model_names(ckpt: SafetensorsCheckpoint) -> Callable[[str], str]:
    """How the checkpoint names the language model's tensors, as a map from the text model's names: as they are,
    or under a multimodal model's `language_model` (Gemma3ForConditionalGeneration: transformers 5 writes
    model.language_model.X, the published checkpoints language_model.model.X and language_model.lm_head)."""
    if "model.embed_tokens.weight" in ckpt:
        return lambda name: name
    if "model.language_model.embed_tokens.weight" in ckpt:
        return lambda name: "model.language_model." + name[len("model."):] if name.startswith("model.") else name
    if "language_model.model.embed_tokens.weight" in ckpt:
        return lambda name: "language_model." + name
    return lambda name: name


def param_sharding(axes, shape, mesh: Mesh | None, rules: ShardingRules):
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return rules.named_sharding(mesh, axes, shape)


def abstract_model(cfg: ModelConfig, dtype=jnp.float32) -> CausalLM:
    """The model with shapes and logical axes only; no memory allocated."""
    return nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def with_quantization(cfg: ModelConfig, quantization: str | None) -> ModelConfig:
    """`cfg` with its matmul weights quantized at load as `quantization` asks ("int8", "fp8"; None / "" / "none":
    as the checkpoint holds them). A checkpoint quantized already keeps its own scheme; asking for another fails."""
    if not quantization or quantization == "none":
        return cfg
    if quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {('none',) + WEIGHT_QUANTIZATIONS}, got {quantization!r}")
    if cfg.quantization and cfg.quantization != quantization:
        raise ValueError(f"the checkpoint holds {cfg.quantization} weights; it cannot be loaded as {quantization}")
    return dataclasses.replace(cfg, quantization=quantization)


def load_hf_model(model_dir: str, *, dtype=jnp.float32, mesh: Mesh | None = None,
                  rules: ShardingRules = DEFAULT_RULES, config: ModelConfig | None = None,
                  quantization: str | None = None) -> CausalLM:
    """Loads an HF safetensors checkpoint (single file or sharded) into a CausalLM placed on `mesh`; with
    `quantization` ("int8" / "fp8") its float matmul weights are quantized as they load (models.quant)."""
    cfg = with_quantization(config or ModelConfig.from_pretrained(model_dir), quantization)
    return load_checkpoint(SafetensorsCheckpoint(model_dir), cfg, model_dir, dtype=dtype, mesh=mesh, rules=rules,
                           ckpt_quant=_checkpoint_quantization(model_dir))


def load_gguf_model(path: str, *, dtype=jnp.float32, mesh: Mesh | None = None, rules: ShardingRules = DEFAULT_RULES,
                    config: ModelConfig | None = None, quantization: str | None = None) -> CausalLM:
    """A GGUF model (file, split parts or a directory holding one; models.gguf) as `load_hf_model` loads HF ones: each
    tensor dequantized as it is read, placed on its parameter's sharding, then quantized as `quantization` asks."""
    from models.gguf import GGUFCheckpoint, GGUFModel, config_from_gguf  # the gguf package only for GGUF models
    model = GGUFModel.open(path)
    cfg = with_quantization(config or config_from_gguf(model), quantization)
    # Weights quantized after loading start from float32, not from a rounding to the serving dtype.
    ckpt = GGUFCheckpoint(model, cfg, dtype=np.float32 if cfg.quantization else np.dtype(dtype))
    return load_checkpoint(ckpt, cfg, path, dtype=dtype, mesh=mesh, rules=rules)


def load_checkpoint(ckpt, cfg: ModelConfig, where: str, *, dtype=jnp.float32, mesh: Mesh | None = None,
                    rules: ShardingRules = DEFAULT_RULES, ckpt_quant: CheckpointQuantization | None = None
                    ) -> CausalLM:
    """The CausalLM of `cfg` from `ckpt` (HF tensor names and layout: a `SafetensorsCheckpoint`, or a GGUF file seen
    as one, `models.gguf.GGUFCheckpoint`), parameter by parameter onto `mesh`; `where` names it in errors."""
    t0 = time.perf_counter()
    graphdef, state, rest = nnx.split(abstract_model(cfg, dtype), nnx.Param, ...)
    used: set[str] = set()
    flat = dict(nnx.to_flat_state(state))
    rename = _language_model_names(ckpt)
    for path, var in flat.items():
        if str(path[-1]).endswith("_scale") and path[:-1] + (str(path[-1])[:-len("_scale")],) in flat:
            continue  # set with its weight
        names, fn = _hf_source(cfg, path)
        names = [rename(n) for n in names]
        stored = _stored_quantized(ckpt_quant, ckpt, names, path)
        if stored is not None:
            used.update(t for q in stored for t in q.tensors)
            _set_from_quantized(cfg, path, var, flat, stored, fn, mesh, rules)
            continue
        if any(n not in ckpt for n in names):
            names, fn = _alternative_source(ckpt, names, fn, str(path[-1]))
        missing = [n for n in names if n not in ckpt]
        if missing:
            raise CheckpointError(f"tensor {missing[0]!r} is missing from the checkpoint in {where!r} "
                                  f"(needed for parameter {'/'.join(map(str, path))})")
        used.update(names)
        try:
            host = fn(*[ckpt.get(n) for n in names])
        except ValueError as err:
            shapes = {n: ckpt.shape(n) for n in names[:2]}
            raise CheckpointError(f"tensor {names[0]!r} has shape {shapes[names[0]]}, which does not fit parameter "
                                  f"{'/'.join(map(str, path))} of shape {tuple(var.shape)} ({err})") from None
        if tuple(host.shape) != tuple(var.shape):
            raise CheckpointError(f"tensor {names[0]!r} has shape {ckpt.shape(names[0])} -> {tuple(host.shape)} "
                                  f"in our layout, expected {tuple(var.shape)} for {'/'.join(map(str, path))}")
        if not (np.issubdtype(host.dtype, np.floating) or host.dtype == jnp.bfloat16):
            raise CheckpointError(f"tensor {names[0]!r} has dtype {host.dtype}, which cannot be cast to {dtype}")
        if is_quantized(var):
            scale_var = flat[path[:-1] + (scale_name(str(path[-1])),)]
            host, scale = quantize(host, contracting_axes(cfg, path), cfg.weight_quant)
            _set(scale_var, scale, mesh, rules)
        _set(var, host, mesh, rules)
    vision = [n for n in ckpt.names() if _VISION.search(n)]
    if vision:
        log.info("%s: %d tensors of the vision tower and projector not loaded (meshserve serves the language model: "
                 "text in, text out)", where, len(vision))
    unused = [n for n in ckpt.names() if n not in used and not _IGNORED.search(n) and not _VISION.search(n)
              and not (n == rename("lm_head.weight") and cfg.tie_word_embeddings)
              and not (ckpt_quant is not None and ckpt_quant.kv_cache and _KV_SCALES.search(n))
              and not _next_token_layer(cfg, n)]
    if unused:
        raise CheckpointError(f"{len(unused)} checkpoint tensors are not used by the {cfg.family} model, e.g. "
                              f"{unused[:3]} — an option the config does not declare?")
    model = nnx.merge(graphdef, state, _init_routing_state(rest, cfg, mesh))
    log.info("loaded %s from %s in %.2fs", cfg.family, where, time.perf_counter() - t0)
    return model


# Parameters that are HF Linear weights (a pre-quantized checkpoint may hold any of them quantized).
_LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "router",
           "shared_expert_gate", "lm_head", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
# compressed-tensors' static KV-cache scales: our quantized cache keeps a scale per token (--kv_cache_dtype)
_KV_SCALES = re.compile(r"\.(k_scale|v_scale)$")


def _next_token_layer(cfg: ModelConfig, name: str) -> bool:
    """A DeepSeek-V3 multi-token-prediction layer's tensor (model.layers.<num_layers and past>): a draft module for
    speculation that serving does not use (HF skips it on load too)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return cfg.family in DEEPSEEK_FAMILIES and m is not None and int(m.group(1)) >= cfg.num_layers


def _checkpoint_quantization(model_dir: str) -> CheckpointQuantization | None:
    with open(os.path.join(model_dir, "config.json")) as f:
        q = CheckpointQuantization.from_config(json.load(f))
    if q is not None and q.kv_cache:
        log.info("%s: the checkpoint's static KV-cache scales are not used (--kv_cache_dtype quantizes the cache "
                 "with a scale per token)", model_dir)
    return q


def _stored_quantized(ckpt_quant, ckpt, names: list[str], path) -> list[QuantizedWeight] | None:
    """The checkpoint's quantized tensors behind a parameter, or None when it holds them in floating point."""
    if ckpt_quant is None or str(path[-1]) not in _LINEAR:
        return None
    stored = [ckpt_quant.read_linear(ckpt, n) for n in names]
    if all(q is None for q in stored):
        return None
    if any(q is None for q in stored):
        raise CheckpointError(f"{names[0]!r}: the checkpoint quantizes some of the tensors of parameter "
                              f"{'/'.join(map(str, path))} and not others")
    return stored


def _set_from_quantized(cfg: ModelConfig, path, var, flat, stored: list[QuantizedWeight], fn, mesh, rules) -> None:
    """Sets a parameter from a checkpoint's quantized tensors: as they are (values in our layout, scales mapped with
    them) when the model holds it quantized, else dequantized (e.g. a router the checkpoint quantized)."""
    where = "/".join(map(str, path))
    if not is_quantized(var):
        host = fn(*[q.dequantize() for q in stored])
    else:
        if any(q.values.dtype != var.dtype for q in stored):
            raise CheckpointError(f"{where}: the checkpoint holds {stored[0].values.dtype} values, the model "
                                  f"{var.dtype}")
        host = fn(*[q.values for q in stored])
        # Each element's scale, moved to our layout like the values, then one per output column per group.
        per_element = fn(*[element_scales(q.scales, q.block, q.values.shape) for q in stored])
        contract = contracting_axes(cfg, path)
        c0, c1 = contract[0], contract[-1] + 1
        lead, k, out = per_element.shape[:c0], int(np.prod(per_element.shape[c0:c1])), per_element.shape[c1:]
        group = cfg.quantization_group
        rows = group if group and k > group else k
        scale = np.ascontiguousarray(per_element.reshape(lead + (num_groups(k, group), rows) + out)[
            (slice(None),) * len(lead) + (slice(None), 0)])
        if not group:
            scale = scale.reshape(lead + out)
        scale_var = flat[path[:-1] + (scale_name(str(path[-1])),)]
        if scale.shape != tuple(scale_var.shape):
            raise CheckpointError(f"{where}: scales of shape {scale.shape}, expected {tuple(scale_var.shape)}")
        _set(scale_var, scale, mesh, rules)
    if tuple(host.shape) != tuple(var.shape):
        raise CheckpointError(f"{where}: the checkpoint's tensors give shape {tuple(host.shape)}, expected "
                              f"{tuple(var.shape)}")
    _set(var, host, mesh, rules)


def _init_routing_state(rest, cfg: ModelConfig, mesh: Mesh | None):
    """Concrete values for the non-parameter state (MoE expert maps: the identity placement)."""
    sharding = SingleDeviceSharding(jax.devices()[0]) if mesh is None else \
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if cfg.num_experts:
        slots = cfg.num_expert_slots or cfg.num_experts
        table, count = identity_placement(cfg.num_experts, slots, 1).replica_table()
    for path, var in nnx.to_flat_state(rest):
        value = {"replica_slots": table, "replica_count": count}[str(path[-1])]
        var.set_value(jax.device_put(value, sharding))
    return rest


def _set(var, host: np.ndarray, mesh: Mesh | None, rules: ShardingRules) -> None:
    """Sets parameter `var` to `host` in its dtype, placed on its sharding under `mesh`."""
    var.set_value(_place(host, var.dtype, param_sharding(var.get_metadata().get("axes"), var.shape, mesh, rules)))


def _place(host: np.ndarray, dtype, sharding) -> jax.Array:
    def shard(index):
        return np.ascontiguousarray(host[index]).astype(dtype)
    return jax.make_array_from_callback(host.shape, sharding, shard)


# --------------------------------------------------------------------------- Orbax

_META = "meshserve_model.json"


def save_orbax(model: CausalLM, out_dir: str, *, hf_dir: str | None = None) -> None:
    """Saves parameters as an Orbax checkpoint under `out_dir/params`, with the config (and, from `hf_dir`,
    tokenizer files) beside it."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(out_dir, "params"), nnx.to_pure_dict(state), force=True)
    dtype = str(model.embed_tokens[...].dtype)  # the float parameters' (quantized weights keep their own)
    with open(os.path.join(out_dir, _META), "w") as f:
        json.dump({"config": model.config.to_dict(), "param_dtype": dtype}, f, indent=1)
    if hf_dir:
        for name in os.listdir(hf_dir):
            if name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")) or \
                    name == "config.json":
                shutil.copy(os.path.join(hf_dir, name), out_dir)


def is_orbax_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, _META))


def load_orbax_model(ckpt_dir: str, *, dtype=None, mesh: Mesh | None = None,
                     rules: ShardingRules = DEFAULT_RULES) -> CausalLM:
    """Restores an Orbax checkpoint onto `mesh` (any layout: each array is restored to its new sharding)."""
    import orbax.checkpoint as ocp

    t0 = time.perf_counter()
    ckpt_dir = os.path.abspath(ckpt_dir)
    with open(os.path.join(ckpt_dir, _META)) as f:
        meta = json.load(f)
    cfg = ModelConfig.from_dict(meta["config"])
    dtype = dtype or jnp.dtype(meta["param_dtype"])
    graphdef, state, rest = nnx.split(abstract_model(cfg, dtype), nnx.Param, ...)
    target = {}
    for path, var in nnx.to_flat_state(state):
        sharding = param_sharding(var.get_metadata().get("axes"), var.shape, mesh, rules)
        target[path] = jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding)
    target_tree = nnx.to_pure_dict(nnx.from_flat_state(target))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(os.path.join(ckpt_dir, "params"), target_tree)
    nnx.replace_by_pure_dict(state, restored)
    log.info("restored %s from Orbax %s in %.2fs", cfg.family, ckpt_dir, time.perf_counter() - t0)
    return nnx.merge(graphdef, state, _init_routing_state(rest, cfg, mesh))


def model_format(path: str) -> str:
    """"orbax" (a `models.convert` checkpoint), "gguf" (a GGUF file, its split parts, or a directory holding one) or
    "hf" (a directory with config.json and safetensors) for the model at `path`."""
    if os.path.isdir(path) and is_orbax_dir(path):
        return "orbax"
    return "gguf" if is_gguf(path) else "hf"


def read_config(path: str) -> ModelConfig:
    """The ModelConfig of the model at `path`, in any format `load_model` reads (an HF config.json path too)."""
    if os.path.isfile(path) and path.endswith(".json"):
        with open(path) as f:
            return ModelConfig.from_hf(json.load(f))
    kind = model_format(path)
    if kind == "orbax":
        with open(os.path.join(path, _META)) as f:
            return ModelConfig.from_dict(json.load(f)["config"])
    if kind == "gguf":
        from models.gguf import GGUFModel, config_from_gguf
        return config_from_gguf(GGUFModel.open(path))
    return ModelConfig.from_pretrained(path)


def load_model(path: str, *, dtype=None, mesh: Mesh | None = None, rules: ShardingRules = DEFAULT_RULES,
               quantization: str | None = None, config: ModelConfig | None = None) -> CausalLM:
    """An HF directory, a GGUF model (`models.gguf`) or an Orbax checkpoint made by `models.convert`; `quantization`
    as `load_hf_model` (an Orbax checkpoint holds its weights as saved: asking for another quantization fails);
    `config` replaces the checkpoint's own (HF and GGUF only)."""
    kind = model_format(path)
    if kind == "orbax":
        if config is not None:
            raise ValueError(f"{path} is an Orbax checkpoint: it restores with the config it was saved with")
        model = load_orbax_model(path, dtype=dtype, mesh=mesh, rules=rules)
        with_quantization(model.config, quantization)  # validates
        if quantization and quantization != "none" and not model.config.quantization:
            raise ValueError(f"{path} holds float weights; quantize when converting (python -m models.convert "
                             f"--quantization={quantization}) or load the HF checkpoint with quantization")
        return model
    if kind == "gguf":
        return load_gguf_model(path, dtype=dtype or jnp.float32, mesh=mesh, rules=rules, config=config,
                               quantization=quantization)
    return load_hf_model(path, dtype=dtype or jnp.float32, mesh=mesh, rules=rules, quantization=quantization,
                         config=config)
