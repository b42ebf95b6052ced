"""The native kernels' standalone self-test (native/selftest.cc, built by `native.build_selftest`): every
instruction-set path against double-precision references, with no jaxlib or FFI in between; the aarch64 paths
(generic, NEON, NEON with bf16 dot products) cross-compiled and run under qemu-user, so an x86-64 machine checks
them too."""
import ctypes
import hashlib
import shutil

import pytest

from pallas_kernels import native
from tests.support import native_selftest as support

_ALL_OK = ("matmul ok, matmul_packed ok, attention ok, greedy_head ok, matmul_int8 ok, expert_mlp ok, "
           "latent_attention ok, lora ok, lora_int8 ok")
_DOT = " (int8 dot products)"  # the path's int8 matmul ran its dot method too, and its int8 LoRA its dot products
_AARCH64_TOOLS = "Debian packages g++-aarch64-linux-gnu and qemu-user; scripts/test.sh installs them where apt can"
_run = support.run


def _lines(output: str):
    return (line.partition(": ") for line in output.splitlines())


def _passed(output: str) -> set[str]:
    """The paths whose line says every kernel passed."""
    return {name for name, _, rest in _lines(output) if rest.removesuffix(_DOT) == _ALL_OK}


def _dot(output: str) -> set[str]:
    """The paths whose int8 matmul ran (and passed) with int8 dot products."""
    return {name for name, _, rest in _lines(output) if rest == _ALL_OK + _DOT}


def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_selftest_runs_every_path_on_this_cpu(tmp_path):
    if native.library._machine_reason():
        pytest.skip(f"native kernels cannot be built here: {native.library._machine_reason()}")
    objects = native.kernel_objects()  # the library's own objects: the selftest is keyed by their bytes
    cxx = native.library._compiler()
    key = native.library._source_key(cxx, "selftest", support.selftest_hash(),
                                     *(hashlib.sha256(o.read_bytes()).hexdigest() for o in objects))
    exe = support.cached(f"selftest_{native.machine()}", key,
                  lambda out: native.build_selftest(cxx, native.machine(), out, objects=objects))
    rc, out = _run([exe])
    assert rc == 0, out
    runnable = set(native.runnable_isas())
    # The library holds the paths the CPU check says this CPU runs (or every path, where one of all is cached).
    held = {obj.stem.removeprefix("kernels_") for obj in native.kernel_objects()[:-1]}
    assert held in (set(native.cpu_paths()), set(native.ARCH_ISAS[native.machine()])), held
    assert native.cpu_paths() == native.runnable_isas()
    passed = _passed(out)
    assert "generic" in passed, out
    if runnable:  # the library's own detection (cpu.cc too) agrees with the selftest's
        assert passed == runnable, out
    # int8 dot products: on the AVX-512 paths where the CPU has AVX512_VNNI (aarch64: below, under qemu)
    if native.machine() == "x86_64":
        vnni = "avx512_vnni" in _cpu_flags()
        assert _dot(out) == ({p for p in passed if p.startswith(("avx512", "amx"))} if vnni else set()), out
    assert f"selftest: {len(passed)} paths passed" in out.splitlines(), out


# Cross-compiling three copies of the kernels at -Og takes ~30 s of a Zen 1 core (once per source change: see
# support.aarch64_selftest); the two qemu runs, side by side, ~50 s of CPU. In a whole run both are done by then, in
# the background job (tests/support/background.py) on the cores the workers left idle.
@pytest.mark.timeout(1200)
def test_aarch64_paths_compile_and_run_under_qemu():
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip(f"no aarch64 cross compiler (aarch64-linux-gnu-g++): {_AARCH64_TOOLS}")
    exe = support.aarch64_selftest(cxx)  # compiling must pass even where qemu is missing
    assert exe.is_file()
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        pytest.skip("the aarch64 selftest built, but qemu-aarch64 is missing to run it: Debian package qemu-user; "
                    "scripts/test.sh installs it where apt can")
    runs = support.started_qemu_runs(exe) or support.run_qemu(qemu, exe)
    (rc, out), (rc_a72, out_a72) = runs["max"], runs["cortex-a72"]
    assert rc == 0, out
    assert _passed(out) == {"neon", "neon_bf16"}, out
    assert _dot(out) == {"neon", "neon_bf16"}, out  # -cpu max has dotprod: sdot ran
    # A Cortex-A72 has no bf16: the hwcaps check must keep the bfdot path off, the others still run.
    rc, out = rc_a72, out_a72
    assert rc == 0, out
    assert _passed(out) == {"generic", "neon"}, out
    assert _dot(out) == set(), out  # nor dotprod: the widened int8 path only
    assert "neon_bf16: not run (this CPU lacks it)" in out.splitlines(), out


def test_each_path_defines_only_its_own_table(tmp_path):
    """The copies of kernels.cc built for different instruction sets share no code: each object defines nothing
    global but its own table (weak: a build may lack a path) and the C++ runtime's personality pointer, so the
    linker can never pick one copy's inline function (built for AVX-512) to serve another (run on an AVX2 CPU). Every
    other symbol is internal to its copy's namespace. The library holds only the paths this CPU runs: the others
    are compiled here (at -Og, a compile check, not code to run), so every path of the architecture is checked."""
    if native.library._machine_reason():
        pytest.skip(f"native kernels cannot be built here: {native.library._machine_reason()}")
    built = native.kernel_objects()[:-1]
    missing = support.missing_paths()
    cxx = native.library._compiler()
    # Once per source change, into the native kernels' cache (three AVX-512 copies: ~30 s of a Zen 1 core; in a whole
    # run, by the background job).
    checked = support.check_objects(cxx, missing)
    compiled = [checked / f"kernels_{name}.o" for name in missing]
    tables = []
    for obj in built + compiled:
        name = obj.stem.removeprefix("kernels_")
        table = "meshserve::Kernels" + "".join(part.capitalize() for part in name.split("_")) + "()"
        rc, out = _run(["nm", "-C", "--defined-only", "-g", obj])
        assert rc == 0, out
        defined = {line.split(" ", 2)[2] for line in out.splitlines() if line.strip()}
        assert defined <= {table, "DW.ref.__gxx_personality_v0"} and table in defined, (name, defined)
        tables.append(name)
    assert sorted(tables) == sorted(native.ARCH_ISAS[native.machine()])
    # Those objects together are a library of every path (MESHSERVE_NATIVE_PATHS=all): it links, and on this CPU it
    # offers exactly the paths the library built for this CPU does.
    objs = native.kernel_objects()[-1].parent
    link = [cxx, "-shared", *built, *compiled, objs / "cpu.o", objs / "ffi.o", "-o", tmp_path / "all.so"]
    rc, out = _run(link)
    assert rc == 0, out
    bits = ctypes.CDLL(str(tmp_path / "all.so")).MeshserveCpuIsas()
    assert tuple(n for i, n in enumerate(native.ISAS) if bits >> i & 1) == native.runnable_isas()


def test_a_paths_setting_other_than_cpu_or_all_is_a_clear_error(monkeypatch):
    if native.library._machine_reason():
        pytest.skip(f"native kernels cannot be built here: {native.library._machine_reason()}")
    monkeypatch.setenv(native.PATHS_ENV, "every")
    with pytest.raises(ValueError, match=r"MESHSERVE_NATIVE_PATHS='every': expected cpu \(the paths this CPU runs"):
        native.build()


@pytest.mark.e2e
def test_without_a_compiler_the_engine_uses_xla_and_says_so_in_one_line(tmp_path):
    """A machine without a C++ compiler (and nothing in the kernels' cache) still serves, on XLA's kernels:
    setup prints one line saying why, and programs traced there call no native kernel."""
    import os
    import sys
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "CXX": "", native.CACHE_ENV: str(tmp_path / "cache")}
    env.pop("CXX")
    env.pop(native.ENV_VAR, None)  # a run with the kernels switched off must not say that instead
    rc, out = _run([sys.executable, "-m", "pallas_kernels.native"], env=env)
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == ["native CPU kernels not built: no C++ compiler (g++ or clang++ on the PATH, or $CXX) (XLA's "
                     "kernels will be used)"], out
    check = ("import jax, jax.numpy as jnp, numpy as np\n"
             "from pallas_kernels.matmul import matmul\n"
             "from pallas_kernels import native\n"
             "assert not native.enabled() and 'no C++ compiler' in native.unavailable_reason()\n"
             "x, w = jnp.ones((4, 64)), jnp.ones((64, 32))\n"
             "text = jax.jit(matmul).lower(x, w).as_text()\n"
             "assert 'meshserve_cpu' not in text, text\n"
             "np.testing.assert_allclose(np.asarray(jax.jit(matmul)(x, w)), 64.0)\n"
             "print('xla ok')\n")
    rc, out = _run([sys.executable, "-c", check], env={**env, "CXX": str(tmp_path / "no-such-g++")})
    assert rc == 0 and "xla ok" in out, out
    assert "native CPU kernels unavailable (no C++ compiler: CXX=" in out  # the engine's one warning line
