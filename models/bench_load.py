"""Load-time benchmark: a ~125M-parameter Llama from HF safetensors and from Orbax.

    python -m models.bench_load [--workdir=/tmp/meshserve-bench-load] [--dtype=float32]
"""
import os
import time

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/meshserve-bench-load", "where the checkpoints are written")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "checkpoint and compute dtype")

LLAMA_125M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                  tie_word_embeddings=False)


def make_llama_125m(out_dir: str, dtype: str = "float32", seed: int = 0) -> str:
    """Builds and saves a random-weight ~125M Llama in HF format (once; reused when present)."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_125M)).to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    return out_dir


def _time(fn):
    import jax
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(out)))
    return out, time.perf_counter() - t0


def main(argv):
    del argv
    import jax.numpy as jnp

    from models.weights import load_hf_model, load_orbax_model, save_orbax
    dtype = jnp.dtype(_DTYPE.value)
    hf_dir = make_llama_125m(os.path.join(_WORKDIR.value, f"hf-{_DTYPE.value}"), _DTYPE.value)
    orbax_dir = os.path.join(_WORKDIR.value, f"orbax-{_DTYPE.value}")
    model, t_hf = _time(lambda: load_hf_model(hf_dir, dtype=dtype))
    n_params = sum(x.size for x in __import__("jax").tree.leaves(__import__("flax").nnx.state(model)))
    if not os.path.exists(os.path.join(orbax_dir, "meshserve_model.json")):
        save_orbax(model, orbax_dir, hf_dir=hf_dir)
    del model
    _, t_hf2 = _time(lambda: load_hf_model(hf_dir, dtype=dtype))
    _, t_orbax = _time(lambda: load_orbax_model(orbax_dir, dtype=dtype))
    _, t_orbax2 = _time(lambda: load_orbax_model(orbax_dir, dtype=dtype))
    print(f"params: {n_params / 1e6:.1f}M ({_DTYPE.value})")
    print(f"load from safetensors: {t_hf:.2f}s first, {t_hf2:.2f}s warm page cache")
    print(f"load from Orbax:       {t_orbax:.2f}s first, {t_orbax2:.2f}s second")


if __name__ == "__main__":
    app.run(main)
