"""The persistent compilation cache: a second process with the same model and default settings compiles nothing
(every program loads from the cache), on the native CPU kernels and on XLA's, and produces the same tokens."""
import json
import os
import subprocess
import sys

import pytest

from models.synthetic import shared_small_llama
from serving.core.model_runner import enable_compilation_cache

pytestmark = pytest.mark.e2e

_CHILD = r"""
import json, sys
import jax
import collections
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: events.update([name]))
from serving.core.llm import LLM
from serving.core.sampling_params import SamplingParams
# Two token buckets (4, 8) of one sequence bucket: every kind of program (forward, screened forward, sampling
# variants), fewest of each.
llm = LLM(sys.argv[1], page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=8, min_token_bucket=4)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
# Every XLA compilation request (a program compiled, or loaded from the cache) records its duration; the
# cache_misses event only fires when an entry is written, so a program under the floor was invisible to it.
requests = events["/jax/core/compile/backend_compile_duration"]
print("RESULT", json.dumps({"hits": events["/jax/compilation_cache/cache_hits"],
                            "compiled": requests - events["/jax/compilation_cache/cache_hits"],
                            "programs": llm.engine.compile_count, "tokens": out.token_ids,
                            "dir": llm.engine.runner.compilation_cache_dir}))
"""


def _run(model: str, cache: str, env: dict) -> dict:
    env = {**os.environ, "MESHSERVE_COMPILATION_CACHE": cache, "JAX_PLATFORMS": "cpu", **env}
    env.pop("MESHSERVE_COMPILATION_CACHE_MIN_SECS", None)  # the default: every program is written
    done = subprocess.run([sys.executable, "-c", _CHILD, model], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.parametrize("env", [{}, {"MESHSERVE_CPU_KERNELS": "xla"}], ids=["default-kernels", "xla-kernels"])
def test_a_restart_compiles_nothing(tmp_path, env):
    model, cache = shared_small_llama(), str(tmp_path / "xla")
    cold = _run(model, cache, env)
    assert cold["dir"] == cache and cold["hits"] == 0 and cold["compiled"] > 0
    assert any(name.endswith("-cache") for name in os.listdir(cache))
    warm = _run(model, cache, env)
    # With the default settings (no compile-time floor) every program the cold start compiled is a hit now.
    assert warm["compiled"] == 0 and warm["hits"] == cold["compiled"], (cold, warm)
    assert warm["tokens"] == cold["tokens"]


def test_cache_can_be_turned_off(monkeypatch):
    import jax
    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache("") is None and enable_compilation_cache("off") is None
    assert jax.config.jax_compilation_cache_dir == before
