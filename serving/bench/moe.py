"""Mixture-of-experts on CPU (issue 25): the grouped expert MLP's native kernel against XLA's `ragged_dot` dispatch,
side by side in one run, on two models built locally with random weights, both 8 layers, hidden 512, 8 query / 4 KV
heads, vocabulary 32000, untied head, and the same expert bytes per layer (~140M parameters in all):
"mixtral-tiny" (Mixtral-shaped: 8 experts of intermediate 1024, top-2) and "qwen3moe-tiny" (Qwen3-MoE-shaped: 64
fine-grained experts of intermediate 128, top-8, top-k weights renormalised, q/k RMS norms, head_dim 64).

    python -m serving.bench moe [--only=kernel,throughput] [--models=mixtral,qwen3moe]
                                [--dtypes=float32,bfloat16,int8] [--quick]

kernel: MoE layers' routed experts (`pallas_kernels.moe.grouped_expert_mlp`, 8 layers of distinct weights in turn,
so they come from memory) at 1 and 16 tokens (decode steps) and 256 (a prefill chunk), time per layer against the
memory roofline of the experts the tokens select (their bytes / read bandwidth measured now). throughput: the engine
(`LLM`), 16 prompts x 128 tokens in -> 128 out greedy at batch 16 (all at once) and batch 1 (one at a time), output
tok/s, and the batch-1 decode step against the roofline of the weights it reads (attention, the selected experts,
the LM head or its int8 screen), and llama.cpp on the same checkpoint written as GGUF (`serving.bench.llamacpp`,
where llama-cpp-python is installed), interleaved round by round; "agree": the mean share of the 16 greedy outputs
a meshserve path and llama.cpp produce identically from the start (random weights leave near-ties that accumulation
order and llama.cpp's float16 KV cache decide differently after a while). "ragged_dot" is the old path
(MESHSERVE_MOE_KERNEL=ragged_dot at trace time: every other native kernel stays on), "native" the new. Dtype
"int8" is the bfloat16 checkpoint quantised at load (a float32 scale per slot and output channel) with bfloat16
activations; llama.cpp runs its Q8_0 GGUF.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
from absl import flags

from serving.bench.harness import BENCH_WORKDIR, TinyMoE, cpu_path, decode_step_bytes, decode_step_expert_bytes, \
    median_time, read_bandwidth, table

_ONLY = flags.DEFINE_list("only", ["kernel", "throughput"], "benchmarks to run")
_MODELS = flags.DEFINE_list("models", ["mixtral", "qwen3moe"], "models (mixtral, qwen3moe)")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "dtypes")
_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the benchmark model is written")
_QUICK = flags.DEFINE_bool("quick", False, "smaller workloads (for a smoke run)")

PATHS = ("ragged_dot", "native")
_PATHS = flags.DEFINE_list("paths", list(PATHS), "MoE paths in the throughput benchmark (ragged_dot is slow at batch 1)")
_SHARED = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
               max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


MODELS = {
    "mixtral": TinyMoE("mixtral-tiny", "Mixtral", dict(_SHARED, intermediate_size=1024, num_local_experts=8,
                                                       num_experts_per_tok=2)),
    # Qwen3-MoE's fine-grained experts (Qwen3-30B-A3B: 128 of 768 at hidden 2048, top-8), sized so a layer's experts
    # hold as many weights as mixtral-tiny's: 64 x 128 = 8 x 1024 intermediate rows. intermediate_size is the dense
    # MLP's, which no layer has (every layer sparse).
    "qwen3moe": TinyMoE("qwen3moe-tiny", "Qwen3Moe", dict(_SHARED, intermediate_size=1024, moe_intermediate_size=128,
                                                         num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
                                                         head_dim=64)),
}


def _models() -> list[TinyMoE]:
    unknown = set(_MODELS.value) - set(MODELS)
    if unknown:
        raise ValueError(f"--models={','.join(_MODELS.value)}: unknown {sorted(unknown)}; expected {', '.join(MODELS)}")
    return [MODELS[m] for m in _MODELS.value]


def moe_path(name: str):
    """Programs traced inside take MoE path `name` ("native": the default choice; "ragged_dot": forced)."""
    from pallas_kernels import native
    from pallas_kernels.moe import MOE_ENV_VAR
    return native.env_var(MOE_ENV_VAR, "auto" if name == "native" else name)


def bench_kernel(model: TinyMoE, bw: float):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import moe, native
    e, i, n, k = model.config["hidden_size"], model.expert_intermediate, model.experts, model.top_k
    rows = []
    layers = 8  # distinct weights per layer, called in turn: more bytes than the caches hold
    for dtype in _DTYPES.value:
        int8 = dtype == "int8"  # bfloat16 activations, int8 experts with per-channel scales (models.quant's layout)
        dt = jnp.dtype(jnp.bfloat16 if int8 else dtype)
        rng = np.random.default_rng(0)
        w = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), dt)
        stack = [(w(n, e, i), w(n, e, i), w(n, i, e)) for _ in range(layers)]
        scales = [None] * layers
        if int8:
            stack, scales = zip(*[_quantized(ws) for ws in stack])
        # As single-device CPU serving holds them: packed slot by slot (`pallas_kernels.matmul.pack_experts`)
        packed = [tuple(native.pack_weights(list(ws))) for ws in stack]
        expert_bytes = 3 * e * i * (1 if int8 else dt.itemsize)
        for t in (1, 16, 256):
            x = jnp.asarray(rng.standard_normal((t, e)), dt)
            slots = [jnp.asarray(np.stack([rng.permutation(n)[:k] for _ in range(t)]), jnp.int32)
                     for _ in range(layers)]
            weights = jnp.asarray(rng.random((t, k)), dt)
            selected = sum(len(np.unique(np.asarray(s))) for s in slots) / layers
            times = {}

            def chain(x, slots, stack, scales):
                for s, (g, u, d), sc in zip(slots, stack, scales):
                    x = x + moe.grouped_expert_mlp(x, s, weights, g, u, d, sc)
                return x
            for path, weights_as in (("ragged_dot", stack), ("native", stack), ("packed", packed)):
                with moe_path("native" if path == "packed" else path):
                    fn = jax.jit(lambda *a: chain(*a))  # a fresh trace: the path is read then
                    fn.lower(x, slots, weights_as, scales).compile()
                    times[path] = median_time(lambda: jax.block_until_ready(fn(x, slots, weights_as, scales)),
                                              10 if t < 256 else 3) / layers
            best = min(times["native"], times["packed"])
            roof = selected * expert_bytes / bw
            rows.append([dtype, t, selected, selected * expert_bytes / 1e6, times["ragged_dot"] * 1e3,
                         times["native"] * 1e3, times["packed"] * 1e3, times["ragged_dot"] / best,
                         roof * 1e3, roof / best])
    table(f"{model.name}: one MoE layer's routed experts (E={e}, I={i}, {n} experts, top-{k}), ms per layer over "
          f"{layers} layers of distinct weights: ragged_dot (old) vs the native grouped kernel ({cpu_path()}) on "
          f"row-major experts and on experts packed as serving holds them; speed-up and roofline/best: "
          f"the faster native; roofline: selected experts' bytes / read bandwidth ({bw / 1e9:.1f} GB/s measured now)",
          ["dtype", "tokens", "experts selected", "MB selected", "ragged_dot (ms)", "native row-major (ms)",
           "native packed (ms)", "speed-up", "roofline (ms)", "roofline/best"], rows)


def _quantized(weights):
    """Expert weights [S, K, N] as the engine holds them quantized (models.quant, int8, a float32 scale per slot and
    output column): (values, scales)."""
    import jax.numpy as jnp

    from models.quant import WeightQuant, quantize
    pairs = [quantize(np.asarray(w, np.float32), (1,), WeightQuant("int8")) for w in weights]
    return tuple(jnp.asarray(v) for v, _ in pairs), tuple(jnp.asarray(sc) for _, sc in pairs)


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> list[float]:
    """Per output: the share of its tokens both produce identically from the start."""
    return [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) / len(x) for x, y in zip(ours, theirs)]


def bench_throughput(model: TinyMoE, bw: float):
    paths = tuple(p for p in PATHS if p in _PATHS.value)
    from serving.core.llm import LLM
    from serving.params import SamplingParams
    n_in, n_out = 128, (32 if _QUICK.value else 128)
    singles = 2 if _QUICK.value else 4
    greedy = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    seeds = iter(range(1000, 10 ** 9))

    def prompts(n):
        rng = np.random.default_rng(next(seeds))
        return [rng.integers(10, model.config["vocab_size"], n_in).tolist() for _ in range(n)]

    from serving.bench import llamacpp
    have_cpp = llamacpp.available()
    if have_cpp:  # its figures are quoted only if it computes what HF does on our GGUF layouts
        print(llamacpp.check_moe_layouts(_WORKDIR.value), flush=True)
    rows = []
    for dtype in _DTYPES.value:
        int8 = dtype == "int8"  # the bfloat16 checkpoint quantised at load (llama.cpp: its Q8_0 GGUF)
        model_dtype = "bfloat16" if int8 else dtype
        hf_dir = model.checkpoint(model_dtype, _WORKDIR.value)
        cpp = None
        if have_cpp:
            gguf_path = os.path.join(_WORKDIR.value, f"{model.name}-{dtype}.gguf")
            if not os.path.exists(gguf_path) or os.path.getmtime(gguf_path) < os.path.getmtime(
                    os.path.join(hf_dir, "config.json")):
                llamacpp.write_gguf(hf_dir, gguf_path, q8_0=int8)
            cpp = llamacpp.LlamaCpp(gguf_path, max_seqs=16, max_len=n_in + n_out)
            cpp.generate(prompts(16), 8)
        cpp_rate16, cpp_rate1 = [], []
        llms = {}
        for path in paths:
            with moe_path(path):
                llms[path] = LLM(hf_dir, dtype=model_dtype, page_size=16, num_pages=4096, max_num_seqs=16,
                                 max_num_batched_tokens=256, enable_prefix_caching=False,
                                 **(dict(quantization="int8") if int8 else {}))
                llms[path].generate(prompts(16), greedy)  # programs traced now, under this path
                llms[path].generate(prompts(1), greedy)
        rate16 = {p: [] for p in paths}
        rate1 = {p: [] for p in paths}
        steps = {p: [] for p in paths}
        outs16 = {p: [] for p in paths}
        cpp_outs16 = []
        for r in range(1 if _QUICK.value else 3):  # interleaved, the order flipped each round
            order = paths if r % 2 == 0 else paths[::-1]
            batch = prompts(16)
            for path in order:
                with moe_path(path):
                    t0 = time.perf_counter()
                    outs = llms[path].generate(batch, greedy)
                    rate16[path].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
                    outs16[path] += [list(o.token_ids) for o in outs]
            ones = prompts(singles)
            for path in order:
                eng = llms[path].engine
                with moe_path(path):
                    took = 0.0
                    for p in ones:
                        t0 = time.perf_counter()
                        req = eng.make_request(f"b1-{r}-{path}-{len(steps[path])}", p, greedy)
                        eng.add_request(req)
                        while eng.has_unfinished():
                            eng.step()
                            if req.num_output_tokens >= 4 and eng.last_step_time_s:
                                steps[path].append(eng.last_step_time_s)
                        took += time.perf_counter() - t0
                    rate1[path].append(len(ones) * n_out / took)
            if cpp is not None:
                t0 = time.perf_counter()
                cpp_outs16 += cpp.generate(batch, n_out)
                cpp_rate16.append(16 * n_out / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                for p in ones:
                    cpp.generate([p], n_out)
                cpp_rate1.append(len(ones) * n_out / (time.perf_counter() - t0))
        from flax import nnx
        eng = llms["native"].engine
        total = decode_step_bytes(eng, 1)
        selected = decode_step_expert_bytes(nnx.merge(eng.runner.graphdef, eng.runner.state), 1)[1]
        for path in paths:
            step = statistics.median(steps[path])
            agree = f"{statistics.mean(_agreement(outs16[path], cpp_outs16)):.0%}" if cpp is not None else "-"
            rows.append([dtype, path, cpu_path(), statistics.median(rate16[path]), statistics.median(rate1[path]),
                         step * 1e3, total / 1e6, selected / 1e6, total / bw * 1e3, total / bw / step, agree])
        if cpp is not None:
            rows.append([dtype, "llama.cpp", llamacpp.instruction_sets(), statistics.median(cpp_rate16),
                         statistics.median(cpp_rate1), "-", "-", "-", "-", "-", "-"])
            cpp.close()
        del llms
    table(f"{model.name} ({model.experts} experts of intermediate {model.expert_intermediate}, top-{model.top_k}), "
          f"output tok/s, 16 x ({n_in} in, {n_out} out) greedy: batch 16 (all at once) and batch 1 (one at a time, "
          f"{singles} prompts); batch-1 decode step (median) against the roofline of the bytes it reads (attention, "
          f"selected experts, LM head screen) at {bw / 1e9:.1f} GB/s measured now; agree: batch-16 greedy tokens "
          f"equal to llama.cpp's from the start",
          ["dtype", "MoE path", "kernels", "tok/s b16", "tok/s b1", "b1 step (ms)", "MB read / step",
           "of which experts", "roofline (ms)", "roofline/step", "agree"], rows)


def main() -> None:
    models = _models()
    bw = read_bandwidth()
    if "kernel" in _ONLY.value:
        for model in models:
            bench_kernel(model, bw)
    if "throughput" in _ONLY.value:
        for model in models:
            bench_throughput(model, bw)
