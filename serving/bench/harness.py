"""What the benchmarks of `python -m serving.bench` share: the markdown table (every one names the CPU), the CPU
kernels' path, the median of timed calls, the read and copy bandwidth probes, random prompts, the random-weight
checkpoints they run (the ~125M Llama, small MoE models) and the timed decode steps of a batch. Imports neither jax
nor the serving core at import (the routing benchmark, gateway.py, runs without them)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import statistics
import time
from typing import Callable, Iterable

BENCH_WORKDIR = "/tmp/meshserve-bench"

LLAMA_125M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=32768,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def hf_checkpoint(directory: str, hf_class: str, config: dict, dtype: str = "float32",
                  config_class: str = "") -> str:
    """`directory`, holding transformers' `{hf_class}ForCausalLM` of `{hf_class}Config(**config)` (or `config_class`:
    Gemma 3's is Gemma3TextConfig) with random weights (seed 0, drawn in float32) in `dtype`: written once (beside it,
    then moved in), reused while it holds that."""
    marker = os.path.join(directory, "meshserve_bench.json")
    wanted = {"hf_class": hf_class, "config": config, "dtype": dtype}
    try:
        with open(marker) as f:
            if json.load(f) == wanted:
                return directory
    except (OSError, ValueError):
        pass
    import shutil

    import torch
    import transformers as tf
    torch.manual_seed(0)
    model = getattr(tf, f"{hf_class}ForCausalLM")(getattr(tf, config_class or f"{hf_class}Config")(**config))
    model = model.to(getattr(torch, dtype))
    tmp = f"{directory}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    del model
    with open(os.path.join(tmp, "meshserve_bench.json"), "w") as f:
        json.dump(wanted, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def llama_125m(dtype: str, workdir: str = BENCH_WORKDIR) -> str:
    """The directory of the ~125M Llama's HF checkpoint in `dtype` under `workdir` (`hf_checkpoint`)."""
    return hf_checkpoint(os.path.join(workdir, f"llama125m-{dtype}"), "Llama", LLAMA_125M, dtype)


@dataclasses.dataclass(frozen=True)
class TinyMoE:
    """A benchmark model: transformers' `{hf_class}Config(**config)` / `{hf_class}ForCausalLM`, random weights."""
    name: str
    hf_class: str
    config: dict

    @property
    def experts(self) -> int:
        return self.config.get("num_local_experts") or self.config["num_experts"]

    @property
    def top_k(self) -> int:
        return self.config["num_experts_per_tok"]

    @property
    def expert_intermediate(self) -> int:
        return self.config.get("moe_intermediate_size", self.config["intermediate_size"])

    def checkpoint(self, dtype: str, workdir: str = BENCH_WORKDIR) -> str:
        """The directory of its HF checkpoint in `dtype` under `workdir` (`hf_checkpoint`)."""
        return hf_checkpoint(os.path.join(workdir, f"{self.name}-{dtype}"), self.hf_class, self.config, dtype)


def cpu_name() -> str:
    """The CPU model, as /proc/cpuinfo names it."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_path() -> str:
    """What the engine's CPU kernels run: the native kernels' instruction-set path, or XLA's (on an accelerator: its
    platform)."""
    import jax

    from pallas_kernels import native
    if jax.default_backend() != "cpu":
        return jax.default_backend()
    return f"native {native.isa()}" if native.enabled() else "xla"


_FRESH_SEEDS = itertools.count(1000)


def random_prompts(n: int, length: int, seed: int = 0, *, low: int = 10, vocab_size: int = 32000) -> list[list[int]]:
    """`n` prompts of `length` token ids drawn uniformly from [low, vocab_size) with `seed`."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab_size, length).tolist() for _ in range(n)]


def fresh_prompts(n: int, length: int, *, low: int = 10) -> list[list[int]]:
    """Random prompts no earlier call in this process drew: a timed cell never reads its prompts from the prefix
    cache (the peers it is compared with have none)."""
    return random_prompts(n, length, next(_FRESH_SEEDS), low=low)


def _times(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn` after one untimed call (compilation, first touch); `fn` waits for
    its own result (jax.block_until_ready)."""
    return statistics.median(_times(fn, repeats))


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` calls of `fn` after one untimed call (for bandwidth: the machine's best case)."""
    return min(_times(fn, repeats))


def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5, *, huge_pages: bool | None = None) -> float:
    """Bytes/s at which a jitted program streams a buffer it only reads (a reduction), measured now on the
    default device: what attention does with the KV pages and a decode step with the weights. (A copy into a
    fresh output measures page faults on CPU, not the memory.) On CPU the buffer is backed by transparent huge
    pages by default, as the engine's packed weights are (`native.pack_weights`); 4 KiB pages read slower."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    if huge_pages is None:
        huge_pages = jax.default_backend() == "cpu"
    if huge_pages:
        from pallas_kernels import native
        host = np.frombuffer(native.huge_page_buffer(nbytes), np.float32)
        host[...] = 1.0
        x = jax.device_put(host, jax.devices("cpu")[0])
    else:
        x = jnp.ones((nbytes // 4,), jnp.float32)
    fn = jax.jit(lambda a: jnp.sum(a))
    return nbytes / best_time(lambda: jax.block_until_ready(fn(x)), repeats)


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a jitted on-device copy of an `nbytes` array (read + write: 2 x nbytes per copy), best of
    `repeats`, on the default device (an accelerator's memory, where a read-only reduction may not stream)."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    fn = jax.jit(jnp.copy)
    return 2 * x.nbytes / best_time(lambda: jax.block_until_ready(fn(x)), repeats)


def _cell(c) -> str:
    if not isinstance(c, float):
        return str(c)
    return f"{c:.0f}" if abs(c) >= 100 else f"{c:.1f}" if abs(c) >= 10 else f"{c:.3g}"


def table(title: str, header: list[str], rows: Iterable[list]) -> None:
    """Prints a markdown table titled `title` and the CPU, a row as soon as `rows` yields it (a slow benchmark
    shows its progress); floats: 3 significant digits below 10, one decimal below 100, whole numbers above."""
    print(f"\n## {title}; CPU: {cpu_name()}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    for r in rows:
        print("| " + " | ".join(_cell(c) for c in r) + " |", flush=True)


_REQUEST_IDS = itertools.count()


def decode_step_bytes(engine, batch: int) -> int:
    """Bytes of weights a decode step of `batch` sequences reads: every parameter as held (quantized weights with
    their scales) but the embedding table, of which it gathers a row per token; a greedy step the LM head's int8
    screen takes reads the screen instead of the head; of a mixture-of-experts layer's experts, those `batch` tokens
    can select: top_k of them at batch 1, at most min(slots, batch * top_k) (`decode_step_expert_bytes`)."""
    import jax
    from flax import nnx
    runner = engine.runner
    model = nnx.merge(runner.graphdef, runner.state)
    tied = engine.model_config.tie_word_embeddings
    embed = model.embed_tokens[...]
    head = embed if tied else model.lm_head[...]
    screen = 0 if model.head_screen is None else model.head_screen[...].nbytes + model.head_screen_bounds[...].nbytes
    total = sum(x.nbytes for x in jax.tree.leaves(runner.state)) - (0 if tied else embed.nbytes) - screen
    experts, selected = decode_step_expert_bytes(model, batch)
    total += selected - experts
    return total - head.nbytes + screen if runner.screens(runner.seq_bucket(batch)) else total


def decode_step_expert_bytes(model, batch: int) -> tuple[int, int]:
    """(bytes of every MoE layer's routed experts, of which a decode step of `batch` tokens reads at most): each
    layer's gate/up/down and their scales, times min(slots, batch * top_k) / slots."""
    from models.quant import scale_name
    experts = selected = 0
    for layer in model.layers:
        mlp = layer.mlp
        if not hasattr(mlp, "replica_slots"):
            continue
        names = [n for p in ("gate_proj", "up_proj", "down_proj") for n in (p, scale_name(p)) if hasattr(mlp, n)]
        per = sum(getattr(mlp, n)[...].nbytes for n in names)
        slots = mlp.gate_proj.shape[0]
        experts += per
        selected += per * min(slots, batch * mlp.top_k) // slots
    return experts, selected


@dataclasses.dataclass(frozen=True)
class DecodeSteps:
    """The timed decode steps of a batch: each one's seconds (`Engine.last_step_time_s`: from its launch, or the
    previous step's end, to its tokens on the host) and the KV tokens its attention read; and the device's mean idle
    time per step waiting on the host, over the whole run."""
    times: list[float]
    kv_tokens: list[int]
    host_gap_s: float


def decode_step_times(engine, prompts: list[list[int]], params, *, warm_tokens: int = 8, skip_steps: int = 0,
                      steps: int | None = None, adapters: list[str | None] | None = None) -> DecodeSteps:
    """Runs `prompts` with sampling `params` on `engine` and times its steps in which every sequence decodes one token
    (no prefill in the step) once every request has `warm_tokens` outputs, the first `skip_steps` of them untimed, up
    to `steps` of them (None: until the requests finish). Then aborts what is left (no tail of shrinking batches,
    each a program to compile) and lets the engine go idle. `adapters`: each prompt's LoRA adapter (None: none)."""
    adapters = adapters or [None] * len(prompts)
    reqs = [engine.make_request(f"decode-{next(_REQUEST_IDS)}", p, params, **({"adapter": a} if a else {}))
            for p, a in zip(prompts, adapters)]
    for r in reqs:
        engine.add_request(r)
    times, kv_tokens, skipped = [], [], 0
    seen, gap0, steps0 = engine.step_count, engine.host_gap_s, engine.host_gap_steps
    while engine.has_unfinished() and (steps is None or len(times) < steps):
        engine.step()
        if engine.step_count == seen:  # launched a step, collected none (look-ahead)
            continue
        seen = engine.step_count
        rec = engine.last_step
        if not rec.num_scheduled_tokens == len(rec.scheduled) == len(reqs) or any(
                r.num_output_tokens < warm_tokens for r in reqs):
            continue
        if skipped < skip_steps:
            skipped += 1
            continue
        times.append(engine.last_step_time_s)
        kv_tokens.append(sum(s.start + 1 for s in rec.scheduled))
    host_gap_s = (engine.host_gap_s - gap0) / max(1, engine.host_gap_steps - steps0)
    for r in reqs:
        if not r.is_finished:
            engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return DecodeSteps(times, kv_tokens, host_gap_s)
