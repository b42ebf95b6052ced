"""Converts an HF safetensors checkpoint to an Orbax checkpoint.

    python -m models.convert --hf_dir=DIR --out=DIR [--dtype=bfloat16] [--quantization=int8|fp8]
"""
from absl import app, flags

FLAGS = flags.DEFINE_string("hf_dir", None, "HF model directory (config.json + safetensors)", required=True)
_OUT = flags.DEFINE_string("out", None, "output directory for the Orbax checkpoint", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "parameter dtype to store")
_QUANT = flags.DEFINE_enum("quantization", "none", ["none", "int8", "fp8"],
                           "matmul weights stored quantized (per-channel scales); a quantized checkpoint keeps its own")


def main(argv):
    del argv
    import time

    import jax.numpy as jnp

    from models.weights import load_hf_model, save_orbax

    t0 = time.perf_counter()
    model = load_hf_model(FLAGS.value, dtype=jnp.dtype(_DTYPE.value), quantization=_QUANT.value)
    save_orbax(model, _OUT.value, hf_dir=FLAGS.value)
    quant = f", {model.config.quantization} weights" if model.config.quantization else ""
    print(f"wrote Orbax checkpoint {_OUT.value} ({model.config.family}, {_DTYPE.value}{quant}) "
          f"in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    app.run(main)
