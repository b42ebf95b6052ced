"""Writes tests/durations.json, each test file's seconds (setup + call + teardown of its tests) from a whole run's
JUnit XML: `scripts/test.sh --junitxml=junit.xml`, then `python scripts/test_durations.py junit.xml` (or from a CPU log,
below: `python scripts/test_durations.py cpu.jsonl`, as `.ci/run` passes no arguments to pytest). The test
collection (tests/conftest.py) starts the longest files first with it; refresh it when files are added or slowed.
`python scripts/test_durations.py --cpu cpu.jsonl` instead prints each file's CPU seconds from a run with
MESHSERVE_TEST_CPU_LOG=cpu.jsonl (tests/conftest.py): the worker's own and its child processes' (servers, pip)."""
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def file_seconds(junit: str) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    if junit.endswith(".jsonl"):  # a CPU log (MESHSERVE_TEST_CPU_LOG): each test's wall seconds
        for line in Path(junit).read_text().splitlines():
            row = json.loads(line)
            seconds[row["file"]] += row["wall"]
        return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "")
        # "tests.serving.test_demo" or "tests.serving.test_x.TestClass": the longest prefix that is a file.
        parts = module.split(".")
        for n in range(len(parts), 0, -1):
            path = "/".join(parts[:n]) + ".py"
            if (ROOT / path).is_file():
                seconds[path] += float(case.get("time", 0.0))
                break
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


def cpu_table(log: str, top: int = 40) -> None:
    """Per file: wall, worker CPU and children's CPU seconds (MESHSERVE_TEST_CPU_LOG lines), the most CPU first."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for line in Path(log).read_text().splitlines():
        row = json.loads(line)
        f = files[row["file"]]
        f[0] += row["wall"]
        f[1] += row["cpu"]
        f[2] += row["children_cpu"]
    rows = sorted(files.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
    total = [sum(v[i] for _, v in rows) for i in range(3)]
    print(f"{'wall s':>8} {'cpu s':>8} {'children':>8}  file ({len(rows)} files; all: wall {total[0]:.0f}, "
          f"cpu {total[1]:.0f}, children {total[2]:.0f})")
    for path, (wall, cpu, kids) in rows[:top]:
        print(f"{wall:8.1f} {cpu:8.1f} {kids:8.1f}  {path}")


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[1] == "--cpu":
        cpu_table(argv[2])
        return
    if len(argv) != 2:
        sys.exit(f"usage: {argv[0]} JUNIT_XML | CPU_LOG.jsonl | --cpu CPU_LOG")
    seconds = {path: round(s, 1) for path, s in file_seconds(argv[1]).items()}
    out = ROOT / "tests" / "durations.json"
    out.write_text(json.dumps(seconds, indent=0) + "\n")
    print(f"{out}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all; the longest:")
    for path, s in list(seconds.items())[:10]:
        print(f"  {s:8.1f} s  {path}")


if __name__ == "__main__":
    main(sys.argv)
