"""Tool calling on the host: parsers that turn a model's generated text into OpenAI `tool_calls`, whole (`parse`) or
streamed (`feed`/`finish`, OpenAI's delta shape), for the formats models are trained on (`hermes`, `llama3_json`,
`mistral`, named as vLLM's --tool-call-parser); the parser a chat template implies; the llguidance Lark grammar that
forces one call for tool_choice `required` or a named function. Pure Python: no engine, no tokenizer.

The parsers read text, so markers that are special tokens (`<|python_tag|>`, `[TOOL_CALLS]`) must be detokenized
with special tokens kept. A call is held back until its JSON is complete and then sent whole (header, then the full
arguments string): a call that turns out malformed is content instead, and both paths say so identically."""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar

from serving.api.reasoning import held

CALL_ID_ALPHABET = string.ascii_letters + string.digits
TOOL_CHOICES = ("none", "auto", "required")


def new_call_id() -> str:
    """OpenAI's shape of a tool call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(CALL_ID_ALPHABET) for _ in range(24))


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON object as text, `json.dumps(args, ensure_ascii=False)`."""
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True, slots=True)
class StreamEvent:
    """One streamed piece: `content` text, or `tool_call`, one entry of an OpenAI delta's `tool_calls`
    (`{"index", "id", "type", "function": {"name", "arguments": ""}}` once per call, then
    `{"index", "function": {"arguments": fragment}}`)."""
    content: str | None = None
    tool_call: dict | None = None


def finish_reason(reason: str, calls: Collection[ToolCall]) -> str:
    """The choice's finish_reason: `tool_calls` once any call was parsed, else the engine's own."""
    return "tool_calls" if calls else reason


# ---------------------------------------------------------------------------- parsing helpers
_JSON_DELIMITER = re.compile(r'["{}\[\]]')
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """Strict JSON (NaN and Infinity rejected, as a client would), or None when `text` is not JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return None


def _call_of(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) from `{"name": str, "arguments" | "parameters": object}`, or None if it is not a call.
    Arguments given as a JSON string of an object are accepted too."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


# ---------------------------------------------------------------------------- parsers
class ToolParser:
    """Streaming parser of one request's output: `feed` each text delta, then `finish`; `result()` is then what
    `parse` returns for the whole text, ids included. Subclasses consume `_buf` in `_step`, deciding only what no
    later text can change, so any split of the text gives the same events.

    Content is the text outside calls, less the whitespace that lies between calls and content's ends (the newline
    between two calls, the blank line before the first); empty content is None."""
    name: ClassVar[str]
    initial_mode: ClassVar[str] = "text"
    markers: ClassVar[tuple[str, ...]] = ()  # the format's markers: decoded text must keep them

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self._new_id = new_id
        self._buf = ""
        self._mode = self.initial_mode
        self._scan: tuple[int, int, int] | None = None  # (start, resume position, depth) of a JSON value's end
        self._events: list[StreamEvent] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._pending_ws = ""  # trailing whitespace of content: dropped if only calls follow
        self._after_call = False  # a call came after the last content
        self._finished = False

    @classmethod
    def parse(cls, text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        parser = cls(new_id)
        parser.feed(text)
        parser.finish()
        return parser.result()

    def feed(self, text: str) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError(f"{self.name} tool parser: feed after finish")
        self._buf += text
        while self._step(final=False):
            pass
        return self._drain()

    def finish(self) -> list[StreamEvent]:
        if not self._finished:
            while self._step(final=True):
                pass
            assert not self._buf, f"{self.name} tool parser left {self._buf!r} unparsed"
            if not self._after_call and self._pending_ws:
                self._emit_content(self._pending_ws)
            self._pending_ws, self._finished = "", True
        return self._drain()

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) so far; the whole answer once finished."""
        return "".join(self._content) or None, list(self._calls)

    # ---- for subclasses
    def _step(self, final: bool) -> bool:
        """Consume what can be decided from the front of `_buf`; True if it consumed anything and should run
        again. With `final`, the text is complete: everything must be consumed."""
        raise NotImplementedError

    def _consume(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._scan = None

    def _text(self, text: str) -> None:
        """Text outside calls, whitespace held until content follows it."""
        text = self._pending_ws + text
        if self._calls and not self._content:  # whitespace after the calls that open the output
            text = text.lstrip()
        head = text.rstrip()
        self._pending_ws = text[len(head):]
        if head:
            self._after_call = False
            self._emit_content(head)

    def _emit_content(self, text: str) -> None:
        self._content.append(text)
        self._events.append(StreamEvent(content=text))

    def _call(self, name: str, arguments: str) -> None:
        call = ToolCall(self._new_id(), name, arguments)
        index = len(self._calls)
        self._calls.append(call)
        self._after_call = True
        self._events.append(StreamEvent(tool_call={
            "index": index, "id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}))
        self._events.append(StreamEvent(tool_call={"index": index, "function": {"arguments": arguments}}))

    def _text_until(self, marker: str, final: bool) -> bool:
        """Text mode: content up to `marker` (then True, `_buf` starting at it); else all but a possible start of
        it (False)."""
        i = self._buf.find(marker)
        if i >= 0:
            self._text(self._buf[:i])
            self._consume(i)
            return True
        keep = 0 if final else held(self._buf, marker)
        self._text(self._buf[:len(self._buf) - keep])
        self._consume(len(self._buf) - keep)
        return False

    def _json_end(self, start: int) -> int | None:
        """End of the JSON object or array opening at `_buf[start]`, None while incomplete. Resumes the last scan,
        so streaming a long value costs linear time."""
        _, pos, depth = self._scan if self._scan and self._scan[0] == start else (start, start, 0)
        buf = self._buf
        while (m := _JSON_DELIMITER.search(buf, pos)) is not None:
            if m.group() == '"':
                rest = _STRING_REST.match(buf, m.end())
                if rest is None:
                    break
                pos = rest.end()
                continue
            depth += 1 if m.group() in "{[" else -1
            pos = m.end()
            if depth == 0:
                return pos
        else:
            pos = len(buf)
        self._scan = (start, pos, depth)
        return None

    def _drain(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        return events


class HermesToolParser(ToolParser):
    """Hermes, Qwen2.5, Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, after
    optional text. A call missing its closing tag at the end of the output still counts if its JSON is whole."""
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)

    def _step(self, final: bool) -> bool:
        if self._mode == "text":
            if not self._text_until(self.OPEN, final):
                return False
            self._mode = "call"
        end = self._buf.find(self.CLOSE, len(self.OPEN))
        if end < 0 and not final:
            return False
        body = self._buf[len(self.OPEN):end if end >= 0 else len(self._buf)]
        call = _call_of(_loads(body))
        self._mode = "text"
        if call is None:  # malformed: the tag is text, and the text after it is read again
            self._text(self.OPEN)
            self._consume(len(self.OPEN))
        else:
            self._call(*call)
            self._consume(end + len(self.CLOSE) if end >= 0 else len(self._buf))
        return True


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calling: the output is `{"name": ..., "parameters": {...}}` (or "arguments"),
    optionally after `<|python_tag|>`; several calls separated by `;`. An output that does not open with one is
    content; text after the last call that is not another call is content too."""
    name = "llama3_json"
    initial_mode = "call"
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._mode == "text":
            self._text(buf)
            self._consume(len(buf))
            return False
        p = _skip_ws(buf, 0)
        if not self._calls:  # the first call may follow the python tag
            if buf.startswith(self.PYTHON_TAG, p):
                p = _skip_ws(buf, p + len(self.PYTHON_TAG))
            elif buf[p:] and self.PYTHON_TAG.startswith(buf[p:]) and not final:
                return False
        elif buf.startswith(";", p):
            p = _skip_ws(buf, p + 1)
        if p == len(buf):
            if not final:
                return False
            if self._calls:  # separators after the last call
                self._consume(len(buf))
                return False
            self._mode = "text"  # whitespace or a lone tag
            return True
        end = self._json_end(p) if buf[p] == "{" else -1
        if end is None and not final:
            return False
        call = _call_of(_loads(buf[p:end])) if end is not None and end > 0 else None
        if call is None:  # not a call: the rest of the output is content
            self._mode = "text"
            return True
        self._call(*call)
        self._consume(end)
        return True


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`
    (one call each, repeated), after optional text."""
    name = "mistral"
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = (MARKER, ARGS)

    def _step(self, final: bool) -> bool:
        if self._mode == "text":
            if not self._text_until(self.MARKER, final):
                return False
            self._mode = "call"
        calls = self._read_calls(final)
        if calls == "wait":
            return False
        self._mode = "text"
        if calls is None:  # malformed: the marker is text, and the text after it is read again
            self._text(self.MARKER)
            self._consume(len(self.MARKER))
        return True

    def _read_calls(self, final: bool) -> list | str | None:
        """Consume the calls after the marker opening `_buf`: "wait" for more text, None if malformed."""
        buf = self._buf
        p = _skip_ws(buf, len(self.MARKER))
        if p == len(buf):
            return None if final else "wait"
        if buf[p] == "[":
            end = self._json_end(p)
            if end is None:
                return None if final else "wait"
            items = _loads(buf[p:end])
            calls = [_call_of(item) for item in items] if isinstance(items, list) and items else [None]
            if None in calls:
                return None
        else:
            q = _NAME.match(buf, p).end()
            if q == len(buf) or (self.ARGS.startswith(buf[q:]) and not buf.startswith(self.ARGS, q)):
                return None if final else "wait"
            if q == p or not buf.startswith(self.ARGS, q):
                return None
            start = _skip_ws(buf, q + len(self.ARGS))
            if start == len(buf):
                return None if final else "wait"
            end = self._json_end(start) if buf[start] == "{" else -1
            if end is None:
                return None if final else "wait"
            call = _call_of({"name": buf[p:q], "arguments": _loads(buf[start:end])}) if end > 0 else None
            if call is None:
                return None
            calls = [call]
        for call in calls:
            self._call(*call)
        self._consume(end)
        return calls


class HarmonyToolParser(ToolParser):
    """GPT-OSS's harmony format, after the `harmony` reasoning parser (serving.api.reasoning), which passes each
    message to `functions.NAME` on in content as `<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>ARGS<|call|>`: a call of NAME with ARGS (the arguments JSON as the model wrote it); any number, among
    content. A call cut off at the end of the output still counts."""
    name = "harmony"
    OPEN = "<|channel|>commentary to=functions."
    MESSAGE, CALL = "<|message|>", "<|call|>"
    markers = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

    def _step(self, final: bool) -> bool:
        if self._mode == "text":
            if not self._text_until(self.OPEN, final):
                return False
            self._mode = "call"
        start = self._buf.find(self.MESSAGE)
        end = self._buf.find(self.CALL, max(start, 0))
        if (start < 0 or end < 0) and not final:
            return False
        self._mode = "text"
        if start < 0:  # a header cut off: nothing to call
            self._consume(len(self._buf))
            return True
        header = self._buf[len(self.OPEN):start]
        name = re.split(r"[\s<]", header, maxsplit=1)[0]
        arguments = self._buf[start + len(self.MESSAGE):end if end >= 0 else len(self._buf)].strip()
        stop = end + len(self.CALL) if end >= 0 else len(self._buf)
        if name and isinstance(_loads(arguments), dict):
            self._call(name, arguments)
        else:  # no name, or arguments that are not a JSON object: the message is text
            self._text(self._buf[:stop])
        self._consume(stop)
        return True


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, HarmonyToolParser)}


def tool_parser(name: str) -> type[ToolParser]:
    """The parser class for a --tool-call-parser name."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; expected one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]


def default_parser_for_template(chat_template: str) -> str | None:
    """The tool-call parser a chat template's text implies, or None when it shows no known tool-call format."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


def resolve_tool_call_parser(name: str, chat_template: str | Mapping[str, str] | None) -> str:
    """A server's tool-call parser: `name` (--tool_call_parser) when given, else the one its chat template implies
    (all of a model's named templates read), else "" (tool calls are not parsed)."""
    if name:
        tool_parser(name)
        return name
    if isinstance(chat_template, Mapping):
        chat_template = "\n".join(chat_template.values())
    return (default_parser_for_template(chat_template) if chat_template else None) or ""


# ---------------------------------------------------------------------------- request checks and grammar
def check_tools(tools: Any, tool_choice: Any) -> list[dict]:
    """The functions (`{"name", "parameters", ...}`) that `tool_choice` allows, after checking both fields:
    a ValueError names the offending field (`tools[1].function.name: ...`, `tool_choice: ...`). Empty for
    tool_choice `none`."""
    functions: list[dict] = []
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools: expected a list of tools, got {type(tools).__name__}")
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            got = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise ValueError(f'tools[{i}]: expected {{"type": "function", "function": {{...}}}}, got {got!r}')
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"tools[{i}].function: expected an object with a name, got {type(fn).__name__}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name: expected 1 to 64 letters, digits, '_' or '-', got {name!r}")
        if any(f["name"] == name for f in functions):
            raise ValueError(f"tools[{i}].function.name: {name!r} is already the name of another tool")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise ValueError(f"tools[{i}].function.parameters: expected a JSON schema object, "
                             f"got {type(fn['parameters']).__name__}")
        functions.append(dict(fn))
    names = [f["name"] for f in functions]
    if tool_choice is None or tool_choice == "auto":
        return functions
    if tool_choice == "none":
        return []
    if tool_choice == "required":
        if not functions:
            raise ValueError("tool_choice: 'required' needs at least one tool in tools")
        return functions
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if name not in names:
            raise ValueError(f"tool_choice: function {name!r} is not among the request's tools "
                             f"({', '.join(names) or 'none given'})")
        return [functions[names.index(name)]]
    raise ValueError(f"tool_choice: expected 'none', 'auto', 'required' or "
                     f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}')


# llguidance's JSON options: whitespace as json.dumps writes it, so the model cannot pad without end.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no parameters
_NOT_SCHEMA_KEYS = frozenset({"const", "enum", "default", "examples"})


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with its local `$ref`s (`#/...`) pointing below `base`, where it will live in the grammar's schema."""
    if isinstance(schema, list):
        return [_rebase_refs(s, base) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _NOT_SCHEMA_KEYS:
            out[key] = value
        else:
            out[key] = _rebase_refs(value, base)
    return out


def _calls_schema(functions: list[dict], arguments_key: str) -> dict:
    """JSON schema of one call object, `{"name": const, arguments_key: parameters}`, for any of `functions`. Each
    function's parameters sit in `$defs` (their own `$ref`s rebased there), so schemas with `$defs` keep working."""
    defs, options = {}, []
    for i, fn in enumerate(functions):
        key = f"parameters_{i}"
        defs[key] = _rebase_refs(fn.get("parameters") or _NO_PARAMETERS, f"#/$defs/{key}")
        options.append({"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                        "properties": {"name": {"const": fn["name"]}, arguments_key: {"$ref": f"#/$defs/{key}"}}})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs, "x-guidance": _JSON_STYLE}


def _marker(text: str, special_tokens: Mapping[str, int]) -> str:
    """A Lark item for a format marker: the token by id when the tokenizer holds it as a special token (llguidance
    matches special tokens only by reference, and `<[TOOL_CALLS]>` would read as an id list), else the text."""
    return f"<[{int(special_tokens[text])}]>" if text in special_tokens else json.dumps(text)


def tool_grammar(parser_name: str, tools: Any, tool_choice: Any, *,
                 special_tokens: Mapping[str, int] | None = None) -> str | None:
    """A Lark grammar for llguidance that makes the output exactly one call in `parser_name`'s format, its
    arguments valid for the function's `parameters`: any of the tools for tool_choice `required`, the named one
    for `{"type": "function", "function": {"name": ...}}`. None for `none` and `auto` (no constraint).

    `special_tokens`: the markers the tokenizer holds as special tokens, with their ids (`{"[TOOL_CALLS]": 9}` for
    Mistral), which the grammar must name as tokens rather than spell out."""
    tool_parser(parser_name)
    special_tokens = special_tokens or {}
    functions = check_tools(tools, tool_choice)
    if tool_choice in (None, "none", "auto"):
        return None
    if parser_name == "harmony":  # its calls follow an analysis message the grammar would have to allow
        raise ValueError(f"tool_choice {tool_choice!r} with the harmony tool-call format (GPT-OSS) is not "
                         f"implemented; use 'auto' or 'none'")
    if parser_name == "hermes":
        call = json.dumps(_calls_schema(functions, "arguments"), ensure_ascii=False)
        start = f'{_marker("<tool_call>", special_tokens)} "\\n" call "\\n" {_marker("</tool_call>", special_tokens)}'
    elif parser_name == "llama3_json":
        call = json.dumps(_calls_schema(functions, "parameters"), ensure_ascii=False)
        start = "call"
    else:
        call = json.dumps(_calls_schema(functions, "arguments"), ensure_ascii=False)
        start = f'{_marker("[TOOL_CALLS]", special_tokens)} "[" call "]"'
    grammar = f"start: {start}\ncall: %json {call}\n"
    _check_schemas(grammar, tools, functions)
    return grammar


def _check_schemas(grammar: str, tools: list, functions: list[dict]) -> None:
    """A parameters schema that llguidance cannot compile is the request's fault: a ValueError naming the tool,
    not a failure later in the engine. Skipped when llguidance is not installed."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        return
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar))
    if not error:
        return
    names = [t["function"]["name"] for t in tools]
    for fn in functions:
        schema = json.dumps(_calls_schema([fn], "arguments"), ensure_ascii=False)
        reason = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(f"start: call\ncall: %json {schema}\n"))
        if reason:
            reason = reason.splitlines()[0].split("failed to compile JSON schema: ")[-1]
            raise ValueError(f"tools[{names.index(fn['name'])}].function.parameters: {reason}")
    raise ValueError(f"tools: llguidance rejects the tool-call grammar: {error.splitlines()[0]}")
