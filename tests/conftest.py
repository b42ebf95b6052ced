"""Test set-up: 8 fake CPU devices for mesh tests (must happen before jax is imported)."""
import atexit
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The tests' XLA:CPU programs compile cheaply: tiny models spend their time compiling, not running. LLVM at -O0
# (27% less CPU for tests/models/test_model_parity.py + test_gemma3.py, same results); fusions through XLA's
# elemental emitter rather than the MLIR fusion emitters, and each program as one LLVM module rather than split
# for parallel codegen (together -54% CPU for a small engine's construction and warm-up on top of -O0;
# docs/testing.md). XLA's HLO passes, so what is computed, are unchanged; the code generated differs from a user's
# (XLA's defaults): tests/serving/test_demo.py runs the demo with XLA's default flags. Servers the tests start
# keep these (serving.process.cpu_xla_flags).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache for this run (servers started as subprocesses inherit it): programs that
# several tests build alike compile once per run, and every run starts cold.
# (pytest-xdist workers inherit it from the controller, which removes it at the end.)
# Unbounded (no LRU): a bounded cache lists its whole directory on every write under a file lock shared by all of
# the run's processes, and this one gathers thousands of small programs (serving/core/model_runner.py): measured on
# Zen 3, three kernel test files in one process took 140 s bounded, 96 s unbounded. test_compilation_cache.py
# checks both (the default bound on the native kernels, unbounded on XLA's).
os.environ.setdefault("MESHSERVE_COMPILATION_CACHE_MAX_GIB", "0")
if "MESHSERVE_COMPILATION_CACHE" not in os.environ:
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="meshserve-xla-cache-")
    os.environ["MESHSERVE_COMPILATION_CACHE"] = _COMPILATION_CACHE
    atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests.support import background  # noqa: E402

# The property tests draw the same examples on every run (seeded per test), for a newcomer and for CI alike (both run
# `bash scripts/test.sh`), so whether a change lands is decided by the change, not by the draw. MESHSERVE_EXPLORE=1
# draws new examples each run; a failure found that way gets a regression test.
settings.register_profile("fixed", derandomize=True, print_blob=True)
if not os.environ.get("MESHSERVE_EXPLORE"):
    settings.load_profile("fixed")

jax.config.update("jax_default_matmul_precision", "highest")


# End-to-end tests (those that start Python processes: servers, gateways, workers, command-line runs) carry the
# `e2e` mark, so `-m e2e` / `-m "not e2e"` runs or skips them as a group. The mark is enforced: a test without it
# that starts a Python process fails, naming the mark to add.
_E2E_ITEM = {"item": None}


def _starts_python(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or [])
    if not argv:
        return False
    exe = os.path.basename(os.fsdecode(argv[0])).split()[0]
    return exe == os.path.basename(sys.executable) or exe.startswith("python")


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *a, **kw):
    item = _E2E_ITEM["item"]
    if item is not None and item.get_closest_marker("e2e") is None and _starts_python(args):
        raise RuntimeError(f"{item.nodeid} starts a Python process ({args!r}): mark it @pytest.mark.e2e "
                           "(or the module: pytestmark = pytest.mark.e2e)")
    _popen_init(self, args, *a, **kw)


subprocess.Popen.__init__ = _guarded_popen_init


# MESHSERVE_TEST_CPU_LOG=path: one JSON line per test (its file, its name, wall seconds, CPU seconds of the worker
# process and of the child processes reaped meanwhile: servers, pip, compilers; a module's servers are reaped at its
# last test's teardown; when it ended, the xdist worker), appended by every worker. `python
# scripts/test_durations.py --cpu path` sums it per file.
_CPU_LOG = os.environ.get("MESHSERVE_TEST_CPU_LOG")


def _test_file(item) -> str:
    return item.nodeid.split("::")[0]


def _cpu_seconds() -> tuple[float, float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _E2E_ITEM["item"] = item
    start = _cpu_seconds() if _CPU_LOG else None
    try:
        return (yield)
    finally:
        _E2E_ITEM["item"] = None
        if start is not None:
            wall, me, kids = (b - a for a, b in zip(start, _cpu_seconds()))
            with open(_CPU_LOG, "a") as f:
                f.write(json.dumps({"file": _test_file(item), "test": item.nodeid, "wall": round(wall, 3),
                                    "cpu": round(me, 3), "children_cpu": round(kids, 3), "end": round(time.time(), 2),
                                    "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")


# Work no other test waits on (test_native_selftest.py's compiles and qemu runs, test_compilation_cache.py's restarts:
# ~80 s of CPU) starts with the run, in a background process at nice 19 (tests/support/background.py): it takes the
# cores only where the workers leave them idle, and the files, ordered late (tests/durations.json: their seconds with
# the job done), find it done. Started for the files the run's arguments select; MESHSERVE_TEST_BACKGROUND set
# beforehand (e.g. to 0) starts nothing, and the tests do the work themselves.
_BACKGROUND: dict = {}


def _selects(config, path: Path) -> bool:
    """The run's arguments (paths, node ids) name `path` or a directory above it (-k / -m are not looked at: a job
    started for nothing is killed at the end)."""
    for arg in config.args or [str(config.rootpath)]:
        where = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if where == path or where in path.parents:
            return True
    return False


def pytest_configure(config):
    if hasattr(config, "workerinput") or background.RUN_DIR_ENV in os.environ:
        return  # a worker (the controller started the jobs), or not asked for
    files = [f for f in background.JOBS if _selects(config, background.REPO / f)]
    if files:
        run_dir = Path(tempfile.mkdtemp(prefix="meshserve-test-background-"))
        _BACKGROUND.update(proc=background.start(run_dir, files), dir=run_dir)
        os.environ[background.RUN_DIR_ENV] = str(run_dir)  # the workers, started after this, inherit it


def pytest_unconfigure(config):
    proc = _BACKGROUND.pop("proc", None)
    if proc is not None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: compilers, qemu and servers with it
        proc.wait()
        shutil.rmtree(_BACKGROUND.pop("dir"), ignore_errors=True)


# The longest files first (their seconds from a whole run: tests/durations.json, written by
# `python scripts/test_durations.py junit.xml`; a file not in it counts as the median one): with `--dist loadfile`
# and `--no-loadscope-reorder` (scripts/test.sh) the workers take files in this order, so no slow file starts last
# while the other worker idles. Tests keep their order inside a file.
_DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(session, config, items):
    try:
        seconds = json.loads(_DURATIONS.read_text())
    except FileNotFoundError:
        return
    default = statistics.median(seconds.values()) if seconds else 0.0
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(_test_file(item), i)

    def key(item):
        path = _test_file(item)
        return -seconds.get(path, default), first[path]
    items.sort(key=key)
