"""LoRA serving (`python -m serving.bench lora`): decode throughput and TPOT of the ~125M Llama at batch 1 and 32 with
LoRA off, with LoRA on and no adapter in the batch, 1 adapter for every request and 8 adapters mixed uniformly
(ranks 8 and 64: random PEFT adapters on every projection), side by side in interleaved rounds on one engine
(--max_loras=8 --max_lora_rank=64); (`--only=serve`) the same cells through `serving.bench serve` against one gRPC
server (issue 41's benchmark: output tok/s and TPOT over whole requests, prefills included); and (`--only=kernels`)
the batched update alone per backend. Details: docs/lora.md."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import flags

from serving.bench.harness import BENCH_WORKDIR, cpu_path, decode_step_times, llama_125m, median_time, \
    random_prompts, table

_ONLY = flags.DEFINE_list("only", ["throughput"], "sections to run: throughput, serve, kernels")
_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the benchmark model and adapters are written")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "the model's dtype")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "interleaved timed rounds per cell (median)")
_STEPS = flags.DEFINE_integer("steps", 16, "timed decode steps per cell and round")
_BATCHES = flags.DEFINE_list("batches", ["1", "32"], "batch sizes")
_QUICK = flags.DEFINE_bool("quick", False, "one round of few steps (a smoke run)")
_LORA_DTYPE = flags.DEFINE_enum("lora_dtype", "", ["", "int8"], "how the adapter slots hold A and B (--lora_dtype)")

def _dtype_flag() -> str:
    return f" --lora_dtype={_LORA_DTYPE.value}" if _LORA_DTYPE.value else ""


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANKS = (8, 64)
NUM_ADAPTERS = 8


def write_peft_adapter(directory: str, model_dir: str, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter of the HF model in `model_dir` on every projection (`TARGETS`), rank `rank`,
    lora_alpha 2 * rank, both A and B non-zero (the update matters), as PEFT saves one (adapter_config.json +
    adapter_model.safetensors); written once, reused while its config holds."""
    import numpy as np
    from safetensors.numpy import save_file

    from models.config import ModelConfig
    from models.lora import lora_targets
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
              "base_model_name_or_path": model_dir, "bias": "none", "meshserve_bench_seed": seed}
    marker = os.path.join(directory, "adapter_config.json")
    try:
        with open(marker) as f:
            if json.load(f) == config:
                return directory
    except (OSError, ValueError):
        pass
    cfg = ModelConfig.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, t in lora_targets(cfg, layer).items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, t.in_features)) / np.sqrt(t.in_features)
                                               ).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((t.out_features, rank)) * 0.01).astype(np.float32)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(marker, "w") as f:
        json.dump(config, f)
    return directory


def _adapters(model_dir: str) -> dict[int, list[tuple[str, str]]]:
    """Per rank, NUM_ADAPTERS (name, directory) of random adapters of the benchmark model."""
    return {r: [(f"r{r}-{i}", write_peft_adapter(os.path.join(_WORKDIR.value, f"lora-{_DTYPE.value}-r{r}-{i}"),
                                                 model_dir, r, seed=1000 * r + i))
                for i in range(NUM_ADAPTERS)] for r in RANKS}


def _adapter_cells(adapters: dict[int, list[tuple[str, str]]]) -> dict[str, list[str]]:
    """The cells with adapters, each as the adapter names its requests take in turn: per rank, one adapter for every
    request, and the NUM_ADAPTERS mixed uniformly."""
    cells = {}
    for r in RANKS:
        cells[f"1 adapter, r{r}"] = [adapters[r][0][0]]
        cells[f"{NUM_ADAPTERS} adapters, r{r}"] = [name for name, _ in adapters[r]]
    return cells


def bench_throughput() -> None:
    from serving.core.config import EngineConfig
    from serving.core.engine import Engine
    from serving.params import SamplingParams
    model_dir = llama_125m(_DTYPE.value, _WORKDIR.value)
    adapters = _adapters(model_dir)
    batches = [int(b) for b in _BATCHES.value]
    common = dict(model=model_dir, dtype=_DTYPE.value, page_size=16, num_pages=1024, max_num_seqs=max(batches),
                  max_num_batched_tokens=max(64, max(batches)))
    engines = {"off": Engine(EngineConfig(**common)),
               "on": Engine(EngineConfig(**common, enable_lora=True, max_loras=NUM_ADAPTERS,
                                         max_lora_rank=max(RANKS), lora_dtype=_LORA_DTYPE.value))}
    for r in RANKS:
        for name, path in adapters[r]:
            engines["on"].load_adapter(name, path)
    # cell -> (engine, the adapter of request i of a batch)
    cells = {"LoRA off": ("off", lambda i: None), "LoRA on, no adapter": ("on", lambda i: None)}
    for cell, names in _adapter_cells(adapters).items():
        cells[cell] = ("on", lambda i, names=names: names[i % len(names)])
    rounds, steps = (1, 4) if _QUICK.value else (_ROUNDS.value, _STEPS.value)
    # room for the batch's staggered prefills (64 tokens a step), 8 warm tokens, 2 skipped steps and the timed ones;
    # decode_step_times aborts what is left
    greedy = SamplingParams(temperature=0.0, max_tokens=max(batches) // 2 + 16 + steps, ignore_eos=True)
    times = {(cell, b): [] for cell in cells for b in batches}
    # round 0: warm-up (compiles the programs the cells run, loads every adapter a cell needs, first touch)
    for rnd in range(rounds + 1):
        order = list(cells) if rnd % 2 == 0 else list(cells)[::-1]
        for b in batches:
            for cell in order:
                engine, adapter_of = engines[cells[cell][0]], cells[cell][1]
                timed = decode_step_times(engine, random_prompts(b, 32, seed=rnd), greedy, skip_steps=2,
                                          steps=steps, adapters=[adapter_of(i) for i in range(b)])
                if rnd:
                    times[cell, b] += timed.times
    rows = []
    for b in batches:
        base = statistics.median(times["LoRA off", b])
        for cell in cells:
            step = statistics.median(times[cell, b])
            rows.append([b, cell, b / step, step * 1e3, f"{(step / base - 1) * 100:+.1f}%"])
    lora = engines["on"].lora
    table(f"LoRA decode on the ~125M Llama ({_DTYPE.value}, {cpu_path()}; --max_loras={NUM_ADAPTERS} "
          f"--max_lora_rank={max(RANKS)}{_dtype_flag()}; median of {rounds} interleaved rounds x {steps} steps; "
          f"{lora.num_loads} slot loads, {lora.num_evictions} evictions)",
          ["batch", "cell", "output tok/s", "TPOT (ms)", "TPOT vs LoRA off"], rows)


def bench_serve() -> None:
    """`python -m serving.bench serve` (a process per cell and round) against one gRPC server on the benchmark model
    with the 16 adapters registered (--max_loras=8): random prompts of 32 tokens, 32 output tokens, max_concurrency =
    the batch (2 x batch requests, at least 6), each timed run after one short request per adapter of its cell (the
    r8 and r64 cells evict each other's adapters: the timed run finds its own loaded, the steady state); round 0
    warms up (compiles, first touch), then `--rounds` timed rounds, the cells' order reversed every other round.
    Per cell the median over rounds of output tok/s and mean TPOT, and the TPOT against 0 adapters."""
    from serving.process import REPO_ROOT, ReadyFileProcess, cpu_xla_flags
    model_dir = llama_125m(_DTYPE.value, _WORKDIR.value)
    adapters = _adapters(model_dir)
    batches = [int(b) for b in _BATCHES.value]
    modules = ",".join(f"{name}={path}" for r in RANKS for name, path in adapters[r])
    args = ["-m", "serving.server", f"--model={model_dir}", f"--dtype={_DTYPE.value}", "--host=127.0.0.1",
            "--port=0", "--metrics_port=0", "--enable_lora", f"--max_loras={NUM_ADAPTERS}",
            f"--max_lora_rank={max(RANKS)}", f"--lora_dtype={_LORA_DTYPE.value}", f"--lora_modules={modules}",
            "--page_size=16", "--num_pages=1024",
            f"--max_num_seqs={max(batches)}", f"--max_num_batched_tokens={max(256, max(batches))}"]
    server = ReadyFileProcess("lora-server", args, os.path.join(_WORKDIR.value, "lora-serve"),
                              env={"XLA_FLAGS": cpu_xla_flags(1)}, ready_timeout_s=1800.0).start()
    cells = {"0 adapters": [], **_adapter_cells(adapters)}
    rounds = 1 if _QUICK.value else _ROUNDS.value
    results = {(cell, b): [] for cell in cells for b in batches}
    result = os.path.join(server.workdir, "result.json")

    def run(num_prompts: int, output_len: int, concurrency: int, seed: int, names: list[str]) -> dict:
        subprocess.run([sys.executable, "-m", "serving.bench", "serve", f"--target={server.target}",
                        "--dataset=random", "--random_input_len=32", f"--random_output_len={output_len}",
                        f"--num_prompts={num_prompts}", f"--max_concurrency={concurrency}", f"--seed={seed}",
                        f"--lora_adapters={','.join(names)}", "--disable_tqdm", f"--result_json={result}"],
                       check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        with open(result) as f:
            return json.load(f)

    try:
        server.wait_ready()
        for rnd in range(rounds + 1):
            order = list(cells) if rnd % 2 == 0 else list(cells)[::-1]
            for b in batches:
                for cell in order:
                    # first one short request per adapter of the cell: its adapters in their slots (a cell
                    # after the other rank's finds them evicted), so the timed run measures the steady state
                    run(len(cells[cell]) or 1, 2, NUM_ADAPTERS, rnd, cells[cell])
                    r = run(max(6, 2 * b), 32, b, rnd, cells[cell])
                    if r["failed"]:
                        raise RuntimeError(f"{cell}, batch {b}: {r['failed']} requests failed: "
                                           f"{[e for e in r['errors'] if e][:3]}")
                    if rnd:
                        results[cell, b].append((r["output_throughput"], r["mean_tpot_ms"]))
    finally:
        server.stop()
    rows = []
    for b in batches:
        base = statistics.median(t for _, t in results["0 adapters", b])
        for cell in cells:
            tok = statistics.median(o for o, _ in results[cell, b])
            tpot = statistics.median(t for _, t in results[cell, b])
            rows.append([b, cell, tok, tpot, ", ".join(f"{t:.1f}" for _, t in results[cell, b]),
                         f"{(tpot / base - 1) * 100:+.1f}%"])
    table(f"LoRA through serving.bench serve on the ~125M Llama ({_DTYPE.value}, {cpu_path()}; one gRPC server, "
          f"--max_loras={NUM_ADAPTERS} --max_lora_rank={max(RANKS)}{_dtype_flag()}, 16 adapters registered; "
          f"32-token prompts, 32 output tokens, max_concurrency = batch; median of {rounds} interleaved rounds)",
          ["batch", "cell", "output tok/s", "mean TPOT (ms)", "TPOT per round", "TPOT vs 0 adapters"], rows)


def bench_kernels() -> None:
    """The batched update of one 768 -> 2048 projection (the 125M model's gate) per backend, 8 slots of rank 64,
    tokens spread over the 8 adapters, vs the base projection's matmul."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import lora as lora_kernels
    from pallas_kernels.matmul import matmul
    dt = jnp.dtype(_DTYPE.value)
    k, n, slots, rank = 768, 2048, NUM_ADAPTERS, max(RANKS)
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((slots, rank, k)) * 0.02, dt)
    b = jnp.asarray(rng.standard_normal((slots, rank, n)) * 0.02, dt)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, dt)
    ranks = jnp.full((slots,), rank, jnp.int32)
    backends = [name for name in lora_kernels.BACKENDS]
    rows = []
    base = jax.jit(matmul)
    for t in [int(x) for x in _BATCHES.value]:
        x = jnp.asarray(rng.standard_normal((t, k)), dt)
        s = jnp.asarray(np.arange(t) % slots, jnp.int32)
        row = [t, median_time(lambda: jax.block_until_ready(base(x, w)), 20) * 1e3]
        for backend in backends:
            os.environ[lora_kernels.LORA_ENV_VAR] = backend
            fn = jax.jit(lambda *z: lora_kernels.lora_delta(*z))  # a new function: jit's cache would reuse a backend
            row.append(median_time(lambda: jax.block_until_ready(fn(x, s, a, b, ranks)), 20) * 1e3)
        os.environ.pop(lora_kernels.LORA_ENV_VAR)
        rows.append(row)
    table(f"The LoRA update of one {k} -> {n} projection ({_DTYPE.value}; {slots} slots of rank {rank}, tokens over "
          "all of them), ms per call, beside the base projection's matmul",
          ["tokens", "base matmul"] + backends, rows)


def main() -> None:
    sections = {"throughput": bench_throughput, "serve": bench_serve, "kernels": bench_kernels}
    for name in _ONLY.value:
        if name not in sections:
            raise SystemExit(f"--only: unknown section {name!r}; known: {', '.join(sections)}")
        sections[name]()
