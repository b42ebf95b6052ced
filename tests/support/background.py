"""Work of a whole run that no other test waits on, started with the run in a background process at nice 19, so it
takes the cores only where the test workers leave them idle (waiting on servers, sockets and sleeps: ~15% of a 2-core
run). Each job belongs to one test file, which runs late (tests/durations.json: its seconds with the job done), finds
the job's output in its directory, and asserts on it as on its own; where no job ran (the file run on its own with
the variable set, or the job failed or died) the test does the work itself.

tests/conftest.py starts `python -m tests.support.background RUN_DIR FILE...` for the files the run selects and sets
MESHSERVE_TEST_BACKGROUND=RUN_DIR for the workers; set beforehand (e.g. to 0), nothing is started."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

RUN_DIR_ENV = "MESHSERVE_TEST_BACKGROUND"
REPO = Path(__file__).resolve().parent.parent.parent
# test file (from the repository root) -> the job: a function of its output directory, in the module named
JOBS = {
    "tests/pallas_kernels/test_native_selftest.py": ("tests.support.native_selftest", "background"),
    "tests/serving/core/test_compilation_cache.py": ("tests.serving.core.test_compilation_cache", "background"),
}
_WAIT_S = 1200.0


def job_dir(test_file: str) -> Path | None:
    """Where this run's job for `test_file` (its path, from the repository root or absolute: `__file__`) writes, or
    None where none was started."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir or not (Path(run_dir) / "pid").exists():
        return None
    return Path(run_dir) / Path(test_file).stem


def _running(run_dir: Path, name: str) -> bool:
    """`name`'s job has not ended, and the background process has not died (gone, or a zombie not reaped yet)."""
    if (run_dir / name / "ended").exists():
        return False
    try:
        pid = int((run_dir / "pid").read_text())
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def result(test_file: str, name: str) -> Path | None:
    """The file `name` that `test_file`'s job writes, once it is there (waited for while the job runs); None where
    no job was started, or it ended without writing it."""
    where = job_dir(test_file)
    if where is None:
        return None
    out = where / name
    deadline = time.monotonic() + _WAIT_S
    while not out.exists() and _running(where.parent, where.name) and time.monotonic() < deadline:
        time.sleep(0.2)
    return out if out.exists() else None


def write(path: Path, text: str) -> None:
    """`text` into `path` whole or not at all (a waiting test sees the file only once it is complete)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def start(run_dir: Path, files: list[str]) -> subprocess.Popen:
    """The background process for `files`' jobs, in its own session so it can be killed whole."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "log", "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.background", str(run_dir), *files], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    (run_dir / "pid").write_text(str(proc.pid))
    return proc


def main(run_dir: str, files: list[str]) -> None:
    os.nice(19)
    for test_file in files:
        out = Path(run_dir) / Path(test_file).stem
        out.mkdir(parents=True, exist_ok=True)
        try:
            module, function = JOBS[test_file]
            getattr(importlib.import_module(module), function)(out)
        except Exception:  # the test redoes the work and reports what fails
            traceback.print_exc()
        finally:
            (out / "ended").touch()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
