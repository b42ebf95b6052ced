"""Gemma 3's hybrid KV cache (`--hybrid_kv_cache`): the KV pages and bytes a long prompt holds with it and without, on
a small random Gemma 3 run by the engine on this CPU (`pages`); the ledger's KV bytes per token and how many 32k-token
requests fit on 8 x 80 GB for Gemma 3 27B with and without it, beside a standard-attention model of its size
(`ledger`, arithmetic only: the published configs, no download). Figures: docs/benchmarks.md."""
from __future__ import annotations

import os
import time

from absl import flags

from serving.bench.harness import BENCH_WORKDIR, hf_checkpoint, table

_ONLY = flags.DEFINE_list("only", ["pages", "ledger"], "sections: pages (engine run), ledger (arithmetic)")
_WORKDIR = flags.DEFINE_string("workdir", BENCH_WORKDIR, "where the benchmark model is written")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32768, "prompt tokens of the engine run")
_DECODE = flags.DEFINE_integer("decode", 16, "greedy tokens after the prompt")
_WINDOW = flags.DEFINE_integer("window", 1024, "the local layers' sliding window (Gemma 3's)")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "tokens per KV page")
_CHUNK = flags.DEFINE_integer("chunk", 2048, "prefill chunk (the step's token budget)")

GiB, KiB = 1 << 30, 1 << 10


def small_gemma3(workdir: str, max_len: int, window: int) -> str:
    """A 6-layer random Gemma 3 (Gemma 3 1B's pattern: five local layers, then a global one; its one KV head) small
    enough for a 32k prompt on a CPU."""
    config = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=window,
                  max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return hf_checkpoint(os.path.join(workdir, f"gemma3-small-{window}"), "Gemma3", config,
                         config_class="Gemma3TextConfig")


def _held(block_manager) -> list[int]:
    """Pages referenced per pool (the table's first)."""
    if hasattr(block_manager, "pages_held"):
        return block_manager.pages_held()
    return [sum(1 for r in block_manager.ref_counts if r)]


def run_pages(hybrid: bool) -> list:
    from serving.core.config import EngineConfig
    from serving.core.engine import Engine
    from serving.core.sampling_params import SamplingParams
    from serving.bench.harness import random_prompts

    ps, n, steps = _PAGE_SIZE.value, _PROMPT_LEN.value, _DECODE.value
    path = small_gemma3(_WORKDIR.value, n + steps + ps, _WINDOW.value)
    pages = -(-(n + steps) // ps) + 1
    engine = Engine(EngineConfig(model=path, page_size=ps, num_pages=pages, max_num_seqs=1,
                                 max_num_batched_tokens=_CHUNK.value, enable_prefix_caching=False,
                                 hybrid_kv_cache=hybrid, compilation_cache_dir=""))
    runner, bm = engine.runner, engine.scheduler.block_manager
    # bytes of one page in each pool: its layers' page rows (the table's pool: every layer without the hybrid cache)
    pool_of = [spec.sliding_window if spec.sliding_window in runner.window_pages else None
               for spec in runner.kv_cache_specs]
    pools = [None] + list(runner.window_pages)
    page_bytes = [ps * sum(s.bytes_per_token for s, p in zip(runner.kv_cache_specs, pool_of) if p == pool)
                  for pool in pools]
    engine.add_request(engine.make_request("long", random_prompts(1, n, vocab_size=1024)[0],
                                           SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)))
    t0 = time.perf_counter()
    peak, after_prefill = None, None
    while engine.has_unfinished():
        outputs = engine.step()
        held = _held(bm)
        peak = held if peak is None else [max(a, b) for a, b in zip(peak, held)]
        if after_prefill is None and any(o.new_token_ids for o in outputs):
            after_prefill = held
    seconds = time.perf_counter() - t0
    allocated = sum(kv.nbytes for kv in runner.kv_caches)
    peak_bytes = sum(p * b for p, b in zip(peak, page_bytes))
    return ["on" if hybrid else "off", " + ".join(map(str, after_prefill)), " + ".join(map(str, peak)),
            peak_bytes / (1 << 20), allocated / (1 << 20), seconds]


def bench_pages() -> None:
    table(f"small random Gemma 3 (6 layers: 5 local of window {_WINDOW.value}, 1 global; 1 KV head x 32), one "
          f"{_PROMPT_LEN.value}-token prompt in {_CHUNK.value}-token chunks + {_DECODE.value} greedy tokens, pages of "
          f"{_PAGE_SIZE.value} (python -m serving.bench hybrid_kv --only=pages)",
          ["hybrid KV cache", "pages held after the prefill (table + window pool)", "peak pages held",
           "peak KV held, MiB", "KV allocated, MiB", "run s"],
          (run_pages(hybrid) for hybrid in (True, False)))


def bench_ledger() -> None:
    from serving import ledger

    seq, ps, tokens = 32768, 16, 2048
    hw = ledger.Hardware(device_memory=80 * ledger.GB, num_devices=8)
    layout = ledger.Layout(tp=8)

    def row(preset: str, hybrid: bool):
        name, cfg = ledger.load_config(preset)
        mm = ledger.ModelMemory(cfg, "bfloat16", hybrid=hybrid)
        request = mm.stage_kv_bytes_per_request(ledger.Layout(), 0, seq, ps)  # every layer, unsharded
        per_device = mm.stage_kv_bytes_per_request(layout, 0, seq, ps)
        fits = None
        for _ in range(3):  # the activations grow with the sequences a step samples: settle the count
            act = ledger.peak_activation_bytes(mm, layout, tokens, fits or 256, hw)
            free = (hw.device_memory - int(hw.reserve_fraction * hw.device_memory) - act
                    - ledger.comm_buffer_bytes(mm, layout, tokens, hw) - mm.stage_weight_bytes(layout, 0))
            fits = free // per_device
        # the engine's own sizing at that concurrency: its table's pages hold that many 32k requests
        pages = ledger.plan_kv_pages(cfg, dtype="bfloat16", page_size=ps, free_bytes=hw.device_memory,
                                     mesh_shape={"tensor": 8}, weights_loaded=False, max_batched_tokens=tokens,
                                     max_seqs=fits, hybrid=hybrid)
        full = mm.pool_kv_bytes_per_token(None)
        windows = ", ".join(f"{mm.pool_kv_bytes_per_token(w) / KiB:g} KiB x {mm.window_tokens(w, seq, ps)}"
                            for w in mm.windows) or "-"
        return [name + (" hybrid" if mm.windows else ""), mm.num_params / 1e9, mm.kv_bytes_per_token / KiB,
                full / KiB, windows, request / GiB, request / seq / KiB, fits, pages // (seq // ps)]

    table("ledger: 32k-token requests on 8 x 80 GB (tp=8, bf16 weights and KV, 5% reserve, 2,048-token steps, pages "
          "of 16; python -m serving.bench hybrid_kv --only=ledger)",
          ["model", "params e9", "KV KiB/token, every layer", "KiB/token of the full layers",
           "window layers: KiB/token x tokens held", "KV GiB per 32k request", "KiB/token at 32k", "32k requests fit",
           "engine sizing: 32k requests its pages hold"],
          [row("gemma-3-27b", True), row("gemma-3-27b", False), row("qwen2.5-32b", True),
           row("gpt-oss-120b", True), row("gpt-oss-120b", False)])


def main() -> None:
    for section in _ONLY.value:
        if section == "pages":
            bench_pages()
        elif section == "ledger":
            bench_ledger()
        else:
            raise ValueError(f"--only: unknown section {section!r} (pages, ledger)")
