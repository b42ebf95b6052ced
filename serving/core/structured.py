"""Structured outputs on the host: a request's `StructuredOutput` compiled to an llguidance matcher (cached per
grammar), one `GrammarState` per sample following its output tokens, and each step's allowed-token bitmask
(int32 [S, ceil(V / 32)], bit j of word w = token 32w + j) that the sampling program applies to the logits
(`sampling.apply_token_bitmask`). Why llguidance, and the measurements behind it: docs/structured-outputs.md.

The masks of step N are filled while step N's forward runs on the device (`Engine._launch` launches the forward
first); a sample's matcher consumes its new output tokens just before its row is filled, so it never sees a token
twice or a token that was dropped (preemption keeps the tokens; a lost matcher is rebuilt from them)."""
from __future__ import annotations

import collections
import json
import logging
import re
import threading
import time
import weakref
from typing import Sequence

import numpy as np

# How a reasoning model marks its reasoning, {name: (start marker, end marker, whether the output starts inside it)}:
# the reasoning parsers' own table, so the grammar and the text split agree. The markers must be single tokens.
from serving.params import CHANNEL_REASONING, REASONING_FORMATS, InvalidSampling, StructuredOutput

log = logging.getLogger(__name__)

# Bounds checked before anything parses or compiles a grammar: its text (a schema, regex, Lark grammar, or the choices
# together) and a JSON schema's nesting (Python's json would raise RecursionError, a 500, past ~1,000 levels; OpenAI
# allows 10 levels of schema, about 20 of brackets). llguidance's own fuel limits bound the compile past these.
MAX_GRAMMAR_CHARS = 128 << 10
MAX_SCHEMA_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """How deeply the brackets of JSON text nest (strings skipped), without parsing it."""
    depth = deepest = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def check_bounds(spec: StructuredOutput) -> None:
    """InvalidSampling naming the field when `spec` is over MAX_GRAMMAR_CHARS or, as a JSON schema,
    MAX_SCHEMA_DEPTH."""
    field = f"structured.{spec.kind}"
    text = spec.choice if spec.choice is not None else (spec.json_schema or spec.regex or spec.grammar or "",)
    size = sum(len(t) for t in text)
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidSampling(f"{field}: {size} characters, more than the {MAX_GRAMMAR_CHARS} a grammar may have")
    if spec.json_schema is not None:
        depth = json_depth(spec.json_schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidSampling(f"{field}: nested {depth} levels deep, more than {MAX_SCHEMA_DEPTH}")


class GrammarState:
    """One sample's matcher and how many of its output tokens it has consumed."""
    __slots__ = ("matcher", "consumed", "__weakref__")

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0

    def sync(self, output_ids: Sequence[int]) -> None:
        """Consumes the outputs it has not seen (a shrunk output is rolled back first)."""
        if len(output_ids) < self.consumed:
            self.matcher.rollback(self.consumed - len(output_ids))
            self.consumed = len(output_ids)
        for t in output_ids[self.consumed:]:
            if not self.matcher.consume_token(int(t)):
                log.error("grammar refused token %d it allowed: %s", t, self.matcher.get_error())
            self.consumed += 1


class StructuredOutputs:
    """The engine's grammar side: the llguidance tokenizer (built at the first constrained request), a bounded LRU
    of compiled matchers keyed by grammar, masks per step, and the figures /metrics report."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *, reasoning_parser: str = "",
                 cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.words = -(-vocab_size // 32)
        self.reasoning = None
        self.channel_reasoning = reasoning_parser in CHANNEL_REASONING
        if reasoning_parser and not self.channel_reasoning:
            if reasoning_parser not in REASONING_FORMATS:
                raise ValueError(f"reasoning_parser: unknown {reasoning_parser!r}; use one of "
                                 f"{', '.join(sorted(REASONING_FORMATS))}")
            start, end, inside = REASONING_FORMATS[reasoning_parser]
            ids = [self._single_token(m, reasoning_parser) for m in (start, end)]
            self.reasoning = (ids[0], ids[1], inside)
        self._llg_tokenizer = None
        self._lock = threading.Lock()  # compiles run on the event loop, masks on the engine thread
        # Compiled matchers by request spec (LRU), and those compiled for a request not attached yet.
        self._cache: collections.OrderedDict[StructuredOutput, object] = collections.OrderedDict()
        self._fresh: set[StructuredOutput] = set()
        self.cache_size = cache_size
        self._live: weakref.WeakSet = weakref.WeakSet()
        # Figures for /metrics (serving/telemetry/metrics.py) and the benchmark.
        self.compiles = 0
        self.compile_time_s = 0.0
        self.cache_hits = 0
        self.constrained_requests = 0
        self.mask_time_s = 0.0  # host time filling masks, summed over steps
        self.mask_steps = 0
        self.last_mask_time_s = 0.0

    def _single_token(self, marker: str, parser: str) -> int:
        if self.tokenizer is None:
            raise ValueError(f"reasoning_parser: {parser} needs the model's tokenizer")
        ids = self.tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"reasoning_parser: {parser} marks reasoning with {marker!r}, which is {len(ids)} tokens "
                             "for this tokenizer (it must be one)")
        return ids[0]

    def stats(self) -> dict:
        """Counters for /metrics (serving/telemetry/metrics.py mirrors them)."""
        return {"structured_requests": self.constrained_requests, "grammar_compiles": self.compiles,
                "grammar_compile_seconds": self.compile_time_s, "grammar_cache_hits": self.cache_hits,
                "grammar_mask_seconds": self.mask_time_s, "grammar_mask_steps": self.mask_steps}

    @property
    def num_live(self) -> int:
        """Grammar states still referenced (by requests the engine holds)."""
        return len(self._live)

    # ------------------------------------------------------------------ compiling
    def _llg(self):
        if self._llg_tokenizer is None:
            import llguidance
            if self.tokenizer is None:
                raise InvalidSampling("structured: this model has no tokenizer, which constrained decoding needs")
            self._llg_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=list(self.eos_token_ids))
        return self._llg_tokenizer

    def grammar(self, spec: StructuredOutput) -> str:
        """llguidance's top-level grammar (JSON) for `spec`: the body, behind the reasoning when asked."""
        import llguidance
        field = f"structured.{spec.kind}"
        if spec.json_schema is not None:
            try:
                schema = json.loads(spec.json_schema)
            except json.JSONDecodeError as e:
                raise InvalidSampling(f"{field}: not valid JSON: {e}") from e
            except RecursionError:  # check_bounds refuses such depths first; never a 500
                raise InvalidSampling(f"{field}: nested too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidSampling(f"{field}: a JSON schema is an object or a boolean, got "
                                      f"{type(schema).__name__}")
            body = {"json_schema": _compact(schema)}
        elif spec.json_object:
            body = {"json_schema": _compact({"type": "object"})}
        elif spec.regex is not None:
            body = json.loads(llguidance.LLMatcher.grammar_from_regex(spec.regex))["grammars"][0]
        elif spec.grammar is not None:
            body = {"lark_grammar": spec.grammar}
        else:
            body = {"lark_grammar": "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)}
        if not (spec.after_reasoning and self.reasoning):
            return json.dumps({"grammars": [body]})
        start, end, inside = self.reasoning
        think = f"<[{end}]>" if inside else f"(<[{start}]> THINK <[{end}]>)?"
        lark = f"start: {'THINK ' if inside else ''}{think} WS @body\nTHINK: /(.|\\n)*/\nWS: /[ \\t\\n]*/\n"
        return json.dumps({"grammars": [{"lark_grammar": lark}, {**body, "name": "body"}]})

    def compile(self, spec: StructuredOutput):
        """The pristine matcher of `spec`, compiled on the first sight of it, then from the cache; raises
        InvalidSampling naming the field when the grammar is bad (the engine's make_request, so a bad grammar is
        refused before anything is queued); `attach` then finds it here. Callers on an event loop run it in a thread:
        a compile takes up to tens of milliseconds within the bounds (`check_bounds`, llguidance's fuel)."""
        check_bounds(spec)
        if self.channel_reasoning:
            raise InvalidSampling(f"structured.{spec.kind}: constrained decoding with the harmony format "
                                  f"(--reasoning_parser=harmony, GPT-OSS) is not implemented")
        with self._lock:
            matcher = self._cache.get(spec)
            if matcher is not None:
                self._cache.move_to_end(spec)
                return matcher
        import llguidance
        if spec.after_reasoning and self.reasoning is None:
            raise InvalidSampling("structured.after_reasoning: this server has no reasoning parser "
                                  "(--reasoning_parser)")
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self._llg(), self.grammar(spec))
        if matcher.is_error():
            raise InvalidSampling(f"structured.{spec.kind}: the grammar does not compile: {matcher.get_error()}")
        with self._lock:
            self.compiles += 1
            self.compile_time_s += time.perf_counter() - t0
            self._cache[spec] = matcher
            self._fresh.add(spec)  # its first request is a miss, not a cache hit
            if len(self._cache) > self.cache_size:
                self._fresh.discard(self._cache.popitem(last=False)[0])
        return matcher

    def attach(self, request) -> None:
        """Gives every sample of `request` its own grammar state (None when unconstrained). Raises InvalidSampling."""
        spec = request.sampling_params.structured
        if spec is None:
            return
        pristine = self.compile(spec)
        with self._lock:
            if spec in self._fresh:
                self._fresh.discard(spec)
            else:
                self.cache_hits += 1
        self.constrained_requests += 1
        for sample in request.samples:
            sample.grammar = GrammarState(pristine.deep_copy())
            self._live.add(sample.grammar)

    # ------------------------------------------------------------------ masks
    def fill(self, requests: Sequence, num_slots: int) -> np.ndarray | None:
        """The step's bitmask, [num_slots, words] int32: each constrained request's row holds its grammar's allowed
        tokens (the request first consumes its new output tokens), every other row has every bit set (None in
        `requests`: a slot that does not sample this step); None when no request in the step is constrained."""
        rows = [(i, r) for i, r in enumerate(requests) if r is not None and r.grammar is not None]
        if not rows:
            return None
        import llguidance.numpy as llg_np
        t0 = time.perf_counter()
        mask = np.full((num_slots, self.words), -1, np.int32)
        for i, r in rows:
            state = r.grammar
            state.sync(r.output_token_ids)
            if state.matcher.is_error():  # an engine bug; never leave a row with no token to draw
                log.error("request %s: grammar in error: %s; allowing EOS only", r.request_id,
                          state.matcher.get_error())
                mask[i] = 0
                for t in self.eos_token_ids:
                    mask[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
                continue
            llg_np.fill_next_token_bitmask(state.matcher, mask, i)
        self.last_mask_time_s = time.perf_counter() - t0
        self.mask_time_s += self.last_mask_time_s
        self.mask_steps += 1
        return mask


def _compact(schema):
    """JSON without free whitespace (`{"a": 1, "b": [2, 3]}`, OpenAI's separators): a model cannot spend its tokens
    on blank lines inside an object."""
    if not isinstance(schema, dict):
        return schema
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}


def unpack_bitmask(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Host-side, for tests: bool [S, vocab_size] from an int32 bitmask."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)
