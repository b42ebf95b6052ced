"""Tool-call parsers and grammars: examples per format, streaming equal to the whole-text parse for any split of the
text, request checks, and llguidance grammars walked at random over the tiny tokenizer: every output they allow
parses as one call whose arguments satisfy the function's schema."""
import itertools
import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.api.tools import (TOOL_PARSERS, StreamEvent, ToolCall, check_tools, default_parser_for_template,
                               finish_reason, new_call_id, tool_grammar, tool_parser)

TOKENIZER = pathlib.Path(__file__).parents[3] / "models/tiny/target/tokenizer.json"


def counter_ids():
    """A fresh deterministic id generator: call_0, call_1, ..."""
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def calls(*pairs):
    return [ToolCall(f"call_{i}", name, args) for i, (name, args) in enumerate(pairs)]


def parse(name, text):
    return tool_parser(name).parse(text, counter_ids())


# ---------------------------------------------------------------------------- examples
@pytest.mark.parametrize("text, expected", [
    ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     ("Let me check.", calls(("get_weather", '{"city": "Paris"}'), ("now", "{}")))),
    ('<tool_call>\n{"name": "f", "arguments": {"s": "é\\u00e9", "n": [1,2]}}',  # no closing tag at the end
     (None, calls(("f", '{"s": "éé", "n": [1, 2]}')))),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', (None, calls(("f", '{"a": 1}')))),
    ("No tools needed.", ("No tools needed.", [])),
    ('<tool_call>{bad <tool_call>{"name": "g", "arguments": {}}</tool_call> done',
     ("<tool_call>{bad  done", calls(("g", "{}")))),
])
def test_hermes(text, expected):
    assert parse("hermes", text) == expected


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', (None, calls(("get_weather", '{"city": "Paris"}')))),
    ('<|python_tag|>{"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {}}',
     (None, calls(("f", '{"a": 1}'), ("g", "{}")))),
    ('\n {"name": "f", "parameters": {}}\n{"name": "g", "parameters": {}};\n', (None, calls(("f", "{}"), ("g", "{}")))),
    ('{"name": "f", "parameters": {}} and more', ("and more", calls(("f", "{}")))),
    ("", (None, [])),
])
def test_llama3_json(text, expected):
    assert parse("llama3_json", text) == expected


@pytest.mark.parametrize("text, expected", [
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
     (None, calls(("f", '{"a": 1}'), ("g", "{}")))),
    ('Sure.\n[TOOL_CALLS] [{"name": "f", "arguments": {}}]', ("Sure.", calls(("f", "{}")))),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}',
     (None, calls(("get_weather", '{"city": "Paris"}'), ("now", "{}")))),
])
def test_mistral(text, expected):
    assert parse("mistral", text) == expected


@pytest.mark.parametrize("name, text", [
    ("hermes", "<tool_call>{oops}</tool_call> then"),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>'),  # no arguments
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),  # not JSON
    ("hermes", "a </tool_call> b <tool_c"),
    ("llama3_json", "The answer is {42}."),
    ("llama3_json", '{"name": "Ann", "age": 3}'),  # JSON that is no call
    ("llama3_json", '{"name": "f", "parameters": {"a": "}"'),  # cut off
    ("llama3_json", "<|python_tag|>"),
    ("mistral", "[TOOL_CALLS]oops"),
    ("mistral", "[TOOL_CALLS][1, 2]"),
    ("mistral", "[TOOL_CALLS]f[ARGS][1]"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": 3}]'),  # one bad call spoils the list
    ("mistral", "[TOOL_CALLS]"),
])
def test_malformed_calls_are_content(name, text):
    assert parse(name, text) == (text, [])


def test_streaming_events_and_held_back_tag():
    p = tool_parser("hermes")(counter_ids())
    assert p.feed("Hi <tool_c") == [StreamEvent(content="Hi")]
    assert p.feed('all>\n{"name": "f", ') == []
    assert p.feed('"arguments": {"a": 1}}\n</tool_call>') == [
        StreamEvent(tool_call={"index": 0, "id": "call_0", "type": "function",
                               "function": {"name": "f", "arguments": ""}}),
        StreamEvent(tool_call={"index": 0, "function": {"arguments": '{"a": 1}'}})]
    assert p.finish() == [] and p.result() == ("Hi", calls(("f", '{"a": 1}')))
    p = tool_parser("hermes")()
    assert p.feed("a <tool_c") == [StreamEvent(content="a")] and p.feed("x") == [StreamEvent(content=" <tool_cx")]


def test_ids_and_finish_reason():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 29 and i.startswith("call_") and i[5:].isalnum() for i in ids)
    content, found = tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert found[0].id.startswith("call_") and found[0].to_openai()["function"] == {"name": "f", "arguments": "{}"}
    assert finish_reason("stop", found) == "tool_calls" and finish_reason("length", []) == "length"
    with pytest.raises(ValueError, match="^tool_call_parser: unknown parser 'pythonic'"):
        tool_parser("pythonic")


def test_default_parser_for_template():
    assert default_parser_for_template("{% if tools %}<tool_call>\n{{ tool }}</tool_call>{% endif %}") == "hermes"
    assert default_parser_for_template("{{- '<|python_tag|>' }}") == "llama3_json"
    assert default_parser_for_template("{%- if message.role == 'ipython' %}") == "llama3_json"
    assert default_parser_for_template("{{ '[TOOL_CALLS][' }}") == "mistral"
    assert default_parser_for_template((TOKENIZER.parent / "chat_template.jinja").read_text()) is None


# ---------------------------------------------------------------------------- stream == whole, for any split
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_c", "<", "\n", " ", "Hi", "é", "{bad", "}",
               '{"name": "g", "arguments": {"s": "x\\"}<tool_call>"}}',
               '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'],
    "llama3_json": ["<|python_tag|>", "<|py", ";", " ", "\n", "{", "}", '"', "x", '{"name": "h"}',
                    '{"name": "f", "parameters": {"a": [1, "]"]}}', '{"name": "g", "arguments": {}}'],
    "mistral": ["[TOOL_CALLS]", "[TOOL_C", "[ARGS]", "[AR", "f", " ", "Hi", "[", "]", ", ", "{", '{"a": "}"}',
                '{"name": "g", "arguments": {}}', '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]',
                '[TOOL_CALLS]get_x[ARGS]{"b": [2]}'],
    # as the harmony reasoning parser passes calls on (serving.api.reasoning)
    "harmony": ["<|channel|>commentary to=functions.", "<|chan", "f", " ", "<|constrain|>json", "<|message|>",
                "<|call|>", "<|ca", "Hi", "{", "}", '{"a": 1}',
                '<|channel|>commentary to=functions.get <|constrain|>json<|message|>{"b": [2]}<|call|>'],
}


@st.composite
def split_text(draw, name):
    text = "".join(draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=10)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def check_stream_equals_parse(name, case):
    text, pieces = case
    parser = tool_parser(name)(counter_ids())
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content, found = tool_parser(name).parse(text, counter_ids())
    assert parser.result() == (content, found)
    assert "".join(e.content for e in events if e.content is not None) == (content or "")
    deltas = [e.tool_call for e in events if e.tool_call is not None]
    assert sorted({d["index"] for d in deltas}) == list(range(len(found)))
    for index, call in enumerate(found):
        head, *rest = [d for d in deltas if d["index"] == index]
        assert head == {"index": index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}
        assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
        assert "".join(d["function"]["arguments"] for d in rest) == call.arguments
        json.loads(call.arguments)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@settings(derandomize=True, max_examples=300, deadline=None)
@given(data=st.data())
def test_streaming_equals_parse(name, data):
    check_stream_equals_parse(name, data.draw(split_text(name)))


# ---------------------------------------------------------------------------- request checks
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
                   "days": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99}, "b": {"$ref": "#/$defs/digit"}},
    "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: arguments must be {}
TOOLS = [WEATHER, ADD, PING]


def named(name):
    return {"type": "function", "function": {"name": name}}


def test_check_tools():
    assert [f["name"] for f in check_tools(TOOLS, "auto")] == ["get_weather", "add", "ping"]
    assert check_tools(TOOLS, "none") == [] and check_tools(None, None) == []
    assert [f["name"] for f in check_tools(TOOLS, named("add"))] == ["add"]
    assert tool_grammar("hermes", TOOLS, "auto") is None and tool_grammar("hermes", TOOLS, "none") is None


@pytest.mark.parametrize("tools, tool_choice, message", [
    (TOOLS, named("nope"), r"^tool_choice: function 'nope' is not among the request's tools \(get_weather, add, "),
    (TOOLS, "sometimes", "^tool_choice: expected 'none', 'auto', 'required'"),
    (TOOLS, {"type": "function"}, "^tool_choice: function None"),
    ([], "required", "^tool_choice: 'required' needs at least one tool"),
    ([WEATHER, {"type": "retrieval"}], "auto", r"^tools\[1\]: expected"),
    (["f"], "auto", r"^tools\[0\]: expected"),
    ([{"type": "function", "function": {"name": "a b"}}], "auto", r"^tools\[0\]\.function\.name: expected"),
    ([PING, PING], "auto", r"^tools\[1\]\.function\.name: 'ping' is already"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto",
     r"^tools\[0\]\.function\.parameters: expected a JSON schema object"),
    ({"type": "function"}, "auto", "^tools: expected a list"),
])
def test_check_tools_rejects(tools, tool_choice, message):
    with pytest.raises(ValueError, match=message):
        check_tools(tools, tool_choice)


def test_grammar_rejects_a_schema_llguidance_cannot_compile():
    pytest.importorskip("llguidance")
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
    with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters: Invalid type: bogus"):
        tool_grammar("hermes", [PING, bad], "required")
    with pytest.raises(ValueError, match="^tool_call_parser: unknown parser"):
        tool_grammar("xml", TOOLS, "required")


# ---------------------------------------------------------------------------- grammars, walked at random
@pytest.fixture(scope="module")
def walker():
    """walk(grammar, seed, special_markers) -> text: a random path through what the grammar allows, one allowed
    token at a time, decoded with special tokens kept; with special_markers, over the tiny tokenizer with
    `[TOOL_CALLS]` added as a special token (a literal "[TOOL_CALLS]" then tokenizes to it, so the grammar must
    name it by id)."""
    llguidance = pytest.importorskip("llguidance")
    np = pytest.importorskip("numpy")
    tokenizers = pytest.importorskip("tokenizers")
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    spec = json.loads(TOKENIZER.read_text())
    spec["added_tokens"].append({"id": len(spec["model"]["vocab"]), "content": "[TOOL_CALLS]", "special": True,
                                 "single_word": False, "lstrip": False, "rstrip": False, "normalized": False})
    plain, special = TOKENIZER.read_text(), json.dumps(spec)
    hfs = {s: tokenizers.Tokenizer.from_str(s) for s in (plain, special)}
    toks = {s: llguidance.LLTokenizer(s, eos_token=hfs[s].token_to_id("</s>")) for s in (plain, special)}

    def walk(grammar, seed, special_markers=False):
        hf, tok = hfs[special if special_markers else plain], toks[special if special_markers else plain]
        matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar))
        assert not matcher.is_error(), matcher.get_error()
        rng, mask, tokens = np.random.default_rng(seed), allocate_token_bitmask(1, tok.vocab_size), []
        while not matcher.is_stopped():
            assert len(tokens) < 400, hf.decode(tokens, skip_special_tokens=False)
            fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:tok.vocab_size])
            tokens.append(int(rng.choice(allowed)))
            assert matcher.consume_token(tokens[-1]), matcher.get_error()
        assert matcher.is_accepting()
        return hf.decode(tokens, skip_special_tokens=False)
    return walk


def test_harmony_refuses_forced_tool_calls():
    with pytest.raises(ValueError, match="tool_choice 'required' with the harmony tool-call format"):
        tool_grammar("harmony", TOOLS, "required")
    assert tool_grammar("harmony", TOOLS, "auto") is None


@pytest.mark.parametrize("tool_choice", ["required", "get_weather", "add", "ping"])
@pytest.mark.parametrize("name", sorted(set(TOOL_PARSERS) - {"harmony"}))  # harmony: refused, above
def test_grammar_walks_parse_as_one_valid_call(walker, name, tool_choice):
    jsonschema = pytest.importorskip("jsonschema")
    choice = tool_choice if tool_choice == "required" else named(tool_choice)
    grammar = tool_grammar(name, TOOLS, choice)
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"additionalProperties": False})
               for t in TOOLS}
    seen = set()
    for seed in range(12):
        text = walker(grammar, seed)
        content, found = tool_parser(name).parse(text)
        assert content is None and len(found) == 1, text
        call = found[0]
        assert call.name in (schemas if tool_choice == "required" else {tool_choice}), text
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        seen.add(call.name)
    assert tool_choice != "required" or len(seen) > 1  # the walk reaches more than one tool


def test_grammar_names_special_markers_by_id(walker):
    grammar = tool_grammar("mistral", TOOLS, named("add"), special_tokens={"[TOOL_CALLS]": 8192})
    assert grammar.startswith('start: <[8192]> "["')
    for seed in range(3):
        content, found = tool_parser("mistral").parse(walker(grammar, seed, special_markers=True))
        assert content is None and [c.name for c in found] == ["add"]
