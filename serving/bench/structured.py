"""Structured outputs' cost (issue 23): output tokens/s of the engine with 0%, 50% and 100% of its sequences
constrained by a JSON schema, at batch 16 and 64, the host time per step spent filling the grammars' masks (and the
part of it the device step did not hide), and each schema's grammar compile time.

    python -m serving.bench structured [--structured_model=DIR] [--structured_seconds=15] [--structured_batches=16,64]

Closed loop on the in-process engine (no server): `batch` requests always in flight, each sampling at temperature
1.0 with a fresh seed; a constrained one follows the schema (its output ends where the JSON does), a free one runs
to max_tokens. The three fractions of a batch run round-robin in one process, `--structured_rounds` times, and the
table gives the median of the rounds, so every ratio is measured side by side. "Mask ms/step" is the host time to
fill one step's bitmask; "exposed" is how much longer a constrained step's launch took than a free one's (what the
forward on the device did not cover)."""
from __future__ import annotations

import itertools
import json
import os
import statistics
import time

from absl import flags

from serving.bench.harness import table

_MODEL = flags.DEFINE_string("structured_model", "", "Model directory (default: the shipped tiny model).")
_SECONDS = flags.DEFINE_float("structured_seconds", 15.0, "Seconds of load per cell and round.")
_BATCHES = flags.DEFINE_list("structured_batches", ["16", "64"], "Sequences in flight.")
_ROUNDS = flags.DEFINE_integer("structured_rounds", 3, "Rounds over the cells (medians are reported).")
_MAX_TOKENS = flags.DEFINE_integer("structured_max_tokens", 96, "max_tokens of every request.")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "<|im_start|>user\nDescribe an order as JSON.<|im_end|>\n<|im_start|>assistant\n"
# The benchmark's schema: nested objects, an enum, bounded numbers and an array, so its outputs are tens of tokens.
SCHEMA = {"type": "object", "properties": {
    "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                  "tier": {"enum": ["free", "pro", "enterprise"]}},
                 "required": ["name", "tier"], "additionalProperties": False},
    "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "total": {"type": "number", "minimum": 0, "maximum": 10000}},
    "required": ["order_id", "customer", "items", "total"], "additionalProperties": False}


# The structured-outputs tests' grammars (tests/serving/core/test_structured.py), timed by `_compile_times`.
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"},
        "kind": {"const": "shirt"}}, "required": ["color", "size", "ok", "kind"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
                   "maxItems": 4}}, "required": ["tags", "scores"], "additionalProperties": False},
    "bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "delta": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5}},
        "required": ["age", "ratio", "delta"], "additionalProperties": False},
    "pattern_optional": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "nickname": {"type": "string", "maxLength": 8},
        "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"}},
        "required": ["id"], "additionalProperties": False},
}
REGEX = r"(GET|POST) /[a-z]{1,8}(/[0-9]{1,3})? HTTP/1\.[01]"
LARK = """
start: select
select: "SELECT " cols " FROM " NAME (" WHERE " cond)?
cols: "*" | NAME (", " NAME){0,2}
cond: NAME " = " NUMBER
NAME: /[a-z]{1,8}/
NUMBER: /[0-9]{1,4}/
"""


def _cell(engine, batch: int, fraction: float, seconds: float, max_tokens: int, ids) -> dict:
    from serving.params import SamplingParams, StructuredOutput
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    so = engine.structured
    constrained_every = 0 if fraction == 0 else round(1 / fraction)
    made = itertools.count()

    def new_request():
        i = next(made)
        structured = spec if constrained_every and i % constrained_every == 0 else None
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, structured=structured,
                                ignore_eos=structured is None)
        r = engine.make_request(f"b{next(ids)}", PROMPT, params)
        engine.add_request(r)
        return r

    live = [new_request() for _ in range(batch)]
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in live):
        engine.step()  # prefills out of the way: the cell measures decoding
    mask0, masks0 = so.mask_time_s, so.mask_steps
    tokens, steps, launch = 0, 0, []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s0 = time.perf_counter()
        outs = engine.step()
        launch.append(time.perf_counter() - s0)
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in outs)
        done = sum(o.finished for o in outs)
        for _ in range(done):
            live.append(new_request())
        live = [r for r in live if not r.is_finished]
    elapsed = time.perf_counter() - t0
    for r in list(engine.scheduler.requests):
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    return {"tok_s": tokens / elapsed, "step_ms": 1e3 * elapsed / steps,
            "mask_ms": 1e3 * (so.mask_time_s - mask0) / max(1, so.mask_steps - masks0),
            "launch_ms": 1e3 * statistics.median(launch)}


def _compile_times(engine) -> list[list]:
    """Cold compile (source to a matcher) and a cache hit, per schema of the structured-outputs tests."""
    from serving.params import StructuredOutput
    from serving.core.structured import StructuredOutputs
    rows = []
    cases = [(name, StructuredOutput(json_schema=json.dumps(s))) for name, s in SCHEMAS.items()]
    cases += [("bench order", StructuredOutput(json_schema=json.dumps(SCHEMA))),
              ("regex", StructuredOutput(regex=REGEX)), ("lark", StructuredOutput(grammar=LARK))]
    fresh = StructuredOutputs(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    fresh.compile(StructuredOutput(json_object=True))  # builds the llguidance tokenizer, once per engine
    for name, spec in cases:
        t0 = time.perf_counter()
        m = fresh.compile(spec).deep_copy()
        m.compute_bitmask()
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh.compile(spec).deep_copy().compute_bitmask()
        rows.append([name, f"{1e3 * cold:.2f}", f"{1e3 * (time.perf_counter() - t0):.3f}"])
    return rows


def main() -> None:
    from serving.core.llm import LLM
    model = _MODEL.value or os.path.join(REPO, "models", "tiny", "target")
    batches = [int(b) for b in _BATCHES.value]
    llm = LLM(model, max_num_seqs=max(batches), max_num_batched_tokens=max(256, max(batches)))
    engine = llm.engine
    ids = itertools.count()
    fractions = (0.0, 0.5, 1.0)
    results = {(b, f): [] for b in batches for f in fractions}
    for _ in range(_ROUNDS.value):
        for b in batches:
            for f in fractions:
                results[b, f].append(_cell(engine, b, f, _SECONDS.value, _MAX_TOKENS.value, ids))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in results.items()}
    rows = []
    for b in batches:
        base = med[b, 0.0]
        for f in fractions:
            m = med[b, f]
            rows.append([b, f"{int(100 * f)}%", f"{m['tok_s']:.0f}", f"{m['tok_s'] / base['tok_s']:.3f}",
                         f"{m['step_ms']:.2f}", f"{m['mask_ms']:.3f}" if f else "-",
                         f"{max(0.0, m['launch_ms'] - base['launch_ms']):.3f}" if f else "-"])
    table(f"Structured outputs, {os.path.basename(os.path.normpath(model))} "
          f"(vocab {engine.model_config.vocab_size}), median of {_ROUNDS.value} rounds x "
          f"{_SECONDS.value:g} s", ["batch", "constrained", "output tok/s", "vs 0%", "step ms",
                                    "mask ms/step", "exposed launch ms/step"], rows)
    table("Grammar compile (llguidance, a fresh cache)", ["grammar", "cold ms (to first mask)", "cached ms"],
          _compile_times(engine))
