"""The native CPU kernels' library (C++ in this directory): its build into a cache (`build`: the paths this CPU runs,
`cpu_paths`, or every path; and the self-test's `build_selftest`), its load and FFI registration, and the per-CPU
instruction-set choice read at trace time (`enabled`, `isa`, `use_isa`); `python -m pallas_kernels.native` builds
it ahead (`main`)."""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from pallas_kernels.target import target_platform

log = logging.getLogger("pallas_kernels.native")

SOURCE_DIR = Path(__file__).parent
ENV_VAR = "MESHSERVE_CPU_KERNELS"  # native (default when it builds) | xla
ISA_ENV_VAR = "MESHSERVE_CPU_ISA"  # unset/auto: the best this CPU runs | one of ISAS (a lower path, e.g. avx2)
CACHE_ENV = "MESHSERVE_NATIVE_CACHE"
PATHS_ENV = "MESHSERVE_NATIVE_PATHS"  # unset/cpu: build the paths this CPU runs | all: every path of the architecture
_MATMUL = "meshserve_cpu_matmul"
_ATTENTION = "meshserve_cpu_ragged_paged_attention"
_MATMUL_PACKED = "meshserve_cpu_matmul_packed"
_GREEDY_HEAD = "meshserve_cpu_greedy_head"
_EXPERT_MLP = "meshserve_cpu_expert_mlp"
_MATMUL_INT8 = "meshserve_cpu_matmul_int8"
_LATENT_ATTENTION = "meshserve_cpu_latent_attention"
_LORA = "meshserve_cpu_lora"
_LORA_INT8 = "meshserve_cpu_lora_int8"
# CPU only: never in a GPU/TPU program
FFI_TARGETS = (_MATMUL, _ATTENTION, _MATMUL_PACKED, _GREEDY_HEAD, _EXPERT_MLP, _MATMUL_INT8, _LATENT_ATTENTION, _LORA,
               _LORA_INT8)

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


def compile_jobs(cxx: str, arch: str, workdir: Path, include: str | None, paths=None,
                 opt: str = "-O3") -> list[list[str]]:
    """The compiler commands that build the objects of the library for `arch` (one per instruction set in `paths`,
    default all of the architecture's, plus the CPU check, plus the FFI handlers when `include` (jaxlib's FFI
    headers) is given) into `workdir`; `opt`: the optimisation level (a compile check needs less than -O3)."""
    flags_for = ARCH_ISAS[arch]
    jobs = []
    for name in (flags_for if paths is None else paths):
        jobs.append([cxx, *_flags(opt), "-fvisibility=hidden", f"-DMESHSERVE_ISA_ID={ISAS.index(name)}",
                     *flags_for[name], "-c", str(SOURCE_DIR / "kernels.cc"), "-o", str(workdir / f"kernels_{name}.o")])
    jobs.append([cxx, *_flags(opt), "-c", str(SOURCE_DIR / "cpu.cc"), "-o", str(workdir / "cpu.o")])
    if include is not None:
        jobs.append([cxx, *_flags(opt), f"-I{include}", "-c", str(SOURCE_DIR / "ffi.cc"), "-o", str(workdir / "ffi.o")])
    return jobs


def _flags(opt: str) -> list[str]:
    return [opt if f == "-O3" else f for f in _CXXFLAGS]


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


def _all_paths_wanted() -> bool:
    value = os.environ.get(PATHS_ENV, "").strip().lower()
    if value not in ("", "cpu", "all"):
        raise ValueError(f"{PATHS_ENV}={value!r}: expected cpu (the paths this CPU runs, the default) or all")
    return value == "all"


# The CPU check on its own (cpu.cc): which paths `CpuRuns` says this CPU runs, as a bit per Isa id.
_PROBE_MAIN = """#include <cstdio>
#include "api.h"
int main() {
  int bits = 0;
  for (int i = 0; i < meshserve::kNumIsas; ++i) bits |= meshserve::CpuRuns(i) ? 1 << i : 0;
  std::printf("%d\\n", bits);
}
"""


def cpu_paths(cxx: str | None = None) -> tuple[str, ...]:
    """The instruction-set paths of this architecture that this CPU runs, lowest first, as the library's own CPU
    check (cpu.cc, built once into a small program in the cache) reports them: the paths a library for this CPU
    needs."""
    from filelock import FileLock

    cxx = cxx or _compiler()
    probe = _cache_dir() / f"cpu_probe_{machine()}_{_source_key(cxx, 'probe')}"
    probe.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(probe) + ".lock"):
        if not probe.is_file():
            with tempfile.TemporaryDirectory(dir=probe.parent) as tmp:
                (Path(tmp) / "probe.cc").write_text(_PROBE_MAIN)
                cmd = [cxx, *_flags("-O1"), f"-I{SOURCE_DIR}", str(Path(tmp) / "probe.cc"), str(SOURCE_DIR / "cpu.cc"),
                       "-o", str(Path(tmp) / "probe")]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"compiling failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
                os.replace(Path(tmp) / "probe", probe)
    done = subprocess.run([str(probe)], capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        raise RuntimeError(f"the CPU check {probe} failed (exit {done.returncode}): {done.stdout}{done.stderr}")
    bits = int(done.stdout)
    return tuple(name for name in ARCH_ISAS[machine()] if name == "generic" or bits >> ISAS.index(name) & 1)


def build(force: bool = False, all_paths: bool | None = None) -> Path:
    """Compiles the kernels (or finds them in the cache) and returns the shared library's path. Its objects stay
    beside it (`<library>.objs/`: the self-test links them). The library holds the paths this CPU runs
    (`cpu_paths`), or every path of the architecture with `all_paths` (default: MESHSERVE_NATIVE_PATHS=all), for
    a cache built on one machine and used on others; a library of every path already in the cache serves any CPU."""
    from filelock import FileLock

    reason = _machine_reason()
    if reason:
        raise RuntimeError(reason)
    cxx = _compiler()
    key = _source_key(cxx, jax.__version__)
    every = tuple(ARCH_ISAS[machine()])
    if all_paths is None:
        all_paths = _all_paths_wanted()
    all_lib = _library_path(key, every)
    if all_paths or (all_lib.exists() and _objects_dir(all_lib).is_dir()):
        paths = every
    else:
        paths = cpu_paths(cxx)
    lib = _library_path(key, paths)
    lib.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lib) + ".lock"):
        if force or not lib.exists() or not _objects_dir(lib).is_dir():
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                work = Path(tmp)
                jobs = compile_jobs(cxx, machine(), work / "objs", jax.ffi.include_dir(), paths=paths)
                (work / "objs").mkdir()
                run_jobs(jobs)
                link = [cxx, "-shared", *(j[-1] for j in jobs), "-o", str(work / "lib.so")]
                done = subprocess.run(link, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"linking failed ({' '.join(link)}):\n{done.stderr[-4000:]}")
                shutil.rmtree(_objects_dir(lib), ignore_errors=True)
                os.replace(work / "objs", _objects_dir(lib))
                os.replace(work / "lib.so", lib)
            log.info("built native CPU kernels (%s): %s", ", ".join(paths), lib)
    return lib


def _library_path(key: str, paths: tuple[str, ...]) -> Path:
    """Keyed by the sources, compiler, jaxlib and the paths built in it ("all": the architecture's every path), so
    CPUs of different instruction sets sharing a home directory each build their own."""
    tag = "all" if paths == tuple(ARCH_ISAS[machine()]) else "-".join(paths)
    return _cache_dir() / f"meshserve_cpu_{machine()}_{key}_{tag}.so"


def _objects_dir(lib: Path) -> Path:
    return lib.with_suffix(".objs")


def kernel_objects() -> list[Path]:
    """The built library's per-instruction-set kernel objects (the paths it holds, lowest first) and its CPU check
    (building it if needed)."""
    objs = _objects_dir(build())
    return [objs / f"kernels_{name}.o" for name in ARCH_ISAS[machine()] if (objs / f"kernels_{name}.o").is_file()] + [
        objs / "cpu.o"]


def build_selftest(cxx: str, arch: str, out: Path, static: bool = False, objects: list[Path] | None = None,
                   opt: str = "-O3") -> Path:
    """Compiles `native/selftest.cc` (every kernel path the CPU runs against double-precision references; no
    jaxlib) with the kernels for `arch` (every path of it, at `opt`) into the executable `out`: with a cross compiler
    and `static`, for running another architecture's paths under qemu-user. `objects`: the kernels already compiled
    (`kernel_objects()`). The harness itself (inputs, double-precision references, checks) is always built at -O3:
    under qemu a -Og harness spent ~9 of the NEON paths' 32 s of CPU on its references (18.9 against 28.1 s of
    wall, kernels at -Og both times, Zen 3), for 2.6 s more compiling."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        work = Path(tmp)
        jobs = [] if objects is not None else compile_jobs(cxx, arch, work, include=None, opt=opt)
        jobs.append([cxx, *_flags("-O3"), "-c", str(SOURCE_DIR / "selftest.cc"), "-o", str(work / "selftest.o")])
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
_pair_dot: tuple[str, ...] = ()  # the paths that multiply bfloat16 pairs by a dot product instruction


@functools.cache
def _load() -> str | None:
    """Builds and registers the FFI targets once per process. Returns None, or why it could not (whatever
    MESHSERVE_CPU_KERNELS says: the switch is read at trace time, so flipping it back re-enables them)."""
    reason = _machine_reason()
    if reason:
        log.warning("native CPU kernels unavailable (%s): using XLA's kernels", reason)
        return reason
    global _registered, _runnable, _int8_dot, _pair_dot
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
    _pair_dot = tuple(name for i, name in enumerate(ISAS) if bits >> i & 1 and lib.MeshservePairDot(i))
    jax.ffi.register_ffi_target(_MATMUL, jax.ffi.pycapsule(lib.MeshserveMatmul), platform="cpu")
    jax.ffi.register_ffi_target(_MATMUL_PACKED, jax.ffi.pycapsule(lib.MeshserveMatmulPacked), platform="cpu")
    jax.ffi.register_ffi_target(_ATTENTION, jax.ffi.pycapsule(lib.MeshserveRaggedPagedAttention), platform="cpu")
    jax.ffi.register_ffi_target(_GREEDY_HEAD, jax.ffi.pycapsule(lib.MeshserveGreedyHead), platform="cpu")
    jax.ffi.register_ffi_target(_EXPERT_MLP, jax.ffi.pycapsule(lib.MeshserveExpertMlp), platform="cpu")
    jax.ffi.register_ffi_target(_MATMUL_INT8, jax.ffi.pycapsule(lib.MeshserveMatmulInt8), platform="cpu")
    jax.ffi.register_ffi_target(_LATENT_ATTENTION, jax.ffi.pycapsule(lib.MeshserveLatentAttention), platform="cpu")
    jax.ffi.register_ffi_target(_LORA, jax.ffi.pycapsule(lib.MeshserveLora), platform="cpu")
    jax.ffi.register_ffi_target(_LORA_INT8, jax.ffi.pycapsule(lib.MeshserveLoraInt8), platform="cpu")
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


def int8_dot_runs(path: str) -> bool:
    """Whether path `path`'s int8 matmul has the dot method on this CPU (AVX512_VNNI on the AVX-512 paths, dotprod
    on aarch64's)."""
    return _load() is None and path in _int8_dot


def pair_dot(path: str) -> bool:
    """Whether path `path` multiplies bfloat16 pairs by the CPU's dot product (avx512_bf16, amx, neon_bf16): the
    LoRA kernel then takes A row-major (x @ A^T by dot products of bfloat16 rows) and only B in pairs."""
    return _load() is None and path in _pair_dot


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build the native CPU kernels into their cache.")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--all-paths", action="store_true",
                        help=f"build every instruction-set path of this architecture, not only those this CPU runs "
                             f"(as {PATHS_ENV}=all): for a cache built here and used on other CPUs")
    args = parser.parse_args(argv)
    reason = _machine_reason()
    if reason:
        print(f"native CPU kernels not built: {reason} (XLA's kernels will be used)")
        return 0
    try:
        lib = build(force=args.force, all_paths=args.all_paths or None)
    except ValueError as exc:  # a setting with no meaning: say so, do not fall back quietly
        print(f"native CPU kernels not built: {exc}")
        return 2
    except RuntimeError as exc:
        print(f"native CPU kernels not built (XLA's kernels will be used): {str(exc).splitlines()[0]}")
        return 0
    runnable = runnable_isas()
    why_not = unavailable_reason()
    use = f"not used: {why_not}" if why_not else f"using {isa()}"
    print(f"native CPU kernels: {lib} (paths this CPU runs: {', '.join(runnable)}; {use})")
    return 0

