"""Test set-up: 8 fake CPU devices for mesh tests (must happen before jax is imported)."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache for this run (servers started as subprocesses inherit it): programs that
# several tests build alike compile once per run, and every run starts cold.
# (pytest-xdist workers inherit it from the controller, which removes it at the end.)
if "MESHSERVE_COMPILATION_CACHE" not in os.environ:
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="meshserve-xla-cache-")
    os.environ["MESHSERVE_COMPILATION_CACHE"] = _COMPILATION_CACHE
    atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI (`.ci/run` sets MESHSERVE_CI=1): the property tests draw the same examples on every run (seeded per test), so
# whether a change lands is decided by the change, not by the draw. Run without it to explore new examples; a
# failure found that way gets a regression test.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("MESHSERVE_CI"):
    settings.load_profile("ci")

jax.config.update("jax_default_matmul_precision", "highest")
