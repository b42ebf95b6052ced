"""What tests/pallas_kernels/test_native_selftest.py compiles and runs that no other test waits on: the aarch64 selftest
(three kernel copies cross-compiled, then two qemu runs: ~45 s of CPU) and the x86-64 paths this CPU cannot run,
compiled to check their symbols (~18 s). In a whole run `background` does them at the run's start on the cores the
test workers leave idle (tests/support/background.py); the test then finds the builds in the native kernels' cache
and the qemu runs' output in the job's directory, and asserts on them as on its own. Where no job ran, or it failed,
the test builds and runs them itself."""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from filelock import FileLock

from pallas_kernels import native
from tests.support import background as _background

# The optimisation level of a compile that only checks the code (the paths this CPU cannot run): -Og defines
# __OPTIMIZE__ as -O3 does (the intrinsics headers take the same inline-function form) and, unlike -O0, inlines the
# library's header functions as the nm check needs; an AVX-512 copy took 10 s of a Zen 1 core (-O1 25 s, -O3 ~50).
CHECK_OPT = "-Og"
# The aarch64 selftest's optimisation level: the emulated run checks the NEON paths' logic (and their hwcaps gating),
# so it is built like the check-only copies above: all four objects 30 s of a Zen 1 core against ~315 s at -O3, and
# the two qemu runs 65 s of CPU (its harness, selftest.cc, at -O3 whatever the kernels' level: build_selftest). The -O3
# machine code that ships is built and checked on an aarch64 machine itself
# (test_selftest_runs_every_path_on_this_cpu runs there natively).
AARCH64_OPT = CHECK_OPT
A72_EVERY = 4
# -cpu max has FEAT_BF16 and dotprod: the two NEON paths, every case; a Cortex-A72 has neither: the run shows the
# hwcaps gating, and generic and NEON passing without them, on every 4th case. Both at once. The generic path's every
# case runs natively (test_selftest_runs_every_path_on_this_cpu: the same portable C++, simd.h's scalar VOps); under
# -cpu max it was 13 of the run's 57 s of CPU.
QEMU_RUNS = (("max", ("neon", "neon_bf16")), ("cortex-a72", (f"--every={A72_EVERY}",)))


def run(cmd: list, env=None, timeout=180) -> tuple[int, str]:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env)
    return done.returncode, done.stdout + done.stderr


def cached(name: str, key: str, build) -> Path:
    """`build(path)` once per key into the native kernels' cache (`name_key`; a file lock, so two workers, or a
    worker and the background job, build it once): what a test compiles is keyed like the library, by the sources,
    the compiler and its flags, so a rerun does not spend minutes of a slow machine's cores compiling it again."""
    out = native.library._cache_dir() / f"{name}_{key}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not out.exists():
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                os.replace(build(Path(tmp) / name), out)
    return out


def selftest_hash() -> str:
    return hashlib.sha256((native.library.SOURCE_DIR / "selftest.cc").read_bytes()).hexdigest()


def aarch64_selftest(cxx: str) -> Path:
    """The static aarch64 selftest, cross-compiled once per source change (three copies of the kernels)."""
    key = native.library._source_key(cxx, "static", AARCH64_OPT, "harness -O3", selftest_hash())
    # Static: qemu-user then needs no aarch64 sysroot.
    return cached("selftest_aarch64", key, lambda out: native.build_selftest(cxx, "aarch64", out, static=True,
                                                                           opt=AARCH64_OPT))


def run_qemu(qemu: str, exe: Path) -> dict[str, tuple[int, str]]:
    """{cpu: (exit code, output)} of QEMU_RUNS, side by side."""
    with concurrent.futures.ThreadPoolExecutor(len(QEMU_RUNS)) as pool:
        runs = {cpu: pool.submit(run, [qemu, "-cpu", cpu, exe, *args], timeout=600) for cpu, args in QEMU_RUNS}
        return {cpu: r.result() for cpu, r in runs.items()}


def missing_paths() -> list[str]:
    """This architecture's paths the library does not hold (the CPU does not run them)."""
    have = {obj.stem.removeprefix("kernels_") for obj in native.kernel_objects()[:-1]}
    return [p for p in native.ARCH_ISAS[native.machine()] if p not in have]


def check_objects(cxx: str, missing: list[str]) -> Path:
    """The kernels of `missing` compiled at CHECK_OPT (a compile check, not code to run), once per source change."""
    def compile_missing(out: Path) -> Path:
        out.mkdir()
        native.run_jobs(native.compile_jobs(cxx, native.machine(), out, include=None, paths=missing,
                                            opt=CHECK_OPT)[:-1])  # the kernels only (the CPU check is the library's)
        return out
    return cached(f"check_{native.machine()}", native.library._source_key(cxx, "check", CHECK_OPT, *missing),
                  compile_missing)


TEST_FILE = "tests/pallas_kernels/test_native_selftest.py"


def started_qemu_runs(exe: Path) -> dict[str, tuple[int, str]] | None:
    """The qemu runs of `exe` by this run's background job (tests/support/background.py), waited for; None where no
    job was started, it failed, or it ran another build (then the test runs them itself)."""
    out = _background.result(TEST_FILE, "qemu.json")
    if out is None:
        return None
    found = json.loads(out.read_text())
    return {cpu: tuple(r) for cpu, r in found["runs"].items()} if found["exe"] == str(exe) else None


def background(out: Path) -> None:
    """The background job: each step as the test would take it; errors are the test's to find (it redoes the step)."""
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx and qemu:
        exe = aarch64_selftest(cxx)
        _background.write(out / "qemu.json", json.dumps({"exe": str(exe), "runs": run_qemu(qemu, exe)}))
    if not native.library._machine_reason():
        check_objects(native.library._compiler(), missing_paths())
