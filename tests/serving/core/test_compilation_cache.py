"""The persistent compilation cache: a second process with the same model and default settings compiles nothing
(every program loads from the cache), on the native CPU kernels with the default bounded cache and on XLA's with an
unbounded one, and produces the same tokens."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.synthetic import shared_small_llama
from serving.core.model_runner import (COMPILATION_CACHE_MAX_GIB_ENV, COMPILATION_CACHE_MIN_SECS_ENV,
                                       enable_compilation_cache)
from tests.support.background import result, write

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
                            "dir": llm.engine.runner.compilation_cache_dir,
                            "max_size": jax.config.jax_compilation_cache_max_size}))
"""


def _run(model: str, cache: str, env: dict) -> dict:
    # The defaults unless the case sets them: every program written (no compile-time floor), the cache bounded (the
    # run's own cache is not: tests/conftest.py).
    base = {k: v for k, v in os.environ.items()
            if k not in (COMPILATION_CACHE_MIN_SECS_ENV, COMPILATION_CACHE_MAX_GIB_ENV)}
    env = {**base, "MESHSERVE_COMPILATION_CACHE": cache, "JAX_PLATFORMS": "cpu", **env}
    done = subprocess.run([sys.executable, "-c", _CHILD, model], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


# The default cache (an 8 GiB LRU) on the native kernels; unbounded (MESHSERVE_COMPILATION_CACHE_MAX_GIB=0, as the
# test run's own cache) on XLA's.
CASES = {"default-kernels": {},
         "xla-kernels": {"MESHSERVE_CPU_KERNELS": "xla", COMPILATION_CACHE_MAX_GIB_ENV: "0"}}
MAX_SIZE = {"default-kernels": 8 << 30, "xla-kernels": -1}


def _restarts(cache: str, env: dict) -> tuple[dict, dict]:
    """A cold start into the empty `cache`, then a restart on it."""
    model = shared_small_llama()
    return _run(model, cache, env), _run(model, cache, env)


def background(out: Path) -> None:
    """A whole run's background job (tests/support/background.py): both cases' restarts, each into its own cache."""
    for case, env in CASES.items():
        cache = str(out / case)
        cold, warm = _restarts(cache, env)
        write(out / f"{case}.json", json.dumps({"cache": cache, "cold": cold, "warm": warm}))


@pytest.mark.parametrize("case", CASES)
def test_a_restart_compiles_nothing(tmp_path, case):
    done = result(__file__, f"{case}.json")
    if done is not None:  # this run's background job did them (as below, on the cores the workers left idle)
        found = json.loads(done.read_text())
        cache, cold, warm = found["cache"], found["cold"], found["warm"]
    else:
        cache = str(tmp_path / "xla")
        cold, warm = _restarts(cache, CASES[case])
    assert cold["dir"] == cache and cold["hits"] == 0 and cold["compiled"] > 0
    assert any(name.endswith("-cache") for name in os.listdir(cache))
    # With the default settings (no compile-time floor) every program the cold start compiled is a hit now.
    assert warm["compiled"] == 0 and warm["hits"] == cold["compiled"], (cold, warm)
    assert warm["tokens"] == cold["tokens"]
    assert cold["max_size"] == warm["max_size"] == MAX_SIZE[case]


def test_cache_can_be_turned_off(monkeypatch):
    import jax
    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache("") is None and enable_compilation_cache("off") is None
    assert jax.config.jax_compilation_cache_dir == before


@pytest.mark.parametrize("variable", [COMPILATION_CACHE_MAX_GIB_ENV, COMPILATION_CACHE_MIN_SECS_ENV])
def test_a_setting_that_is_not_a_number_is_refused_by_name(monkeypatch, tmp_path, variable):
    import jax
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv(variable, "lots")
    with pytest.raises(ValueError, match=f"{variable}='lots': expected a number"):
        enable_compilation_cache(str(tmp_path / "cache"))
    assert jax.config.jax_compilation_cache_dir == before  # nothing was set
