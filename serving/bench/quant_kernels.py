"""int8 weight matmuls on CPU (issue 24): per-call time and weight bytes per second of the native kernels on packed
float32, packed bfloat16 and packed int8 weights (int8 as serving runs it, `auto`, and each method forced: `widen`,
and `dot` where the CPU has int8 dot products), side by side in one run (interleaved), on the W1 shapes of the ~125M
Llama (hidden 768, 12 query and 4 KV heads of 64, intermediate 2048: fused qkv 768 x 1280, o 768 x 768, fused
gate|up 768 x 4096, down 2048 x 768) at 1, 4, 16, 64 and 256 rows, beside the machine's read bandwidth.

    python -m serving.bench quant_kernels [--rows=1,4,16,64,256] [--repeats=9] [--x_dtype=bfloat16]

Each shape is called on enough distinct copies of its weight, in turn, that every format's copies exceed twice the
last-level cache (weights come from memory, as in a decode step), in one jitted program per format (each call's
input depends on the previous call's output). Time per call: the median over `repeats` rounds (a round runs every
format's program once) divided by the program's calls; GB/s: the weight's bytes over that time. int8 weights have
a float32 scale per column; x is `x_dtype` for the bfloat16 and int8 columns, float32 for the float32 one. The dot
method's x is quantised to two int8 digits per row (~15 bits): its difference from the widened (exact) products is
printed beside, max |dot - widen| over max |widen|.
"""
from __future__ import annotations

import math
import statistics

import numpy as np
from absl import flags

from serving.bench.harness import read_bandwidth, table

_ROWS = flags.DEFINE_list("rows", ["1", "4", "16", "64", "256"], "rows of x (tokens in the step)")
_REPEATS = flags.DEFINE_integer("repeats", 9, "timed rounds (median)")
_X_DTYPE = flags.DEFINE_enum("x_dtype", "bfloat16", ["bfloat16", "float32"], "x of the bf16 and int8 columns")

W1_SHAPES = {"qkv 768x1280": (768, 1280), "o 768x768": (768, 768), "gate|up 768x4096": (768, 4096),
             "down 2048x768": (2048, 768)}
FOOTPRINT = 64 << 20  # bytes of int8 copies per shape (the float formats' copies are 2x and 4x that)
BYTES = {"f32": 4, "bf16": 2, "int8": 1}  # weight bytes per element


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
    methods = ["auto", "widen"] + (["dot"] if native.int8_dot_runs(isa) else [])
    formats = ["f32", "bf16"] + [f"int8 {m}" for m in methods]
    bandwidth = read_bandwidth() / 1e9
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
            times = {f: t / copies for f, t in interleaved_medians(programs, repeats).items()}
            err = ""
            if "dot" in outs:
                err = float(np.abs(outs["dot"] - outs["widen"]).max() / np.abs(outs["widen"]).max())
            cells = [c for f in formats for c in (times[f] * 1e3, k * n * BYTES[f.split()[0]] / times[f] / 1e9)]
            result.append([name, m] + cells + [times["bf16"] / times["int8 auto"], err])
    table(f"Per-call ms and weight GB/s of the native matmuls on packed weights ({isa} path; x {x_dtype} for "
          f"bf16/int8, f32 for f32), weights from memory (distinct copies in turn, {FOOTPRINT >> 20} MB of int8 per "
          f"shape), median of {repeats} interleaved rounds; read bandwidth {bandwidth:.1f} GB/s; int8: per-column "
          f"float32 scales, 'auto' as serving runs it; 'bf16/int8': the packed bf16 time over int8 auto's; "
          f"'dot err': max |dot - widen| / max |widen|",
          ["shape", "rows"] + [h for f in formats for h in (f"{f} ms", f"{f} GB/s")] + ["bf16/int8", "dot err"],
          result)


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
