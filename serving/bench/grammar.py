"""Grammar engines for structured outputs measured on our tokenizers (issue 23): llguidance, xgrammar and
outlines-core. Per engine: tokenizer-info build, compile to the first mask per grammar kind (cold / cached), the
per-step token-bitmask fill over random valid continuations (one sequence, and 16 / 64 per step serially or with the
engine's batched fill), whether a fill releases the GIL, memory per matcher, whether finished outputs obey the
grammar; and the cost of applying the int32 bitmask to the logits on the device. Details: docs/structured-outputs.md.

    python -m serving.bench grammar [--grammar_tokenizers=tiny,llama512,bpe32k,bpe128k] [--grammar_json=FILE]
"""
from __future__ import annotations

import dataclasses
import decimal
import gc
import glob
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np
from absl import flags

from models.tokenizer import BYTE_LEVEL_ALPHABET, Tokenizer
from serving.bench.harness import BENCH_WORKDIR, table

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINES = ("llguidance", "xgrammar", "outlines-core")
TOKENIZERS = ("tiny", "llama512", "bpe32k", "bpe128k")

_ENGINES = flags.DEFINE_list("grammar_engines", list(ENGINES), f"grammar engines, of {', '.join(ENGINES)}")
_TOKENIZERS = flags.DEFINE_list(
    "grammar_tokenizers", list(TOKENIZERS),
    "tiny: models/tiny/target (8192); llama512: the test Llama's (512); bpe32k / bpe128k: byte-level BPEs trained on "
    "this Python's standard library (cached under --grammar_workdir); or a directory holding a tokenizer.json")
_STEPS = flags.DEFINE_integer("grammar_steps", 200, "decode steps per sequence")
_SEQS = flags.DEFINE_integer("grammar_seqs", 64, "constrained sequences per step (the 16-sequence numbers are its "
                             "first 16)")
_REPEATS = flags.DEFINE_integer("grammar_repeats", 3, "compiles timed per grammar, cold and cached (median)")
_MASK_REPEATS = flags.DEFINE_integer("grammar_mask_repeats", 3, "times each continuation is replayed (the same walk; "
                                     "each statistic is the median of the replays)")
_SEED = flags.DEFINE_integer("grammar_seed", 0, "random continuations")
_WORKDIR = flags.DEFINE_string("grammar_workdir", BENCH_WORKDIR, "where the trained BPE tokenizers are kept")
_JSON = flags.DEFINE_string("grammar_json", "", "also write every measurement here")

# ---------------------------------------------------------------------------------------------- the grammars
_STRING = {"type": "string"}
SCHEMAS: dict[str, dict] = {
    "nested": {  # objects in objects, and an array of objects
        "type": "object", "additionalProperties": False, "required": ["id", "customer", "items"],
        "properties": {
            "id": {"type": "integer"},
            "customer": {
                "type": "object", "additionalProperties": False, "required": ["name", "address"],
                "properties": {"name": _STRING, "address": {
                    "type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
                    "properties": {"street": _STRING, "city": _STRING, "zip": _STRING}}}},
            "items": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["sku", "quantity"],
                "properties": {"sku": _STRING, "quantity": {"type": "integer"}}}}}},
    "enum": {  # choices: string and integer enums, a const, a boolean
        "type": "object", "additionalProperties": False,
        "required": ["sentiment", "language", "priority", "source", "urgent"],
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral", "mixed"]},
            "language": {"type": "string", "enum": ["en", "de", "fr", "es", "ja", "zh", "pt", "it"]},
            "priority": {"enum": [1, 2, 3, 5, 8]},
            "source": {"const": "support-ticket"},
            "urgent": {"type": "boolean"}}},
    "array": {  # arrays with min / max items, nested arrays
        "type": "object", "additionalProperties": False, "required": ["tags", "scores", "matrix"],
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2, "maxItems": 5},
            "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
            "matrix": {"type": "array", "maxItems": 3, "items": {
                "type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}}}},
    "bounds": {  # integer and number ranges
        "type": "object", "additionalProperties": False, "required": ["age", "year", "temperature", "ratio"],
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}},
    "pattern": {  # string patterns, a length range, a format, optional fields
        "type": "object", "additionalProperties": False, "required": ["email"],
        "properties": {
            "email": {"type": "string", "pattern": "^[a-z0-9._]{1,20}@[a-z0-9]{1,12}\\.[a-z]{2,4}$"},
            "phone": {"type": "string", "pattern": "^\\+[0-9]{1,3} [0-9]{3}-[0-9]{4}$"},
            "nickname": {"type": "string", "minLength": 1, "maxLength": 20},
            "birthday": {"type": "string", "format": "date"},
            "notes": _STRING}},
}
REGEX = r"(INFO|WARN|ERROR) [0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z [a-z_]{1,20}: [a-zA-Z0-9 ,.]{1,60}"
LARK = r"""
start: select
select: "SELECT " columns " FROM " NAME where? ";"
columns: "*" | NAME (", " NAME)*
where: " WHERE " condition (" AND " condition)*
condition: NAME OP value
OP: "=" | "<" | ">" | "<=" | ">=" | "!="
value: NUMBER | STRING
NAME: /[a-z_][a-z0-9_]{0,15}/
NUMBER: /[0-9]{1,6}/
STRING: /'[a-z ]{0,20}'/
"""
# The language LARK describes, as a regex, to check finished outputs.
_LARK_NAME, _LARK_VALUE = r"[a-z_][a-z0-9_]{0,15}", r"([0-9]{1,6}|'[a-z ]{0,20}')"
_LARK_CONDITION = f"{_LARK_NAME}(=|<|>|<=|>=|!=){_LARK_VALUE}"
LARK_AS_REGEX = (f"SELECT (\\*|{_LARK_NAME}(, {_LARK_NAME})*) FROM {_LARK_NAME}"
                 f"( WHERE {_LARK_CONDITION}( AND {_LARK_CONDITION})*)?;")
# name -> (kind, source); kind is "json", "regex" or "lark"
GRAMMARS: dict[str, tuple[str, Any]] = {**{k: ("json", v) for k, v in SCHEMAS.items()},
                                        "regex": ("regex", REGEX), "lark": ("lark", LARK)}
# What every engine compiles: the main table's mask times pool these.
COMMON = ("nested", "enum", "array", "bounds", "pattern", "regex")


class Unsupported(Exception):
    """The engine cannot compile this grammar (its message says why)."""


# ---------------------------------------------------------------------------------------------- the engines
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class LLGuidanceEngine:
    """llguidance: an Earley parser over a lazily built lexer; no ahead-of-time mask tables, so a "compiled grammar"
    is a pristine matcher that each request deep-copies."""
    name = "llguidance"
    package = "llguidance"
    modules = ("llguidance", "llguidance.numpy")

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import llguidance
        import llguidance.numpy
        self._llg, self._np = llguidance, llguidance.numpy
        # The HF tokenizers JSON is what llguidance's own HF adapter passes (llguidance.hf.from_tokenizer).
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=list(tokenizer.eos_token_ids))
        self.executor = llguidance.LLExecutor(num_threads=os.cpu_count())
        self._cache: dict[str, Any] = {}

    def compile(self, name: str, cached: bool):
        if cached and name in self._cache:
            return self._cache[name]
        kind, source = GRAMMARS[name]
        m = self._llg.LLMatcher
        text = {"json": lambda: m.grammar_from_json_schema(source), "regex": lambda: m.grammar_from_regex(source),
                "lark": lambda: m.grammar_from_lark(source)}[kind]()
        matcher = m(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise Unsupported(matcher.get_error())
        self._cache[name] = matcher
        return matcher

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: np.ndarray, row: int) -> None:
        self._np.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list, bitmask: np.ndarray) -> None:
        self._np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammarEngine:
    """xgrammar: a pushdown automaton with per-rule token-mask caches built at compile time; the compiler caches
    compiled grammars by source."""
    name = "xgrammar"
    package = "xgrammar"
    modules = ("xgrammar", "transformers")

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import transformers
        import xgrammar
        self._xg = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                       stop_token_ids=list(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count())
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=os.cpu_count())

    def compile(self, name: str, cached: bool):
        if not cached:
            self.compiler.clear_cache()
        kind, source = GRAMMARS[name]
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(json.dumps(source))
            if kind == "regex":
                return self.compiler.compile_regex(source)
            return self.compiler.compile_lark(source)
        except RuntimeError as e:
            raise Unsupported(str(e).splitlines()[0]) from e

    def new_matcher(self, compiled):
        return self._xg.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: np.ndarray, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class OutlinesCoreEngine:
    """outlines-core: regular languages only (JSON schemas become one regex); compiling builds the full
    token-level DFA index over the vocabulary, a step is a table lookup. One EOS id; no batched fill."""
    name = "outlines-core"
    package = "outlines-core"
    modules = ("outlines_core",)
    fill_batch = None

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import outlines_core
        self._oc = outlines_core
        special = tokenizer.special_token_ids
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes(tokenizer)):
            if i not in special:  # Vocabulary keeps the EOS apart, and no other special token may be generated
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, by_bytes)
        self._cache: dict[str, Any] = {}

    def compile(self, name: str, cached: bool):
        if cached and name in self._cache:
            return self._cache[name]
        kind, source = GRAMMARS[name]
        if kind == "lark":
            raise Unsupported("regular languages only: no context-free grammars")
        regex = self._oc.json_schema.build_regex_from_schema(json.dumps(source)) if kind == "json" else source
        try:
            index = self._oc.Index(regex, self.vocabulary)
        except ValueError as e:
            raise Unsupported(str(e).splitlines()[0]) from e
        self._cache[name] = index
        return index

    def new_matcher(self, compiled):
        return self._oc.Guide(compiled)

    def fill(self, matcher, bitmask: np.ndarray, row: int) -> None:
        matcher.write_mask_into(bitmask.ctypes.data + row * bitmask.strides[0], bitmask.shape[1], 4)

    def consume(self, matcher, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False


ENGINE_CLASSES = {c.name: c for c in (LLGuidanceEngine, XGrammarEngine, OutlinesCoreEngine)}


# ---------------------------------------------------------------------------------------------- the tokenizers
def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each token id's bytes (byte-level BPE vocabularies; added tokens as their UTF-8 text)."""
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise ValueError(f"token_bytes: only ByteLevel decoders are handled, this tokenizer's is {decoder.get('type')}")
    table = BYTE_LEVEL_ALPHABET
    added = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values()}
    out = [b""] * tokenizer.vocab_size
    for text, i in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        out[i] = text.encode() if text in added else bytes(table[c] for c in text)
    return out


def _stdlib_texts() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for path in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)):
        if "site-packages" not in path:
            try:
                with open(path, encoding="utf-8") as f:
                    texts.append(f.read())
            except (UnicodeDecodeError, OSError):
                pass
    return texts


def trained_bpe(vocab_size: int, workdir: str) -> str:
    """The test tokenizer's layout (models.synthetic.make_test_tokenizer: special tokens, two EOS ids) with a
    byte-level BPE of `vocab_size` trained on this Python's standard library sources (~31 MB; a minute on two
    cores, once): a realistic large vocabulary without a download, kept in `workdir`. Returns its directory."""
    from models.synthetic import make_test_tokenizer
    d = os.path.join(workdir, f"grammar-bpe{vocab_size // 1000}k")
    if not os.path.exists(os.path.join(d, "tokenizer.json")):
        os.makedirs(workdir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(d) + "-", dir=workdir)
        make_test_tokenizer(tmp, vocab_size, corpus=_stdlib_texts())
        try:
            os.rename(tmp, d)
        except OSError:  # built concurrently: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def tokenizer_dir(name: str, workdir: str) -> str:
    if name == "tiny":
        return os.path.join(_ROOT, "models", "tiny", "target")
    if name == "llama512":
        from models.synthetic import shared_small_llama
        return shared_small_llama()
    if name in ("bpe32k", "bpe128k"):
        return trained_bpe(32000 if name == "bpe32k" else 128000, workdir)
    if os.path.isdir(name):
        return name
    raise ValueError(f"--grammar_tokenizers: unknown tokenizer {name!r}; use {', '.join(TOKENIZERS)} or a directory")


def model_vocab_size(directory: str, tokenizer: Tokenizer) -> int:
    """The LM head's width (config.json's vocab_size, else the tokenizer's): the bitmask covers it."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, KeyError):
        return tokenizer.vocab_size


# ---------------------------------------------------------------------------------------------- the measurements
def mask_bits(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[V] of one int32 bitmask row: bit j of word w is token 32 w + j."""
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size].view(bool)


@dataclasses.dataclass
class Walker:
    """Chooses each sequence's next token among the allowed ones: mostly uniform (whitespace-only tokens avoided),
    increasingly often a token that closes something (quote, bracket, semicolon), and EOS half the time it is allowed,
    so outputs finish after tens to hundreds of tokens and the matcher then restarts."""
    closing: np.ndarray  # bool[V]: tokens holding a closing character, EOS excluded
    solid: np.ndarray  # bool[V]: neither whitespace-only nor EOS
    not_eos: np.ndarray  # bool[V]
    eos_ids: np.ndarray
    rng: np.random.Generator

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, pieces: list[bytes], vocab_size: int, seed: int) -> "Walker":
        closing = np.zeros(vocab_size, bool)
        blank = np.zeros(vocab_size, bool)
        for i, b in enumerate(pieces[:vocab_size]):
            closing[i] = any(c in b for c in b'"}]);')
            blank[i] = bool(b) and not b.strip()
        eos_ids = np.array([i for i in tokenizer.eos_token_ids if i < vocab_size], np.int64)
        not_eos = np.ones(vocab_size, bool)
        not_eos[eos_ids] = False
        return cls(closing & not_eos, ~blank & not_eos, not_eos, eos_ids, np.random.default_rng(seed))

    def choose(self, bits: np.ndarray, age: int) -> int | None:
        """A token whose bit is set in `bits` (mask_bits), or None: end the sequence here (EOS)."""
        eos_allowed = bool(bits[self.eos_ids].any())
        if eos_allowed and self.rng.random() < 0.5:
            return None
        if self.rng.random() < min(0.9, age / 48):
            candidates = np.flatnonzero(bits & self.closing)
            if len(candidates):
                return int(candidates[self.rng.integers(len(candidates))])
        candidates = np.flatnonzero(bits & self.solid)
        if not len(candidates):
            candidates = np.flatnonzero(bits & self.not_eos)
        if not len(candidates):
            if eos_allowed:
                return None
            raise RuntimeError("empty token mask")
        return int(candidates[self.rng.integers(len(candidates))])


def _percentile(a, q: float) -> float:
    return float(np.percentile(np.asarray(a, np.float64), q)) if len(a) else float("nan")


def measure_compile(engine, name: str, vocab_size: int, repeats: int) -> dict[str, float]:
    """Milliseconds from grammar source to the first mask, cold (nothing cached) and cached (the grammar compiled
    before), each the median of `repeats`; compile and first mask apart too."""
    bitmask = np.zeros((1, (vocab_size + 31) // 32), np.int32)
    out = {}
    for cached in (False, True):
        compile_s, first_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = engine.compile(name, cached)
            t1 = time.perf_counter()
            engine.fill(engine.new_matcher(compiled), bitmask, 0)
            t2 = time.perf_counter()
            compile_s.append(t1 - t0)
            first_s.append(t2 - t1)
        label = "cached" if cached else "cold"
        out[f"{label}_compile_ms"] = statistics.median(compile_s) * 1e3
        out[f"{label}_first_mask_ms"] = statistics.median(first_s) * 1e3
        out[f"{label}_ms"] = statistics.median(np.add(compile_s, first_s)) * 1e3
    return out


_NUMBER_TYPES = (int, float, decimal.Decimal)


def _violations(schema: dict, value, path: str = "$") -> list[str]:
    """Where `value` breaks `schema`, for the JSON-schema keywords SCHEMAS use (format: date only)."""
    errors = []
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} != const")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in enum")
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind in types and not isinstance(value, types[kind]):
        return errors + [f"{path}: not {kind}"]
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return errors + [f"{path}: not integer"]
    if kind == "number" and (isinstance(value, bool) or not isinstance(value, _NUMBER_TYPES)):
        return errors + [f"{path}: not number"]
    if kind in ("integer", "number"):
        for key, bad in (("minimum", lambda lim: value < lim), ("maximum", lambda lim: value > lim),
                         ("exclusiveMinimum", lambda lim: value <= lim),
                         ("exclusiveMaximum", lambda lim: value >= lim)):
            if key in schema and bad(schema[key]):
                errors.append(f"{path}: {value} breaks {key} {schema[key]}")
    if kind == "string":
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match the pattern")
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30):
            errors.append(f"{path}: length {len(value)} out of range")
        if schema.get("format") == "date" and not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", value):
            errors.append(f"{path}: {value!r} is not a date")
    if kind == "array":
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30):
            errors.append(f"{path}: {len(value)} items out of range")
        for i, item in enumerate(value):
            errors += _violations(schema.get("items", {}), item, f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        errors += [f"{path}: missing {k}" for k in schema.get("required", ()) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{path}: extra {k}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += _violations(props[k], v, f"{path}.{k}")
    return errors


def _json_number(text: str) -> decimal.Decimal | float:
    """A JSON number exactly, as a decimal (a float only past the decimal's exponent range)."""
    try:
        return decimal.Decimal(text)
    except decimal.InvalidOperation:
        return float(text)


def output_ok(name: str, text: bytes) -> bool:
    """Whether a finished output obeys its grammar (JSON numbers compared exactly, as decimals)."""
    kind, source = GRAMMARS[name]
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    if kind == "json":
        try:
            return not _violations(source, json.loads(decoded, parse_float=_json_number))
        except ValueError:
            return False
    return re.fullmatch(source if kind == "regex" else LARK_AS_REGEX, decoded) is not None


def measure_masks(engine, name: str, compiled, vocab_size: int, pieces: list[bytes], walker: Walker,
                  num_seqs: int, steps: int) -> dict[str, Any]:
    """Drives `num_seqs` matchers `steps` steps each with random valid continuations (a finished one restarts),
    timing every fill (serially into one [num_seqs, ceil(V/32)] int32 bitmask), the engine's batched fill of all
    of them and of the first 16, and every consume. Microseconds."""
    words = (vocab_size + 31) // 32
    few = min(16, num_seqs)
    serial = np.zeros((num_seqs, words), np.int32)
    batched = np.zeros((num_seqs, words), np.int32)
    batched_few = np.zeros((few, words), np.int32)
    matchers = [engine.new_matcher(compiled) for _ in range(num_seqs)]
    outputs: list[list[int]] = [[] for _ in range(num_seqs)]
    fill_us = np.zeros((steps, num_seqs))
    batch_us, batch_few_us, consume_us, restart_us = [], [], [], []
    finished = valid = rejected = mismatched = 0
    examples = []

    def fill_batches():
        t0 = time.perf_counter_ns()
        engine.fill_batch(matchers, batched)
        t1 = time.perf_counter_ns()
        engine.fill_batch(matchers[:few], batched_few)
        batch_us.append((t1 - t0) / 1e3)
        batch_few_us.append((time.perf_counter_ns() - t1) / 1e3)

    for step in range(steps):
        if engine.fill_batch is not None and step % 2:  # alternate the order: neither gets the warmer caches
            fill_batches()
        for i, m in enumerate(matchers):
            t0 = time.perf_counter_ns()
            engine.fill(m, serial, i)
            fill_us[step, i] = (time.perf_counter_ns() - t0) / 1e3
        if engine.fill_batch is not None:
            if not step % 2:
                fill_batches()
            mismatched += int(not np.array_equal(serial, batched)) + int(not np.array_equal(serial[:few], batched_few))
        for i in range(num_seqs):
            token = walker.choose(mask_bits(serial[i], vocab_size), len(outputs[i]))
            if token is not None:
                t0 = time.perf_counter_ns()
                ok = engine.consume(matchers[i], token)
                consume_us.append((time.perf_counter_ns() - t0) / 1e3)
                if ok:
                    outputs[i].append(token)
                    continue
                rejected += 1  # a token its own mask allowed: an engine bug
            else:
                finished += 1
                text = b"".join(pieces[t] for t in outputs[i])
                ok = output_ok(name, text)
                valid += ok
                if len(examples) < 2 or (not ok and len(examples) < 4):  # two outputs, then up to two invalid ones
                    examples.append(text.decode("utf-8", "replace")[:160])
            t0 = time.perf_counter_ns()
            matchers[i] = engine.new_matcher(compiled)
            restart_us.append((time.perf_counter_ns() - t0) / 1e3)
            outputs[i] = []
    flat = fill_us.ravel()
    serial_step = fill_us.sum(axis=1)
    serial_few = fill_us[:, :few].sum(axis=1)
    med = lambda a: _percentile(a, 50) if len(a) else float("nan")  # noqa: E731
    return {
        "mask_us_median": med(flat), "mask_us_mean": float(flat.mean()), "mask_us_p99": _percentile(flat, 99),
        "mask_us_max": float(flat.max()),
        "first_mask_us_median": med(fill_us[0]),
        "step_few_serial_us": med(serial_few), "step_all_serial_us": med(serial_step),
        "step_few_batched_us": med(batch_few_us), "step_all_batched_us": med(batch_us),
        "step_all_serial_us_p99": _percentile(serial_step, 99), "step_all_batched_us_p99": _percentile(batch_us, 99),
        "consume_us_median": med(consume_us), "consume_us_p99": _percentile(consume_us, 99),
        "new_matcher_us_median": med(restart_us),
        "finished": finished, "valid": valid, "rejected": rejected,
        "batched_mismatches": mismatched, "examples": examples, "num_seqs": num_seqs, "steps": steps,
    }


def releases_gil(fills: list[Callable[[], None]]) -> bool:
    """Whether a fill lets another Python thread run: a helper thread is made to wait for the GIL while this one
    holds it (switch interval 10 s, so only a release hands it over), then a fill runs; the helper counts if it got
    the GIL during the fill. A short fill can end before the helper wakes, so several states are tried: any fill
    that lets the helper in says yes (one that holds the GIL never can)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    wake, done = threading.Event(), threading.Event()
    got = [0]
    stop = [False]

    def helper():
        while True:
            wake.wait()
            wake.clear()
            if stop[0]:
                return
            got[0] += 1
            done.set()

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    released = False
    try:
        for fill_once in fills:
            time.sleep(0.001)  # the helper is parked in wake.wait()
            got[0] = 0
            wake.set()  # it wakes and waits for the GIL, which we keep until the fill
            deadline = time.perf_counter() + 0.002
            while time.perf_counter() < deadline:
                pass
            fill_once()
            during = got[0]
            done.wait()  # (sleeping on it releases the GIL: the helper finishes its round)
            done.clear()
            if during:
                released = True
                break
    finally:
        stop[0] = True
        wake.set()
        thread.join()
        sys.setswitchinterval(old)
    return released


def import_seconds(engine_name: str) -> float:
    """Seconds a fresh interpreter takes to import the engine (and what its adapter needs), beyond starting; NaN
    when it does not import."""
    def run(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        return time.perf_counter() - t0
    imports = "; ".join(f"import {m}" for m in ENGINE_CLASSES[engine_name].modules)
    try:
        with_engine = statistics.median(run(imports) for _ in range(3))
    except subprocess.CalledProcessError:
        return float("nan")
    return max(0.0, with_engine - statistics.median(run("pass") for _ in range(3)))


def _heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back (glibc's mallinfo2, all arenas and mmapped chunks: the Rust and
    C++ engines allocate through it); resident memory where that is missing."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def matcher_memory(engine_name: str, directory: str, name: str, prefix: list[int], count: int = 1000) -> float:
    """KiB of heap per matcher of grammar `name`, each fed `prefix` and asked for one mask (what a running request
    holds), measured in a fresh interpreter."""
    code = ("import sys, json; from serving.bench.grammar import _memory_child; "
            "print(_memory_child(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])))")
    done = subprocess.run([sys.executable, "-c", code, engine_name, directory, name, json.dumps(prefix), str(count)],
                          check=True, capture_output=True, text=True, cwd=_ROOT)
    return float(done.stdout.split()[-1])


def _memory_child(engine_name: str, directory: str, name: str, prefix: list[int], count: int) -> float:
    tokenizer = Tokenizer.from_pretrained(directory)
    vocab_size = model_vocab_size(directory, tokenizer)
    engine = ENGINE_CLASSES[engine_name](tokenizer, vocab_size)
    compiled = engine.compile(name, cached=True)
    bitmask = np.zeros((1, (vocab_size + 31) // 32), np.int32)

    def running():
        m = engine.new_matcher(compiled)
        for t in prefix:
            engine.consume(m, t)
        engine.fill(m, bitmask, 0)
        return m

    keep = [running() for _ in range(8)]  # shared state (lexer, caches) is built before measuring
    gc.collect()
    before = _heap_bytes()
    keep += [running() for _ in range(count)]
    return (_heap_bytes() - before) / count / 1024


def _probe_fills(engine, compiled, vocab_size: int, walker: Walker, count: int = 20) -> list[Callable[[], None]]:
    """Fills of `count` matchers walked 0, 3, 6, ... tokens into the grammar: states of varied mask widths."""
    fills = []
    for k in range(count):
        m, bitmask = engine.new_matcher(compiled), np.zeros((1, (vocab_size + 31) // 32), np.int32)
        for _ in range(3 * k):
            engine.fill(m, bitmask, 0)
            token = walker.choose(mask_bits(bitmask[0], vocab_size), 0)
            if token is None or not engine.consume(m, token):
                break
        fills.append(lambda m=m, bitmask=bitmask: engine.fill(m, bitmask, 0))
    return fills


def _sample_prefix(engine, compiled, vocab_size: int, walker: Walker, length: int = 32) -> list[int]:
    bitmask = np.zeros((1, (vocab_size + 31) // 32), np.int32)
    m, prefix = engine.new_matcher(compiled), []
    while len(prefix) < length:
        engine.fill(m, bitmask, 0)
        token = walker.choose(mask_bits(bitmask[0], vocab_size), 0)
        if token is None or not engine.consume(m, token):
            break
        prefix.append(token)
    return prefix


def measure_engine(engine_name: str, tokenizer: Tokenizer, directory: str, pieces: list[bytes], num_seqs: int,
                   steps: int, repeats: int, mask_repeats: int, seed: int) -> dict[str, Any]:
    """Everything about one engine on one tokenizer (see the module notes)."""
    vocab_size = model_vocab_size(directory, tokenizer)
    result: dict[str, Any] = {"engine": engine_name, "version": _version(ENGINE_CLASSES[engine_name].package),
                              "grammars": {}}
    engine_class = ENGINE_CLASSES[engine_name]
    try:
        for module in engine_class.modules:
            importlib.import_module(module)
    except ImportError as e:
        result["error"] = f"import failed: {e}"
        return result
    t0 = time.perf_counter()
    engine = engine_class(tokenizer, vocab_size)
    result["tokenizer_info_ms"] = (time.perf_counter() - t0) * 1e3
    probe_fills = []
    for name in GRAMMARS:
        entry: dict[str, Any] = {}
        result["grammars"][name] = entry
        try:
            entry.update(measure_compile(engine, name, vocab_size, repeats))
        except Unsupported as e:
            entry["unsupported"] = str(e)[:200]
            continue
        compiled = engine.compile(name, cached=True)
        runs = [measure_masks(engine, name, compiled, vocab_size, pieces,
                              Walker.for_tokenizer(tokenizer, pieces, vocab_size, seed), num_seqs, steps)
                for _ in range(mask_repeats)]
        entry.update({k: statistics.median(r[k] for r in runs) if isinstance(v, float) else v
                      for k, v in runs[0].items()})
        walker = Walker.for_tokenizer(tokenizer, pieces, vocab_size, seed)
        if name in ("nested", "pattern", "regex"):
            probe_fills += _probe_fills(engine, compiled, vocab_size, walker)
        if name == "nested":
            prefix = _sample_prefix(engine, compiled, vocab_size, walker)
            entry["matcher_kib"] = matcher_memory(engine_name, directory, name, prefix)
            if engine_name == "xgrammar":
                entry["compiled_kib"] = compiled.memory_size_bytes / 1024
    result["gil_released"] = releases_gil(probe_fills) if probe_fills else None
    return result


def apply_token_bitmask(logits, bitmask):
    """Pure, jit-able: logits [S, V] with every token whose bit is clear in the int32 bitmask [S, ceil(V/32)] set to
    -inf (bit j of word w is token 32 w + j): the unpack by shifts the sampling program would run."""
    import jax.numpy as jnp
    num_slots, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return jnp.where(bits.reshape(num_slots, -1)[:, :vocab] != 0, logits, -jnp.inf)


def measure_apply(vocab_size: int, num_seqs: int, repeats: int = 20) -> dict[str, float]:
    """Microseconds, on JAX's default backend, of the sampler's greedy argmax over float32 logits [num_seqs, V] with
    and without `apply_token_bitmask` in front, and of copying the numpy bitmask to the device (median of
    `repeats`)."""
    import jax
    import jax.numpy as jnp
    from serving.bench.harness import median_time
    from serving.core.sampling import greedy
    words = (vocab_size + 31) // 32
    host_mask = np.random.default_rng(0).integers(-2 ** 31, 2 ** 31, (num_seqs, words)).astype(np.int32)
    logits = jax.random.normal(jax.random.key(0), (num_seqs, vocab_size), jnp.float32)
    bitmask = jax.device_put(host_mask)
    masked = jax.jit(lambda x, b: greedy(apply_token_bitmask(x, b)))
    plain = jax.jit(greedy)
    return {
        "backend": jax.default_backend(),
        "argmax_us": median_time(lambda: plain(logits).block_until_ready(), repeats) * 1e6,
        "masked_argmax_us": median_time(lambda: masked(logits, bitmask).block_until_ready(), repeats) * 1e6,
        "copy_us": median_time(lambda: jax.device_put(host_mask).block_until_ready(), repeats) * 1e6,
        "bitmask_bytes": host_mask.nbytes,
    }


# ---------------------------------------------------------------------------------------------- the report
def _pair(entry: dict, a: str, b: str) -> str:
    if "unsupported" in entry:
        return "unsupported"
    return f"{_fmt(entry[a])} / {_fmt(entry[b])}"


def _fmt(x: float) -> str:
    if x != x:
        return "-"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2g}" if abs(x) >= 0.01 else f"{x:.1g}"


def _pooled(result: dict, key: str, names=COMMON) -> float:
    values = [result["grammars"][n][key] for n in names if key in result["grammars"].get(n, {})]
    return statistics.median(values) if values else float("nan")


def _notes(result: dict) -> str:
    g = result["grammars"]
    notes = []
    if result.get("import_s", float("nan")) == result.get("import_s"):  # (not NaN)
        notes.append(f"import {result['import_s']:.1f} s")
    if "tokenizer_info_ms" in result:
        notes.append(f"tokenizer info {_fmt(result['tokenizer_info_ms'])} ms")
    bad = [f"{n} {e['valid']}/{e['finished']} valid" for n, e in g.items() if e.get("valid", 0) < e.get("finished", 0)]
    notes += bad
    unsupported = [n for n, e in g.items() if "unsupported" in e]
    if unsupported:
        notes.append("no " + ", ".join(unsupported))
    if any(e.get("rejected") for e in g.values()):
        notes.append("rejected own-mask tokens")
    if any(e.get("batched_mismatches") for e in g.values()):
        notes.append("batched != serial masks")
    if "matcher_kib" in g.get("nested", {}):
        notes.append(f"{_fmt(g['nested']['matcher_kib'])} KiB/matcher")
    return "; ".join(notes)


def report(tokenizer_label: str, vocab_size: int, results: list[dict]) -> None:
    many = _SEQS.value
    few = min(16, many)
    kinds = list(GRAMMARS)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["engine"], r["version"], *["-"] * (len(kinds) + 5), r["error"]])
            continue
        g = r["grammars"]
        gil = {True: "yes", False: "no", None: "-"}[r.get("gil_released")]
        rows.append([r["engine"], r["version"], *[_pair(g[k], "cold_ms", "cached_ms") for k in kinds],
                     f"{_fmt(_pooled(r, 'mask_us_median'))} / {_fmt(_pooled(r, 'mask_us_mean'))} / "
                     f"{_fmt(_pooled(r, 'mask_us_p99'))}",
                     f"{_fmt(_pooled(r, 'step_few_serial_us'))} / {_fmt(_pooled(r, 'step_few_batched_us'))}",
                     f"{_fmt(_pooled(r, 'step_all_serial_us'))} / {_fmt(_pooled(r, 'step_all_batched_us'))}",
                     f"{_fmt(_pooled(r, 'consume_us_median'))}", gil, _notes(r)])
    table(f"Grammar engines, tokenizer {tokenizer_label} (mask width {vocab_size} = {(vocab_size + 31) // 32} int32 "
          f"words); compile: ms to the first mask, cold / cached; mask and step: median over the grammars "
          f"{', '.join(COMMON)} of each one's median",
          ["engine", "version", *[f"{k} ms" for k in kinds], "mask us/seq-step median / mean / p99",
           f"{few}-seq step us serial / batched", f"{many}-seq step us serial / batched", "consume us",
           "GIL released", "notes"], rows)
    detail = []
    for r in results:
        for name, e in r.get("grammars", {}).items():
            if "mask_us_median" not in e:
                continue
            detail.append([r["engine"], name, _fmt(e["cold_compile_ms"]), _fmt(e["cold_first_mask_ms"]),
                           _fmt(e["cached_ms"]), _fmt(e["mask_us_median"]), _fmt(e["mask_us_p99"]),
                           f"{_fmt(e['step_few_serial_us'])} / {_fmt(e['step_few_batched_us'])}",
                           f"{_fmt(e['step_all_serial_us'])} / {_fmt(e['step_all_batched_us'])}",
                           _fmt(e["consume_us_median"]), _fmt(e["new_matcher_us_median"]),
                           f"{e['valid']}/{e['finished']}"])
    table(f"Per grammar, tokenizer {tokenizer_label}: {_SEQS.value} sequences x {_STEPS.value} steps",
          ["engine", "grammar", "cold compile ms", "cold first mask ms", "cached to first mask ms", "mask us median",
           "p99", f"{few}-seq step us serial / batched", f"{many}-seq step us serial / batched", "consume us",
           "new matcher us", "finished outputs valid"], detail)


def report_apply(tokenizer_label: str, vocab_size: int, rows: list[dict]) -> None:
    table(f"Applying the bitmask on the device ({rows[0]['backend']}), tokenizer {tokenizer_label}: argmax over "
          f"float32 logits [S, {vocab_size}] with and without the unpack; the bitmask's copy to the device",
          ["S", "bitmask KiB", "argmax us", "masked argmax us", "added us", "copy us"],
          [[r["num_seqs"], r["bitmask_bytes"] / 1024, r["argmax_us"], r["masked_argmax_us"],
            r["masked_argmax_us"] - r["argmax_us"], r["copy_us"]] for r in rows])


def main() -> None:
    unknown = [e for e in _ENGINES.value if e not in ENGINE_CLASSES]
    if unknown:
        raise ValueError(f"--grammar_engines: unknown {unknown}; valid: {', '.join(ENGINES)}")
    everything = {}
    imports = {e: import_seconds(e) for e in _ENGINES.value}
    for label in _TOKENIZERS.value:
        directory = tokenizer_dir(label, _WORKDIR.value)
        tokenizer = Tokenizer.from_pretrained(directory)
        pieces = token_bytes(tokenizer)
        vocab_size = model_vocab_size(directory, tokenizer)
        results = [measure_engine(e, tokenizer, directory, pieces, _SEQS.value, _STEPS.value, _REPEATS.value,
                                  _MASK_REPEATS.value, _SEED.value) for e in _ENGINES.value]
        for r in results:
            r["import_s"] = imports[r["engine"]]
        report(label, vocab_size, results)
        apply = [{"num_seqs": n, **measure_apply(vocab_size, n)} for n in (16, 64)]
        report_apply(label, vocab_size, apply)
        everything[label] = {"vocab_size": vocab_size, "results": results, "apply": apply}
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(everything, f, indent=1)
