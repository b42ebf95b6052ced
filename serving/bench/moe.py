"""Mixture-of-experts on CPU (issue 25): the grouped expert MLP's native kernel against XLA's `ragged_dot` dispatch,
side by side in one run, on a Mixtral-shaped model built locally with random weights ("mixtral-tiny": 8 layers,
hidden 512, 8 experts of intermediate 1024, top-2, vocabulary 32000).

    python -m serving.bench moe [--only=kernel,throughput] [--dtypes=float32,bfloat16,int8] [--quick]

kernel: MoE layers' routed experts (`pallas_kernels.moe.grouped_expert_mlp`, 8 layers of distinct weights in turn,
so they come from memory) at 1 and 16 tokens (decode steps) and 256 (a prefill chunk), time per layer against the
memory roofline of the experts the tokens select (their bytes / read bandwidth measured now). throughput: the engine
(`LLM`), 16 prompts x 128 tokens in -> 128 out greedy at batch 16 (all at once) and batch 1 (one at a time), output
tok/s, and the batch-1 decode step against the roofline of the weights it reads (attention, the selected experts,
the LM head or its int8 screen), and llama.cpp on the same checkpoint written as GGUF (`serving.bench.llamacpp`,
where llama-cpp-python is installed), interleaved round by round. "ragged_dot" is the old path
(MESHSERVE_MOE_KERNEL=ragged_dot at trace time: every other native kernel stays on), "native" the new. The kernel
benchmark's dtype "int8" is bfloat16 activations with int8 experts (a float32 scale per slot and output channel).
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
from absl import flags

from serving.bench.harness import BENCH_WORKDIR, median_time, read_bandwidth, table

_ONLY = flags.DEFINE_list("only", ["kernel", "throughput"], "benchmarks to run")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "dtypes")
_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the benchmark model is written")
_QUICK = flags.DEFINE_bool("quick", False, "smaller workloads (for a smoke run)")

MIXTRAL_TINY = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
PATHS = ("ragged_dot", "native")


def mixtral_tiny(dtype: str, workdir: str = BENCH_WORKDIR) -> str:
    """The directory of mixtral-tiny's HF checkpoint in `dtype` under `workdir`: written once (seed 0), then reused."""
    d = os.path.join(workdir, f"mixtral-tiny-{dtype}")
    if not os.path.exists(os.path.join(d, "config.json")):
        import torch
        import transformers as tf
        torch.manual_seed(0)
        tf.MixtralForCausalLM(tf.MixtralConfig(**MIXTRAL_TINY)).to(getattr(torch, dtype)).save_pretrained(d)
    return d


def moe_path(name: str):
    """Programs traced inside take MoE path `name` ("native": the default choice; "ragged_dot": forced)."""
    from pallas_kernels import native
    from pallas_kernels.moe import MOE_ENV_VAR
    return native.env_var(MOE_ENV_VAR, "auto" if name == "native" else name)


def _cpu_path() -> str:
    from pallas_kernels import native
    return f"native {native.isa()}" if native.enabled() else "xla"


def bench_kernel(bw: float):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import moe
    e, i, n, k = MIXTRAL_TINY["hidden_size"], MIXTRAL_TINY["intermediate_size"], MIXTRAL_TINY["num_local_experts"], 2
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
            for path in PATHS:
                with moe_path(path):
                    fn = jax.jit(lambda *a: chain(*a))  # a fresh trace: the path is read then
                    fn.lower(x, slots, stack, scales).compile()
                    times[path] = median_time(lambda: jax.block_until_ready(fn(x, slots, stack, scales)),
                                              10 if t < 256 else 3) / layers
            roof = selected * expert_bytes / bw
            rows.append([dtype, t, selected, selected * expert_bytes / 1e6, times["ragged_dot"] * 1e3,
                         times["native"] * 1e3, times["ragged_dot"] / times["native"], roof * 1e3,
                         roof / times["native"]])
    table(f"One MoE layer's routed experts (E={e}, I={i}, {n} experts, top-{k}), ms per layer over {layers} layers "
          f"of distinct weights: ragged_dot (old) vs "
          f"native grouped kernel ({_cpu_path()}); roofline: selected experts' bytes / read bandwidth "
          f"({bw / 1e9:.1f} GB/s measured now)",
          ["dtype", "tokens", "experts selected", "MB selected", "ragged_dot (ms)", "native (ms)", "speed-up",
           "roofline (ms)", "roofline/native"], rows)


def _quantized(weights):
    """Expert weights [S, K, N] as int8 with a float32 scale per slot and output column: (values, scales)."""
    import jax.numpy as jnp
    values, scales = [], []
    for w in weights:
        w = np.asarray(w, np.float32)
        scale = np.maximum(np.abs(w).max(axis=1), 1e-30) / 127
        values.append(jnp.asarray(np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)))
        scales.append(jnp.asarray(scale.astype(np.float32)))
    return tuple(values), tuple(scales)


def _step_bytes(llm, screened: bool) -> tuple[int, int]:
    """(bytes a batch-1 decode step reads, of which the selected experts'): every weight but the embedding table
    (a row gathered) and the experts not selected (top_k of num_experts per layer); the LM head's int8 screen
    instead of the head where the step is screened."""
    import jax
    from flax import nnx
    eng = llm.engine
    model = nnx.merge(eng.runner.graphdef, eng.runner.state)
    embed = model.embed_tokens[...]
    head = model.lm_head[...]
    screen = 0 if model.head_screen is None else model.head_screen[...].nbytes + model.head_screen_bounds[...].nbytes
    experts = selected = 0
    for layer in model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "replica_slots"):
            per = sum(getattr(mlp, p)[...].nbytes for p in ("gate_proj", "up_proj", "down_proj"))
            experts += per
            selected += per * mlp.top_k // mlp.gate_proj.shape[0]
    total = sum(x.nbytes for x in jax.tree.leaves(eng.runner.state)) - embed.nbytes - screen - experts + selected
    if screened and screen:
        total += screen - head.nbytes
    return total, selected


def bench_throughput(bw: float):
    from serving.core.llm import LLM
    from serving.core.sampling_params import SamplingParams
    n_in, n_out = 128, (32 if _QUICK.value else 128)
    singles = 2 if _QUICK.value else 4
    greedy = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    seeds = iter(range(1000, 10 ** 9))

    def prompts(n):
        rng = np.random.default_rng(next(seeds))
        return [rng.integers(10, MIXTRAL_TINY["vocab_size"], n_in).tolist() for _ in range(n)]

    from serving.bench import llamacpp
    have_cpp = llamacpp.available()
    rows = []
    for dtype in _DTYPES.value:
        int8 = dtype == "int8"  # the bfloat16 checkpoint quantised at load (llama.cpp: its Q8_0 GGUF)
        model_dtype = "bfloat16" if int8 else dtype
        cpp = None
        if have_cpp:
            hf_dir = mixtral_tiny(model_dtype, _WORKDIR.value)
            gguf_path = os.path.join(_WORKDIR.value, f"mixtral-tiny-{dtype}.gguf")
            if not os.path.exists(gguf_path) or os.path.getmtime(gguf_path) < os.path.getmtime(
                    os.path.join(hf_dir, "config.json")):
                llamacpp.write_gguf(hf_dir, gguf_path, q8_0=int8)
            cpp = llamacpp.LlamaCpp(gguf_path, max_seqs=16, max_len=n_in + n_out)
            cpp.generate(prompts(16), 8)
        cpp_rate16, cpp_rate1 = [], []
        llms = {}
        for path in PATHS:
            with moe_path(path):
                llms[path] = LLM(mixtral_tiny(model_dtype, _WORKDIR.value), dtype=model_dtype, page_size=16,
                                 num_pages=4096, max_num_seqs=16, max_num_batched_tokens=256,
                                 enable_prefix_caching=False, **(dict(quantization="int8") if int8 else {}))
                llms[path].generate(prompts(16), greedy)  # programs traced now, under this path
                llms[path].generate(prompts(1), greedy)
        rate16 = {p: [] for p in PATHS}
        rate1 = {p: [] for p in PATHS}
        steps = {p: [] for p in PATHS}
        for r in range(1 if _QUICK.value else 2):  # interleaved, the order flipped each round
            order = PATHS if r % 2 == 0 else PATHS[::-1]
            batch = prompts(16)
            for path in order:
                with moe_path(path):
                    t0 = time.perf_counter()
                    outs = llms[path].generate(batch, greedy)
                    rate16[path].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
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
                cpp.generate(batch, n_out)
                cpp_rate16.append(16 * n_out / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                for p in ones:
                    cpp.generate([p], n_out)
                cpp_rate1.append(len(ones) * n_out / (time.perf_counter() - t0))
        screened = llms["native"].engine.runner.screens(llms["native"].engine.runner.seq_bucket(1))
        total, selected = _step_bytes(llms["native"], bool(screened))
        for path in PATHS:
            step = statistics.median(steps[path])
            rows.append([dtype, path, _cpu_path(), statistics.median(rate16[path]), statistics.median(rate1[path]),
                         step * 1e3, total / 1e6, selected / 1e6, total / bw * 1e3, total / bw / step])
        if cpp is not None:
            rows.append([dtype, "llama.cpp", llamacpp.instruction_sets(), statistics.median(cpp_rate16),
                         statistics.median(cpp_rate1), "-", "-", "-", "-", "-"])
            cpp.close()
        del llms
    table(f"mixtral-tiny, output tok/s, 16 x ({n_in} in, {n_out} out) greedy: batch 16 (all at once) and batch 1 "
          f"(one at a time, {singles} prompts); batch-1 decode step (median) against the roofline of the bytes it "
          f"reads (attention, selected experts, LM head screen) at {bw / 1e9:.1f} GB/s measured now",
          ["dtype", "MoE path", "kernels", "tok/s b16", "tok/s b1", "b1 step (ms)", "MB read / step",
           "of which experts", "roofline (ms)", "roofline/step"], rows)


def main() -> None:
    bw = read_bandwidth()
    if "kernel" in _ONLY.value:
        bench_kernel(bw)
    if "throughput" in _ONLY.value:
        bench_throughput(bw)
