"""Hypothesis strategies for fuzzing meshserve's front ends, and judges of what each request's answer must be:
meshserve.v1 GenerateRequests over every field (`generate_requests`, judged by `generate_faults`), OpenAI HTTP bodies
(`http_requests`, judged by `http_faults`), requests protobuf cannot decode (`request_with_bad_utf8`,
`CORRUPT_REQUESTS`) and raw bytes for the ports (`garbage`). The judges work from the documented ranges
(meshserve.proto, the OpenAI parameters), not by calling serving.params, so a check that drifts from them shows up
as a disagreement."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid

from hypothesis import strategies as st

from serving.wire import meshserve_pb2 as pb

VOCAB = 512  # models.synthetic.shared_small_llama()
CONTEXT = 512
MAX_REQUEST_BYTES = 1 << 20  # the servers' default --max_request_bytes
TRANSPORT_SLACK_BYTES = 64 << 10  # serving.transport: gRPC core reads no message past the limit + this
# Grammars over the bounds of serving/core/structured.py (refused before anything parses or compiles them): a JSON
# schema nested past Python's recursion limit (once a RecursionError, a 500), a valid Lark grammar of ~200K characters.
DEEP_SCHEMA = '{"type": "array", "items": ' * 1200 + "{}" + "}" * 1200
HUGE_GRAMMAR = "start: " + " | ".join(f'"w{i}"' for i in range(20000))
DEFAULT_MAX_TOKENS = 16
MAX_N, MAX_LOGPROBS, MAX_LOGIT_BIAS, MAX_REQUEST_ID = 16, 20, 300, 256
TEMPLATE_ROLES = ("system", "user", "assistant", "tool")  # the test model's chat template knows these, no others
INT32 = (-(2 ** 31), 2 ** 31 - 1)
INT64 = (-(2 ** 63), 2 ** 63 - 1)
MODEL = "tiny-llama"

_FIELD = re.compile(r"[A-Za-z_][\w.\[\]]*")


def field_of(details: str) -> str:
    """The field an error message starts with, indices dropped: 'chat.messages[2].role: ...' -> chat.messages.role."""
    m = _FIELD.match(details)
    return re.sub(r"\[[^\]]*\]", "", m.group(0)).rstrip(".") if m else ""


def param_of(param: str | None) -> str | None:
    """An OpenAI error's top-level parameter: 'messages[0].role' -> messages, 'logit_bias[5]' -> logit_bias."""
    return None if param is None else re.split(r"[.\[]", param, maxsplit=1)[0]


# ---------------------------------------------------------------------------------------------------- numbers
def _finite_in(x, lo=None, hi=None, lo_open=False) -> bool:
    if not math.isfinite(x):
        return False
    if lo is not None and (x <= lo if lo_open else x < lo):
        return False
    return hi is None or x <= hi


def floats(*edges: float):
    """Any double (NaN, infinities, subnormals) or one of `edges` (a range's bounds and their neighbours)."""
    return st.one_of(st.sampled_from(edges + (0.0, -0.0, math.nan, math.inf, -math.inf, 5e-324, 1e308)),
                     st.floats(allow_nan=True, allow_infinity=True))


def ints(lo: int, hi: int, *edges: int):
    """Integers of a field's width [lo, hi], mostly small or one of `edges`."""
    return st.one_of(st.sampled_from(edges + (lo, hi, -1, 0)), st.integers(-3, 3), st.integers(lo, hi))


token_ids_in_vocab = st.integers(0, VOCAB - 1)
token_ids_any = st.one_of(token_ids_in_vocab, st.sampled_from([-1, VOCAB, VOCAB + 1, *INT64]),
                          st.integers(*INT64))


# ---------------------------------------------------------------------------------------------------- meshserve.v1
@dataclasses.dataclass
class GrpcCase:
    request: pb.GenerateRequest
    timeout: float  # the call's deadline, from now: PAST has passed by the time the server sees it

    def __repr__(self) -> str:  # hypothesis prints the falsifying example: keep a huge prompt readable
        text = repr(self.request)
        return f"GrpcCase(timeout={self.timeout}, request=<{len(text)} chars> {text[:2000]})"


PAST, SHORT, LONG = 1e-4, 0.05, 60.0


def words(k: int) -> str:
    """k words of the tokenizer's corpus: about k tokens."""
    return " ".join(["hello", "world", "the", "quick", "fox"][i % 5] for i in range(k))


class Faults:
    """Which fields of a request a draw gets wrong: none (a request that must be served), one, or any of them.
    Without this nearly every request drawn field by field would be wrong somewhere, and few would be served."""

    def __init__(self, draw, names):
        self.draw = draw
        self.mode = draw(st.sampled_from(["valid", "valid", "one wrong", "one wrong", "anything"]))
        self.wrong = draw(st.sampled_from(names)) if self.mode == "one wrong" else None

    def __call__(self, name: str, valid, wrong):
        """A value of field `name`: from `valid`, or (when this field may be wrong) from `wrong` too."""
        if self.mode == "anything":
            return self.draw(st.one_of(valid, wrong))
        return self.draw(wrong if name == self.wrong else valid)


def _opt(strategy):
    return st.one_of(st.none(), strategy)  # None: the field is left unset


# meshserve.v1 prompts as (oneof field, value).
grpc_prompts_valid = st.one_of(
    st.text(min_size=1, max_size=40).map(lambda t: ("text", t)),
    st.integers(1, 200).map(lambda k: ("text", words(k))),
    st.lists(token_ids_in_vocab, min_size=1, max_size=20).map(lambda ids: ("token_ids", ids)),
    st.integers(100, 450).map(lambda k: ("token_ids", [7] * k)),
    st.tuples(st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(TEMPLATE_ROLES),
                                 content=st.one_of(st.text(max_size=30), st.integers(0, 60).map(words))),
                       min_size=1, max_size=3), _opt(st.booleans())).map(lambda c: ("chat", c)),
)
grpc_prompts_wrong = st.one_of(
    st.just(("none", None)),
    st.one_of(st.just(""), st.integers(480, 700).map(words),
              st.integers(0, 4000).map(lambda k: "y" * (MAX_REQUEST_BYTES + 1000 + k)),
              # past the transport's limit: refused by gRPC core before it is decoded (RESOURCE_EXHAUSTED)
              st.integers(0, 1000).map(lambda k: "z" * (MAX_REQUEST_BYTES + TRANSPORT_SLACK_BYTES + k))
              ).map(lambda t: ("text", t)),
    st.one_of(st.just([]), st.lists(token_ids_any, min_size=1, max_size=8),
              st.integers(500, 560).map(lambda k: [7] * k),
              st.just([300] * (MAX_REQUEST_BYTES // 2 + 1000))).map(lambda ids: ("token_ids", ids)),
    st.tuples(st.lists(st.builds(pb.ChatMessage, role=st.one_of(
        st.sampled_from(TEMPLATE_ROLES + ("", "developer", "robot", "User")), st.text(max_size=6)),
        content=st.one_of(st.text(max_size=30), st.integers(0, 700).map(words))), max_size=4),
        _opt(st.booleans())).map(lambda c: ("chat", c)),
)
# SamplingParameters: field -> (valid values, wrong values); None leaves the field unset. Valid max_tokens are small
# (the fuzzer is not a benchmark); 512 and up never fit a prompt in the context.
GRPC_SAMPLING = {
    "max_tokens": (_opt(st.integers(1, 4)), st.sampled_from([0, -1, 512, 513, *INT32])),
    "min_tokens": (_opt(st.integers(0, 1)), st.sampled_from([-1, 17, 100, *INT32])),
    "temperature": (_opt(st.floats(0.0, 2.0)), floats(-0.1, -5e-324)),
    "top_k": (_opt(st.one_of(st.integers(-1, 20), st.sampled_from([VOCAB, INT32[1]]))), ints(INT32[0], -2)),
    "top_p": (_opt(st.floats(0.0, 1.0, exclude_min=True)), floats(1.0000001, -0.5)),
    "min_p": (_opt(st.floats(0.0, 1.0)), floats(1.0000001, -0.1)),
    "repetition_penalty": (_opt(st.floats(0.01, 10.0)), floats(-1.0)),
    "presence_penalty": (_opt(st.floats(-2.0, 2.0)), floats(2.0000001, -2.0000001)),
    "frequency_penalty": (_opt(st.floats(-2.0, 2.0)), floats(2.0000001, -2.0000001)),
    "seed": (_opt(st.integers(*INT64)), st.sampled_from(INT64)),  # every int64 is a seed
    "stop": (st.lists(st.text(min_size=1, max_size=6), max_size=2),
             st.lists(st.one_of(st.text(max_size=6), st.just("z" * 5000)), min_size=1, max_size=3)),
    "stop_token_ids": (st.lists(token_ids_in_vocab, max_size=3), st.lists(token_ids_any, min_size=1, max_size=4)),
    "include_stop_str_in_output": (_opt(st.booleans()), st.booleans()),
    "ignore_eos": (_opt(st.booleans()), st.booleans()),
    "logprobs": (_opt(st.integers(0, MAX_LOGPROBS)), ints(*INT32, MAX_LOGPROBS + 1)),
    "skip_special_tokens": (_opt(st.booleans()), st.booleans()),
    "spaces_between_special_tokens": (_opt(st.booleans()), st.booleans()),
    "n": (_opt(st.one_of(st.integers(1, 3), st.just(MAX_N))), st.sampled_from([0, MAX_N + 1, -1, *INT32])),
    "logit_bias": (st.dictionaries(token_ids_in_vocab, st.floats(-100.0, 100.0), max_size=4), st.one_of(
        st.dictionaries(token_ids_any, floats(100.0, -100.0, 100.5, -100.5, 3.0), min_size=1, max_size=4),
        st.just({t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}))),  # one entry too many
}


@st.composite
def generate_requests(draw) -> GrpcCase:
    """A GenerateRequest with its fields drawn in or out of their ranges, and the deadline to send it with."""
    pick = Faults(draw, ["request_id", "prompt", "priority", "structured", *GRPC_SAMPLING])
    req = pb.GenerateRequest()
    unique = uuid.uuid4().hex  # ids of requests that run are unique: ALREADY_EXISTS is not what is tested here
    req.request_id = pick("request_id", st.sampled_from(["", unique, unique.ljust(MAX_REQUEST_ID, "r")]) | st.text(
        max_size=8).map(lambda t: t + unique), st.integers(MAX_REQUEST_ID + 1, 5000).map(lambda k: "r" * k))
    which, prompt = pick("prompt", grpc_prompts_valid, grpc_prompts_wrong)
    if which == "text":
        req.text = prompt
    elif which == "token_ids":
        req.token_ids.SetInParent()  # set, even if empty
        req.token_ids.ids.extend(prompt)
    elif which == "chat":
        messages, add_generation_prompt = prompt
        req.chat.SetInParent()
        req.chat.messages.extend(messages)
        if add_generation_prompt is not None:
            req.chat.add_generation_prompt = add_generation_prompt
    if draw(st.booleans()) or pick.wrong in GRPC_SAMPLING:
        sp = req.sampling
        sp.SetInParent()
        for name, (valid, wrong) in GRPC_SAMPLING.items():
            value = pick(name, valid, wrong)
            if isinstance(value, dict):
                getattr(sp, name).update(value)
            elif isinstance(value, list):
                getattr(sp, name).extend(value)
            elif value is not None:
                setattr(sp, name, value)
    # Structured outputs: only wrong ones are drawn (a valid grammar refuses ignore_eos and min_tokens, which the
    # other draws set freely): no kind set, and grammars that do not compile.
    structured = pick("structured", st.none(), st.sampled_from(
        [("empty", None), ("regex", "a(("), ("json_schema", "{"), ("json_schema", '{"type": 5}'),
         ("grammar", "start: nowhere"), ("choice", []), ("json_schema", DEEP_SCHEMA), ("grammar", HUGE_GRAMMAR),
         ("choice", ["c" * 1000] * 200)]))
    if structured is not None:
        kind, value = structured
        req.sampling.structured.SetInParent()
        if kind == "choice":
            req.sampling.structured.choice.SetInParent()
        elif kind != "empty":
            setattr(req.sampling.structured, kind, value)
    # Priority is an open enum: any int32 arrives as that number.
    req.priority = pick("priority", st.sampled_from([0, 1]), ints(*INT32, 2))
    req.tenant = draw(st.text(max_size=12))
    if draw(st.booleans()):
        req.add_special_tokens = draw(st.booleans())
    return GrpcCase(req, draw(st.sampled_from([LONG, LONG, LONG, SHORT, PAST])))


def generate_faults(req: pb.GenerateRequest, tokenizer) -> set[str]:
    """The fields of `req` that are wrong, as a refusal names them (indices dropped); empty if it must be served."""
    which = req.WhichOneof("prompt")
    prompt_field = {"text": "text", "token_ids": "token_ids", "chat": "chat.messages", None: "prompt"}[which]
    if req.ByteSize() > MAX_REQUEST_BYTES:  # checked first: nothing else is looked at
        return {prompt_field if which else "request"}
    bad = set()
    if len(req.request_id) > MAX_REQUEST_ID:
        bad.add("request_id")
    if req.priority not in (pb.PRIORITY_INTERACTIVE, pb.PRIORITY_BATCH):
        bad.add("priority")
    sp = req.sampling
    has = sp.HasField

    def check(name: str, ok: bool) -> None:
        if not ok:
            bad.add(f"sampling.{name}")
    max_tokens = sp.max_tokens if has("max_tokens") else DEFAULT_MAX_TOKENS
    check("max_tokens", max_tokens >= 1)
    check("min_tokens", 0 <= sp.min_tokens <= max(max_tokens, 0))
    check("temperature", not has("temperature") or _finite_in(sp.temperature, 0.0))
    check("top_k", sp.top_k >= -1)
    check("top_p", not has("top_p") or _finite_in(sp.top_p, 0.0, 1.0, lo_open=True))
    check("min_p", _finite_in(sp.min_p, 0.0, 1.0))
    check("repetition_penalty", not has("repetition_penalty") or _finite_in(sp.repetition_penalty, 0.0, lo_open=True))
    check("presence_penalty", _finite_in(sp.presence_penalty, -2.0, 2.0))
    check("frequency_penalty", _finite_in(sp.frequency_penalty, -2.0, 2.0))
    check("stop", all(sp.stop))
    check("stop_token_ids", all(0 <= t < VOCAB for t in sp.stop_token_ids))
    check("logprobs", not has("logprobs") or 0 <= sp.logprobs <= MAX_LOGPROBS)
    check("n", not has("n") or 1 <= sp.n <= MAX_N)
    check("logit_bias", len(sp.logit_bias) <= MAX_LOGIT_BIAS and all(
        0 <= t < VOCAB and _finite_in(b, -100.0, 100.0) for t, b in sp.logit_bias.items()))
    if has("structured"):  # every drawn one is wrong (see generate_requests); so are these beside any grammar
        kind = sp.structured.WhichOneof("kind")
        bad.update({"sampling.structured", f"sampling.structured.{kind}"})
        check("ignore_eos", not sp.ignore_eos)
        check("min_tokens", sp.min_tokens == 0)

    ids = None
    if which is None:
        bad.add("prompt")
    elif which == "text":
        if not req.text:
            bad.add("text")
        else:
            add = req.add_special_tokens if req.HasField("add_special_tokens") else True
            ids = tokenizer.encode(req.text, add_special_tokens=add)
    elif which == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids or not all(0 <= t < VOCAB for t in ids):
            bad.add("token_ids")
            ids = None
    else:
        messages = req.chat.messages
        if not messages:
            bad.add("chat.messages")
        elif not all(m.role in TEMPLATE_ROLES for m in messages):
            bad.update({"chat.messages", "chat.messages.role"})  # the role, or the conversation, is named
        else:
            add = req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else True
            ids = tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages],
                                        add_generation_prompt=add)
    if ids is not None:
        if not ids or len(ids) >= CONTEXT:
            bad.add(prompt_field)
        elif len(ids) + max_tokens > CONTEXT:
            bad.add("sampling.max_tokens")
    return bad


# Strings of a request that the servers read, and bytes that are not UTF-8 (protobuf requires it of string fields).
STRING_FIELDS = ("text", "request_id", "tenant", "sampling.stop", "chat.messages.role", "chat.messages.content")
BAD_UTF8 = (b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"ab\x80")


# Bytes that are no GenerateRequest at all: a length past the end, a bad wire type, a cut-short varint.
CORRUPT_REQUESTS = (b"\x12\xff\xff\xff\xff\x0f", b"\x12\x05ab", b"\x17garbage", b"\x08\xff\xff", b"\xff" * 16)


def request_with_bad_utf8(field: str, bad: bytes) -> bytes:
    """A serialized GenerateRequest, otherwise valid, whose string `field` holds the bytes `bad`."""
    marker = "~" * len(bad)  # same length: the length prefixes stay right
    req = pb.GenerateRequest(text="hello")
    req.sampling.max_tokens = 2
    if field == "text":
        req.text = marker
    elif field == "request_id":
        req.request_id = marker
    elif field == "tenant":
        req.tenant = marker
    elif field == "sampling.stop":
        req.sampling.stop.append(marker)
    else:
        m = req.chat.messages.add(role="user", content="hi")
        setattr(m, field.rsplit(".", 1)[1], marker)
    raw = req.SerializeToString()
    if raw.count(marker.encode()) != 1:
        raise ValueError(f"the marker {marker!r} is not unique in {raw!r}")
    return raw.replace(marker.encode(), bad)


# ---------------------------------------------------------------------------------------------------- OpenAI HTTP
class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()  # a field left out of the body


@dataclasses.dataclass
class HttpCase:
    """A POST to the HTTP API. `bad`: top-level parameters that are wrong (the answer must be an error naming one);
    `maybe`: parameters an error may name although the judge cannot tell (a template variable the template may choke
    on). `http_faults` completes `bad` with what needs the prompt's token count."""
    path: str
    body: dict
    encoding: str  # json | text/plain | no content type | bad utf-8 | truncated | not an object
    bad: set[str]
    maybe: set[str] = dataclasses.field(default_factory=set)
    facts: dict = dataclasses.field(default_factory=dict, repr=False)  # the drawn values, ABSENT included

    @classmethod
    def of(cls, path: str, body: dict, bad: set[str], encoding: str = "json") -> "HttpCase":
        """A hand-written case (a regression example): every parameter in `body` drawn as it is."""
        return cls(path, body, encoding, set(bad), facts=dict(body))

    def encoded(self) -> tuple[bytes, dict]:
        raw = json.dumps(self.body).encode()  # NaN and Infinity as Python writes them
        headers = {"Content-Type": "application/json"}
        if self.encoding == "text/plain":
            headers["Content-Type"] = "text/plain"
        elif self.encoding == "no content type":
            headers = {}
        elif self.encoding == "bad utf-8":
            raw = raw[:1] + b'"\xff\xfe": 1, ' + raw[1:]  # a key that is not UTF-8
        elif self.encoding == "truncated":
            raw = raw[: len(raw) // 2]
        elif self.encoding == "not an object":
            raw = json.dumps([self.body]).encode()
        return raw, headers

    @property
    def is_object(self) -> bool:
        return self.encoding in ("json", "text/plain", "no content type")

    def value(self, name: str):
        """A drawn field's value; None when left out."""
        v = self.facts.get(name, ABSENT)
        return None if v is ABSENT else v

    def __repr__(self) -> str:  # hypothesis prints the falsifying example: keep a huge prompt readable
        text = repr(self.body)
        return (f"HttpCase({self.path!r}, {self.encoding!r}, bad={sorted(self.bad)}, maybe={sorted(self.maybe)}, "
                f"body=<{len(text)} chars> {text[:2000]})")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:  # what a strict pydantic float takes
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Values of the wrong JSON type for most fields, and integers out of most ranges (and of meshserve.v1's widths).
wrong_types = st.sampled_from(["x", "1", [], {}, [1], {"a": 1}, 1.5, True])
big_ints = st.sampled_from([0, -1, CONTEXT, 2 ** 31, 2 ** 63, 10 ** 30, -(10 ** 30)])
json_floats = floats(0.0, 0.5, 1.0, 2.0, -0.1, 100.0, -100.0, 100.5)
absent = st.just(ABSENT)
bools_valid = st.sampled_from([ABSENT, None, True, False])
bools_wrong = st.sampled_from([1, 0, "true"])  # not booleans (strict)
# field -> (lowest, highest, lowest excluded), and the valid values drawn.
REAL_RANGES = {"temperature": (0.0, None, False, st.floats(0.0, 2.0)),
               "top_p": (0.0, 1.0, True, st.floats(0.0, 1.0, exclude_min=True)),
               "min_p": (0.0, 1.0, False, st.floats(0.0, 1.0)),
               "presence_penalty": (-2.0, 2.0, False, st.floats(-2.0, 2.0)),
               "frequency_penalty": (-2.0, 2.0, False, st.floats(-2.0, 2.0)),
               "repetition_penalty": (0.0, None, True, st.floats(0.01, 10.0))}

completion_prompts_valid = st.one_of(
    st.text(min_size=1, max_size=30),
    st.integers(1, 150).map(words),
    st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
    st.lists(token_ids_in_vocab, min_size=1, max_size=12),
    st.lists(st.lists(token_ids_in_vocab, min_size=1, max_size=5), min_size=1, max_size=3),
)
completion_prompts_wrong = st.one_of(
    st.sampled_from(["", [], [""], [[]], [[1], []]]),
    st.integers(480, 700).map(words),
    st.lists(token_ids_any, min_size=1, max_size=4),
    st.integers(500, 560).map(lambda k: [9] * k),
    st.integers(0, 1000).map(lambda k: "q" * (MAX_REQUEST_BYTES + k)),  # over --max_request_bytes
    st.sampled_from([5, True, None, {"a": 1}, [1, "a"], [[1], "a"], [1.5], [[True]]]),
)
content_parts_valid = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text"]),
                                                     "text": st.text(max_size=8)}), max_size=2)
content_parts_any = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "image_url"])},
                                                   optional={"text": st.one_of(st.text(max_size=8), st.just(None))}),
                             max_size=2)
messages_valid = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(TEMPLATE_ROLES)},
    optional={"content": st.one_of(st.text(max_size=20), st.integers(0, 60).map(words), st.just(None),
                                   content_parts_valid), "name": st.text(max_size=4)}), min_size=1, max_size=3)
messages_wrong = st.one_of(
    st.lists(st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(TEMPLATE_ROLES + ("", "developer", "robot")), st.sampled_from([5, None]))},
        optional={"content": st.one_of(st.text(max_size=20), st.integers(0, 700).map(words), st.just(None),
                                       content_parts_any, st.sampled_from([5, [5], "m" * (MAX_REQUEST_BYTES + 10)])),
                  "name": st.text(max_size=4)}), max_size=3),
    st.sampled_from([ABSENT, None, 5, "hi"]))
RESERVED_TEMPLATE_KWARGS = {"chat_template", "add_generation_prompt", "messages", "field", "tokenizer", "self"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _rendered_messages(messages) -> list | None:
    """The messages as the server hands them to the chat template; None if they are wrong."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in TEMPLATE_ROLES:
            return None
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p["type"] in ("text", "input_text") and isinstance(p.get("text"), str)
                       for p in content):
                return None
            content = "\n".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            return None
        out.append({"role": role, **({"content": content} if content is not None else {}),
                    **({"name": m["name"]} if "name" in m else {})})
    return out


PATH_FIELDS = {
    "/detokenize": ["tokens"],
    "/tokenize": ["which", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"],
}
_SHARED = ["model", "max_tokens", *REAL_RANGES, "top_k", "seed", "stop", "stop_token_ids", "n", "logit_bias",
           "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "stream", "min_tokens", "stream_options",
           "user", "priority"]
PATH_FIELDS["/v1/completions"] = [*_SHARED, "prompt", "echo", "add_special_tokens", "logprobs", "best_of"]
PATH_FIELDS["/v1/chat/completions"] = [*_SHARED, "max_completion_tokens", "messages", "logprobs", "top_logprobs",
                                       "tools", "tool_choice", "response_format", "add_generation_prompt",
                                       "chat_template_kwargs"]


@st.composite
def http_requests(draw) -> HttpCase:
    """A POST to /v1/completions, /v1/chat/completions, /tokenize or /detokenize with its parameters drawn in or out
    of range and type; the faults that need no token count are judged here, the rest by `http_faults`."""
    path = draw(st.sampled_from(list(PATH_FIELDS)))
    pick = Faults(draw, [*PATH_FIELDS[path], "encoding"])
    encoding = pick("encoding", st.sampled_from(["json", "json", "json", "text/plain", "no content type"]),
                    st.sampled_from(["bad utf-8", "truncated", "not an object"]))
    case = HttpCase(path, {}, encoding, set())
    body, bad = case.body, case.bad

    def field(name, valid, wrong, ok=None):
        """Draws `name` (ABSENT leaves it out); `ok(value)` False marks it bad (JSON's null is not judged)."""
        value = case.facts[name] = pick(name, valid, wrong)
        if value is not ABSENT:
            body[name] = value
            if value is not None and ok is not None and not ok(value):
                bad.add(name)
        return case.value(name)

    def boolean(name):
        field(name, bools_valid, bools_wrong, lambda v: isinstance(v, bool))

    if path == "/detokenize":
        field("tokens", st.lists(token_ids_in_vocab, max_size=8), st.one_of(
            st.lists(token_ids_any, min_size=1, max_size=3), st.sampled_from([ABSENT, None, "abc", [1.5], [True]])),
            lambda v: isinstance(v, list) and all(_is_int(t) and 0 <= t < VOCAB for t in v))
        if case.value("tokens") is None:
            bad.add("tokens")  # required
        return case
    if path == "/tokenize":
        which = pick("which", st.sampled_from(["prompt", "messages"]), st.sampled_from(["both", "neither"]))
        if which in ("prompt", "both"):
            field("prompt", st.text(max_size=30), st.just(5), lambda v: isinstance(v, str))
        if which in ("messages", "both"):
            field("messages", messages_valid, messages_wrong.filter(lambda v: v is not ABSENT))
        for name in ("add_special_tokens", "add_generation_prompt", "return_token_strs"):
            boolean(name)
        prompt, messages = case.value("prompt"), case.value("messages")
        if (prompt is None) == (messages is None):
            bad.add("prompt")  # exactly one of prompt and messages
        if messages is not None and _rendered_messages(messages) is None:
            bad.add("messages")
        return case

    chat = path == "/v1/chat/completions"
    field("model", st.sampled_from([ABSENT, None, MODEL]), st.sampled_from(["gpt-4", "", 5]), lambda v: v == MODEL)
    # Valid max_tokens are small; None is 16 for completions but the rest of the context for chats, which is slow:
    # a chat carries max_tokens or max_completion_tokens.
    max_tokens_wrong = st.one_of(big_ints, wrong_types)
    field("max_tokens", st.one_of(absent if chat else st.sampled_from([ABSENT, None]), st.integers(1, 4)),
          max_tokens_wrong)
    if chat:
        field("max_completion_tokens", st.integers(1, 4) if case.value("max_tokens") is None else st.one_of(
            absent, st.integers(1, 4)), max_tokens_wrong)
        if case.value("max_tokens") is None and case.value("max_completion_tokens") is None:
            body["max_completion_tokens"] = case.facts["max_completion_tokens"] = 2
    for name, (lo, hi, lo_open, valid) in REAL_RANGES.items():
        field(name, st.one_of(st.sampled_from([ABSENT, None]), valid), st.one_of(json_floats, wrong_types),
              lambda v, lo=lo, hi=hi, lo_open=lo_open: _is_real(v) and _finite_in(v, lo, hi, lo_open))
    field("top_k", st.one_of(absent, st.integers(-1, 20), st.just(VOCAB)),
          st.one_of(st.integers(max_value=-2), st.sampled_from([2 ** 31, 2 ** 63, 10 ** 30]), wrong_types),
          lambda v: _is_int(v) and -1 <= v <= INT32[1])
    field("seed", st.one_of(st.sampled_from([ABSENT, None]), st.integers(*INT64)),
          st.one_of(st.sampled_from([2 ** 63, 10 ** 30, INT64[0] - 1]), wrong_types),
          lambda v: _is_int(v) and INT64[0] <= v <= INT64[1])
    field("stop", st.one_of(st.sampled_from([ABSENT, None]), st.text(min_size=1, max_size=5),
                            st.lists(st.text(min_size=1, max_size=5), max_size=3)),
          st.sampled_from(["", [""], ["a", ""], 5, [5], [None], {}]),
          lambda v: (isinstance(v, str) and v) or (isinstance(v, list) and all(isinstance(s, str) and s for s in v)))
    field("stop_token_ids", st.one_of(st.sampled_from([ABSENT, None]), st.lists(token_ids_in_vocab, max_size=3)),
          st.one_of(st.lists(token_ids_any, min_size=1, max_size=3), wrong_types),
          lambda v: isinstance(v, list) and all(_is_int(t) and 0 <= t < VOCAB for t in v))
    field("n", st.sampled_from([ABSENT, None, 1, 2, 3, MAX_N]),
          st.one_of(st.sampled_from([0, MAX_N + 1, -1, 2 ** 31, 10 ** 30]), wrong_types),
          lambda v: _is_int(v) and 1 <= v <= MAX_N)
    field("logit_bias", st.one_of(st.sampled_from([ABSENT, None]), st.dictionaries(
        token_ids_in_vocab.map(str), st.floats(-100.0, 100.0), max_size=4)), st.one_of(
        st.dictionaries(st.one_of(token_ids_any.map(str), st.sampled_from(["x", "1.5", ""])), json_floats,
                        min_size=1, max_size=4),
        st.just({str(t): 1.0 for t in range(MAX_LOGIT_BIAS + 1)}), st.sampled_from([[], 5, "x"])),
        lambda v: isinstance(v, dict) and len(v) <= MAX_LOGIT_BIAS and all(
            re.fullmatch(r"-?\d+", k) and 0 <= int(k) < VOCAB and _is_real(b) and _finite_in(b, -100.0, 100.0)
            for k, b in v.items()))
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "stream"):
        boolean(name)
    field("min_tokens", st.sampled_from([ABSENT, None, 0, 1]),
          st.one_of(st.sampled_from([-1, 17, 100, 2 ** 31, 10 ** 30]), wrong_types),
          lambda v: _is_int(v) and 0 <= v <= INT32[1])
    usage_options = st.sampled_from([{}, {"include_usage": True}, {"include_usage": False}, {"include_usage": None}])
    field("stream_options", st.one_of(st.sampled_from([ABSENT, None]),
                                      usage_options if case.value("stream") is True else st.nothing()),
          st.one_of(st.sampled_from([5, [], {"include_usage": 1}]), usage_options),
          lambda v: isinstance(v, dict) and v.get("include_usage") in (True, False, None)
          and case.value("stream") is True)  # only with stream=true
    field("user", st.one_of(absent, st.text(max_size=8)), st.sampled_from([5, []]), lambda v: isinstance(v, str))
    field("priority", st.sampled_from([ABSENT, None, 0, 1]), st.one_of(st.sampled_from([2, -1, "batch"]), big_ints),
          lambda v: v in (0, 1) and not isinstance(v, bool))
    if draw(st.booleans()):
        body["unknown_field"] = draw(st.sampled_from([1, "x", None, [math.nan]]))  # ignored
    if chat:
        field("messages", messages_valid, messages_wrong, lambda v: _rendered_messages(v) is not None)
        if case.value("messages") is None:
            bad.add("messages")  # required
        boolean("logprobs")
        field("top_logprobs", st.one_of(st.sampled_from([ABSENT, None]), st.integers(0, MAX_LOGPROBS)
                                        if case.value("logprobs") is True else st.nothing()),
              st.one_of(st.sampled_from([-1, MAX_LOGPROBS + 1, 2 ** 40, "1"]), st.integers(0, MAX_LOGPROBS)),
              lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS and case.value("logprobs") is True)
        field("tools", st.sampled_from([ABSENT, None, [], [TOOL]]), st.sampled_from(["x", [5], {}]),
              lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v))
        field("tool_choice", st.sampled_from([ABSENT, None, "none", "auto"]),
              st.sampled_from(["required", {"type": "function"}, 5]), lambda v: v in ("none", "auto"))
        # (json_object and json_schema are valid too, but refuse ignore_eos and min_tokens: tested on their own in
        # tests/serving/server/test_http.py, not drawn here, where the expected error must be one field's.)
        field("response_format", st.sampled_from([ABSENT, None, {}, {"type": "text"}]),
              st.sampled_from([{"type": None}, 5, {"type": "yaml"}, {"type": "json_schema"},
                               {"type": "json_schema", "json_schema": {"schema": 5}}]),
              lambda v: isinstance(v, dict) and v.get("type", "text") == "text")
        boolean("add_generation_prompt")
        field("chat_template_kwargs", st.sampled_from([ABSENT, None, {}, {"enable_thinking": False},
                                                       {"bos_token": ""}]),
              st.sampled_from([5, [], {"chat_template": "{{ messages }}"}, {"add_generation_prompt": 5},
                               {"messages": []}, {"field": 1}, {"tokenizer": 1}, {"self": 1}]),
              lambda v: isinstance(v, dict) and not set(v) & RESERVED_TEMPLATE_KWARGS)
        if case.value("chat_template_kwargs") and "chat_template_kwargs" not in bad:
            case.maybe.add("messages")  # a template variable the template may choke on
    else:
        field("prompt", completion_prompts_valid, completion_prompts_wrong)
        boolean("echo")
        boolean("add_special_tokens")
        field("logprobs", st.one_of(st.sampled_from([ABSENT, None]), st.integers(0, MAX_LOGPROBS)),
              st.sampled_from([-1, MAX_LOGPROBS + 1, 2 ** 40, True]), lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS)
        field("best_of", st.sampled_from([ABSENT, None]), st.sampled_from([0, 1, 2, 3, "2"]))
    return case


def http_faults(case: HttpCase, tokenizer) -> HttpCase:
    """`case` with the faults added that span parameters (min_tokens > max_tokens, best_of, echo with logprobs) or
    need the prompts' token counts (the context, --max_request_bytes)."""
    if case.path in ("/tokenize", "/detokenize"):
        return case
    chat = case.path == "/v1/chat/completions"
    bad, value = case.bad, case.value
    # The max_tokens in force and the parameter that set it (an overridden max_tokens is only type-checked).
    max_name = "max_completion_tokens" if chat and value("max_completion_tokens") is not None else "max_tokens"
    for name in ("max_tokens", "max_completion_tokens"):
        v = value(name)
        if v is not None and not (_is_int(v) and (name != max_name or 1 <= v <= INT32[1])):
            bad.add(name)
    max_tokens = value(max_name)
    if max_tokens is None and not chat:
        max_tokens = DEFAULT_MAX_TOKENS
    if not (_is_int(max_tokens) and 1 <= max_tokens <= INT32[1]):
        max_tokens = None  # refused already: nothing more to check against it
    min_tokens = value("min_tokens")
    if _is_int(min_tokens) and max_tokens is not None and min_tokens > max_tokens:
        bad.add("min_tokens")
    if not chat:
        n, best_of = value("n"), value("best_of")
        if best_of is not None and best_of != (n if _is_int(n) and n else 1):
            bad.add("best_of")
        if value("echo") is True and value("logprobs") is not None:
            bad.add("echo")

    raw = case.encoded()[0]
    if len(raw) > MAX_REQUEST_BYTES:
        bad.add("messages" if chat else "prompt")
    counts = []  # (parameter, prompt tokens)
    if chat:
        rendered = _rendered_messages(value("messages"))
        kwargs = value("chat_template_kwargs")
        if rendered is not None and "chat_template_kwargs" not in bad and "tools" not in bad:
            extra = dict(kwargs or {})
            if value("tools") is not None:
                extra["tools"] = value("tools")
            try:
                counts.append(("messages", len(tokenizer.encode_chat(
                    rendered, add_generation_prompt=value("add_generation_prompt") is not False, **extra))))
            except Exception:  # noqa: BLE001 - the template refused: a refusal may name the messages
                case.maybe.add("messages")
    else:
        prompt = value("prompt")
        add = value("add_special_tokens") is not False
        single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0]))
        items = [prompt] if single else prompt if isinstance(prompt, list) else None
        well_typed = items and (all(isinstance(i, str) for i in items) or all(
            isinstance(i, list) and all(_is_int(t) for t in i) for i in items))
        if not well_typed:
            bad.add("prompt")  # the wrong type, or empty
        elif len(raw) <= MAX_REQUEST_BYTES:
            for item in items:
                if not item or isinstance(item, list) and not all(0 <= t < VOCAB for t in item):
                    bad.add("prompt")
                else:
                    counts.append(("prompt", len(item) if isinstance(item, list)
                                   else len(tokenizer.encode(item, add_special_tokens=add))))
    for name, count in counts:
        if count >= CONTEXT:
            bad.add(name)
        elif max_tokens is not None and count + max_tokens > CONTEXT:
            bad.add(max_name)
    return case


def expected_choices(case: HttpCase) -> int:
    """How many choices a served completion request answers with: prompts times n."""
    prompt = case.value("prompt")
    single = case.path == "/v1/chat/completions" or isinstance(prompt, str) or _is_int(prompt[0])
    n = case.value("n")
    return (1 if single else len(prompt)) * (n or 1)


# ---------------------------------------------------------------------------------------------------- raw bytes
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_HEADERS = b"\x00\x00\x10\x01\x04\x00\x00\x00\x01"  # a HEADERS frame that promises 16 bytes


@dataclasses.dataclass(frozen=True)
class Garbage:
    data: bytes

    def __repr__(self) -> str:  # a readable falsifying example
        return f"Garbage({self.data[:300]!r}{'...' if len(self.data) > 300 else ''}, {len(self.data)} bytes)"


def garbage():
    """Bytes a port may get from a confused or hostile client."""
    return st.builds(Garbage, st.one_of(
        st.binary(max_size=512),
        st.binary(max_size=256).map(lambda b: H2_PREFACE + b),
        st.binary(max_size=64).map(lambda b: H2_PREFACE + _H2_SETTINGS + _H2_HEADERS + b),  # a truncated frame
        st.sampled_from([
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"POST /meshserve.v1.Inference/Generate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
            b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"",  # body cut short
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            H2_PREFACE[:10],
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # the start of a TLS ClientHello
        ]),
    ))
