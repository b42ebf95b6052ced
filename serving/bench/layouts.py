"""Per-step time of every tested parallel layout, on 8 fake CPU devices (for regression only: the fake devices
share this machine's cores, so more devices never means faster here).

    python -m serving.bench layouts [--steps=20]
"""
import os

# Before jax is first imported (the dispatcher imports this module before anything that imports jax).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import flags  # noqa: E402

from serving.bench.harness import hf_checkpoint, table  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 20, "decode steps timed per layout")

LAYOUTS = [("dense", {}), ("dense", dict(tp=2)), ("dense", dict(tp=4)), ("dense", dict(tp=8)),
           ("dense", dict(pp=2)), ("dense4", dict(pp=4)), ("dense4", dict(pp=2, tp=2)), ("dense", dict(dp=2, tp=2)),
           ("moe", {}), ("moe", dict(ep=2)), ("moe", dict(ep=4)), ("moe", dict(ep=8)), ("moe", dict(tp=2, ep=2)),
           ("moe", dict(ep=4, spare_expert_slots=4))]


def _models(root):
    common = dict(vocab_size=160, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=512)
    return {name: hf_checkpoint(os.path.join(root, name), hf_class, config) for name, hf_class, config in (
        ("dense", "Llama", common), ("dense4", "Llama", {**common, "num_hidden_layers": 4}),
        ("moe", "Mixtral", dict(common, num_local_experts=8, num_experts_per_tok=2)))}


def _rows():
    """A table row per layout, as each is measured: the median decode step after the first 3 steps."""
    from serving.core.llm import LLM
    from serving.params import SamplingParams
    models = _models(tempfile.mkdtemp())
    prompts = [[(7 * i + j) % 150 + 3 for j in range(24)] for i in range(8)]
    for name, layout in LAYOUTS:
        llm = LLM(models[name], page_size=8, num_pages=256, max_num_seqs=8, max_num_batched_tokens=64,
                  min_token_bucket=64, enable_prefix_caching=False, **layout)
        params = SamplingParams(temperature=0.0, max_tokens=_STEPS.value + 4, ignore_eos=True)
        times = []
        for i, p in enumerate(prompts):
            llm.engine.add_request(llm.engine.make_request(f"r{i}", p, params))
        while llm.engine.has_unfinished():
            t0 = time.perf_counter()
            llm.engine.step()
            times.append(time.perf_counter() - t0)
        devices = len(llm.engine.devices)
        tag = " ".join(f"{k}={v}" for k, v in layout.items()) or "single device"
        yield [name, tag, devices, statistics.median(times[3:]) * 1e3]


def main() -> None:
    table("Decode step per parallel layout, 8 fake CPU devices (regression only: they share this machine's cores)",
          ["model", "layout", "devices", "decode step (ms, median)"], _rows())
