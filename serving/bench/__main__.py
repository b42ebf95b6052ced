"""`python -m serving.bench NAME [flags]`: every benchmark of the project behind one entry point. NAME is a module
of this package with absl flags and a `main()` (`python -m serving.bench` lists them; `NAME --help` gives its
flags); serving/bench/harness.py holds what they share."""
import importlib
import sys

from absl import app, flags

BENCHMARKS = {
    "offline": "the serving core in-process on the ~125M Llama: vs HF and llama.cpp, start-up, caches, roofline",
    "serve": "a server or gateway over gRPC and/or the OpenAI HTTP API, `vllm bench serve`-style",
    "sweep": "serve at several request rates against a local server on the ~125M Llama, vs the offline engine",
    "gateway": "the gateway's routing policies in front of N instances, one of them slow or stuck",
    "attention": "ragged paged attention: time per call vs the read-bandwidth roofline and a dense baseline",
    "moe": "mixture of experts on CPU: grouped expert kernel vs ragged_dot, Mixtral/Qwen3-MoE-shaped, vs llama.cpp",
    "quant_kernels": "int8 weight matmuls on CPU: ms and GB/s per call, int8 vs packed f32 and bf16, 1-256 rows",
    "paths": "batch-1 decode step vs its bytes' roofline on every CPU path (native ISAs, XLA, XLA at AVX2), 2 models",
    "layouts": "decode step of every tested parallel layout on 8 fake CPU devices (regression only)",
    "load": "load time of the ~125M Llama from HF safetensors and from Orbax",
    "gguf": "a GGUF model (the demo's SmolLM2): load time and peak RSS, file -> SERVING, tok/s vs llama.cpp",
    "speculative": "speculative decoding (draft model, prompt lookup) on the shipped tiny target/draft pair",
    "host_overhead": "host time per engine step with N running decodes, the device stubbed out",
    "chaos": "faults injected into a gateway + instances under load: overload, kill -9, hang, cancels, restarts",
    "structured": "structured outputs: tok/s with 0/50/100% of sequences JSON-schema constrained, mask time, compile",
    "quant": "quantized serving: bf16 vs int8 weights (+ int8 KV) vs llama.cpp Q8_0, KV capacity, int8 kernels",
    "lora": "LoRA adapters: decode tok/s and TPOT at batch 1 and 32, no adapter / 1 / 8 mixed (ranks 8, 64)",
    "hybrid_kv": "Gemma 3's hybrid KV cache: pages a 32k prompt holds with and without it; 27B's ledger on 8 x 80 GB",
    "accelerator": "acceptance run on a GPU/TPU host: kernels vs oracle, KV write, parity, roofline (--smoke on CPU)",
    "disagg_mix": "prefill/decode disaggregation: decode ITL and long-prompt TTFT, one instance vs a P/D pair",
    "mla": "multi-head latent attention: DeepSeek-V3's KV per token (ledger), decode vs GQA/MHA, absorbed vs expanded",
}


def _usage() -> str:
    width = max(map(len, BENCHMARKS))
    return "usage: python -m serving.bench NAME [flags]   (NAME --help: its flags)\n\n" + "\n".join(
        f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items())


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    if name not in BENCHMARKS:
        asked = name in ("-h", "--help", "help")
        print(_usage(), file=sys.stdout if asked else sys.stderr)
        sys.exit(0 if asked else 2)
    # Only the chosen benchmark is imported: flag names repeat across them (--workdir, --dtype, --steps, --target)
    # and layouts sets XLA_FLAGS before jax is first imported.
    module = importlib.import_module(f"serving.bench.{name}")
    flags.adopt_module_key_flags(module)  # --help lists its flags
    sys.modules["__main__"].__doc__ = module.__doc__  # what absl's --help prints above the flags

    def run(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
        module.main()

    app.run(run, argv=[f"{sys.argv[0]} {name}", *sys.argv[2:]])


if __name__ == "__main__":
    main()
