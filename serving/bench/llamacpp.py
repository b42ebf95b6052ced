"""llama.cpp side by side with meshserve on the same checkpoint, for `offline --only=llamacpp` and `moe`: `LlamaCpp`
(greedy batched generation and prompt logits through llama-cpp-python, the optional `llamacpp` extra) over a GGUF file
from `models.gguf_writer.write_gguf` (re-exported here). Details: docs/benchmarks.md."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from models.gguf_writer import write_gguf  # noqa: F401  (the benchmarks' GGUF files)


def available() -> bool:
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def instruction_sets() -> str:
    """The x86/ARM vector extensions the installed llama.cpp build uses, from its system info (e.g. "AVX2")."""
    import llama_cpp as lc
    info = lc.llama_print_system_info().decode()
    on = [f.strip().split(" = ")[0] for f in info.replace("|", "\n").splitlines() if f.strip().endswith("= 1")]
    order = ["AMX_INT8", "AVX512_BF16", "AVX512", "AVX2", "NEON", "SVE"]
    return next((f for f in order if f in on), "/".join(on) or "?")


def quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: str, threads: int | None = None) -> None:
    """llama.cpp's own quantizer (`llama_model_quantize`, as `llama-quantize` runs it): `src` rewritten to `dst` with
    its weights as `ftype` ("Q8_0", "BF16", "F16", "Q4_0", ...: llama.cpp's LLAMA_FTYPE_MOSTLY_* names), an already
    quantized source's tensors dequantized first (allow_requantize)."""
    import llama_cpp as lc
    code = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}", None)
    if code is None:
        names = sorted(n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(lc) if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise ValueError(f"llama.cpp has no file type {ftype!r}; valid: {', '.join(names)}")
    lc.llama_log_set(_quiet, None)
    lc.llama_backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = code
    params.allow_requantize = True
    params.nthread = threads or len(os.sched_getaffinity(0))
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype}) returned {rc}")


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
