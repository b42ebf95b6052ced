"""Converts an HF safetensors checkpoint or a GGUF model to an Orbax checkpoint.

    python -m models.convert --model=DIR|FILE.gguf --out=DIR [--dtype=bfloat16] [--quantization=int8|fp8]
"""
from absl import app, flags

_MODEL = flags.DEFINE_string("model", None, "HF model directory (config.json + safetensors), or a GGUF model (a "
                             ".gguf file, a part of a split one, or a directory holding one)", required=True)
flags.DEFINE_alias("hf_dir", "model")
_OUT = flags.DEFINE_string("out", None, "output directory for the Orbax checkpoint", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "parameter dtype to store")
_QUANT = flags.DEFINE_enum("quantization", "none", ["none", "int8", "fp8"],
                           "matmul weights stored quantized (per-channel scales); a quantized checkpoint keeps its own")


def main(argv):
    del argv
    import time

    import jax.numpy as jnp

    from models.tokenizer import Tokenizer
    from models.weights import load_model, model_format, save_orbax

    t0 = time.perf_counter()
    kind = model_format(_MODEL.value)
    if kind == "orbax":
        raise app.UsageError(f"{_MODEL.value} is an Orbax checkpoint already")
    model = load_model(_MODEL.value, dtype=jnp.dtype(_DTYPE.value), quantization=_QUANT.value)
    save_orbax(model, _OUT.value, hf_dir=_MODEL.value if kind == "hf" else None)
    if kind == "gguf":  # the tokenizer rebuilt from the GGUF's metadata, as HF files beside the checkpoint
        Tokenizer.from_pretrained(_MODEL.value).save_pretrained(_OUT.value)
    quant = f", {model.config.quantization} weights" if model.config.quantization else ""
    print(f"wrote Orbax checkpoint {_OUT.value} ({model.config.family}, {_DTYPE.value}{quant}) "
          f"in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    app.run(main)
