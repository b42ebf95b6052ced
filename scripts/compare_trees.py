"""Before/after throughput of two checkouts, side by side: `python scripts/compare_trees.py OLD_TREE NEW_TREE
[--rounds 3] [--dtypes float32,bfloat16]`. Each round runs one process per tree, alternating (this machine's speed
drifts between processes), through the public API only (`LLM.generate`, so any two versions compare): the bench's
~125M Llama, 16 fresh 128-token prompts -> 128 tokens, then batch 1 (median of 3). Prints medians and ranges."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, time
tree, dtype, model = sys.argv[1:4]
sys.path.insert(0, tree)
import numpy as np
from serving.core.llm import LLM
from serving.params import SamplingParams
rng = np.random.default_rng(int(time.time() * 1e6) % (1 << 32))
prompts = lambda n: [rng.integers(10, 30000, 128).tolist() for _ in range(n)]
greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
llm = LLM(model, dtype=dtype, page_size=16, num_pages=4096, max_num_seqs=16, max_num_batched_tokens=256)
llm.generate(prompts(16), greedy(32)); llm.generate(prompts(1), greedy(32))
t0 = time.perf_counter(); outs = llm.generate(prompts(16), greedy(128))
b16 = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
b1 = []
for _ in range(3):
    t0 = time.perf_counter(); out = llm.generate(prompts(1), greedy(128))[0]
    b1.append(len(out.token_ids) / (time.perf_counter() - t0))
print("RESULT", json.dumps({"b16": b16, "b1": sorted(b1)[1]}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from serving.bench.harness import cpu_name, llama_125m
    print(f"CPU: {cpu_name()}")
    for dtype in args.dtypes.split(","):
        model = llama_125m(dtype)
        results = {"old": [], "new": []}
        for _ in range(args.rounds):
            for side in ("old", "new"):
                tree = os.path.abspath(getattr(args, side))
                env = {**os.environ, "MESHSERVE_COMPILATION_CACHE": os.path.join(tempfile.gettempdir(), f"meshserve-compare-xla-{side}")}
                done = subprocess.run([sys.executable, "-c", _CHILD, tree, dtype, model], cwd=tree, env=env,
                                      capture_output=True, text=True, check=True)
                line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
                results[side].append(json.loads(line[7:]))
        for cell in ("b16", "b1"):
            old = [r[cell] for r in results["old"]]
            new = [r[cell] for r in results["new"]]
            print(f"{dtype} {cell}: old {statistics.median(old):.0f} new {statistics.median(new):.0f} tok/s "
                  f"(new/old {statistics.median(new) / statistics.median(old):.3f}; ranges "
                  f"{min(old):.0f}-{max(old):.0f} / {min(new):.0f}-{max(new):.0f}, {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
