"""Speculative decoding benchmark on the shipped tiny target/draft pair (models/tiny/{target,draft}): decode tokens/s,
TPOT and acceptance rate without speculation, with the draft, with prompt lookup. Details: docs/benchmarks.md.

    python -m serving.bench speculative [--k=4] [--batch_sizes=1,8] [--max_tokens=64] [--json=FILE]
"""
from __future__ import annotations

import json
import os
import statistics
import time

from absl import flags

from serving.bench.harness import table

_ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "models", "tiny")
_TARGET = flags.DEFINE_string("target", os.path.join(_ROOT, "target"), "target model directory")
_DRAFT = flags.DEFINE_string("draft", os.path.join(_ROOT, "draft"), "draft model directory")
_K = flags.DEFINE_integer("k", 4, "num_speculative_tokens")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "concurrent requests")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "tokens generated per request")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "batches per measurement (the best is reported)")
_WORKLOADS = flags.DEFINE_list("workloads", ["text", "edit"], "text, edit")
_METHODS = flags.DEFINE_list("methods", ["off", "draft", "ngram"], "off, draft, ngram")
_DTYPE = flags.DEFINE_string("dtype", "float32", "parameter and KV dtype")
_JSON = flags.DEFINE_string("json", "", "also write the results here")


def prompts(tokenizer, workload: str, n: int) -> list[list[int]]:
    """`n` prompts of ~100-200 tokens cut from the model's held-out text (held-out.txt next to the weights)."""
    path = os.path.join(_TARGET.value, "heldout.txt")
    with open(path) as f:
        text = f.read()
    pieces = [p for p in text.split("\n\n") if 200 < len(p) < 800][:n * 3]
    out = []
    for i in range(n):
        snippet = pieces[i * 3 % len(pieces)]
        if workload == "edit":
            body = snippet[:400]
            prompt = f"# Original:\n{body}\n\n# The same code, reformatted:\n{body[:60]}"
        else:
            prompt = snippet[:500]
        out.append(tokenizer.encode(prompt))
    return out


def measure(llm, batch, max_tokens: int, rounds: int) -> dict:
    from serving.params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    best = None
    for _ in range(rounds):
        spec = llm.engine.spec
        before = spec.stats() if spec else None
        outs = llm.generate(batch, params)
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finished_time for o in outs)
        decode_tokens = sum(len(o.token_ids) - 1 for o in outs)
        tpot = statistics.mean((o.metrics.token_times[-1] - o.metrics.token_times[0]) / (len(o.token_ids) - 1)
                               for o in outs)
        row = dict(decode_tokens_per_s=decode_tokens / (last - first), tpot_ms=1e3 * tpot)
        if spec:
            after = spec.stats()
            drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            rounds_ = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            per_pos = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                             before["spec_decode_num_accepted_tokens_per_pos"])]
            row.update(acceptance_rate=accepted / drafted if drafted else 0.0, drafts=rounds_,
                       accepted_per_pos=[round(a / rounds_, 3) if rounds_ else 0.0 for a in per_pos])
        if best is None or row["decode_tokens_per_s"] > best["decode_tokens_per_s"]:
            best = row
    return best


def main() -> None:
    from serving.core.llm import LLM
    from serving.core.speculative import draft_memory
    batch_sizes = [int(b) for b in _BATCH_SIZES.value]
    max_seqs = max(batch_sizes)
    common = dict(dtype=_DTYPE.value, page_size=16, num_pages=max_seqs * 32 + 64, max_num_seqs=max_seqs,
                  max_num_batched_tokens=max(64, max_seqs * (_K.value + 1)), min_token_bucket=16, max_model_len=512)
    methods = {"off": {}, "draft": dict(speculative_method="draft", speculative_model=_DRAFT.value),
               "ngram": dict(speculative_method="ngram", prompt_lookup_min=2, prompt_lookup_max=4)}
    results = []
    for method in _METHODS.value:
        extra = dict(methods[method], num_speculative_tokens=_K.value) if method != "off" else {}
        t0 = time.perf_counter()
        llm = LLM(_TARGET.value, **common, **extra)
        print(f"[{method}] start-up {time.perf_counter() - t0:.1f}s, {llm.engine.compile_count} programs", flush=True)
        for workload in _WORKLOADS.value:
            for b in batch_sizes:
                batch = prompts(llm.tokenizer, workload, b)
                row = dict(method=method, workload=workload, batch=b,
                           **measure(llm, batch, _MAX_TOKENS.value, _ROUNDS.value))
                results.append(row)
                print(json.dumps(row), flush=True)
        if method == "draft":
            mem = draft_memory(_DRAFT.value, dtype=_DTYPE.value, page_size=common["page_size"],
                               num_pages=common["num_pages"])
            measured = dict(weights=llm.engine.spec.draft_weight_bytes, kv_cache=llm.engine.spec.draft_kv_bytes)
            print(f"draft memory (ledger): {json.dumps(mem)}; measured arrays: {json.dumps(measured)}", flush=True)
            results.append(dict(method="draft_memory", ledger=mem, measured=measured))
        del llm

    base = {(r["workload"], r["batch"]): r["decode_tokens_per_s"] for r in results if r["method"] == "off"}
    table(f"Speculative decoding, k={_K.value}, {_MAX_TOKENS.value} tokens per request, greedy ({_DTYPE.value})",
          ["workload", "batch", "method", "decode tok/s", "TPOT ms", "speed-up", "acceptance", "accepted/pos"],
          [[r["workload"], r["batch"], r["method"], r["decode_tokens_per_s"], r["tpot_ms"],
            f"{r['decode_tokens_per_s'] / base.get((r['workload'], r['batch']), float('nan')):.2f}x",
            r.get("acceptance_rate", float("nan")), r.get("accepted_per_pos", "")]
           for r in results if "workload" in r])
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=1)

