"""Native CPU kernels (C++ in this directory) called from XLA:CPU programs through the XLA FFI: their build into a
cache, load and per-CPU instruction-set choice (`build`, `enabled`, `isa`), and the calls `matmul`, `matmul_packed`
(with `pack_weights`), `matmul_int8`, `greedy_head`, `ragged_paged_attention` and `expert_mlp`. Details:
docs/native-kernels.md."""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_quant import QuantizedKV
from pallas_kernels.target import target_platform

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
ENV_VAR = "MESHSERVE_CPU_KERNELS"  # native (default when it builds) | xla
ISA_ENV_VAR = "MESHSERVE_CPU_ISA"  # unset/auto: the best this CPU runs | one of ISAS (a lower path, e.g. avx2)
CACHE_ENV = "MESHSERVE_NATIVE_CACHE"
_MATMUL = "meshserve_cpu_matmul"
_ATTENTION = "meshserve_cpu_ragged_paged_attention"
_MATMUL_PACKED = "meshserve_cpu_matmul_packed"
_GREEDY_HEAD = "meshserve_cpu_greedy_head"
_EXPERT_MLP = "meshserve_cpu_expert_mlp"
_MATMUL_INT8 = "meshserve_cpu_matmul_int8"
# CPU only: never in a GPU/TPU program
FFI_TARGETS = (_MATMUL, _ATTENTION, _MATMUL_PACKED, _GREEDY_HEAD, _EXPERT_MLP, _MATMUL_INT8)
PANELS = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.bfloat16): 64}  # columns per packed float weight panel
BF16_K_ALIGN = 32  # packed bfloat16 weights pad K to a multiple of this (one AMX tile step)
# Packed layouts per weight dtype: (columns per panel, K rows side by side per column, K padded to a multiple of).
_PACKED = {jnp.dtype(jnp.float32): (32, 1, 1), jnp.dtype(jnp.bfloat16): (64, 2, BF16_K_ALIGN),
           jnp.dtype(jnp.int8): (64, 4, 4)}
INT8_ENV_VAR = "MESHSERVE_INT8_KERNEL"  # auto (default) | widen | dot: how the int8 matmul multiplies (INT8_METHODS)
INT8_METHODS = ("auto", "widen", "dot")  # the index is the kernel's `method` (native/api.h Int8Method)

# Instruction-set paths; the index is the id the library knows them by (native/api.h `Isa`).
ISAS = ("generic", "avx2", "avx512", "avx512_bf16", "amx", "neon", "neon_bf16")
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# Per architecture, the paths built (lowest first) and each one's compiler flags over the baseline.
ARCH_ISAS = {
    "x86_64": {"generic": [], "avx2": _AVX2, "avx512": _AVX512, "avx512_bf16": _AVX512 + ["-mavx512bf16"],
               "amx": _AVX512 + ["-mavx512bf16", "-mamx-tile", "-mamx-bf16"]},
    "aarch64": {"generic": [], "neon": [], "neon_bf16": ["-march=armv8.2-a+bf16"]},
}
# What the automatic choice may take: the portable path is for tests and for forcing (XLA's dots are as fast).
_AUTO_MIN = {"x86_64": "avx2", "aarch64": "neon"}


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _compiler() -> str | None:
    """$CXX (where it names a program that exists), else g++ or clang++ on the PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("clang++")


_CXXFLAGS = ["-O3", "-std=c++17", "-fPIC", "-Wno-attributes", "-Wno-psabi"]


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "meshserve" / "native")


def _switched_off() -> bool:
    return os.environ.get(ENV_VAR, "native").strip().lower() == "xla"


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used here (None if they can; builds them on first call)."""
    if _switched_off():
        return f"{ENV_VAR}=xla"
    return machine_reason()


def machine_reason() -> str | None:
    """Why this machine cannot build or run the native kernels, whatever MESHSERVE_CPU_KERNELS says (None if it
    can; builds them on first call). Their own tests go by this: switching them off for serving does not skip them."""
    return _load() or _auto_reason()


def _machine_reason() -> str | None:
    if machine() not in ARCH_ISAS or not sys.platform.startswith("linux"):
        return f"needs x86-64 or aarch64 Linux, this is {sys.platform}/{platform.machine()}"
    if _compiler() is None:
        return ("no C++ compiler (g++ or clang++ on the PATH, or $CXX)" if not os.environ.get("CXX")
                else f"no C++ compiler: CXX={os.environ['CXX']} is not a program")
    return None


def compile_jobs(cxx: str, arch: str, workdir: Path, include: str | None) -> list[list[str]]:
    """The compiler commands that build the objects of the library for `arch` (one per instruction set, plus the
    CPU check, plus the FFI handlers when `include` (jaxlib's FFI headers) is given) into `workdir`."""
    jobs = []
    for name, flags in ARCH_ISAS[arch].items():
        jobs.append([cxx, *_CXXFLAGS, "-fvisibility=hidden", f"-DMESHSERVE_ISA_ID={ISAS.index(name)}", *flags, "-c",
                     str(SOURCE_DIR / "kernels.cc"), "-o", str(workdir / f"kernels_{name}.o")])
    jobs.append([cxx, *_CXXFLAGS, "-c", str(SOURCE_DIR / "cpu.cc"), "-o", str(workdir / "cpu.o")])
    if include is not None:
        jobs.append([cxx, *_CXXFLAGS, f"-I{include}", "-c", str(SOURCE_DIR / "ffi.cc"), "-o", str(workdir / "ffi.o")])
    return jobs


def run_jobs(jobs: list[list[str]]) -> None:
    """Runs compiler commands side by side (one per CPU); raises with the first failure's message."""
    with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        for cmd, done in zip(jobs, pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), jobs)):
            if done.returncode != 0:
                raise RuntimeError(f"compiling failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")


def _source_key(cxx: str, *extra) -> str:
    key = hashlib.sha256()
    for f in sorted(SOURCE_DIR.iterdir()):
        if f.suffix in (".cc", ".h") and f.name != "selftest.cc":  # the library's sources
            key.update(f.name.encode() + f.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key.update(repr((cxx, version, _CXXFLAGS, ARCH_ISAS, *extra)).encode())
    return key.hexdigest()[:16]


def build(force: bool = False) -> Path:
    """Compiles the kernels (or finds them in the cache) and returns the shared library's path. Its objects stay
    beside it (`<library>.objs/`: the self-test links them)."""
    from filelock import FileLock

    reason = _machine_reason()
    if reason:
        raise RuntimeError(reason)
    cxx = _compiler()
    lib = _cache_dir() / f"meshserve_cpu_{machine()}_{_source_key(cxx, jax.__version__)}.so"
    lib.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lib) + ".lock"):
        if force or not lib.exists() or not _objects_dir(lib).is_dir():
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                work = Path(tmp)
                jobs = compile_jobs(cxx, machine(), work / "objs", jax.ffi.include_dir())
                (work / "objs").mkdir()
                run_jobs(jobs)
                link = [cxx, "-shared", *(j[-1] for j in jobs), "-o", str(work / "lib.so")]
                done = subprocess.run(link, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"linking failed ({' '.join(link)}):\n{done.stderr[-4000:]}")
                shutil.rmtree(_objects_dir(lib), ignore_errors=True)
                os.replace(work / "objs", _objects_dir(lib))
                os.replace(work / "lib.so", lib)
            log.info("built native CPU kernels: %s", lib)
    return lib


def _objects_dir(lib: Path) -> Path:
    return lib.with_suffix(".objs")


def kernel_objects() -> list[Path]:
    """The built library's per-instruction-set kernel objects and its CPU check (building it if needed)."""
    objs = _objects_dir(build())
    return [objs / f"kernels_{name}.o" for name in ARCH_ISAS[machine()]] + [objs / "cpu.o"]


def build_selftest(cxx: str, arch: str, out: Path, static: bool = False, objects: list[Path] | None = None) -> Path:
    """Compiles `native/selftest.cc` (every kernel path the CPU runs against double-precision references; no
    jaxlib) with the kernels for `arch` into the executable `out`: with a cross compiler and `static`, for running
    another architecture's paths under qemu-user. `objects`: the kernels already compiled (`kernel_objects()`)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        work = Path(tmp)
        jobs = [] if objects is not None else compile_jobs(cxx, arch, work, include=None)
        jobs.append([cxx, *_CXXFLAGS, "-c", str(SOURCE_DIR / "selftest.cc"), "-o", str(work / "selftest.o")])
        run_jobs(jobs)
        inputs = [*(j[-1] for j in jobs), *map(str, objects or [])]
        link = [cxx, *(["-static"] if static else []), "-pthread", *inputs, "-o", str(out)]
        done = subprocess.run(link, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"linking failed ({' '.join(link)}):\n{done.stderr[-4000:]}")
    return out


_registered = False
_runnable: tuple[str, ...] = ()
_int8_dot: tuple[str, ...] = ()  # the paths whose int8 matmul has int8 dot products on this CPU


@functools.cache
def _load() -> str | None:
    """Builds and registers the FFI targets once per process. Returns None, or why it could not (whatever
    MESHSERVE_CPU_KERNELS says: the switch is read at trace time, so flipping it back re-enables them)."""
    reason = _machine_reason()
    if reason:
        log.warning("native CPU kernels unavailable (%s): using XLA's kernels", reason)
        return reason
    global _registered, _runnable, _int8_dot
    if _registered:  # FFI targets are registered once per process (a second library could not replace them)
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
    except Exception as exc:  # a broken toolchain must not take serving down: fall back to XLA
        log.warning("native CPU kernels unavailable, using XLA's: %s", exc)
        return str(exc)
    bits = lib.MeshserveCpuIsas()
    _runnable = tuple(name for i, name in enumerate(ISAS) if bits >> i & 1)
    _int8_dot = tuple(name for i, name in enumerate(ISAS) if bits >> i & 1 and lib.MeshserveInt8Dot(i))
    jax.ffi.register_ffi_target(_MATMUL, jax.ffi.pycapsule(lib.MeshserveMatmul), platform="cpu")
    jax.ffi.register_ffi_target(_MATMUL_PACKED, jax.ffi.pycapsule(lib.MeshserveMatmulPacked), platform="cpu")
    jax.ffi.register_ffi_target(_ATTENTION, jax.ffi.pycapsule(lib.MeshserveRaggedPagedAttention), platform="cpu")
    jax.ffi.register_ffi_target(_GREEDY_HEAD, jax.ffi.pycapsule(lib.MeshserveGreedyHead), platform="cpu")
    jax.ffi.register_ffi_target(_EXPERT_MLP, jax.ffi.pycapsule(lib.MeshserveExpertMlp), platform="cpu")
    jax.ffi.register_ffi_target(_MATMUL_INT8, jax.ffi.pycapsule(lib.MeshserveMatmulInt8), platform="cpu")
    _registered = True
    return None


def runnable_isas() -> tuple[str, ...]:
    """The instruction-set paths this CPU runs in the built library, lowest first (empty if it cannot be built)."""
    return () if _load() else _runnable


def _auto_reason() -> str | None:
    """Why the automatic choice takes no path here (the CPU runs only the portable one), or None."""
    if os.environ.get(ISA_ENV_VAR, "").strip().lower() not in ("", "auto"):
        return None
    floor = ISAS.index(_AUTO_MIN[machine()])
    if not any(ISAS.index(n) >= floor for n in _runnable):
        return f"this CPU has no {_AUTO_MIN[machine()]} (paths it runs: {', '.join(_runnable)})"
    return None


def isa() -> str:
    """Trace-time. The instruction-set path programs traced now use: MESHSERVE_CPU_ISA where set (it must be one
    this CPU runs), else the best this CPU runs."""
    _require()
    forced = os.environ.get(ISA_ENV_VAR, "").strip().lower()
    if forced in ("", "auto"):
        return _runnable[-1]
    if forced not in ISAS:
        raise ValueError(f"{ISA_ENV_VAR}={forced!r}: expected one of {', '.join(ISAS)} or auto")
    if forced not in _runnable:
        raise RuntimeError(f"{ISA_ENV_VAR}={forced}: this CPU cannot run it; it runs {', '.join(_runnable)}")
    return forced


@contextlib.contextmanager
def env_var(name: str, value: str):
    """Environment variable `name` set to `value` inside, as it was after (the kernel switches are read at trace
    time)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def use_isa(name: str):
    """Programs traced inside take path `name` (as MESHSERVE_CPU_ISA would; jit a fresh function inside: a
    program traced earlier keeps the path it was traced with)."""
    with env_var(ISA_ENV_VAR, name):
        isa()
        yield


def _isa_attr() -> np.int32:
    return np.int32(ISAS.index(isa()))


def _require() -> None:
    reason = _load()
    if reason:
        raise RuntimeError(f"native CPU kernels unavailable: {reason}")


def enabled() -> bool:
    """Trace-time. Whether programs traced now for the CPU use the native kernels (building them if needed)."""
    if target_platform() != "cpu" or _switched_off():
        return False
    if _load() is not None or _auto_reason() is not None:
        return False
    isa()  # a forced path this CPU cannot run is an error here, at start-up, not a silent fallback
    return True


def _single_device_context() -> bool:
    """Trace-time. The kernels run on whole local arrays: outside shard_map, only without a multi-device mesh
    (a custom call on GSPMD-sharded operands would gather them)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1 or all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


# Most rows the native matmul takes (the decode-sized steps); above, XLA's (packing, AMX for bf16) is faster.
# Measured side by side on the 125M model's weight matmuls (`python -m serving.bench offline --only=floor`).
MAX_MATMUL_ROWS = {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.bfloat16): 16}


def matmul_supported(x: jax.Array, w: jax.Array, out_dtype) -> bool:
    """Trace-time. Whether `matmul` should run natively for these operands here."""
    if w.ndim != 2 or x.shape[-1] != w.shape[0] or not enabled() or not _single_device_context():
        return False
    dt, out = jnp.dtype(x.dtype), jnp.dtype(out_dtype)
    if dt not in MAX_MATMUL_ROWS or w.dtype != dt or math.prod(x.shape[:-1]) > MAX_MATMUL_ROWS[dt]:
        return False
    return out == dt or out == jnp.float32


def matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """Pure. `x[..., K] @ w[K, N]` accumulated in float32, returned in `out_dtype` (default x's)."""
    _require()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[1],), out_dtype)
    return jax.ffi.ffi_call(_MATMUL, out)(x, w, isa=_isa_attr())


# ---------------------------------------------------------------------------------------------------------
# Packed weights: a [K, N] weight stored as panels of P columns, each contiguous down K, so the kernel streams
# every panel front to back (the row-major weight is read as K separate row streams, which the hardware
# prefetchers follow poorly: ~8-15 GB/s against ~20-24 GB/s here). float32: [N/32, K, 32, 1] (32 columns: a
# register tile then holds 14 rows); bfloat16: [N/64, Kp/2, 64, 2] with K zero-padded to Kp (a multiple of 32)
# and rows k, k+1 of each column side by side (the pair layout vdpbf16ps and AMX B tiles read); int8: [N/64, Kp/4,
# 64, 4], K zero-padded to a multiple of 4 and rows k..k+3 side by side (the quads vpdpbusd and sdot read). Same
# bytes as the weight (plus the K padding). A stack of weights [S, K, N] (a MoE layer's experts, one per slot) packs
# slot by slot: [S, N/P, Kp/step, P, step].


def _padded_k(k: int, dtype) -> int:
    align = _PACKED[jnp.dtype(dtype)][2]
    return -(-k // align) * align


def can_pack(w) -> bool:
    """Whether `pack_weight` takes this [K, N] weight (or [S, K, N] stack)."""
    layout = _PACKED.get(jnp.dtype(w.dtype))
    return (layout is not None and w.ndim in (2, 3) and min(w.shape) > 0 and w.shape[-1] % layout[0] == 0)


def _panels(w, xp):
    """The packed layout of [..., K, N] `w` with array module `xp` (jax.numpy on device, NumPy on the host)."""
    *lead, k, n = w.shape
    panel, step, _ = _PACKED[jnp.dtype(w.dtype)]
    kp = _padded_k(k, w.dtype)
    if kp != k:
        w = xp.pad(w, [(0, 0)] * len(lead) + [(0, kp - k), (0, 0)])
    b = len(lead)
    return w.reshape(*lead, kp // step, step, n // panel, panel).transpose(*range(b), b + 2, b, b + 3, b + 1)


def pack_weight(w: jax.Array) -> jax.Array:
    """Pure. The packed layout of a [K, N] weight or [S, K, N] stack (see above); `can_pack(w)` must hold."""
    return _panels(w, jnp)


def packed_host(w: np.ndarray) -> np.ndarray:
    """`pack_weight` in NumPy, on the host (a strided view where no padding is needed; copy it where it should
    live)."""
    return _panels(w, np)


_ARENA_ALIGN = 4096


def huge_page_buffer(nbytes: int):
    """An anonymous, zeroed host buffer (an mmap) advised for transparent huge pages (where the kernel has them
    off, ordinary pages: same contents, slower streams)."""
    import mmap

    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf


def pack_weights(weights: list) -> list[jax.Array]:
    """Packs [K, N] weights into one host buffer backed by transparent huge pages where the kernel grants them,
    and returns CPU arrays aliasing it (device_put of an aligned NumPy array is zero-copy on the CPU), each on
    its weight's device. An entry may be a list of [K, N_i] blocks, packed as their concatenation along N (fused
    projections); each packed matrix must pass `can_pack`. One matrix at a time is materialised on the host, so
    packing needs the buffer plus the largest matrix beyond the weights themselves. With 4 KiB pages a weight
    stream crosses a page every 4 KiB and one core read ~11 GB/s here; with 2 MiB pages ~14.5 GB/s. The arrays
    keep the buffer alive."""
    entries = [w if isinstance(w, (list, tuple)) else [w] for w in weights]
    shapes = []
    for blocks in entries:
        *lead, k = blocks[0].shape[:-1]
        dt = jnp.dtype(blocks[0].dtype)
        n = sum(b.shape[-1] for b in blocks)
        if any(b.shape[:-1] != blocks[0].shape[:-1] or jnp.dtype(b.dtype) != dt for b in blocks) or not can_pack(
                jax.ShapeDtypeStruct((*lead, k, n), dt)):
            raise ValueError(f"cannot pack blocks of shapes {[b.shape for b in blocks]} ({dt})")
        panel, step, _ = _PACKED[dt]
        shapes.append((*lead, n // panel, _padded_k(k, dt) // step, panel, step, dt))
    offsets, total = [], 0
    for *shape, dt in shapes:
        offsets.append(total)
        total += -(-math.prod(shape) * dt.itemsize // _ARENA_ALIGN) * _ARENA_ALIGN
    if total == 0:
        return []
    arena = huge_page_buffer(total)
    out = []
    for blocks, (*shape, dt), off in zip(entries, shapes, offsets):
        host = [np.asarray(b) for b in blocks]
        view = np.frombuffer(arena, dtype=dt, count=math.prod(shape), offset=off).reshape(shape)
        view[...] = packed_host(host[0] if len(host) == 1 else np.concatenate(host, axis=-1))
        view.flags.writeable = False
        w = blocks[0]
        device = next(iter(w.devices())) if isinstance(w, jax.Array) else jax.devices("cpu")[0]
        out.append(jax.device_put(view, device))
    return out


def is_packed(w) -> bool:
    """Whether `w` is a weight in the packed layout of its dtype (a 4-D array of another layout or dtype is not)."""
    if getattr(w, "ndim", 0) != 4:
        return False
    layout = _PACKED.get(jnp.dtype(w.dtype))
    return layout is not None and tuple(w.shape[2:]) == layout[:2]


def packed_shape(w, k: int) -> tuple[int, int]:
    """The logical [K, N] of packed `w` for inputs with `k` columns (checked against its padded K)."""
    kw = w.shape[1] * w.shape[3]
    expected = _padded_k(k, w.dtype)
    if kw != expected:
        raise ValueError(f"packed weight holds {kw} rows of K, inputs have {k} columns")
    return k, w.shape[0] * w.shape[2]


def is_packed_experts(w) -> bool:
    """Whether `w` is a stack of weights [S, K, N] packed slot by slot ([S, N/P, Kp/step, P, step], float32,
    bfloat16 or int8: the expert kernel's packed layouts)."""
    if getattr(w, "ndim", 0) != 5:
        return False
    layout = _PACKED.get(jnp.dtype(w.dtype))
    return layout is not None and tuple(w.shape[3:]) == layout[:2]


def unpack_experts(w: jax.Array, k: int) -> jax.Array:
    """Pure. The [S, K, N] stack back from its packed layout (an XLA copy: the fallback paths only)."""
    s, panels, rows, panel, step = w.shape
    if rows * step != _padded_k(k, w.dtype):
        raise ValueError(f"packed experts hold {rows * step} rows of K, inputs have {k} columns")
    return w.transpose(0, 2, 4, 1, 3).reshape(s, rows * step, panels * panel)[:, :k]


def unpack_weight(w: jax.Array, k: int) -> jax.Array:
    """Pure. The [K, N] weight back from its packed layout (an XLA copy: the fallback path only)."""
    _, n = packed_shape(w, k)
    full = w.transpose(1, 3, 0, 2).reshape(w.shape[1] * w.shape[3], n)
    return full[:k]


def packed_supported(x: jax.Array, w: jax.Array, out_dtype) -> bool:
    """Trace-time. Whether `matmul_packed` can run here (else unpack and use XLA's dot)."""
    if not is_packed(w) or not enabled() or not _single_device_context():
        return False
    dt, out = jnp.dtype(x.dtype), jnp.dtype(out_dtype)
    if dt != jnp.dtype(w.dtype) or dt not in PANELS:
        return False
    return out == dt or out == jnp.float32


def matmul_packed(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """Pure. `x[..., K] @ W` for W packed by `pack_weight`, accumulated in float32, any number of rows."""
    _require()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    _, n = packed_shape(w, x.shape[-1])
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), out_dtype)
    return jax.ffi.ffi_call(_MATMUL_PACKED, out)(x, w, isa=_isa_attr())


# ---------------------------------------------------------------------------------------------------------
# int8 weights with float32 scales (native/matmul_int8.h): x @ (w * scale) with w int8, row-major [K, N] or packed,
# scale [N] (per column) or [G, N] (per group of K/G rows and column), accumulated in float32. Two methods: "widen"
# (exact products: the weights widened in registers, or from many rows each panel once, to bfloat16 where x is
# bfloat16 and the path has pair dot products) and "dot" (x quantised per row to two int8 digits, ~15 bits, and int8
# dot products: vpdpbusd on AVX512_VNNI, sdot on aarch64's dotprod); "auto" takes the dot method for bfloat16 x
# where the path has it, except many rows on the pair paths, and the exact widened products for float32 x
# (docs/native-kernels.md).

# Most rows the int8 matmul on row-major weights takes; above, XLA's (the weight converted, then its dot). Row-major
# int8 streams poorly (short row segments): on the AMD EPYC both ran even at 4-16 rows (768 x 2304, weights from
# memory), XLA ahead from 32. Packed int8 weights take the kernel at any rows (at 256 rows even with XLA's unpack
# and dot, faster below).
MAX_INT8_ROWS = 16


def int8_dot_runs(path: str) -> bool:
    """Whether path `path`'s int8 matmul has the dot method on this CPU (AVX512_VNNI on the AVX-512 paths, dotprod
    on aarch64's)."""
    return _load() is None and path in _int8_dot


def int8_method() -> str:
    """Trace-time. The int8 matmul's method for programs traced now: MESHSERVE_INT8_KERNEL where set ("dot" must be
    one the path runs), else "auto"."""
    method = os.environ.get(INT8_ENV_VAR, "").strip().lower() or "auto"
    if method not in INT8_METHODS:
        raise ValueError(f"{INT8_ENV_VAR}={method!r}: expected one of {', '.join(INT8_METHODS)}")
    if method == "dot" and not int8_dot_runs(isa()):
        raise RuntimeError(f"{INT8_ENV_VAR}=dot: the {isa()} path has no int8 dot products on this CPU (paths that "
                           f"do: {', '.join(_int8_dot) or 'none'})")
    return method


def scale_groups(scale, n: int) -> int:
    """G of a weight scale for N columns: 1 where it holds one per column ([N], or the output dims), else its
    leading dimension ([G, N] or G + the output dims); raises where its size is not a multiple of N."""
    size = math.prod(scale.shape)
    if size == 0 or size % n:
        raise ValueError(f"scale of shape {scale.shape} does not hold per-column or per-group scales of {n} columns")
    return size // n


def matmul_int8_supported(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype) -> bool:
    """Trace-time. Whether `matmul_int8` can run here: x float32 or bfloat16, w int8 row-major [K, N] (at most
    MAX_INT8_ROWS rows of x) or packed, scale float32 per column or per group (packed: groups of a multiple of 4
    rows), out float32 or bfloat16."""
    if jnp.dtype(w.dtype) != jnp.int8 or not enabled() or not _single_device_context():
        return False
    floats = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    if jnp.dtype(x.dtype) not in floats or jnp.dtype(out_dtype) not in floats or jnp.dtype(scale.dtype) != jnp.float32:
        return False
    k = x.shape[-1]
    packed = is_packed(w)
    if packed:
        if w.shape[1] * 4 != _padded_k(k, jnp.int8):
            return False
        n = w.shape[0] * w.shape[2]
    elif w.ndim != 2 or w.shape[0] != k or math.prod(x.shape[:-1]) > MAX_INT8_ROWS:
        return False
    else:
        n = w.shape[1]
    size = math.prod(scale.shape)
    if n == 0 or size == 0 or size % n:
        return False
    groups = size // n
    return k % groups == 0 and (not packed or groups == 1 or (k // groups) % 4 == 0)


def matmul_int8(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
    """Pure. `x[..., K] @ (w * scale)` accumulated in float32, returned in `out_dtype` (default x's), for int8 `w`
    row-major [K, N] or packed (`pack_weight`) and float32 `scale` per column (N values) or per group of K/G rows
    (G x N values, G leading); `matmul_int8_supported` must hold."""
    _require()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    n = packed_shape(w, x.shape[-1])[1] if is_packed(w) else w.shape[1]
    groups = scale_groups(scale, n)
    scale = scale.reshape((n,) if groups == 1 else (groups, n))
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), out_dtype)
    return jax.ffi.ffi_call(_MATMUL_INT8, out)(x, w, scale, isa=_isa_attr(),
                                               method=np.int32(INT8_METHODS.index(int8_method())))


# ---------------------------------------------------------------------------------------------------------
# Greedy LM head by screening (native/greedy_head.h): the argmax of the exact logits from
# a read of an int8 copy of the head plus the full-precision columns of the few rows its error bounds cannot
# rule out.
SCREEN_K_ALIGN = 64  # the int8 copy pads K to a multiple of this
HEAD_LAYOUTS = {"packed": 0, "kn": 1, "nk": 2}  # the exact head: packed panels, [K, N], [N, K] (tied table)


def screen_width(k: int) -> int:
    """Columns of the int8 screen of a head with K = `k`: K rounded up to SCREEN_K_ALIGN."""
    return -(-k // SCREEN_K_ALIGN) * SCREEN_K_ALIGN


def greedy_head_screen(head_nk: np.ndarray, block: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """Host-side. The int8 screen of an LM head given as [N, K] (vocabulary rows): q [N, Kq] (K rounded up to
    SCREEN_K_ALIGN, zero-padded) and bounds [2, N] float32: each row's scale s_j (row j ~ s_j q_j) and c_j, an
    upper bound on |x.w_j - s_j fl32(x.q_j)| / ||x|| for any x: the quantisation error's norm plus float32
    rounding of the kernel's accumulation over Kq terms and the scaling (gamma_{Kq+2} ||s_j q_j||), rounded up."""
    n, k = head_nk.shape
    kq = screen_width(k)
    q = np.zeros((n, kq), np.int8)
    bounds = np.zeros((2, n), np.float32)
    u = 2.0 ** -24
    gamma = (kq + 2) * u / (1 - (kq + 2) * u)
    for j0 in range(0, n, block):
        w = np.asarray(head_nk[j0:j0 + block], np.float64)
        scale = (np.abs(w).max(axis=1) / 127).astype(np.float32)
        scale = np.where(scale > 0, scale, np.float32(1))
        s = scale.astype(np.float64)[:, None]
        qi = np.clip(np.rint(w / s), -127, 127)
        approx = qi * s  # exact in float64 (8-bit x 24-bit products)
        c = (np.linalg.norm(w - approx, axis=1) + gamma * np.linalg.norm(approx, axis=1)) * (1 + 1e-6)
        c32 = c.astype(np.float32)
        c32 = np.where(c32.astype(np.float64) < c, np.nextafter(c32, np.float32(np.inf)), c32)
        q[j0:j0 + len(w), :k] = qi.astype(np.int8)
        bounds[0, j0:j0 + len(w)] = scale
        bounds[1, j0:j0 + len(w)] = c32
    return q, bounds


def greedy_head_supported(x: jax.Array, w: jax.Array) -> bool:
    """Trace-time. Whether `greedy_head` can run here for hidden states `x` and the exact head `w`."""
    if not enabled() or not _single_device_context() or x.ndim != 2:
        return False
    return jnp.dtype(x.dtype) == jnp.dtype(w.dtype) and jnp.dtype(x.dtype) in PANELS


def greedy_head(x: jax.Array, q: jax.Array, bounds: jax.Array, w: jax.Array, num_rows: jax.Array, *,
                layout: str) -> tuple[jax.Array, jax.Array]:
    """Pure. For hidden states x [M, K]: int32 [M] the argmax of each row's exact logits x @ head (lowest id on
    ties), and int32 [M] how many vocabulary rows each needed at full precision (its candidates). Only the first
    `num_rows[0]` rows are computed (the rest: 0, 0). `q`, `bounds`: `greedy_head_screen` of the head; `w` the
    head itself in `layout` ("packed": `pack_weight` panels, "kn": [K, N], "nk": [N, K])."""
    _require()
    m = x.shape[0]
    out = (jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct((m,), jnp.int32))
    return jax.ffi.ffi_call(_GREEDY_HEAD, out)(x, q, bounds, w, num_rows.astype(jnp.int32).reshape(1),
                                               layout=np.int32(HEAD_LAYOUTS[layout]), isa=_isa_attr())


def expert_mlp_supported(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, scales=None) -> bool:
    """Trace-time. Whether `expert_mlp` can run here: x [T, E] float32 or bfloat16 and row-major gate/up [S, E, I],
    down [S, I, E] in x's dtype (`scales` None), or int8 with float32 `scales` (gate, up, down) per output channel
    and slot: [S, I], [S, I], [S, E] (group-wise scales are not taken); either packed slot by slot
    (`pack_weights`)."""
    if not enabled() or not _single_device_context() or x.ndim != 2:
        return False
    dt = jnp.dtype(x.dtype)
    wdt = dt if scales is None else jnp.dtype(jnp.int8)
    if dt not in PANELS or any(jnp.dtype(w.dtype) != wdt for w in (gate, up, down)):
        return False
    if all(is_packed_experts(w) for w in (gate, up, down)):
        s, e, i = gate.shape[0], x.shape[1], gate.shape[1] * gate.shape[3]
        shapes_ok = (gate.shape[2] * gate.shape[4] == _padded_k(e, wdt) and up.shape == gate.shape
                     and down.shape[:2] == (s, e // gate.shape[3]) and down.shape[3] * down.shape[1] == e
                     and down.shape[2] * down.shape[4] == _padded_k(i, wdt))
    elif gate.ndim == 3:
        s, e, i = gate.shape
        shapes_ok = x.shape[1] == e and up.shape == (s, e, i) and down.shape == (s, i, e)
    else:
        return False
    return shapes_ok and (scales is None or [(tuple(c.shape), jnp.dtype(c.dtype)) for c in scales] == [
        ((s, i), jnp.float32), ((s, i), jnp.float32), ((s, e), jnp.float32)])


def expert_mlp(x: jax.Array, slots: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
               down: jax.Array, scales=None) -> jax.Array:
    """Pure. [T, E] in x's dtype: sum_k weights[t, k] * down_s(silu(x[t] @ gate_s) * (x[t] @ up_s)) with
    s = slots[t, k] (slots < 0 or >= S: no work), accumulated in float32 (native/moe.h). Each selected expert's
    weights are read once for all its tokens; experts no token selected are not read. int8 experts: `scales`
    (gate, up, down) per output channel and slot, [S, I], [S, I], [S, E], float32: the weights are w * scale."""
    _require()
    if scales is None:  # (empty scale operands: weights in x's dtype)
        scales = (jnp.zeros((0,), jnp.float32),) * 3
    call = jax.ffi.ffi_call(_EXPERT_MLP, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, jnp.asarray(slots, jnp.int32), jnp.asarray(weights, jnp.float32), gate, up, down, *scales,
                isa=_isa_attr())


def attention_supported(q: jax.Array, kv_pages) -> bool:
    """Trace-time. Whether `ragged_paged_attention` can take these operands here: f32 q over an f32 cache, bf16 q
    over a bf16 (or uint16-bits) cache, or f32 / bf16 q over a `QuantizedKV` (int8, float8_e4m3fn or its uint8
    bits)."""
    if not enabled() or q.shape[-1] % 16 or kv_pages.shape[-1] != q.shape[-1]:
        return False
    if isinstance(kv_pages, QuantizedKV):
        return (q.dtype in (jnp.float32, jnp.bfloat16) and kv_pages.scales.dtype == jnp.float32
                and kv_pages.values.dtype in (jnp.int8, jnp.uint8, jnp.float8_e4m3fn))
    if q.dtype == jnp.float32:
        return kv_pages.dtype == jnp.float32
    return q.dtype == jnp.bfloat16 and kv_pages.dtype in (jnp.bfloat16, jnp.uint16)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, logit_soft_cap=None):
    """Pure. Same contract as `reference.ragged_paged_attention_reference`; a `QuantizedKV` is dequantised row by
    row inside the kernel (native/attention.h)."""
    _require()
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    if isinstance(kv_pages, QuantizedKV):
        values, scales = kv_pages.values, kv_pages.scales
    else:  # an unquantized cache has no scales: an empty operand
        values, scales = kv_pages, jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(_ATTENTION, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, values, scales, i32(kv_lens), i32(page_indices), i32(cu_q_lens),
                jnp.reshape(i32(num_seqs), (1,)), sm_scale=np.float32(sm_scale),
                soft_cap=np.float32(logit_soft_cap or 0.0), window=np.int64(sliding_window or 0), isa=_isa_attr())


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build the native CPU kernels into their cache.")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    reason = _machine_reason()
    if reason:
        print(f"native CPU kernels not built: {reason} (XLA's kernels will be used)")
        return 0
    try:
        lib = build(force=args.force)
    except RuntimeError as exc:
        print(f"native CPU kernels not built (XLA's kernels will be used): {str(exc).splitlines()[0]}")
        return 0
    runnable = runnable_isas()
    why_not = unavailable_reason()
    use = f"not used: {why_not}" if why_not else f"using {isa()}"
    print(f"native CPU kernels: {lib} (paths this CPU runs: {', '.join(runnable)}; {use})")
    return 0

