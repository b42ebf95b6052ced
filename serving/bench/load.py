"""Load-time benchmark: the ~125M-parameter Llama of serving/bench/harness.py from HF safetensors and from Orbax.

    python -m serving.bench load [--workdir=/tmp/meshserve-bench] [--dtype=float32]
"""
import os
import time

from absl import flags

from serving.bench.harness import BENCH_WORKDIR, llama_125m, table

_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the checkpoints are written")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "checkpoint and compute dtype")


def _timed(load):
    """`load()`'s model and the seconds until its every array is ready."""
    import jax
    from flax import nnx
    t0 = time.perf_counter()
    model = load()
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    return model, time.perf_counter() - t0


def main() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.weights import load_hf_model, load_orbax_model, save_orbax
    dtype = jnp.dtype(_DTYPE.value)
    hf_dir = llama_125m(_DTYPE.value, _WORKDIR.value)
    orbax_dir = f"{hf_dir}-orbax"
    model, t_hf = _timed(lambda: load_hf_model(hf_dir, dtype=dtype))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    if not os.path.exists(os.path.join(orbax_dir, "meshserve_model.json")):
        save_orbax(model, orbax_dir, hf_dir=hf_dir)
    del model
    _, t_hf2 = _timed(lambda: load_hf_model(hf_dir, dtype=dtype))
    _, t_orbax = _timed(lambda: load_orbax_model(orbax_dir, dtype=dtype))
    _, t_orbax2 = _timed(lambda: load_orbax_model(orbax_dir, dtype=dtype))
    table(f"Checkpoint load time, ~125M Llama ({n_params / 1e6:.1f}M params, {_DTYPE.value})",
          ["from", "first (s)", "second (s)"],
          [["safetensors (second: warm page cache)", t_hf, t_hf2], ["Orbax", t_orbax, t_orbax2]])
