"""The accelerator extras (`.[cuda]`, `.[cuda12]`, `.[cuda13]`, `.[tpu]`) resolve to a jax plugin that matches the
jax that gets installed: pip's resolver in dry-run (metadata only, nothing installed) on `-e <repo>[extra]` added to
this environment (the project's own install: what is installed and satisfies the requirements stays), then the
report's install list, with the installed jax and jaxlib where pip keeps them, is checked. Skipped only where the
package index cannot be reached; a resolution that fails for any other reason fails the test."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.e2e  # runs pip (a Python process)

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
RESOLVE_TIMEOUT_S = 300

# extra -> the CUDA major of the plugin it must bring (None: TPU).
CUDA_MAJOR = {"cuda": 12, "cuda12": 12, "cuda13": 13, "tpu": None}

# What pip prints when the index cannot be reached (urllib3 / requests / pip's own messages).
_NETWORK_ERRORS = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
                   "Name or service not known", "Network is unreachable", "Connection refused", "ConnectTimeoutError",
                   "ReadTimeoutError", "Max retries exceeded", "ProxyError", "Could not fetch URL",
                   "No route to host", "SSLError", "Connection reset by peer", "connection broken")


def _jax_requirement(reqs) -> Requirement:
    found = [Requirement(r) for r in reqs if canonicalize_name(Requirement(r).name) == "jax"]
    assert len(found) == 1, reqs
    return found[0]


MAIN_JAX = _jax_requirement(PYPROJECT["project"]["dependencies"])


def _network_error(out: str) -> str | None:
    """The first line of pip's output that says the index could not be reached, or None."""
    return next((line.strip() for line in out.splitlines() if any(s in line for s in _NETWORK_ERRORS)), None)


@pytest.fixture(scope="module")
def index_reachable():
    """One quick look-up first, so that an unreachable index skips the module in seconds, not after every
    resolution's retries (one retry: pip names the connection error only when it retries)."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "jax-cuda13-plugin", "--timeout", "15", "--retries", "1",
           "--disable-pip-version-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    error = _network_error(proc.stdout + proc.stderr) if proc.returncode != 0 else None
    if error:
        pytest.skip(f"package index not reachable: {error}")


def _build_isolation() -> list[str]:
    """`--no-build-isolation` where this environment already has the build backend's requirements: pip then builds
    meshserve's editable metadata with them instead of installing them into a fresh build environment for each
    resolution (~4 s of a Zen 1 core's 20 s a resolution; the resolution itself is the same, install for install)."""
    for req in map(Requirement, PYPROJECT["build-system"]["requires"]):
        try:
            if not req.specifier.contains(importlib.metadata.version(req.name), prereleases=True):
                return []
        except importlib.metadata.PackageNotFoundError:
            return []
    return ["--no-build-isolation"]


def _distinct_extras() -> dict[tuple[str, ...], str]:
    """One extra per distinct requirement list (`cuda` is `cuda12`): pip is given the same input, so it resolves
    once."""
    out: dict[tuple[str, ...], str] = {}
    for extra in CUDA_MAJOR:
        out.setdefault(tuple(sorted(EXTRAS[extra])), extra)
    return out


# pip's lazy wheels: the metadata of each wheel read with HTTP range requests (pip falls back to the whole wheel where
# the index does not serve ranges). Without it pip downloaded every wheel whole to read its metadata, ~3 GB for each
# CUDA extra (cuDNN alone 717 MB): 15.8 s of wall and 14.9 s of CPU for `.[cuda12]`, against 3.0 s and 2.3 s with it,
# the same 16 installs, version for version (Zen 3). Dropped if a pip no longer knows the feature.
LAZY_WHEELS = "fast-deps"


@pytest.fixture(scope="module")
def resolutions(index_reachable, tmp_path_factory):
    """pip's resolver, dry run, for `-e ROOT[extra]` of every distinct extra, all started at once (each spends its
    time waiting on the index, so side by side they take the time of the slowest): {requirements: pending run}."""
    runs = {}
    for key, extra in _distinct_extras().items():
        work = tmp_path_factory.mktemp(f"resolve-{extra}")
        runs[key] = (extra, _start_resolution(extra, work, [f"--use-feature={LAZY_WHEELS}"]), work, time.monotonic())
    yield runs
    for _, proc, _, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start_resolution(extra: str, work: Path, options: list[str]) -> subprocess.Popen:
    # Not --ignore-installed: pip would then fetch and resolve the ~90 packages this environment already has
    # from the index again (18.8 against 11.4 s of CPU a resolution, measured on Zen 3).
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-input", *options,
           "--timeout", "30", "--retries", "2", *_build_isolation(), "--report", str(work / "report.json"),
           "-e", f"{ROOT}[{extra}]"]
    with open(work / "pip.log", "w") as log:  # a file, not a pipe: nobody reads it while pip runs
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work,
                                env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))


def _resolve(extra: str, runs) -> dict[str, dict]:
    """{canonical name: metadata} of what pip would install for `-e ROOT[extra]`."""
    key = tuple(sorted(EXTRAS[extra]))
    extra, proc, work, started = runs[key]
    try:
        proc.wait(timeout=max(1.0, started + RESOLVE_TIMEOUT_S - time.monotonic()))
        log = (work / "pip.log").read_text(errors="replace")
        if proc.returncode != 0 and f"invalid choice: '{LAZY_WHEELS}'" in log:
            proc = _start_resolution(extra, work, [])  # a pip without the feature: whole wheels, as before
            runs[key] = (extra, proc, work, started)
            proc.wait(timeout=max(1.0, started + RESOLVE_TIMEOUT_S - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        error = _network_error((work / "pip.log").read_text(errors="replace"))
        if error:
            pytest.skip(f"package index not reachable (pip ran past {RESOLVE_TIMEOUT_S}s): {error}")
        raise
    out = (work / "pip.log").read_text(errors="replace")
    if proc.returncode != 0:
        error = _network_error(out)
        if error and "ResolutionImpossible" not in out and "conflicting dependencies" not in out:
            pytest.skip(f"package index not reachable: {error}")
        pytest.fail(f"pip could not resolve .[{extra}] (rc={proc.returncode}):\n{out[-4000:]}")
    data = json.loads((work / "report.json").read_text())
    installs = {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in data["install"]}
    for name in ("jax", "jaxlib"):  # installed and kept: the plugin must match these
        installs.setdefault(name, importlib.metadata.metadata(name).json)
    return installs


def _version(installs: dict[str, dict], name: str) -> Version:
    assert name in installs, f"{name} not in the resolution: {sorted(installs)}"
    return Version(installs[name]["version"])


def test_extras_pin_the_main_jax_range():
    """Each accelerator extra asks for jax with the main dependency's range (and the extra of jax that matches it),
    so the plugin pip picks is the one for the jax that gets installed."""
    for extra, major in CUDA_MAJOR.items():
        assert extra in EXTRAS, f"[project.optional-dependencies] has no `{extra}`"
        req = _jax_requirement(EXTRAS[extra])
        assert req.specifier == MAIN_JAX.specifier, (extra, str(req), str(MAIN_JAX))
        assert req.extras == ({"tpu"} if major is None else {f"cuda{major}"}), (extra, str(req))


@pytest.mark.parametrize("extra", list(CUDA_MAJOR))
def test_extra_resolves_to_matching_plugin(extra, resolutions):
    installs = _resolve(extra, resolutions)
    assert "meshserve" in installs
    jax = _version(installs, "jax")
    assert MAIN_JAX.specifier.contains(jax), f"resolved jax {jax} outside the project's pin {MAIN_JAX}"
    assert _version(installs, "jaxlib") == jax
    major = CUDA_MAJOR[extra]
    if major is not None:
        assert _version(installs, f"jax-cuda{major}-plugin") == jax
        assert _version(installs, f"jax-cuda{major}-pjrt") == jax
        other = 25 - major  # 12 <-> 13
        assert f"jax-cuda{other}-plugin" not in installs, f".[{extra}] also pulls the CUDA {other} plugin"
        # The CUDA runtime wheel (nvidia-cuda-runtime-cu12 for CUDA 12; unsuffixed nvidia-cuda-runtime for 13).
        runtime = [Version(m["version"]) for n, m in installs.items()
                   if n in ("nvidia-cuda-runtime", f"nvidia-cuda-runtime-cu{major}")]
        assert runtime and all(v.major == major for v in runtime), (extra, runtime)
        assert "libtpu" not in installs
    else:
        libtpu = _version(installs, "libtpu")
        # libtpu satisfies jax's own pin for its tpu extra (e.g. libtpu==0.0.42.* for jax 0.10.2).
        pins = [Requirement(r) for r in installs["jax"].get("requires_dist", [])]
        pins = [r for r in pins if canonicalize_name(r.name) == "libtpu"
                and r.marker is not None and r.marker.evaluate({"extra": "tpu"})]
        assert pins, "jax's metadata has no libtpu requirement for its tpu extra"
        assert all(r.specifier.contains(libtpu, prereleases=True) for r in pins), (libtpu, [str(r) for r in pins])
        assert not any(n.startswith("jax-cuda") for n in installs)
