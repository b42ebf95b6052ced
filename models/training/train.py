"""Trains the two tiny Llama models shipped in models/tiny/ (target ~12.6M and draft ~1.8M parameters, one shared
byte-level BPE) on the Python standard library, on CPU, deterministically from a seed, and writes each as an HF
directory with its held-out text and a training report.

    python -m models.training.train --out=models/tiny --which=both --seed=0
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import shutil
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from absl import app, flags, logging
from safetensors.numpy import save_file

from models.training import corpus as tiny_corpus
from models.training.tiny_llama import TinyLlamaConfig, count_params, forward, init_params, token_losses

VOCAB_SIZE = 8192
CONTEXT = 256
MODEL_CONFIGS = {
    "target": TinyLlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=384, intermediate_size=1024, num_layers=6,
                              num_heads=6, num_kv_heads=2, max_position_embeddings=CONTEXT),
    "draft": TinyLlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_layers=4,
                             num_heads=4, num_kv_heads=2, max_position_embeddings=CONTEXT),
}
# The held-out slice the tests re-evaluate: the first windows of heldout.txt's token stream.
HELDOUT_SLICE_WINDOWS = 16
SAMPLE_PROMPTS = ("def ", "import os\n", "class ", "    def __init__(self", '"""')
STORED_DTYPE = "bfloat16"  # halves the files; the reported figures are for the stored (rounded) weights


@dataclasses.dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int
    batch_size: int = 2
    seq_len: int = CONTEXT
    peak_lr: float = 2e-3
    warmup_steps: int = 40
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    attention_block: int = 128
    compute_dtype: str = "bfloat16"  # matmul operands (float32 accumulation); see tiny_llama.forward

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "attention_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"TrainConfig.compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if not 0 < self.peak_lr < 1:
            raise ValueError(f"TrainConfig.peak_lr must be in (0, 1), got {self.peak_lr}")


TRAIN_CONFIGS = {
    # ~2M tokens each (0.8 epochs), bf16-operand matmuls: ~25 + ~12 minutes on the shared 2-core CPU. Batches of
    # 4 x 256 tokens: larger ones gave no more tokens/s here, and at this budget more updates buy more quality.
    # At 2e-3 the target stalled at the draft's held-out loss; the wider model wants the smaller step size.
    "target": TrainConfig(steps=2000, batch_size=4, peak_lr=1e-3, warmup_steps=100),
    "draft": TrainConfig(steps=2000, batch_size=4, peak_lr=3e-3, warmup_steps=100),
}

FLAGS = flags.FLAGS
_OUT = _WHICH = _SEED = _STEPS = _BATCH = _CORPUS_MAX_BYTES = _HELDOUT_EVERY = _MAX_HELDOUT_BYTES = None
_LOG_EVERY = _EVAL_EVERY = _SAMPLE_TOKENS = None


def define_flags() -> None:
    """The command line's flags; defined only when run as a program, so importing this module (tests) adds
    no global flags that could collide with another module's."""
    global _OUT, _WHICH, _SEED, _STEPS, _BATCH, _CORPUS_MAX_BYTES, _HELDOUT_EVERY, _MAX_HELDOUT_BYTES
    global _LOG_EVERY, _EVAL_EVERY, _SAMPLE_TOKENS
    _OUT = flags.DEFINE_string("out", "models/tiny", "Directory that receives target/ and draft/.")
    _WHICH = flags.DEFINE_enum("which", "both", ["target", "draft", "both"], "Which model(s) to train.")
    _SEED = flags.DEFINE_integer("seed", 0, "Seed of the initialisation and the data order.")
    _STEPS = flags.DEFINE_integer("steps", None, "Optimiser steps (default: the preset of each model).")
    _BATCH = flags.DEFINE_integer("batch_size", None, "Windows per step (default: the preset).")
    _CORPUS_MAX_BYTES = flags.DEFINE_integer("corpus_max_bytes", 16_000_000, "Byte budget of the corpus.")
    _HELDOUT_EVERY = flags.DEFINE_integer("heldout_every", 40, "Hold out files with sha256(path) % N == 0.")
    _MAX_HELDOUT_BYTES = flags.DEFINE_integer("max_heldout_bytes", 120_000, "Byte budget of heldout.txt.")
    _LOG_EVERY = flags.DEFINE_integer("log_every", 20, "Steps between progress lines.")
    _EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "Steps between quick validation losses.")
    _SAMPLE_TOKENS = flags.DEFINE_integer("sample_tokens", 48, "Greedy tokens per sample in the report.")


# ----------------------------------------------------------------------------------------------- training

def make_optimizer(run: TrainConfig) -> optax.GradientTransformation:
    """AdamW (no decay on norm weights) with linear warm-up and cosine decay, after global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=run.peak_lr, warmup_steps=run.warmup_steps, decay_steps=run.steps,
        end_value=run.peak_lr * run.final_lr_fraction)
    decay_mask = lambda params: {k: v.ndim >= 2 for k, v in params.items()}  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(run.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=run.weight_decay, mask=decay_mask))


def batch_starts(run: TrainConfig, num_tokens: int) -> np.ndarray:
    """Host-side. [steps, batch] start offsets of the training windows: the whole data order, from the seed."""
    if num_tokens <= run.seq_len + 1:
        raise ValueError(f"{num_tokens} training tokens do not fill one window of seq_len={run.seq_len}")
    rng = np.random.default_rng(run.seed)
    return rng.integers(0, num_tokens - run.seq_len - 1, size=(run.steps, run.batch_size))


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=(0, 1))
def train_step(params: dict, opt_state, windows: jax.Array, cfg: TinyLlamaConfig, run: TrainConfig):
    """Pure. One AdamW step on `windows` [B, seq_len + 1]; returns (params, opt_state, loss, grad norm)."""
    loss_fn = lambda p: jnp.mean(token_losses(p, cfg, windows, run.attention_block,  # noqa: E731
                                              jnp.dtype(run.compute_dtype)))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = make_optimizer(run).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)


def train(cfg: TinyLlamaConfig, run: TrainConfig, train_ids: np.ndarray, *, eval_windows: np.ndarray | None = None,
          log_every: int = 0, eval_every: int = 0, name: str = "model") -> tuple[dict, dict]:
    """Trains from `jax.random.key(run.seed)` on random windows of `train_ids`; returns (params, history).

    Deterministic: the same config, seed and data give the same parameters (same machine and XLA build).
    """
    train_ids = np.asarray(train_ids, np.int32)
    starts = batch_starts(run, len(train_ids))
    offsets = np.arange(run.seq_len + 1)
    params = init_params(cfg, jax.random.key(run.seed))
    opt_state = make_optimizer(run).init(params)
    history = {"step": [], "loss": [], "grad_norm": [], "eval": []}
    t0 = time.perf_counter()
    compile_s = 0.0
    for step in range(run.steps):
        windows = jnp.asarray(train_ids[starts[step][:, None] + offsets])
        params, opt_state, loss, grad_norm = train_step(params, opt_state, windows, cfg, run)
        history["step"].append(step + 1)
        history["loss"].append(float(loss))  # also syncs, so the timings below are real
        history["grad_norm"].append(float(grad_norm))
        if step == 0:
            compile_s = time.perf_counter() - t0
        if log_every and ((step + 1) % log_every == 0 or step + 1 == run.steps):
            elapsed = time.perf_counter() - t0
            rate = step * run.batch_size * run.seq_len / max(elapsed - compile_s, 1e-9)
            eta = (run.steps - step - 1) * run.batch_size * run.seq_len / max(rate, 1e-9)
            logging.info("%s step %d/%d loss %.4f |g| %.3f  %.0f tok/s  elapsed %.0fs  eta %.0fs", name, step + 1,
                         run.steps, np.mean(history["loss"][-log_every:]), float(grad_norm), rate, elapsed, eta)
        if eval_windows is not None and eval_every and (step + 1) % eval_every == 0 and step + 1 < run.steps:
            val = mean_loss(params, cfg, eval_windows)
            history["eval"].append({"step": step + 1, "val_loss": val})
            logging.info("%s step %d quick val loss %.4f (ppl %.2f)", name, step + 1, val, math.exp(val))
    history["train_time_s"] = time.perf_counter() - t0
    history["compile_s"] = compile_s
    return params, history


# ------------------------------------------------------------------------------------------------ evaluation

def make_windows(ids, seq_len: int) -> np.ndarray:
    """Non-overlapping [n, seq_len + 1] windows (each token but the first of a window is predicted once)."""
    ids = np.asarray(ids, np.int32)
    n = (len(ids) - 1) // seq_len
    return np.stack([ids[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])


@functools.partial(jax.jit, static_argnums=(1,))
def _window_losses(params, cfg, windows):
    return jnp.sum(token_losses(params, cfg, windows), axis=-1)


def mean_loss(params: dict, cfg: TinyLlamaConfig, windows: np.ndarray, batch: int = 4) -> float:
    """Mean next-token loss (nats) over all predicted tokens of `windows`."""
    total = 0.0
    for i in range(0, len(windows), batch):
        total += float(jnp.sum(_window_losses(params, cfg, jnp.asarray(windows[i:i + batch]))))
    return total / (windows.shape[0] * (windows.shape[1] - 1))


@functools.partial(jax.jit, static_argnums=(1,))
def _logits_at(params, cfg, tokens, pos):
    return forward(params, cfg, tokens)[0, pos]


def greedy(params: dict, cfg: TinyLlamaConfig, prompt_ids: list[int], max_new_tokens: int,
           buffer_len: int = 128) -> list[int]:
    """Greedy continuation (stops at </s>); recomputes a fixed-length padded forward, so one compile."""
    length = len(prompt_ids) + max_new_tokens
    if length > buffer_len:
        raise ValueError(f"prompt of {len(prompt_ids)} + {max_new_tokens} new tokens exceeds buffer_len={buffer_len}")
    buf = np.full((1, buffer_len), tiny_corpus.PAD_ID, np.int32)
    buf[0, :len(prompt_ids)] = prompt_ids
    out = []
    for pos in range(len(prompt_ids), length):
        token = int(jnp.argmax(_logits_at(params, cfg, jnp.asarray(buf), pos - 1)))
        out.append(token)
        if token == tiny_corpus.EOS_ID:
            break
        buf[0, pos] = token
    return out


def round_to_stored_dtype(params: dict) -> dict:
    return {k: jnp.asarray(np.asarray(v).astype(ml_dtypes.bfloat16).astype(np.float32)) for k, v in params.items()}


# --------------------------------------------------------------------------------------------------- output

def save_hf_dir(out_dir: str, cfg: TinyLlamaConfig, params: dict, tokenizer_dir: str, heldout_text: str) -> None:
    """config.json, model.safetensors (bf16, HF names and layout), tokenizer files and heldout.txt."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf(STORED_DTYPE), f, indent=2)
        f.write("\n")
    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(ml_dtypes.bfloat16)) for k, v in sorted(params.items())}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name in tiny_corpus.TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "heldout.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(heldout_text)


def train_one(which: str, seed: int, out_root: str, corpus: tiny_corpus.Corpus, tokenizer, tokenizer_dir: str,
              train_ids: np.ndarray, heldout_ids: list[int]) -> dict:
    cfg = MODEL_CONFIGS[which]
    run = dataclasses.replace(TRAIN_CONFIGS[which], seed=seed)
    if _STEPS.value:
        run = dataclasses.replace(run, steps=_STEPS.value, warmup_steps=min(run.warmup_steps, _STEPS.value // 10))
    if _BATCH.value:
        run = dataclasses.replace(run, batch_size=_BATCH.value)
    heldout_windows = make_windows(heldout_ids, run.seq_len)
    params, history = train(cfg, run, train_ids, eval_windows=heldout_windows[:8], log_every=_LOG_EVERY.value,
                            eval_every=_EVAL_EVERY.value, name=which)
    stored = round_to_stored_dtype(params)
    t0 = time.perf_counter()
    val_loss = mean_loss(stored, cfg, heldout_windows)
    slice_loss = mean_loss(stored, cfg, heldout_windows[:HELDOUT_SLICE_WINDOWS])
    eval_s = time.perf_counter() - t0
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer.encode(prompt).ids
        new = greedy(stored, cfg, ids, _SAMPLE_TOKENS.value)
        samples.append({"prompt": prompt, "completion": tokenizer.decode(new, skip_special_tokens=False)})
    out_dir = os.path.join(out_root, which)
    save_hf_dir(out_dir, cfg, stored, tokenizer_dir, corpus.heldout_text)
    tokens_seen = run.steps * run.batch_size * run.seq_len
    report = {
        "model": which,
        "command": f"python -m models.training.train --out={out_root} --which={which} --seed={seed}"
                   + (f" --steps={_STEPS.value}" if _STEPS.value else "")
                   + (f" --batch_size={_BATCH.value}" if _BATCH.value else ""),
        "corpus": corpus.description,
        "tokenizer": {"type": "byte-level BPE (tokenizers), GPT-2 pre-tokenisation", "vocab_size": VOCAB_SIZE,
                      "special_tokens": list(tiny_corpus.SPECIAL_TOKENS),
                      "tokenizer_json_sha256": tiny_corpus.file_sha256(os.path.join(out_dir, "tokenizer.json")),
                      "train_tokens": int(len(train_ids)), "heldout_tokens": len(heldout_ids),
                      "train_bytes_per_token": corpus.description["train_bytes"] / len(train_ids)},
        "model_config": dataclasses.asdict(cfg),
        "parameters": count_params(params),
        "stored_dtype": STORED_DTYPE,
        "training": {**dataclasses.asdict(run), "tokens_seen": tokens_seen,
                     "epochs": tokens_seen / len(train_ids),
                     "train_time_s": round(history["train_time_s"], 1), "compile_s": round(history["compile_s"], 1),
                     "tokens_per_s": round(tokens_seen / history["train_time_s"], 1),
                     "platform": f"{platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} "
                                 f"{jax.default_backend()}"},
        "results": {
            "final_train_loss": float(np.mean(history["loss"][-20:])),
            "val_loss": val_loss, "val_ppl": math.exp(val_loss),
            "val_windows": int(len(heldout_windows)), "val_tokens_predicted": int(heldout_windows.size
                                                                                 - len(heldout_windows)),
            "heldout_slice": {"windows": HELDOUT_SLICE_WINDOWS, "seq_len": run.seq_len, "loss": slice_loss,
                              "ppl": math.exp(slice_loss),
                              "definition": "heldout.txt encoded with add_special_tokens (leading <s>), "
                                            "non-overlapping windows of seq_len+1 tokens with stride seq_len, "
                                            "the first `windows` of them; mean next-token NLL"},
            "eval_s": round(eval_s, 1),
            "quick_val_curve": history["eval"],
        },
        "loss_curve": [[s, round(l, 4)] for s, l in zip(history["step"], history["loss"])
                       if s % 10 == 0 or s == 1],
        "samples_greedy": samples,
    }
    with open(os.path.join(out_dir, "training_report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")
    logging.info("%s: %d params, val loss %.4f ppl %.2f, slice ppl %.2f, %.0fs training; wrote %s", which,
                 report["parameters"], val_loss, math.exp(val_loss), math.exp(slice_loss),
                 history["train_time_s"], out_dir)
    for s in samples:
        logging.info("%s sample %r -> %r", which, s["prompt"], s["completion"])
    return report


def main(argv):
    del argv
    t0 = time.perf_counter()
    corpus = tiny_corpus.load_corpus(max_bytes=_CORPUS_MAX_BYTES.value, heldout_every=_HELDOUT_EVERY.value,
                                     max_heldout_bytes=_MAX_HELDOUT_BYTES.value)
    logging.info("corpus: %d train files (%d bytes), %d held-out files (%d bytes), sha256 %s",
                 corpus.description["train_files"], corpus.description["train_bytes"],
                 corpus.description["heldout_files"], corpus.description["heldout_bytes"],
                 corpus.description["sha256"])
    tokenizer = tiny_corpus.train_tokenizer([d.text for d in corpus.train], VOCAB_SIZE)
    tokenizer_dir = os.path.join(_OUT.value, f".tokenizer-{os.getpid()}")
    tiny_corpus.save_tokenizer(tokenizer, tokenizer_dir)
    train_ids = np.asarray(tiny_corpus.encode_documents(tokenizer, corpus.train), np.int32)
    heldout_ids = tiny_corpus.encode_heldout_text(tokenizer, corpus.heldout_text)
    if heldout_ids != tiny_corpus.encode_documents(tokenizer, corpus.heldout):
        raise AssertionError("heldout.txt does not encode to the held-out documents' token stream")
    logging.info("tokenizer: %d train tokens, %d held-out tokens (%.1fs so far)", len(train_ids), len(heldout_ids),
                 time.perf_counter() - t0)
    try:
        for which in (("target", "draft") if _WHICH.value == "both" else (_WHICH.value,)):
            train_one(which, _SEED.value, _OUT.value, corpus, tokenizer, tokenizer_dir, train_ids, heldout_ids)
    finally:
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
    logging.info("done in %.0fs", time.perf_counter() - t0)


if __name__ == "__main__":
    define_flags()
    app.run(main)
