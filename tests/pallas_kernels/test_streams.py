"""The packed kernels' two ways of streaming a panel (native/matmul.h PackedTile: several streams per panel, or one
prefetched further ahead where the CPU streams best that way, `CpuOneStream`), each forced with
MESHSERVE_CPU_STREAMS in a fresh process (the choice is read once per process), on every instruction-set path this
CPU runs: packed matmuls of 1-16 rows and packed experts at 1-3 tokens against float64 NumPy."""
import json
import os
import subprocess
import sys

import pytest

from pallas_kernels import native
from tests.pallas_kernels.test_native import RUNNABLE

_REASON = native.machine_reason()
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(_REASON is not None, reason=f"native CPU kernels cannot run here: {_REASON}")]

_CHECK = r"""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import native
from tests.pallas_kernels.test_moe import operands, oracle
from tests.pallas_kernels.test_native import _call  # a fresh trace per path
errors = {}
rng = np.random.default_rng(0)
for isa in json.loads(sys.argv[1]):
    os.environ[native.ISA_ENV_VAR] = isa
    for dt in (jnp.float32, jnp.bfloat16):
        for m in (1, 2, 3, 5, 16):
            x = rng.standard_normal((m, 320)).astype(np.float32)
            w = (rng.standard_normal((320, 192)) / 18).astype(np.float32)
            xd, wd = jnp.asarray(x, dt), jnp.asarray(w, dt)
            got = np.asarray(_call(native.matmul_packed, xd, native.pack_weight(wd)), np.float64)
            want = np.asarray(xd, np.float64) @ np.asarray(wd, np.float64)
            errors[f"{isa} {jnp.dtype(dt).name} matmul {m} rows"] = float(np.abs(got - want).max() / np.abs(want).max())
        for t in (1, 3):
            args = operands(t, 64, 128, 4, 2, dt, seed=t)
            pk = (*args[:3], *(native.pack_weight(a) for a in args[3:]))
            got = np.asarray(_call(native.expert_mlp, *pk), np.float64)
            want = oracle(*(np.asarray(jnp.asarray(a, jnp.float32)) if a.dtype == jnp.bfloat16 else np.asarray(a)
                            for a in args))
            rel = float(np.abs(got - want).max() / np.abs(want).max())
            errors[f"{isa} {jnp.dtype(dt).name} experts {t} tokens"] = rel
print(json.dumps(errors))
"""


@pytest.mark.parametrize("streams", ["one", "several"])
def test_packed_kernels_stream_either_way(streams):
    env = dict(os.environ, MESHSERVE_CPU_STREAMS=streams)
    env.pop(native.ISA_ENV_VAR, None)
    out = subprocess.run([sys.executable, "-c", _CHECK, json.dumps(list(RUNNABLE))], env=env, capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(errors) == len(RUNNABLE) * 2 * 7
    bad = {k: v for k, v in errors.items() if v > (1e-5 if "float32" in k else 1e-2)}
    assert not bad, bad
