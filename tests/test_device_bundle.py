"""scripts/device_bundle.sh --dry-run: the requirements it would fetch for the device machine are exactly the runtime
dependencies of pyproject.toml that the device image (scripts/device_image.txt) lacks, worked out here on their own;
and the image list itself holds what the acceptance run imports there."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import device_image

pytestmark = pytest.mark.e2e  # runs the script, which runs Python

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_bundle.sh"


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHON=sys.executable))


def test_dry_run_lists_the_runtime_dependencies_the_image_lacks():
    proc = _dry_run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.splitlines()
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    image = device_image.image_packages()
    assert listed == [r for r in runtime if canonicalize_name(Requirement(r).name) not in image]
    names = {canonicalize_name(Requirement(r).name) for r in listed}
    # What the image is known to lack (the device tool's package list), and what it has.
    assert {"fastapi", "uvicorn", "httptools", "llguidance", "grpcio-health-checking", "opentelemetry-sdk"} <= names
    assert not names & {"jax", "flax", "orbax-checkpoint", "numpy", "grpcio", "safetensors", "tokenizers"}
    assert f"{len(listed)} requirements to fetch" in proc.stderr


def test_unknown_argument_is_refused():
    proc = _dry_run("--fast")
    assert proc.returncode == 2 and "unknown argument --fast" in proc.stderr


def test_image_list_holds_what_the_acceptance_run_needs():
    image = device_image.image_packages()
    assert {"jax", "jaxlib", "jax-cuda13-plugin", "flax", "orbax-checkpoint", "torch", "transformers", "numpy",
            "absl-py", "grpcio", "protobuf", "safetensors", "tokenizers", "jinja2"} <= image
    assert not image & {"fastapi", "uvicorn", "llguidance", "httptools", "grpcio-health-checking"}
