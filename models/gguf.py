"""GGUF, llama.cpp's model file: `gguf_files` (a file, its split -0000k-of-0000n parts, or the model in a directory),
`GGUFModel` (the header parsed, tensors memory-mapped and dequantized one at a time by gguf's reference code),
`config_from_gguf` (metadata -> ModelConfig) and `GGUFCheckpoint` (the tensors under the HF names and layout they were
converted from), which `models.weights.load_model` loads; `models.tokenizer` rebuilds the tokenizer. Details:
docs/models.md."""
from __future__ import annotations

import dataclasses
import math
import mmap
import re
import struct
from typing import Any

import gguf
import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from models.config import ModelConfig, RopeConfig, UnsupportedModelError
from models.gguf_files import GGUFError, gguf_files, is_gguf  # noqa: F401  (re-exported)
from models.safetensors_io import CheckpointError

# llama.cpp architecture -> our family (a "llama" with experts is Mixtral; Mistral's dense models are "llama" too)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                 "gemma3": "gemma3", "phi3": "phi3", "deepseek2": "deepseek_v2",
                 "gpt-oss": "gpt_oss"}
# What llama.cpp's gemma3 does not read from the file but hard-codes: every sixth layer global, the local layers'
# RoPE base, and the 27B (62 layers) softmax scale of 1 / sqrt(hidden / heads) instead of 1 / sqrt(head_dim)
GEMMA3_GLOBAL_EVERY, GEMMA3_LOCAL_ROPE_BASE, GEMMA3_27B_LAYERS = 6, 10000.0, 62
# ... and for gpt-oss: every second layer global, the SwiGLU's clamp and sigmoid scale
GPT_OSS_GLOBAL_EVERY, GPT_OSS_SWIGLU_LIMIT, GPT_OSS_SWIGLU_ALPHA = 2, 7.0, 1.702
# Tensor types read, each dequantized by gguf.quants (the float ones are views of the file)
TENSOR_TYPES = tuple(GGMLQuantizationType[n] for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "MXFP4"))  # MXFP4: gpt-oss's experts as llama.cpp's converter repacks them
_FLOAT_VIEWS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.BF16: ml_dtypes.bfloat16}
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
            GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
            GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
            GGUFValueType.FLOAT64: "<d"}
_U64 = struct.Struct("<Q")
_DEQUANTIZE_CHUNK = 1 << 20  # elements dequantized at a time: the float32 scratch stays a few MB


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions innermost first)
    ggml_type: int
    offset: int  # in its file
    file: "GGUFFile"

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * size


class _Cursor:
    """Reads GGUF's little-endian header fields from the mapped file, bounds-checked."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated or corrupt header (a field at byte {start} runs past the end of "
                            f"the {len(self.buf)}-byte file)")
        self.pos += n
        return start

    def scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a string at byte {start} is not UTF-8") from None

    def strings(self, n: int) -> list[str]:
        # vocabularies hold ~10^5 of them: one tight loop (GGUFReader's numpy view per field took 15 s for SmolLM2)
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        try:
            for _ in range(n):
                k = length(buf, pos)[0]
                pos += 8
                if pos + k > end:
                    break
                out.append(buf[pos:pos + k].decode("utf-8"))
                pos += k
        except (struct.error, UnicodeDecodeError):
            raise GGUFError(f"{self.path}: a string at byte {pos} is truncated or not UTF-8") from None
        if len(out) != n:
            self.pos = pos
            self.take(k)  # raises, naming the byte
        self.pos = pos
        return out

    def value(self, kind: int):
        kind = _value_type(kind, self)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.scalar(_SCALARS[kind])
        item, n = _value_type(self.scalar("<I"), self), self.scalar("<Q")
        if item == GGUFValueType.STRING:
            return self.strings(n)
        if item == GGUFValueType.ARRAY:
            return [self.value(item) for _ in range(n)]
        dtype = np.dtype(_SCALARS[item].replace("?", "b1"))
        return np.frombuffer(self.buf, dtype, n, self.take(n * dtype.itemsize)).tolist()


def _value_type(kind: int, cursor: _Cursor) -> GGUFValueType:
    try:
        return GGUFValueType(kind)
    except ValueError:
        raise GGUFError(f"{cursor.path}: unknown metadata value type {kind} at byte {cursor.pos}") from None


class GGUFFile:
    """One .gguf file: `metadata` (key -> value; arrays as lists) and `tensors` (name -> GGUFTensor), parsed from
    the memory-mapped header; tensor bytes are read only when asked for."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(4)
            if head != b"GGUF":
                raise GGUFError(f"{path}: not a GGUF file (starts with {head!r}, not b'GGUF')")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        c = _Cursor(self._mm, path)
        c.take(4)
        version = c.scalar("<I")
        if version not in (2, 3):
            order = " (a big-endian file?)" if version > 0xFFFF else ""
            raise GGUFError(f"{path}: GGUF version {version}{order}; readable: 2, 3 (little-endian)")
        n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            self.metadata[key] = c.value(c.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.scalar("<Q") for _ in range(c.scalar("<I"))]
            infos.append((name, tuple(reversed(dims)) or (1,), c.scalar("<I"), c.scalar("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-c.pos // alignment) * alignment
        self.tensors = {name: GGUFTensor(name, shape, kind, data_start + offset, self)
                        for name, shape, kind, offset in infos}
        if len(self.tensors) != len(infos):
            raise GGUFError(f"{path}: a tensor name appears twice")

    def raw(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's bytes, [rows..., bytes per row] uint8, a view of the file."""
        if t.ggml_type not in TENSOR_TYPES:
            raise GGUFError(f"{self.path}: tensor {t.name!r} is {t.type_name}; readable types: "
                            f"{', '.join(k.name for k in TENSOR_TYPES)}")
        block = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)][0]
        if t.shape[-1] % block:
            raise GGUFError(f"{self.path}: tensor {t.name!r} has rows of {t.shape[-1]} values, not a multiple of "
                            f"{t.type_name}'s block of {block}")
        if t.offset + t.n_bytes > len(self._mm):
            raise GGUFError(f"{self.path}: tensor {t.name!r} ({t.type_name} {t.shape}) runs past the end of the file "
                            "(truncated?)")
        data = np.frombuffer(self._mm, np.uint8, t.n_bytes, t.offset)
        return data.reshape(*t.shape[:-1], t.n_bytes // max(1, math.prod(t.shape[:-1])))

    def release(self, t: GGUFTensor) -> None:
        """Drops the tensor's file pages from this process's resident set once its values were copied out (the
        page cache keeps them), so a load's peak RSS holds the model once, not the model and the file."""
        page = mmap.PAGESIZE
        start, end = -(-t.offset // page) * page, (t.offset + t.n_bytes) // page * page
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)


class GGUFModel:
    """The files of one GGUF model (one, or the parts of a split one): the first part's metadata, every part's
    tensors, and `tensor(name, dtype)` to read one dequantized."""

    def __init__(self, paths: list[str]):
        if not paths:
            raise GGUFError("no GGUF file given")
        self.paths = list(paths)
        self.files = [GGUFFile(p) for p in self.paths]
        self.metadata = self.files[0].metadata
        count = self.metadata.get("split.count")
        if count is not None and int(count) != len(self.files):
            raise GGUFError(f"{self.paths[0]} says the model is split in {count} files, got {len(self.files)}")
        self.tensors: dict[str, GGUFTensor] = {}
        for f in self.files:
            for name, t in f.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"tensor {name!r} is in both {self.tensors[name].file.path} and {f.path}")
                self.tensors[name] = t

    @classmethod
    def open(cls, path: str) -> "GGUFModel":
        """The GGUF model at `path` (a file, any part of a split one, or a directory holding one)."""
        files = gguf_files(path)
        if not files:
            raise GGUFError(f"no GGUF model at {path!r} (a .gguf file, or a directory holding one)")
        return cls(files)

    @property
    def path(self) -> str:
        return self.paths[0]

    def tensor(self, name: str, dtype=np.float32) -> np.ndarray:
        """Tensor `name` in numpy order: F32 / F16 / BF16 as stored (a view of the file: `release` it once copied), a
        quantized type dequantized to `dtype` by gguf.quants, a chunk of rows at a time (its file pages released)."""
        t = self.tensors[name]
        raw = t.file.raw(t)
        kind = GGMLQuantizationType(t.ggml_type)
        if kind in _FLOAT_VIEWS:
            return raw.view(_FLOAT_VIEWS[kind]).reshape(t.shape)
        rows = raw.reshape(-1, raw.shape[-1])
        out = np.empty((rows.shape[0], t.shape[-1]), dtype)
        step = max(1, _DEQUANTIZE_CHUNK // t.shape[-1])
        for i in range(0, rows.shape[0], step):
            out[i:i + step] = gguf.quants.dequantize(rows[i:i + step], kind)
        del raw, rows
        t.file.release(t)
        return out.reshape(t.shape)


# ----------------------------------------------------------------------------------------------------------- config
def config_from_gguf(model: GGUFModel) -> ModelConfig:
    """The ModelConfig of a GGUF model from its `<arch>.*` metadata and which tensors it has (biases, q/k norms,
    the layers with experts, a tied head). An architecture or option meshserve does not serve fails here."""
    meta = model.metadata
    where = model.path
    if meta.get("general.type", "model") != "model":
        raise UnsupportedModelError(f"{where} is a GGUF {meta['general.type']!r}, not a model")
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{where}: GGUF architecture {arch!r} is not served (supported: "
                                    f"{', '.join(ARCHITECTURES)})")
    missing = object()

    def key(name: str, default: Any = missing) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is missing:
            raise GGUFError(f"{where}: metadata {arch}.{name} is missing")
        if isinstance(value, list):  # per-layer values: one number if they agree
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"{where}: {arch}.{name} differs between layers ({value[:8]}...)")
            value = value[0]
        return value

    tensors = model.tensors
    num_layers = int(key("block_count"))
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    mla = arch == "deepseek2"  # its key_length / value_length are the MQA view of the latent; the heads' are *_mla
    head_dim = int(key("attention.key_length_mla" if mla else "attention.key_length", hidden // num_heads))
    if not mla and int(key("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{where}: value heads of {key('attention.value_length')} and key heads of "
                                    f"{head_dim} (one head size only)")
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim and not mla and not (arch == "phi3" and 0 < rotary < head_dim and rotary % 2 == 0):
        raise UnsupportedModelError(f"{where}: RoPE on {key('rope.dimension_count')} of {head_dim} head dimensions "
                                    "(partial rotary is not served)")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{where}: no token_embd.weight tensor")
    vocab = int(key("vocab_size", tensors["token_embd.weight"].shape[0]))
    num_experts = int(key("expert_count", 0))
    family = "mixtral" if arch == "llama" and num_experts else ARCHITECTURES[arch]
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    file_types = {tensors[n].ggml_type for n in tensors}
    dtype = ("float32" if file_types == {GGMLQuantizationType.F32} else
             "bfloat16" if GGMLQuantizationType.BF16 in file_types else "float16")
    ffn = int(key("feed_forward_length", 0))
    kw: dict[str, Any] = dict(
        family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=int(key("attention.head_count_kv", num_heads)), head_dim=head_dim,
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)), rope=_rope(model, arch, head_dim),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"), dtype=dtype)
    if num_experts:
        moe_ffn = ffn if family == "mixtral" else int(key("expert_feed_forward_length"))
        kw.update(num_experts=num_experts, num_experts_per_tok=int(key("expert_used_count")),
                  moe_intermediate_size=moe_ffn, intermediate_size=ffn or moe_ffn,
                  # llama.cpp renormalises the top-k weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE
                  norm_topk_prob=bool(key("expert_weights_norm", family not in ("qwen2_moe", "deepseek_v2"))),
                  shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
                  moe_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(num_layers)))
    if mla:
        kw.update(_deepseek2_fields(key, num_heads, head_dim, rotary, kw))
    if arch == "gpt-oss":
        window = int(key("attention.sliding_window", 0)) or None
        kw.update(attention_sinks=True, router_bias="blk.0.ffn_gate_inp.bias" in tensors,
                  expert_bias="blk.0.ffn_gate_exps.bias" in tensors, norm_topk_prob=True,
                  swiglu_alpha=GPT_OSS_SWIGLU_ALPHA, swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
                  sliding_windows=tuple(window if (i + 1) % GPT_OSS_GLOBAL_EVERY else None for i in range(num_layers)))
    if arch in ("gemma3", "phi3"):
        kw.update(_gemma3_phi3_fields(model, arch, key, num_layers, head_dim, rotary, kw))
    return ModelConfig(**kw)


def _deepseek2_fields(key, num_heads: int, head_dim: int, rotary: int, kw: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2 / V3 (llama.cpp's deepseek2): multi-head latent attention's sizes, shared experts without a gate,
    routing: softmax scores (V2: greedy, or group-limited with expert groups) or sigmoid (V3: noaux_tc with the
    correction bias exp_probs_b), the routed weights scaled by expert_weights_scale. RoPE values come in pairs, as
    DeepSeek's checkpoints store them and llama.cpp rotates them."""
    v3 = int(key("expert_gating_func", gguf.ExpertGatingFuncType.SOFTMAX)) == gguf.ExpertGatingFuncType.SIGMOID
    groups, used = int(key("expert_group_count", 1)), int(key("expert_group_used_count", 1))
    method = "noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy"
    return dict(family="deepseek_v3" if v3 else "deepseek_v2", num_kv_heads=num_heads,
                kv_lora_rank=int(key("attention.kv_lora_rank")), q_lora_rank=int(key("attention.q_lora_rank", 0)),
                qk_nope_head_dim=head_dim - rotary, qk_rope_head_dim=rotary,
                v_head_dim=int(key("attention.value_length_mla")), rope_interleave=True,
                shared_expert_intermediate_size=kw.get("moe_intermediate_size", 0) * int(key("expert_shared_count", 0)),
                shared_expert_gate=False, scoring_func="sigmoid" if v3 else "softmax", topk_method=method,
                n_group=groups if method != "greedy" else 1, topk_group=used if method != "greedy" else 1,
                routed_scaling_factor=float(key("expert_weights_scale", 1.0)))


def _gemma3_phi3_fields(model: GGUFModel, arch: str, key, num_layers: int, head_dim: int, rotary: int,
                        kw: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's partial rotary and sliding window (every layer); Gemma 3's GeGLU, (1 + w) norms (stored as 1 + w:
    `GGUFCheckpoint` subtracts the 1), local / global layers with their RoPEs, softmax scale and logit soft-cap."""
    window = int(key("attention.sliding_window", 0)) or None
    if arch == "phi3":
        if "rope_factors_long.weight" in model.tensors or "rope_factors_short.weight" in model.tensors:
            raise UnsupportedModelError(f"{model.path}: Phi-3 LongRoPE (rope_factors_long/short.weight) is not read "
                                        "from GGUF yet (served from the HF checkpoint)")
        return dict(rope=dataclasses.replace(kw["rope"], partial_rotary_factor=rotary / head_dim),
                    sliding_windows=(window,) * num_layers)
    pattern = model.metadata.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is None:
        local = [(i + 1) % GEMMA3_GLOBAL_EVERY != 0 for i in range(num_layers)]
    elif isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise GGUFError(f"{model.path}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                            f"{num_layers} layers")
        local = [bool(p) for p in pattern]
    else:
        local = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    if window is None and any(local):
        raise GGUFError(f"{model.path}: metadata {arch}.attention.sliding_window is missing (Gemma 3's local layers)")
    if key("attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(f"{model.path}: {arch}.attn_logit_softcapping (Gemma 3 does not cap attention "
                                    "scores; expected none)")
    scale = key("attention.scale", None)  # 1 / sqrt(query_pre_attn_scalar) where a file says it
    scalar = (1.0 / float(scale) ** 2 if scale is not None else
              kw["hidden_size"] / kw["num_heads"] if num_layers == GEMMA3_27B_LAYERS else float(head_dim))
    cap = key("final_logit_softcapping", None)
    return dict(hidden_act="gelu_pytorch_tanh", rms_norm_unit_offset=True, query_pre_attn_scalar=scalar,
                final_logit_softcapping=None if cap is None else float(cap),
                sliding_windows=tuple(window if s else None for s in local),
                rope_local=RopeConfig(theta=float(key("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))))


def _rope(model: GGUFModel, arch: str, head_dim: int) -> RopeConfig:
    """RopeConfig from `<arch>.rope.*`; Llama 3's frequency scaling is stored as per-frequency factors
    (rope_freqs.weight), recognised by recomputing them from the llama3 recipe."""
    from models.rope import inverse_frequencies
    meta, where = model.metadata, model.path
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    if scaling == "yarn" and arch == "deepseek2":
        return _deepseek2_yarn(model, arch, theta)
    if scaling == "yarn" and arch == "gpt-oss":  # untruncated, as gpt-oss's config has it
        from models.config import _parse_rope
        return _parse_rope({"rope_parameters": {
            "rope_type": "yarn", "rope_theta": theta, "factor": float(meta[f"{arch}.rope.scaling.factor"]),
            "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"]),
            "beta_fast": float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}}, "gpt_oss")
    if scaling != "none":
        raise UnsupportedModelError(f"{where}: RoPE scaling {scaling!r} (served: none, linear, llama3; yarn for "
                                    "deepseek2 and gpt-oss)")
    if "rope_freqs.weight" not in model.tensors:
        return RopeConfig(theta=theta)
    factors = np.asarray(model.tensor("rope_freqs.weight"), np.float64)
    rope = RopeConfig(theta=theta, rope_type="llama3", factor=float(factors.max()), low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=int(
                          meta.get(f"{arch}.rope.scaling.original_context_length", 8192)))
    plain = inverse_frequencies(RopeConfig(theta=theta), head_dim).astype(np.float64)
    ours = inverse_frequencies(rope, head_dim).astype(np.float64)
    if factors.shape != ours.shape or not np.allclose(plain / factors, ours, rtol=1e-5):
        raise UnsupportedModelError(f"{where}: rope_freqs.weight is not Llama 3's frequency scaling with factor "
                                    f"{rope.factor}, low/high frequency factors 1/4 and original context "
                                    f"{rope.original_max_position_embeddings}")
    return rope


def _deepseek2_yarn(model: GGUFModel, arch: str, theta: float) -> RopeConfig:
    """DeepSeek's YaRN as HF reads it, from llama.cpp's keys: yarn_log_multiplier is 0.1 * mscale_all_dim, and
    llama.cpp takes mscale = mscale_all_dim (as every DeepSeek checkpoint has), so the RoPE's attention factor is 1."""
    from models.config import _parse_rope
    meta = model.metadata
    if f"{arch}.rope.scaling.original_context_length" not in meta or f"{arch}.rope.scaling.factor" not in meta:
        raise GGUFError(f"{model.path}: YaRN without {arch}.rope.scaling.factor / .original_context_length")
    # the key is a float32 of 0.1 * mscale: 6 significant digits give back the config's value (0.707, not 0.70699996)
    mscale = float(f"{float(meta.get(f'{arch}.rope.scaling.yarn_log_multiplier', 0.1)) / 0.1:.6g}")
    return _parse_rope({"rope_parameters": {
        "rope_type": "yarn", "rope_theta": theta, "factor": float(meta[f"{arch}.rope.scaling.factor"]),
        "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"]),
        "beta_fast": float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        "mscale": mscale, "mscale_all_dim": mscale}}, "deepseek_v2")


# ------------------------------------------------------------------------------------------------------ checkpoint
# llama.cpp's per-layer tensor -> the HF module it was converted from (blk.N.<ours>.weight|bias)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# per architecture, where its names differ (Gemma 3's four norms a layer; Phi-3's fused qkv and gate_up)
_ARCH_LAYER_TENSORS = {
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "deepseek2": {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                  "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                  "ffn_down_shexp": "mlp.shared_experts.down_proj"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm"},
}
# architectures whose converter stores every norm weight w as 1 + w (llama.cpp's RMSNorm multiplies by the weight)
_UNIT_OFFSET_NORMS = ("gemma3",)
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)(?:\.(\d+))?\.(weight|bias)$")


@dataclasses.dataclass(frozen=True)
class _Source:
    tensor: str  # GGUF name
    expert: int | None = None  # the expert's slice of a stacked [n_expert, out, in] tensor
    rope_heads: int = 0  # llama.cpp interleaved these rows for its RoPE: undo, with this many heads
    row: bool = False  # a vector stored for a [1, n] HF weight
    minus_one: bool = False  # a norm weight stored as 1 + w
    kv_b: str = ""  # MLA's kv_b_proj, split by llama.cpp: `tensor` is k_b [H, R, Dn], this v_b [H, Dv, R]
    up: str = ""  # GPT-OSS's gate_up_proj: `tensor` the gate [N, I, E] (or bias [N, I]), this the up; interleaved
    transpose: bool = False  # GPT-OSS's down_proj: [N, E, I] stored for HF's [N, I, E]


class GGUFCheckpoint:
    """A GGUF model seen as the HF checkpoint it was converted from (the interface of `SafetensorsCheckpoint`):
    HF tensor names, HF layout (q/k rows back from llama.cpp's interleaved-RoPE order, experts sliced out of their
    stacks), quantized tensors dequantized to `dtype` as each is read."""

    def __init__(self, model: GGUFModel, cfg: ModelConfig, dtype=np.float32):
        self.model, self.dtype = model, dtype
        self._sources: dict[str, _Source] = {}
        self._stack: tuple[str, np.ndarray] | None = None  # the last expert stack read: its experts are read in turn
        self._view: GGUFTensor | None = None  # the last float tensor handed out as a view of the file
        arch = model.metadata["general.architecture"]
        for name, t in model.tensors.items():
            if name == "rope_freqs.weight":
                continue  # read into cfg.rope
            for hf, source in self._hf_names(name, cfg, arch, t.shape):
                self._sources[hf] = source

    def _hf_names(self, name: str, cfg: ModelConfig, arch: str, shape) -> list[tuple[str, _Source]]:
        shift = arch in _UNIT_OFFSET_NORMS and name.endswith("norm.weight")
        if name in _GLOBAL_TENSORS:
            return [(_GLOBAL_TENSORS[name], _Source(name, minus_one=shift))]
        m = _LAYER_NAME.match(name)
        if not m or int(m[1]) >= cfg.num_layers:
            raise GGUFError(f"{self.model.path}: tensor {name!r} has no place in a {cfg.family} model")
        i, kind, expert, suffix = int(m[1]), m[2], m[3], m[4]
        layer = f"model.layers.{i}"
        moe = "block_sparse_moe" if cfg.family == "mixtral" else "mlp"
        if kind == "ffn_gate_inp" and arch != "gpt-oss":
            return [(f"{layer}.{moe}.gate.{suffix}", _Source(name))]
        if arch == "gpt-oss" and kind in ("ffn_gate_inp", "attn_sinks", "ffn_gate_exps", "ffn_up_exps",
                                          "ffn_down_exps"):
            return self._gpt_oss_names(name, layer, i, kind, suffix)
        if arch == "deepseek2" and kind in ("attn_k_b", "attn_v_b", "exp_probs_b"):
            if kind == "exp_probs_b":  # V3's routing correction bias
                return [(f"{layer}.mlp.gate.e_score_correction_bias", _Source(name))]
            if kind == "attn_v_b":
                return []  # read with attn_k_b
            v_b = f"blk.{i}.attn_v_b.weight"
            if v_b not in self.model.tensors:
                raise GGUFError(f"{self.model.path}: {name!r} without {v_b!r} (MLA's kv_b split in two)")
            return [(f"{layer}.self_attn.kv_b_proj.weight", _Source(name, kv_b=v_b))]
        if kind in _EXPERTS or (expert is not None and kind in ("ffn_gate", "ffn_up", "ffn_down")):
            proj = _EXPERTS.get(kind) or _LAYER_TENSORS[kind].split(".")[1]
            proj = _MIXTRAL_EXPERTS[proj] if cfg.family == "mixtral" else proj
            if expert is not None:  # older files: one tensor per expert, blk.N.ffn_gate.E.weight
                return [(f"{layer}.{moe}.experts.{expert}.{proj}.{suffix}", _Source(name))]
            return [(f"{layer}.{moe}.experts.{j}.{proj}.{suffix}", _Source(name, expert=j)) for j in range(shape[0])]
        layer_tensors = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {})}
        if kind not in layer_tensors or expert is not None:
            raise GGUFError(f"{self.model.path}: tensor {name!r} has no place in a {cfg.family} model")
        # llama.cpp's "llama" architecture interleaves q/k rows for its RoPE (pairs 2i, 2i+1); HF rotates halves
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(kind, 0) if arch == "llama" else 0
        return [(f"{layer}.{layer_tensors[kind]}.{suffix}",
                 _Source(name, rope_heads=heads, row=kind == "ffn_gate_inp_shexp" and len(shape) == 1,
                         minus_one=shift))]

    def _gpt_oss_names(self, name: str, layer: str, i: int, kind: str, suffix: str) -> list[tuple[str, _Source]]:
        """GPT-OSS in transformers' layout: the router, the sinks, and the experts fused again (gate_up_proj
        [N, E, 2I], gate and up interleaved by column; down_proj [N, I, E])."""
        if kind == "ffn_gate_inp":
            return [(f"{layer}.mlp.router.{suffix}", _Source(name))]
        if kind == "attn_sinks":
            return [(f"{layer}.self_attn.sinks", _Source(name))]
        fused = "experts.gate_up_proj" if kind != "ffn_down_exps" else "experts.down_proj"
        hf = f"{layer}.mlp.{fused}" + ("_bias" if suffix == "bias" else "")
        if kind == "ffn_up_exps":
            return []  # read with the gate
        if kind == "ffn_down_exps":
            return [(hf, _Source(name, transpose=suffix == "weight"))]
        up = f"blk.{i}.ffn_up_exps.{suffix}"
        if up not in self.model.tensors:
            raise GGUFError(f"{self.model.path}: {name!r} without {up!r}")
        return [(hf, _Source(name, up=up))]

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def names(self) -> list[str]:
        return list(self._sources)

    def shape(self, name: str) -> tuple[int, ...]:
        s = self._sources[name]
        shape = self.model.tensors[s.tensor].shape
        if s.up:
            return (shape[0], shape[2], 2 * shape[1]) if len(shape) == 3 else (shape[0], 2 * shape[1])
        if s.transpose:
            return shape[0], shape[2], shape[1]
        if s.kv_b:
            heads, rank, nope = shape
            return heads * (nope + self.model.tensors[s.kv_b].shape[1]), rank
        return shape[1:] if s.expert is not None else (1, *shape) if s.row else shape

    def dtype_name(self, name: str) -> str:
        return self.model.tensors[self._sources[name].tensor].type_name

    def get(self, name: str) -> np.ndarray:
        if name not in self._sources:
            raise CheckpointError(f"tensor {name!r} is missing from {self.model.path}")
        if self._view is not None:  # the loader placed it (copies) before it asks for the next one
            self._view.file.release(self._view)
            self._view = None
        s = self._sources[name]
        if s.expert is not None:
            if self._stack is None or self._stack[0] != s.tensor:
                if self._stack is not None and self.model.tensors[self._stack[0]].ggml_type in _FLOAT_VIEWS:
                    self.model.tensors[self._stack[0]].file.release(self.model.tensors[self._stack[0]])
                self._stack = (s.tensor, self.model.tensor(s.tensor, self.dtype))
            return self._stack[1][s.expert]
        if s.up or s.transpose:
            a = self.model.tensor(s.tensor, self.dtype)
            if s.transpose:
                w = np.ascontiguousarray(a.transpose(0, 2, 1))
            else:  # gate in the even columns, up in the odd ones
                b = self.model.tensor(s.up, self.dtype)
                a, b = (a.transpose(0, 2, 1), b.transpose(0, 2, 1)) if a.ndim == 3 else (a, b)
                w = np.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])
            for t in {s.tensor, s.up} - {""}:
                self.model.tensors[t].file.release(self.model.tensors[t])
            return w
        if s.kv_b:  # [H, Dn + Dv, R] rows per head, k's first, as HF's kv_b_proj
            k_b, v_b = self.model.tensor(s.tensor, self.dtype), self.model.tensor(s.kv_b, self.dtype)
            w = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
            for t in (self.model.tensors[s.tensor], self.model.tensors[s.kv_b]):
                t.file.release(t)
            return w
        w = self.model.tensor(s.tensor, self.dtype)
        if self.model.tensors[s.tensor].ggml_type in _FLOAT_VIEWS:
            self._view = self.model.tensors[s.tensor]
        if s.rope_heads:
            w = unpermute_rope_rows(w, s.rope_heads)
        if s.minus_one:  # in float32: 1 + (stored - 1) is the stored value again, as HF's (1 + w) is
            w = np.asarray(w, np.float32) - np.float32(1.0)
        return w.reshape(1, -1) if s.row else w


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows (axis 0) of q or k from llama.cpp's interleaved-pair order per head (x0, x_half, x1, ...) back to HF's
    halves (first half, second half): the inverse of its converter's permutation."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
