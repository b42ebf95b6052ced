"""int8 weight matmuls on CPU (issue 24): per-call time of the native kernels on packed float32, packed bfloat16 and
packed int8 weights (each int8 method this CPU runs: `widen`, and `dot` where it has int8 dot products), side by
side in one run (interleaved), on the W1 shapes (hidden 768: fused qkv 768 x 2304, o 768 x 768, fused gate|up
768 x 6144, down 3072 x 768) at 1, 4 and 16 rows.

    python -m serving.bench quant_kernels [--rows=1,4,16] [--repeats=15] [--x_dtype=bfloat16]

Each shape is called on enough distinct copies of its weight, in turn, that every format's copies exceed twice the
last-level cache (weights come from memory, as in a decode step), in one jitted program per format (each call's
input depends on the previous call's output). Time per call: the median over `repeats` rounds (a round runs every
format's program once) divided by the program's calls. int8 weights have a float32 scale per column; x is `x_dtype`
for the bfloat16 and int8 columns, float32 for the float32 one. The dot method's x is quantised to two int8 digits
per row (~15 bits): its difference from the widened (exact) products is printed beside, max |dot - widen| over
max |widen|.
"""
from __future__ import annotations

import math
import statistics

import numpy as np
from absl import flags

from serving.bench.harness import table

_ROWS = flags.DEFINE_list("rows", ["1", "4", "16"], "rows of x (tokens in the step)")
_REPEATS = flags.DEFINE_integer("repeats", 15, "timed rounds (median)")
_X_DTYPE = flags.DEFINE_enum("x_dtype", "bfloat16", ["bfloat16", "float32"], "x of the bf16 and int8 columns")

W1_SHAPES = {"qkv 768x2304": (768, 2304), "o 768x768": (768, 768), "gate|up 768x6144": (768, 6144),
             "down 3072x768": (3072, 768)}
FOOTPRINT = 64 << 20  # bytes of int8 copies per shape (the float formats' copies are 2x and 4x that)


def _chain(matmul, x, weights, scale):
    """One program: matmul on each weight in turn, each call's x made to depend on the previous call's output."""
    import jax.numpy as jnp
    outs = []
    for w in weights:
        y = matmul(x, w, scale)
        outs.append(y[:, :1])
        x = x + (y[:, :1] * 0).astype(x.dtype)
    return jnp.concatenate(outs, axis=1)


def bench(rows: list[int], repeats: int, x_dtype: str):
    """Prints the table: each W1 shape at each row count, every format side by side."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import matmul as mm
    from pallas_kernels import native
    isa = native.isa()
    methods = ["widen"] + (["dot"] if native.int8_dot_runs(isa) else [])
    formats = ["f32", "bf16"] + [f"int8 {m}" for m in methods]
    result = []
    for name, (k, n) in W1_SHAPES.items():
        rng = np.random.default_rng(0)
        copies = math.ceil(FOOTPRINT / (k * n))
        base = rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
        scale = (np.abs(base).max(axis=0) / 127).astype(np.float32)
        q = np.clip(np.rint(base / scale), -127, 127).astype(np.int8)
        weights = {  # distinct copies: each its own bytes (packed in one huge-page arena per format)
            "f32": native.pack_weights([jnp.asarray(np.roll(base, i, axis=1)) for i in range(copies)]),
            "bf16": native.pack_weights([jnp.asarray(np.roll(base, i, axis=1), jnp.bfloat16) for i in range(copies)]),
            "int8": native.pack_weights([jnp.asarray(np.roll(q, i, axis=1)) for i in range(copies)]),
        }
        s = jnp.asarray(scale)
        for m in rows:
            x32 = rng.standard_normal((m, k)).astype(np.float32)
            programs, outs = {}, {}
            for fmt in formats:
                kind, _, method = fmt.partition(" ")
                x = jnp.asarray(x32, jnp.float32 if kind == "f32" else x_dtype)
                ws = weights[kind]
                with native.env_var(native.INT8_ENV_VAR, method or "auto"):
                    if kind == "int8":
                        fn = jax.jit(lambda x, ws: _chain(lambda a, w, sc: mm.matmul(a, w, scale=sc), x, ws, s))
                        one = jax.jit(lambda a, b: mm.matmul(a, b, out_dtype=jnp.float32, scale=s))
                        outs[method] = np.asarray(one(x, ws[0]))
                    else:
                        fn = jax.jit(lambda x, ws: _chain(lambda a, w, sc: mm.matmul(a, w), x, ws, None))
                    compiled = fn.lower(x, ws).compile()  # traced under this method
                programs[fmt] = (lambda c, x, ws: lambda: jax.block_until_ready(c(x, ws)))(compiled, x, ws)
            times = interleaved_medians(programs, repeats)
            err = ""
            if "dot" in outs:
                err = float(np.abs(outs["dot"] - outs["widen"]).max() / np.abs(outs["widen"]).max())
            result.append([name, m, copies] + [times[f] / copies * 1e3 for f in formats] +
                          [times["bf16"] / min(times[f] for f in formats if f.startswith("int8")), err])
    table(f"Per-call ms of the native matmuls on packed weights ({isa} path; x {x_dtype} for bf16/int8, f32 for "
          f"f32), weights from memory (distinct copies in turn, {FOOTPRINT >> 20} MB of int8 per shape), median of "
          f"{repeats} interleaved rounds; int8: per-column float32 scales; 'bf16/int8': the packed bf16 time over "
          f"the faster int8 method's; 'dot err': max |dot - widen| / max |widen|",
          ["shape", "rows", "copies"] + [f"{f} (ms)" for f in formats] + ["bf16/int8", "dot err"], result)


def interleaved_medians(programs: dict, repeats: int) -> dict:
    """Median seconds per call of each program, timed in turn (one call of each per round, after a warm-up round),
    so that a load change on the machine falls on all of them alike."""
    import time
    for fn in programs.values():
        fn()
    times = {name: [] for name in programs}
    for _ in range(repeats):
        for name, fn in programs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    """Prints the table. `argv`: flags as on the command line (None: already parsed, by `python -m serving.bench`)."""
    if argv is not None:
        flags.FLAGS([__name__, *argv])
    bench([int(r) for r in _ROWS.value], _REPEATS.value, _X_DTYPE.value)
