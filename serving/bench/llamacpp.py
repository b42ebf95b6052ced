"""llama.cpp side by side with meshserve on the same checkpoint, for `offline --only=llamacpp` and `moe`:
`write_gguf` (an HF Llama, Mixtral or Qwen3-MoE as a GGUF file of the same weights) and `LlamaCpp` (greedy batched
generation and prompt logits through llama-cpp-python, the optional `llamacpp` extra). Details: docs/benchmarks.md."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import ml_dtypes
import numpy as np

from models.config import ModelConfig
from models.safetensors_io import SafetensorsCheckpoint


def available() -> bool:
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _rope_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotate-half rows (per head: first half, second half) -> interleaved pairs (x0, x_half, x1, ...)."""
    out_dim = w.shape[0]
    return w.reshape(heads, 2, out_dim // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# meshserve's model family -> llama.cpp's architecture
GGUF_ARCHITECTURES = {"llama": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe"}
# HF names of an expert's gate, up and down projections per family (per-expert checkpoints)
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def _stacked_experts(tensors: SafetensorsCheckpoint, layer: int, family: str, n: int) -> tuple[np.ndarray, ...]:
    """Layer `layer`'s experts' gate, up and down weights, each stacked [n, out, in], from per-expert tensors (under
    `block_sparse_moe.` or `mlp.`) or from transformers 5's fused experts (gate_up_proj [n, 2I, E], gate rows
    first, and down_proj [n, E, I])."""
    for module in ("block_sparse_moe", "mlp"):
        m = f"model.layers.{layer}.{module}.experts."
        if f"{m}0.{_EXPERT_NAMES[family][0]}.weight" in tensors:
            return tuple(np.stack([tensors.get(f"{m}{j}.{name}.weight") for j in range(n)])
                         for name in _EXPERT_NAMES[family])
    m = f"model.layers.{layer}.mlp.experts."
    gate, up = np.split(tensors.get(m + "gate_up_proj"), 2, axis=1)
    return gate, up, tensors.get(m + "down_proj")


def _router(tensors: SafetensorsCheckpoint, layer: int) -> np.ndarray:
    mixtral = f"model.layers.{layer}.block_sparse_moe.gate.weight"
    return tensors.get(mixtral if mixtral in tensors else f"model.layers.{layer}.mlp.gate.weight")


def write_gguf(model_dir: str | os.PathLike, path: str | os.PathLike, q8_0: bool = False) -> Path:
    """Writes `model_dir` (a LlamaForCausalLM, MixtralForCausalLM or Qwen3MoeForCausalLM in safetensors) as GGUF at
    `path`: Llama and Mixtral as llama.cpp's "llama" architecture (q/k rows reordered for its interleaved RoPE),
    Qwen3-MoE as "qwen3moe" (NEOX RoPE as HF's: rows as stored; q/k norms as attn_{q,k}_norm); experts stacked as
    ffn_{gate,up,down}_exps [n_expert, out, in] and the router as ffn_gate_inp. Returns the path. `q8_0`: every
    matrix in llama.cpp's Q8_0 (int8 in blocks of 32 with an f16 scale each, what `llama-quantize ... Q8_0` writes),
    the norms float32."""
    import gguf
    model_dir, path = Path(model_dir), Path(path)
    cfg = ModelConfig.from_pretrained(str(model_dir))
    arch = GGUF_ARCHITECTURES.get(cfg.family)
    if arch is None:
        raise ValueError(f"write_gguf handles {', '.join(GGUF_ARCHITECTURES)} checkpoints, not {cfg.family!r}")
    if cfg.rope.rope_type != "default":
        raise ValueError(f"write_gguf writes plain RoPE only, not {cfg.rope.rope_type!r}")
    if any(cfg.sliding_windows):
        raise ValueError(f"write_gguf writes full attention only, not sliding windows {cfg.sliding_windows}")
    if cfg.family == "qwen3_moe" and not (cfg.norm_topk_prob and all(cfg.moe_layers)):
        # llama.cpp's qwen3moe renormalises the top-k weights and has a sparse MLP in every layer
        raise ValueError(f"write_gguf writes Qwen3-MoE with norm_topk_prob and every layer sparse, not "
                         f"norm_topk_prob={cfg.norm_topk_prob}, moe_layers={cfg.moe_layers}")
    tensors = SafetensorsCheckpoint(str(model_dir))
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    dtype = tensors.get("model.embed_tokens.weight").dtype
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    # llama's MoE (Mixtral) sizes its experts by feed_forward_length, qwen3moe by expert_feed_forward_length
    w.add_feed_forward_length(cfg.moe_intermediate_size if cfg.family == "mixtral" else cfg.intermediate_size)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else
                    gguf.LlamaFileType.MOSTLY_BF16 if dtype == ml_dtypes.bfloat16 else gguf.LlamaFileType.ALL_F32)
    vocab = cfg.vocab_size
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"t{i}" for i in range(len(tokens), vocab)]
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:vocab])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types[:vocab])
    w.add_bos_token_id(1 if cfg.bos_token_id is None else cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0] if cfg.eos_token_ids else 2)

    def add(name: str, a: np.ndarray) -> None:
        if q8_0 and a.ndim > 1:
            w.add_tensor(name, gguf.quants.quantize(np.asarray(a, np.float32), gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # the shape from the blocks' bytes
        elif a.ndim == 1 or a.dtype == np.float32:
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
        else:  # bfloat16 bits as stored
            w.add_tensor(name, np.ascontiguousarray(a).view(np.uint16), raw_shape=a.shape,
                         raw_dtype=gguf.GGMLQuantizationType.BF16)

    rope_rows = _rope_pairs if arch == "llama" else lambda a, _: a
    add("token_embd.weight", tensors.get("model.embed_tokens.weight"))
    add("output_norm.weight", tensors.get("model.norm.weight"))
    add("output.weight", tensors.get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", tensors.get(p + "input_layernorm.weight"))
        add(f"blk.{i}.attn_q.weight", rope_rows(tensors.get(p + "self_attn.q_proj.weight"), heads))
        add(f"blk.{i}.attn_k.weight", rope_rows(tensors.get(p + "self_attn.k_proj.weight"), kv_heads))
        add(f"blk.{i}.attn_v.weight", tensors.get(p + "self_attn.v_proj.weight"))
        add(f"blk.{i}.attn_output.weight", tensors.get(p + "self_attn.o_proj.weight"))
        if cfg.qk_norm:
            add(f"blk.{i}.attn_q_norm.weight", tensors.get(p + "self_attn.q_norm.weight"))
            add(f"blk.{i}.attn_k_norm.weight", tensors.get(p + "self_attn.k_norm.weight"))
        add(f"blk.{i}.ffn_norm.weight", tensors.get(p + "post_attention_layernorm.weight"))
        if cfg.moe_layers[i]:  # [n_expert, out, in] per projection (GGUF lists dimensions innermost first)
            add(f"blk.{i}.ffn_gate_inp.weight", _router(tensors, i))
            for name, a in zip(("gate", "up", "down"), _stacked_experts(tensors, i, cfg.family, cfg.num_experts)):
                add(f"blk.{i}.ffn_{name}_exps.weight", a)
            continue
        add(f"blk.{i}.ffn_gate.weight", tensors.get(p + "mlp.gate_proj.weight"))
        add(f"blk.{i}.ffn_up.weight", tensors.get(p + "mlp.up_proj.weight"))
        add(f"blk.{i}.ffn_down.weight", tensors.get(p + "mlp.down_proj.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def instruction_sets() -> str:
    """The x86/ARM vector extensions the installed llama.cpp build uses, from its system info (e.g. "AVX2")."""
    import llama_cpp as lc
    info = lc.llama_print_system_info().decode()
    on = [f.strip().split(" = ")[0] for f in info.replace("|", "\n").splitlines() if f.strip().endswith("= 1")]
    order = ["AMX_INT8", "AVX512_BF16", "AVX512", "AVX2", "NEON", "SVE"]
    return next((f for f in order if f in on), "/".join(on) or "?")


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level, text, user_data):  # llama.cpp's log goes nowhere
    return None


class LlamaCpp:
    """A llama.cpp context over a GGUF file with room for `max_seqs` sequences of up to `max_len` tokens each; its KV
    cache in float16 (llama.cpp's default, the benchmarks') or, with `float32_cache`, float32 and attention without
    flash attention (for exact checks)."""

    def __init__(self, gguf_path: str | os.PathLike, max_seqs: int, max_len: int, threads: int | None = None,
                 float32_cache: bool = False):
        import llama_cpp as lc
        self._lc = lc
        lc.llama_log_set(_quiet, None)
        lc.llama_backend_init()
        threads = threads or len(os.sched_getaffinity(0))
        self._model = lc.llama_model_load_from_file(str(gguf_path).encode(), lc.llama_model_default_params())
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        p = lc.llama_context_default_params()
        p.n_ctx = max_seqs * max_len
        p.n_batch = p.n_ubatch = min(p.n_ctx, 512)
        p.n_seq_max = max_seqs
        p.n_threads = p.n_threads_batch = threads
        if float32_cache:  # and attention without flash attention, whose CPU kernel rounds to float16
            p.type_k = p.type_v = lc.GGML_TYPE_F32
            p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._ctx = lc.llama_init_from_model(self._model, p)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self.max_seqs, self._batch_cap = max_seqs, p.n_batch
        self._batch = lc.llama_batch_init(self._batch_cap, 0, 1)

    def close(self) -> None:
        lc = self._lc
        lc.llama_batch_free(self._batch)
        lc.llama_free(self._ctx)
        lc.llama_model_free(self._model)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most the batch's capacity."""
        b = self._batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self._lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        ptr = self._lc.llama_get_logits_ith(self._ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.vocab,))))

    def prompt_logits(self, prompt: list[int]) -> np.ndarray:
        """[len(prompt), vocab] float32: the logits after each token of `prompt` (one sequence, from an empty
        cache)."""
        lc = self._lc
        lc.llama_memory_clear(lc.llama_get_memory(self._ctx), True)
        rows = []
        for start in range(0, len(prompt), self._batch_cap):
            chunk = prompt[start:start + self._batch_cap]
            self._decode([(t, start + j, 0, True) for j, t in enumerate(chunk)])
            rows += [np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, j), shape=(self.vocab,)).copy()
                     for j in range(len(chunk))]
        return np.stack(rows)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy, `max_tokens` new tokens per prompt (no stop tokens), all prompts at once."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.max_seqs} sequences")
        lc = self._lc
        lc.llama_memory_clear(lc.llama_get_memory(self._ctx), True)
        out: list[list[int]] = [[] for _ in prompts]
        # Prefill in batches of at most the batch capacity; a prompt's last token asks for logits.
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        for start in range(0, len(entries), self._batch_cap):
            chunk = entries[start:start + self._batch_cap]
            self._decode(chunk)
            for i, (_, pos, s, logits) in enumerate(chunk):
                if logits:
                    out[s].append(self._argmax(i))
        while True:
            live = [s for s in range(len(prompts)) if len(out[s]) < max_tokens]
            if not live:
                return out
            self._decode([(out[s][-1], len(prompts[s]) + len(out[s]) - 1, s, True) for s in live])
            for i, s in enumerate(live):
                out[s].append(self._argmax(i))


def small_moe_model(family: str, dtype=None):
    """A small random-weight HF Mixtral or Qwen3-MoE (`family`: mixtral | qwen3_moe; torch `dtype`, default float32;
    vocabulary past the GGUF's 259 special and byte tokens; weights at std 0.2, so logits are peaked and attention
    matters: a wrong layout moves logits by several units)."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    else:  # fine-grained, head_dim apart from hidden / heads, as Qwen3-MoE has them
        cfg = tf.Qwen3MoeConfig(**common, head_dim=32, moe_intermediate_size=32, num_experts=16,
                                num_experts_per_tok=4, norm_topk_prob=True)
    return tf.AutoModelForCausalLM.from_config(cfg).to(dtype or torch.float32).eval()


def check_moe_layouts(workdir: str | os.PathLike) -> str:
    """llama.cpp on `write_gguf`'s Mixtral and Qwen3-MoE files gives HF's logits (within 1e-3 with a float32 KV
    cache, 0.05 with its default float16 one) and greedy tokens (up to the first near-tie), on small models whose
    wrong layouts would move logits by units. Raises AssertionError if not; returns a line saying what was checked.
    The benchmarks that quote llama.cpp on MoE models run it first (llama-cpp-python is not in the test
    environment: it builds llama.cpp from source)."""
    import torch
    worst = {}
    for family in ("mixtral", "qwen3_moe"):
        model = small_moe_model(family)
        d = Path(workdir) / f"gguf-check-{family}"
        model.save_pretrained(d / "hf")
        gguf_path = write_gguf(d / "hf", d / "m.gguf")
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 300, n).tolist() for n in (24, 9)]
        with torch.no_grad():
            refs = [model(torch.tensor([p])).logits[0].numpy() for p in prompts]
        for float32_cache, tol in ((True, 1e-3), (False, 0.05)):
            cpp = LlamaCpp(gguf_path, max_seqs=2, max_len=64, threads=1, float32_cache=float32_cache)
            try:
                for prompt, ref in zip(prompts, refs):
                    err = float(np.abs(cpp.prompt_logits(prompt) - ref).max())
                    assert err <= tol, f"{family}: llama.cpp's logits {err:.3g} from HF's (tolerance {tol})"
                    worst[(family, float32_cache)] = max(err, worst.get((family, float32_cache), 0.0))
                got = cpp.generate(prompts, 8)
            finally:
                cpp.close()
            # Greedy through llama.cpp's KV cache, both prompts at once: HF's tokens up to the first step whose top
            # two logits (HF's, on the same prefix) are within the tolerance, where either may be taken.
            for prompt, tokens in zip(prompts, got):
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].numpy()
                for step, (row, token) in enumerate(zip(logits, tokens)):
                    top2 = np.sort(row)[-2:]
                    if top2[1] - top2[0] < 2 * tol:
                        break
                    assert token == int(np.argmax(row)), \
                        f"{family} step {step}: llama.cpp {token}, HF {int(np.argmax(row))}"
                assert step >= 4, f"{family}: a near-tie at step {step} already: too few tokens checked"
    diffs = ", ".join(f"{f} {worst[(f, True)]:.1e} / {worst[(f, False)]:.1e}" for f in ("mixtral", "qwen3_moe"))
    return (f"llama.cpp on our Mixtral / Qwen3-MoE GGUF layouts vs HF, max |logit diff| (f32 / f16 KV cache): "
            f"{diffs}; greedy tokens equal")
