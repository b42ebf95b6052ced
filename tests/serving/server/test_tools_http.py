"""Tool calling and reasoning through the OpenAI HTTP API end to end (issue 23): real `python -m serving.server`
processes serving small random Llamas whose tokenizers hold the formats' markers as special tokens and whose chat
templates render tools, tool calls and tool results (Hermes `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`),
driven by the real `openai` client. A random-weight model never calls a tool by itself, so calls are forced: by
tool_choice `required` / a named function (the parser's grammar), and for `auto` by a structured_outputs grammar
that spells a call, which the parser must then find in the free text."""
import json

import jsonschema
import openai
import pytest

from models.synthetic import random_llama
from models.tokenizer import Tokenizer
from serving.api.tools import tool_grammar
from serving.process import ServerProcess
from serving.wire.client import Client
from tests.support.server import running

pytestmark = pytest.mark.e2e

MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<think>", "</think>")
# The tools as names and argument names (the model's context is 512 tokens, and its tokenizer is nearly bytes)
_TOOLS_HEADER = ("{{ bos_token }}{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t.function.name }}("
                 "{{ t.function.parameters.properties | list | join(', ') }})\n{% endfor %}<|im_end|>\n{% endif %}"
                 "{% for m in messages %}")
_TURN = "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
_GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
TEMPLATES = {
    "hermes": _TOOLS_HEADER + (
        "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for tc in m.tool_calls %}"
        "<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n"
        "</tool_call>{% endfor %}<|im_end|>\n"
        "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    ) + _TURN + _GENERATION,
    "llama3_json": _TOOLS_HEADER + (
        "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n<|python_tag|>"
        "{% for tc in m.tool_calls %}{\"name\": \"{{ tc.function.name }}\", "
        "\"parameters\": {{ tc.function.arguments | tojson }}}{% endfor %}<|im_end|>\n"
        "{% elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    ) + _TURN + _GENERATION,
    "mistral": _TOOLS_HEADER + (
        "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n[TOOL_CALLS]["
        "{% for tc in m.tool_calls %}{\"name\": \"{{ tc.function.name }}\", "
        "\"arguments\": {{ tc.function.arguments | tojson }}}{% endfor %}]<|im_end|>\n"
        "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.tool_call_id }}: {{ m.content }}<|im_end|>\n"
    ) + _TURN + _GENERATION,
}
PARSERS = tuple(TEMPLATES)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "forecast", "parameters": DAYS}}]
SCHEMAS = {"weather": WEATHER, "forecast": DAYS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
FORCED = {"required": "required", "named": {"type": "function", "function": {"name": "forecast"}}}
SEEDS = (1, 2)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server per tool-call parser (hermes and llama3_json found from the chat template, mistral named by the
    flag), and the hermes model again with --reasoning_parser=qwen3; started together, so they compile at once."""
    root = tmp_path_factory.mktemp("tools_http")
    models = {p: random_llama(str(root / p), seed=i, extra_special_tokens=MARKERS, chat_template=TEMPLATES[p])
              for i, p in enumerate(PARSERS)}
    flags = {"hermes": (), "llama3_json": (), "mistral": ("--tool_call_parser=mistral",),
             "reasoning": ("--reasoning_parser=qwen3",)}
    procs = {}
    try:
        for name, extra in flags.items():
            procs[name] = ServerProcess(models.get(name, models["hermes"]), str(root / f"run_{name}"),
                                        "--http_port=0", "--served_model_name=m", *extra)
        with running(procs["hermes"]), running(procs["llama3_json"]), running(procs["mistral"]), \
                running(procs["reasoning"]):
            yield {name: (p, models.get(name, models["hermes"])) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.proc is not None and p.proc.poll() is None:
                p.terminate()


def client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{proc.info['http_port']}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def streamed_calls(chunks) -> tuple[list[dict], str, str | None]:
    """(calls {id, name, arguments} by index, the content, the last finish_reason) of a chat stream, its
    delta.tool_calls put together as a client does: id and name once, argument fragments concatenated."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert call["id"] is None, "a call's id is sent once"
                call["id"], call["name"] = tc.id, tc.function.name
            call["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


def test_model_info_reports_the_parsers(servers):
    for name, want in (("hermes", ("hermes", "")), ("llama3_json", ("llama3_json", "")),
                       ("mistral", ("mistral", "")), ("reasoning", ("hermes", "qwen3"))):
        with Client(servers[name][0].target, timeout=30) as c:
            info = c.model_info()
        assert (info.tool_call_parser, info.reasoning_parser) == want


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("choice", FORCED)
def test_forced_tool_call_streamed_and_not(servers, parser, choice):
    """tool_choice required / named: always exactly one call, its arguments valid for the function's schema,
    finish_reason tool_calls; the stream's deltas put together equal the whole response (same seed)."""
    with client(servers[parser][0]) as oai:
        for seed in SEEDS:
            kw = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=FORCED[choice], max_tokens=200,
                      temperature=1.0, seed=seed)
            resp = oai.chat.completions.create(**kw)
            c = resp.choices[0]
            assert c.finish_reason == "tool_calls", c.message
            assert c.message.content is None and len(c.message.tool_calls) == 1
            call = c.message.tool_calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            if choice == "named":
                assert call.function.name == "forecast"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            calls, content, finish = streamed_calls(oai.chat.completions.create(**kw, stream=True))
            assert finish == "tool_calls" and content == ""
            assert [(x["name"], x["arguments"]) for x in calls] == [(call.function.name, call.function.arguments)]
            assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("parser", PARSERS)
def test_auto_parses_a_call_in_free_text(servers, parser):
    """tool_choice auto: no grammar of its own, the output is parsed; here a structured_outputs grammar spells a
    call in the parser's format (a random model never writes one), which comes back as tool_calls."""
    proc, model_dir = servers[parser]
    tok = Tokenizer.from_pretrained(model_dir)
    special = {m: tok.special_token_id(m) for m in MARKERS if tok.special_token_id(m) is not None}
    grammar = tool_grammar(parser, TOOLS, "required", special_tokens=special)
    with client(proc) as oai:
        kw = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=3,
                  extra_body={"structured_outputs": {"grammar": grammar}})
        c = oai.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls, _, finish = streamed_calls(oai.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls"
        assert [(x["name"], x["arguments"]) for x in calls] == [(call.function.name, call.function.arguments)]
        # tool_choice none: the same text is content, markers included (they are shown, not skipped)
        none = oai.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
        assert none.finish_reason == "stop" and not none.message.tool_calls
        assert call.function.name in none.message.content and "<|im_end|>" not in none.message.content


@pytest.mark.parametrize("parser", PARSERS)
def test_tool_result_turn(servers, parser):
    """The assistant's tool_calls and a role: tool message (with tool_call_id) go back through the template."""
    with client(servers[parser][0]) as oai:
        first = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, temperature=1.0, seed=5)
        msg = first.choices[0].message
        call = msg.tool_calls[0]
        turn = [*ASK, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
        second = oai.chat.completions.create(model="m", messages=turn, tools=TOOLS, max_tokens=4, temperature=0)
        assert second.choices[0].finish_reason in ("stop", "length")
        assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_reasoning_is_separated_and_the_schema_applies_after_it(servers):
    """--reasoning_parser=qwen3 with response_format json_schema: the reasoning (<think>...</think>, made likely by
    logit_bias) stays free and comes back as reasoning_content; the content validates; usage counts the reasoning
    tokens up to and including </think>; the stream's reasoning and content deltas add up to the same."""
    proc, model_dir = servers["reasoning"]
    tok = Tokenizer.from_pretrained(model_dir)
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    seen_reasoning = 0
    with client(proc) as oai:
        for seed in range(4):
            kw = dict(model="m", messages=ASK, max_tokens=120, temperature=1.0, seed=seed, logprobs=True,
                      logit_bias={str(think): 30, str(end): 4},
                      response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}})
            resp = oai.chat.completions.create(**kw)
            c = resp.choices[0]
            assert c.finish_reason == "stop", c.message
            jsonschema.validate(json.loads(c.message.content), schema)
            tokens = [t.token for t in c.logprobs.content]
            assert tokens[0] == "<think>" and "</think>" in tokens
            assert "<think>" not in c.message.content
            reasoning = c.message.reasoning_content
            assert reasoning is None or "</think>" not in reasoning
            seen_reasoning += reasoning is not None
            assert resp.usage.completion_tokens_details.reasoning_tokens == tokens.index("</think>") + 1
            chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (reasoning or "")
            assert "".join(d.content or "" for d in deltas) == c.message.content
            assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == \
                resp.usage.completion_tokens_details.reasoning_tokens
    assert seen_reasoning, "no seed gave any reasoning text"


def test_reasoning_then_forced_tool_call(servers):
    """A forced call on a reasoning server: the grammar starts after the reasoning; the call is parsed from the
    content, the reasoning kept apart."""
    proc, model_dir = servers["reasoning"]
    tok = Tokenizer.from_pretrained(model_dir)
    bias = {str(tok.token_to_id("<think>")): 30, str(tok.token_to_id("</think>")): 4}
    with client(proc) as oai:
        c = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                                        temperature=1.0, seed=1, logit_bias=bias).choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert "<tool_call>" not in (c.message.reasoning_content or "")


def test_through_the_gateway(servers, tmp_path_factory):
    """The gateway's HTTP API in front of the reasoning server: it renders the tools with the instance's tokenizer,
    takes the parsers from the instance's ModelInfo, and answers as the instance does (same seed): reasoning apart,
    the forced call parsed, streamed and not."""
    from tests.support.gateway import GatewayProcess, wait_for
    proc, model_dir = servers["reasoning"]
    tok = Tokenizer.from_pretrained(model_dir)
    bias = {str(tok.token_to_id("<think>")): 30, str(tok.token_to_id("</think>")): 4}
    config = {"pools": [{"name": "a", "instances": [{"name": "r", "target": proc.target}]}],
              "isolation": {"enabled": False}}
    gw = GatewayProcess(str(tmp_path_factory.mktemp("tools_gw")), config, "--http_port=0")
    try:
        wait_for(lambda: all(i.report_age_s >= 0 for i in gw.instances().values()), 30, what="load reports")
        kw = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=1.0,
                  seed=2, logit_bias=bias)
        with client(proc) as inst, openai.OpenAI(base_url=f"http://127.0.0.1:{gw.info['http_port']}/v1",
                                                 api_key="unused", max_retries=0, timeout=120) as via:
            want = inst.chat.completions.create(**kw)
            got = via.chat.completions.create(**kw)
            w, g = want.choices[0], got.choices[0]
            assert g.finish_reason == w.finish_reason == "tool_calls"
            assert g.message.reasoning_content == w.message.reasoning_content
            assert [(c.function.name, c.function.arguments) for c in g.message.tool_calls] == \
                [(c.function.name, c.function.arguments) for c in w.message.tool_calls]
            assert got.usage.completion_tokens_details.reasoning_tokens == \
                want.usage.completion_tokens_details.reasoning_tokens
            calls, content, finish = streamed_calls(via.chat.completions.create(**kw, stream=True))
            assert finish == "tool_calls" and content == ""
            assert [(x["name"], x["arguments"]) for x in calls] == \
                [(c.function.name, c.function.arguments) for c in w.message.tool_calls]
    finally:
        if gw.proc.poll() is None:
            gw.stop()
