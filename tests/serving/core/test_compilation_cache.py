"""The persistent compilation cache: a second process with the same model and settings loads every warm-up
program from the cache instead of compiling it, and produces the same tokens."""
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
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
from serving.core.llm import LLM
from serving.core.sampling_params import SamplingParams
llm = LLM(sys.argv[1], page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=16)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
print("RESULT", json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                            "misses": events.count("/jax/compilation_cache/cache_misses"),
                            "programs": llm.engine.compile_count, "tokens": out.token_ids,
                            "dir": llm.engine.runner.compilation_cache_dir}))
"""


def _run(model: str, cache: str) -> dict:
    # Every program is written (no compile-time floor): else one compiling in ~0.2 s is cached by one run and
    # not the other depending on machine load, and the counts below stop meaning anything.
    env = dict(os.environ, MESHSERVE_COMPILATION_CACHE=cache, MESHSERVE_COMPILATION_CACHE_MIN_SECS="0",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _CHILD, model], capture_output=True, text=True, env=env,
                         timeout=600, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def test_restart_loads_programs_from_the_cache(tmp_path):
    model, cache = shared_small_llama(), str(tmp_path / "xla")
    cold = _run(model, cache)
    assert cold["dir"] == cache and cold["hits"] == 0 and cold["misses"] > 0
    assert any(name.endswith("-cache") for name in os.listdir(cache))
    warm = _run(model, cache)
    # Every program the cold start compiled (and the cache kept) is a hit now; none is compiled again.
    assert warm["misses"] == 0 and warm["hits"] == cold["misses"], (cold, warm)
    assert warm["tokens"] == cold["tokens"]


def test_cache_can_be_turned_off(monkeypatch):
    import jax
    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache("") is None and enable_compilation_cache("off") is None
    assert jax.config.jax_compilation_cache_dir == before
