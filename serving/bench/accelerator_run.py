"""How `serving.bench accelerator` runs its stages: one time budget for the run and one per stage (a stage starts only
while the run has time left and stops at its own budget's checkpoints), every figure written as it arrives to
`accelerator.json` (and the result lines to `accelerator_summary.txt`) so a run cut short still returns what it
reached, and a watchdog that writes both and ends the process when the run's budget is spent inside a stage."""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any, Callable

STATUS_WORDS = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP", "timeout": "TIMEOUT", "not_reached": "NOT REACHED",
                "killed": "KILLED"}
OK_STATUSES = ("pass", "skip")  # what an accepting run's stages may end as
MIN_STAGE_S = 10.0  # a stage is not started with less of the run's budget left


class StageFailure(Exception):
    """A stage's check failed; the message is the FAIL line's detail."""


class StageSkipped(Exception):
    """The stage cannot run on this machine (a package or kernel it needs is not there); the message says why."""


class StageOutOfTime(Exception):
    """The stage's budget ran out at a checkpoint; the message says how far it got (its figures are kept)."""


@dataclasses.dataclass(frozen=True)
class StageResult:
    stage: str
    status: str  # a key of STATUS_WORDS
    detail: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def line(self) -> str:
        return f"{STATUS_WORDS[self.status]} {self.stage}: {self.detail} [{self.seconds:.1f}s]"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    text = text.splitlines()[0] if text else ""
    own = isinstance(e, (StageFailure, StageSkipped, StageOutOfTime))
    return text if own else f"{type(e).__name__}: {text}" if text else type(e).__name__


def summary(results) -> str:
    """`accelerator acceptance: N passed, M failed`, then the other outcomes that occurred."""
    count = {s: sum(r.status == s for r in results) for s in STATUS_WORDS}
    extra = [f"{count[s]} {w}" for s, w in (("skip", "skipped"), ("timeout", "out of time"),
                                            ("not_reached", "not reached"), ("killed", "killed")) if count[s]]
    return ", ".join([f"accelerator acceptance: {count['pass']} passed, {count['fail']} failed", *extra])


def exit_status(results) -> int:
    return 0 if results and all(r.status in OK_STATUSES for r in results) else 1


class Report:
    """The run's record: `accelerator.json` (meta, then per stage its status, detail, seconds, budget and figures)
    and `accelerator_summary.txt` (the result lines and the summary) under `out_dir`, rewritten whole (atomically)
    on every change; `out_dir` "" keeps it in memory only."""

    def __init__(self, out_dir: str, meta: dict):
        self.out_dir = out_dir
        self.data: dict[str, Any] = {"meta": meta, "stages": {}, "summary": None}
        self.lines: list[str] = []
        self._lock = threading.RLock()
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
        self.write()

    def stage(self, name: str, **fields) -> dict:
        with self._lock:
            entry = self.data["stages"].setdefault(name, {"status": "running", "figures": {}})
            entry.update(fields)
            self.write()
            return entry

    def figure(self, stage: str, key: str, value) -> None:
        with self._lock:
            self.data["stages"].setdefault(stage, {"status": "running", "figures": {}})["figures"][key] = value
            self.write()

    def result(self, result: StageResult, budget_s: float | None) -> None:
        with self._lock:
            self.lines.append(result.line)
            self.stage(result.stage, status=result.status, detail=result.detail, seconds=round(result.seconds, 2),
                       budget_s=budget_s)

    def finish(self, results, seconds: float) -> str:
        with self._lock:
            line = summary(results) + f" [{seconds:.1f}s]"
            self.data["summary"] = line
            self.lines.append(line)
            self.write()
            return line

    def write(self) -> None:
        if not self.out_dir:
            return
        with self._lock:
            for name, text in (("accelerator.json", json.dumps(self.data, indent=1, default=str)),
                               ("accelerator_summary.txt", "\n".join(self.lines) + "\n")):
                path = os.path.join(self.out_dir, name)
                with open(path + ".tmp", "w") as f:
                    f.write(text)
                os.replace(path + ".tmp", path)


class Budget:
    """The run's time budget (None: unlimited) and the running stage's: `stage_deadline` is the earlier of the
    stage's own budget and the run's end."""

    def __init__(self, total_s: float | None, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.start = clock()
        self.total_s = total_s
        self.stage_deadline: float | None = None
        self.stage_budget_s: float | None = None

    @property
    def run_deadline(self) -> float | None:
        return None if self.total_s is None else self.start + self.total_s

    def left(self) -> float:
        """Seconds of the run's budget left (inf without one)."""
        return float("inf") if self.total_s is None else self.run_deadline - self.clock()

    def begin_stage(self, budget_s: float | None) -> bool:
        """Sets the stage's deadline; False when the run has too little left to start it."""
        if self.total_s is None:
            self.stage_deadline = None if budget_s is None else self.clock() + budget_s
            self.stage_budget_s = budget_s
            return True
        left = self.left()
        if left < MIN_STAGE_S:
            return False
        self.stage_budget_s = min(budget_s, left) if budget_s is not None else left
        self.stage_deadline = self.clock() + self.stage_budget_s
        return True

    def stage_left(self) -> float:
        return float("inf") if self.stage_deadline is None else self.stage_deadline - self.clock()


class Watchdog:
    """At the run's deadline plus `grace_s`, if the run is still inside a stage (a compile or a step that does not
    return): marks that stage killed, writes the report and the summary, prints them and ends the process with
    status 3, so the figures reached come back even then."""

    def __init__(self, report: Report, budget: Budget, out: Callable[[str], None], grace_s: float = 15.0,
                 exit: Callable[[int], None] = os._exit):
        self.report, self.budget, self.out, self.grace_s, self.exit = report, budget, out, grace_s, exit
        self.current: tuple[str, float] | None = None  # (stage, its start)
        self.results: list[StageResult] = []
        self._timer: threading.Timer | None = None

    def start(self) -> None:
        if self.budget.total_s is None:
            return
        self._timer = threading.Timer(max(0.0, self.budget.left()) + self.grace_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        if self.current is None:
            return
        stage, t0 = self.current
        result = StageResult(stage, "killed", f"the run's budget of {self.budget.total_s:.0f}s ran out inside "
                             "this stage (figures so far are in accelerator.json)", self.budget.clock() - t0)
        self.report.result(result, self.budget.stage_budget_s)
        self.out(result.line)
        self.out(self.report.finish(self.results + [result], self.budget.clock() - self.budget.start))
        self.exit(3)


@dataclasses.dataclass
class Context:
    """What a stage gets: the mode and sizes, where models go, how to print, the report its figures go to, and the
    budget its checkpoints (`check_time`) stop at."""
    smoke: bool
    sizes: Any
    workdir: str
    parity_subprocess: bool
    out: Callable[[str], None]
    report: Report
    budget: Budget
    stage: str = ""

    def note(self, text: str) -> None:
        """An information line under the stage's PASS/FAIL line's stage (indented)."""
        self.out(f"  {text}")

    def figure(self, key: str, value) -> None:
        """A figure of the running stage, written to accelerator.json at once."""
        self.report.figure(self.stage, key, value)

    def check_time(self, done: int, total: int, what: str) -> None:
        """Before the next of `total` units (`done` finished): raises StageOutOfTime when the stage's budget is
        spent, so the stage ends with the figures of the units done."""
        if done < total and self.budget.stage_left() <= 0:
            raise StageOutOfTime(f"its budget of {self.budget.stage_budget_s:.0f}s ran out after {done} of {total} "
                                 f"{what}")
