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
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="meshserve-xla-cache-")
os.environ.setdefault("MESHSERVE_COMPILATION_CACHE", _COMPILATION_CACHE)
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
