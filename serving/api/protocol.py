"""OpenAI's /v1/chat/completions and /v1/completions requests as pydantic models (unknown fields ignored, types
strict), mapped onto one engine request (`EngineRequest`: token ids per prompt, SamplingParams keywords, priority; the
sampling parameters pass through by name, as serving.params lists them); OpenAI error bodies (`ApiError`). Values are
checked by serving.params when SamplingParams is made, so both APIs reject the same values for the same reasons;
`api_error` turns such a ValueError into a 400 naming the request's parameter."""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serving.api import reasoning as reasoning_api
from serving.api import tools as tools_api
from serving.params import (INT32_FIELDS, MAX_CACHE_SALT_CHARS, PRIORITIES, InvalidArgument, SamplingParams,
                            StructuredOutput, check_token_ids, encode_chat, openai_fields)

TEXT_PART_TYPES = ("text", "input_text")
UNION_TYPES = {"prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
               "stop": "a string or a list of strings"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}


# ---------------------------------------------------------------------------- errors
class ApiError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_FIELD = re.compile(r"[A-Za-z_][\w.\[\]]*")


def api_error(e: ValueError, renames: dict[str, str] | None = None, *, code: str | None = None) -> ApiError:
    """A 400 from a ValueError whose message starts with the field's name (serving.params' convention),
    with meshserve's names (`sampling.max_tokens`, `logprobs`) renamed to the request's (`renames`)."""
    message = str(e).removeprefix("sampling.")
    m = _FIELD.match(message)
    param = m.group(0).rstrip(".") if m else None
    if param is not None:
        base = re.split(r"[.\[]", param, maxsplit=1)[0]
        if renames and base in renames:
            renamed = renames[base] + param[len(base):]
            message, param = renamed + message[len(param):], renamed
    return ApiError(400, message, param=param, code=code)


def validation_error(e: ValidationError) -> ApiError:
    """pydantic's first error as a 400 naming the parameter (`messages[2].content`, `temperature`)."""
    err = e.errors()[0]
    loc = err.get("loc", ())
    param = str(loc[0]) if loc else None
    detail = err.get("msg", "invalid value")
    for part in loc[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in ("role", "content", "type", "text", "include_usage"):
            param += f".{part}"
        else:  # a union member's tag or a dict key: the parameter is named enough
            if param in UNION_TYPES:
                detail = f"must be {UNION_TYPES[param]}"
            break
    return ApiError(400, f"{param}: {detail}" if param else detail, param=param)


def response_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def model_list(name: str, created: int, *, root: str | None = None, max_model_len: int | None = None,
               adapters: Sequence[dict] = ()) -> dict:
    """GET /v1/models' body: the model served, then its LoRA adapters (`adapters`: {name, path}), each with the
    model as its `parent` (as vLLM lists them)."""
    card = {"object": "model", "created": created, "owned_by": "meshserve", "max_model_len": max_model_len}
    return {"object": "list", "data": [{"id": name, **card, "root": root, "parent": None}] + [
        {"id": a["name"], **card, "root": a.get("path"), "parent": name} for a in adapters]}


def model_not_found(model: str, served: str, adapters: Sequence[str] = ()) -> ApiError:
    also = f" and the LoRA adapters {', '.join(f'`{a}`' for a in adapters)}" if adapters else ""
    return ApiError(404, f"The model `{model}` does not exist; this server serves `{served}`{also}.", param="model",
                    code="model_not_found")


# ---------------------------------------------------------------------------- requests
class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Model):
    include_usage: bool | None = None


class ContentPart(_Model):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Model):
    """One message; fields beyond role and content (name, tool_calls, tool_call_id, reasoning_content) reach the
    chat template as they are."""
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None


class _GenerateRequest(_Model):
    """The fields both requests share. None: the default (OpenAI's, else SamplingParams'). Every SamplingParams field
    is here by its name (serving.params.openai_fields), except those serving.params.OPENAI_BY_HAND lists."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int | None = None  # meshserve's: 0 interactive, 1 batch
    # vLLM's: requests share prefix-cache entries only with requests of the same salt (the instance's HTTP API)
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's constrained decoding: exactly one of json (a schema), regex, choice, grammar (Lark), json_object
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = None


class TokenizeRequest(_Model):
    """vLLM's /tokenize: `prompt` text, or `messages` rendered with the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Model):
    """vLLM's POST /v1/load_lora_adapter (and, without lora_path, /v1/unload_lora_adapter)."""
    lora_name: str
    lora_path: str | None = None


# ---------------------------------------------------------------------------- the engine request
@dataclasses.dataclass(slots=True)
class Prompt:
    token_ids: list[int] | None  # None: not tokenized here (`text` or `messages` go to an instance that does)
    text: str | None  # a text prompt as sent: what an echo repeats, the text to tokenize (None: token ids, a chat)
    field: str  # the request parameter it came from: "messages", "prompt", "prompt[2]"
    messages: list[dict] | None = None  # a chat not rendered here (the gateway without a tokenizer)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


@dataclasses.dataclass(slots=True)
class EngineRequest:
    """What an OpenAI request asks of the engine: one engine request per prompt, each with `sampling` (SamplingParams
    keywords; n samples each)."""
    prompts: list[Prompt]
    sampling: dict
    priority: int
    stream: bool
    include_usage: bool
    echo: bool = False
    renames: dict[str, str] = dataclasses.field(default_factory=dict)  # SamplingParams field -> request parameter
    tool_parser: str = ""  # chat with tools to call: the parser that turns the output into tool_calls
    cache_salt: str = ""  # the request's prefix-cache salt (Request.cache_salt)

    @property
    def n(self) -> int:
        return self.sampling.get("n", 1)

    def sampling_params(self) -> SamplingParams:
        """`sampling` as the engine's SamplingParams; raises ValueError (`api_error` names the parameter)."""
        kw = dict(self.sampling)
        if "structured" in kw:
            kw["structured"] = StructuredOutput(**kw["structured"])
        return SamplingParams(**kw)


def _check_widths(kw: dict, renames: dict[str, str]) -> None:
    """meshserve.v1's integer widths (serving.params.INT32_FIELDS; other integers are 64-bit): a value that does not
    fit is a 400 naming the parameter."""
    for name, value in kw.items():
        bits = 32 if name in INT32_FIELDS else 64
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        for v in value if name in ("stop_token_ids", "logit_bias") else (value,):  # logit_bias: its token ids
            if isinstance(v, int) and not isinstance(v, bool) and not lo <= v <= hi:
                param = renames.get(name, name)
                raise ApiError(400, f"{param}: {v} does not fit a {bits}-bit integer; use a value in [{lo}, {hi}]",
                               param=param)


_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}


def structured_output(req: _GenerateRequest, renames: dict[str, str]) -> dict | None:
    """`response_format` (OpenAI's json_object / json_schema) or `structured_outputs` (vLLM's json / regex /
    choice / grammar) as StructuredOutput keywords (plain data, so the gateway can send them on); None for free
    text. Raises ApiError naming the parameter; the grammar itself is compiled where the model is."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and so is not None:
        raise ApiError(400, "structured_outputs: send either response_format or structured_outputs, not both",
                       param="structured_outputs")
    if rf is not None:
        kind = rf.get("type", "text")
        renames["structured"] = "response_format"
        if kind == "text":
            return None
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise ApiError(400, "response_format.json_schema: expected an object with `name` and `schema` (a "
                               "JSON schema object)", param="response_format.json_schema")
            return {"json_schema": json.dumps(spec.get("schema", {}))}  # OpenAI: no schema = any JSON
        raise ApiError(400, f"response_format.type: unknown {kind!r}; use text, json_object or json_schema",
                       param="response_format.type")
    if so is None:
        return None
    renames["structured"] = "structured_outputs"
    given = [k for k in so if so[k] is not None and k in _STRUCTURED_KEYS]
    unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
    if unknown or len(given) != 1:
        raise ApiError(400, "structured_outputs: set exactly one of " + ", ".join(_STRUCTURED_KEYS)
                       + (f" (unknown: {', '.join(unknown)})" if unknown else ""), param="structured_outputs")
    key = given[0]
    value = so[key]
    if key == "json":
        value = value if isinstance(value, str) else json.dumps(value)
    elif key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, "structured_outputs.choice: a list of one or more non-empty strings",
                           param="structured_outputs.choice")
    elif key == "json_object":
        if value is not True:
            raise ApiError(400, "structured_outputs.json_object: must be true", param="structured_outputs.json_object")
    elif not isinstance(value, str) or not value:
        raise ApiError(400, f"structured_outputs.{key}: a non-empty string", param=f"structured_outputs.{key}")
    return {_STRUCTURED_KEYS[key]: value}


def _sampling(req: _GenerateRequest, max_tokens: int | None, logprobs: int | None,
              renames: dict[str, str] | None = None) -> dict:
    """SamplingParams keywords: every field of the same name the request sets, and those mapped by hand."""
    kw = {name: getattr(req, name) for name in openai_fields() if getattr(req, name) is not None}
    kw["max_tokens"] = max_tokens
    kw["logprobs"] = logprobs
    _check_widths(kw, renames if renames is not None else {})
    structured = structured_output(req, renames if renames is not None else {})
    if structured is not None:
        kw["structured"] = structured
    return kw


def _common(req: _GenerateRequest) -> tuple[int, bool, bool]:
    priority = 0 if req.priority is None else req.priority
    if priority not in PRIORITIES:
        raise ApiError(400, f"priority: unknown value {priority}; use 0 (interactive) or 1 (batch)", param="priority")
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise ApiError(400, "stream_options: only allowed with stream=true", param="stream_options")
    include_usage = bool(stream and req.stream_options is not None and req.stream_options.include_usage)
    return priority, stream, include_usage


def parser_markers(tool_call_parser: str, reasoning_parser: str) -> tuple[str, ...]:
    """The markers the chat parsers read, which decoded text must keep even where they are special tokens."""
    markers = tools_api.tool_parser(tool_call_parser).markers if tool_call_parser else ()
    if reasoning_parser:
        markers += reasoning_api.reasoning_parser(reasoning_parser).markers
    return markers


def _arguments_as_objects(i: int, d: dict) -> None:
    """An assistant message's tool_calls with each `function.arguments` (OpenAI's JSON text) as the object it holds,
    which chat templates expect (they write it with `tojson`); text that is not a JSON object stays as it is."""
    calls = d.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        where = f"messages[{i}].tool_calls"
        raise ApiError(400, f"{where}: expected a list of tool calls", param=where)
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                continue
            if isinstance(args, dict):
                fn["arguments"] = args


def _message_dict(i: int, m: ChatMessage) -> dict:
    d = m.model_dump(exclude_none=True)
    _arguments_as_objects(i, d)
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type not in TEXT_PART_TYPES:
                raise ApiError(400, f"messages[{i}].content[{j}].type: {part.type!r} parts are not supported; this "
                               "model takes text parts only", param=f"messages[{i}].content[{j}].type")
            if part.text is None:
                where = f"messages[{i}].content[{j}].text"
                raise ApiError(400, f"{where}: missing", param=where)
            texts.append(part.text)
        d["content"] = "\n".join(texts)
    return d


# chat_template_kwargs names refused: a request's own template (its loops are unbounded and it renders on the event
# loop, so one request could stall the server), and the names the rendering passes itself (a clash was a TypeError).
_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "messages", "add_generation_prompt", "tokenizer", "field",
                                       "self"})


def _tools(req: ChatCompletionRequest, tokenizer, tool_call_parser: str, sampling: dict, renames: dict) -> str:
    """`tools` and `tool_choice` checked; `required` or a named function forced with the parser's grammar (into
    sampling["structured"]). Returns the parser to read the output with ("" when no tool calls are expected)."""
    if req.tools is None and req.tool_choice is None:
        return ""
    try:
        tools_api.check_tools(req.tools, req.tool_choice)
    except ValueError as e:
        raise api_error(e) from e
    if req.tool_choice == "none" or not req.tools:
        return ""
    if req.tool_choice in (None, "auto"):
        return tool_call_parser  # "": this model's tool calls are not parsed, its output is content
    if not tool_call_parser:
        raise ApiError(400, "tool_choice: this server does not know its model's tool-call format, so it cannot force "
                       "a call; start it with --tool_call_parser", param="tool_choice")
    if "structured" in sampling:
        other = renames["structured"]
        raise ApiError(400, f"tool_choice: a forced tool call cannot be combined with {other}", param="tool_choice")
    parser = tools_api.tool_parser(tool_call_parser)
    special = {}
    if tokenizer is not None:
        special = {m: i for m in parser.markers if (i := tokenizer.special_token_id(m)) is not None}
    try:
        grammar = tools_api.tool_grammar(tool_call_parser, req.tools, req.tool_choice, special_tokens=special)
    except ValueError as e:
        raise api_error(e) from e
    sampling["structured"] = {"grammar": grammar}
    renames["structured"] = "tool_choice"
    return tool_call_parser


def chat_request(req: ChatCompletionRequest, tokenizer, *, render_elsewhere: bool = False,
                 tool_call_parser: str = "") -> EngineRequest:
    """Raises ApiError (400) naming the parameter. render_elsewhere (the gateway): without a tokenizer, the messages
    go on as they are, for the instance to render. tool_call_parser: the model's tool-call format (serving.api.tools),
    which parses calls and forces them for tool_choice `required` or a named function."""
    priority, stream, include_usage = _common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
    renames = {"logprobs": "top_logprobs"}
    max_tokens = req.max_tokens
    if req.max_completion_tokens is not None:
        max_tokens, renames["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    sampling = _sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, renames)
    parser = _tools(req, tokenizer, tool_call_parser, sampling, renames)
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
    kwargs = dict(req.chat_template_kwargs or {})
    refused = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if refused:
        raise ApiError(400, f"chat_template_kwargs: {refused[0]!r} cannot be set here; the model's chat template "
                       "renders the request's own messages and add_generation_prompt", param="chat_template_kwargs")
    if req.tools is not None:
        kwargs["tools"] = req.tools
    generation_prompt = req.add_generation_prompt is not False
    if tokenizer is None and render_elsewhere:
        if kwargs:
            which = "tools" if req.tools is not None else "chat_template_kwargs"
            raise ApiError(400, f"{which}: the gateway renders these with the model's chat template and has no "
                           "tokenizer; set `tokenizer:` in its configuration", param=which)
        for i, m in enumerate(messages):
            extra = sorted(set(m) - {"role", "content"})
            if extra:
                raise ApiError(400, f"messages[{i}].{extra[0]}: the gateway renders this with the model's chat "
                               "template and has no tokenizer; set `tokenizer:` in its configuration",
                               param=f"messages[{i}].{extra[0]}")
        prompt = Prompt(None, None, "messages", messages=messages, add_generation_prompt=generation_prompt)
        return EngineRequest([prompt], sampling, priority, stream, include_usage, renames=renames, tool_parser=parser)
    try:
        ids = encode_chat(tokenizer, messages, field="messages", add_generation_prompt=generation_prompt, **kwargs)
    except ValueError as e:
        raise api_error(e) from e
    return EngineRequest([Prompt(ids, None, "messages")], sampling, priority, stream, include_usage, renames=renames,
                         tool_parser=parser)


def completion_request(req: CompletionRequest, tokenizer, *, render_elsewhere: bool = False) -> EngineRequest:
    """Raises ApiError (400) naming the parameter; token ids are checked where the model is known (the engine's
    make_request, the gateway's check). render_elsewhere (the gateway): without a tokenizer, text prompts go on as
    text, for the instance to tokenize."""
    priority, stream, include_usage = _common(req)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise ApiError(400, f"best_of: only best_of = n is supported, got best_of={req.best_of}", param="best_of")
    if req.echo and req.logprobs is not None:
        raise ApiError(400, "echo: echo with logprobs needs the prompt's logprobs, which this server does not compute",
                       param="echo")
    p = req.prompt
    single = isinstance(p, str) or (bool(p) and isinstance(p[0], int))
    items = [p] if single else list(p)
    if not items:
        raise ApiError(400, "prompt: empty; send a string, a list of strings, token ids or a list of token-id lists",
                       param="prompt")
    prompts = []
    add_special = req.add_special_tokens is not False
    try:
        for i, item in enumerate(items):
            field = "prompt" if single else f"prompt[{i}]"
            if not item:
                raise InvalidArgument(f"{field}: the prompt is empty")
            if isinstance(item, str):
                if tokenizer is None and render_elsewhere:
                    prompts.append(Prompt(None, item, field, add_special_tokens=add_special))
                    continue
                if tokenizer is None:
                    raise InvalidArgument(f"{field}: this model has no tokenizer; send token ids")
                prompts.append(Prompt(tokenizer.encode(item, add_special_tokens=add_special), item, field))
            else:
                if req.echo and tokenizer is None and render_elsewhere:
                    raise InvalidArgument("echo: echoing token ids needs their text, and the gateway has no "
                                          "tokenizer; set `tokenizer:` in its configuration")
                prompts.append(Prompt(list(item), None, field))
    except InvalidArgument as e:
        raise api_error(e) from e
    renames: dict[str, str] = {}
    sampling = _sampling(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs, renames)
    return EngineRequest(prompts, sampling, priority, stream, include_usage, echo=bool(req.echo), renames=renames)


def echo_texts(ereq: EngineRequest, tokenizer) -> list[str | None] | None:
    """What an echo repeats of each prompt (None without echo): the text sent, or the token ids decoded (once the
    engine's side has checked them)."""
    if not ereq.echo:
        return None
    return [p.text if p.text is not None or tokenizer is None or p.token_ids is None
            else tokenizer.decode(p.token_ids, skip_special_tokens=False) for p in ereq.prompts]


def tokenize_request(req: TokenizeRequest, tokenizer) -> list[int]:
    """vLLM's /tokenize: the token ids of `prompt` or of the rendered `messages`; raises ApiError (400)."""
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "prompt: send exactly one of prompt and messages", param="prompt")
    try:
        if req.messages is not None:
            messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
            return encode_chat(tokenizer, messages, field="messages",
                               add_generation_prompt=req.add_generation_prompt is not False)
        if tokenizer is None:
            raise InvalidArgument("prompt: this model has no tokenizer")
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    except ValueError as e:
        raise api_error(e) from e


def tokenize_response(req: TokenizeRequest, tokenizer, max_model_len: int) -> dict:
    """vLLM's /tokenize body."""
    if tokenizer is None:
        raise ApiError(400, "prompt: no tokenizer here (a model without one, or a gateway without `tokenizer:` in "
                       "its configuration)", param="prompt")
    ids = tokenize_request(req, tokenizer)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": [tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None}


def detokenize_response(req: DetokenizeRequest, tokenizer, vocab_size: int) -> dict:
    """vLLM's /detokenize body."""
    try:
        if vocab_size:
            check_token_ids("tokens", req.tokens, vocab_size)
        if tokenizer is None:
            raise InvalidArgument("tokens: no tokenizer here (a model without one, or a gateway without `tokenizer:` "
                                  "in its configuration)")
    except ValueError as e:
        raise api_error(e) from e
    return {"prompt": tokenizer.decode(req.tokens)}
