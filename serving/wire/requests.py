"""A meshserve.v1 GenerateRequest read as the engine's request (`read_generate` -> `GenerateCall`: prompt,
SamplingParams, priority, deadline), once for the instance server and the gateway: its size, id and priority; its
SamplingParameters as SamplingParams, field by field by name (`sampling_params`); its prompt tokenized where a
tokenizer is (`tokenize_prompt`), else checked for shape. `status_details` says an error as meshserve.v1 names the
field."""
from __future__ import annotations

import dataclasses
import time

from serving.params import (MAX_CACHE_SALT_CHARS, MAX_REQUEST_ID_CHARS, PRIORITIES, PROTO_BY_HAND, InvalidArgument,
                            InvalidSampling, SamplingParams, StructuredOutput, check_roles, encode_chat, field_names)
from serving.wire.decoding import is_repeated

PROMPT_FIELDS = {"text": "text", "token_ids": "token_ids", "chat": "chat.messages"}  # as error messages name them


@dataclasses.dataclass(slots=True)
class GenerateCall:
    """What a GenerateRequest asks of the engine."""
    field: str  # the prompt's field, as errors name it: text, token_ids or chat.messages
    prompt_ids: list[int] | None  # None: a text or chat prompt left to the instance to tokenize (a gateway)
    params: SamplingParams
    priority: int
    deadline: float | None  # time.monotonic(); None: none


def status_details(e: ValueError) -> str:
    """A check's error as the INVALID_ARGUMENT details: sampling parameters named as meshserve.v1 nests them."""
    return f"sampling.{e}" if isinstance(e, InvalidSampling) else str(e)


def check_request_header(req, max_request_bytes: int) -> str | None:
    """The request's size, request_id and priority, in that order; raises InvalidArgument. Returns which prompt field
    is set (`req.WhichOneof("prompt")`)."""
    which = req.WhichOneof("prompt")
    size = req.ByteSize()
    if size > max_request_bytes:
        field = PROMPT_FIELDS.get(which, "request")
        raise InvalidArgument(f"{field}: the request is {size} bytes, over the server's limit of "
                              f"{max_request_bytes} bytes (--max_request_bytes)")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id: {len(req.request_id)} characters, more than {MAX_REQUEST_ID_CHARS}")
    if req.priority not in PRIORITIES:
        raise InvalidArgument(f"priority: unknown value {req.priority}; use PRIORITY_INTERACTIVE or "
                              "PRIORITY_BATCH")
    if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt: {len(req.cache_salt)} characters, more than {MAX_CACHE_SALT_CHARS}")
    return which


def prefix_cache_salt(req) -> str:
    """The engine's cache salt of a GenerateRequest: its tenant (the gateway sets it), and the client's cache_salt
    within that tenant, so neither a tenant nor a salt shares another's cached prefixes."""
    return f"{req.tenant}\x00{req.cache_salt}" if req.cache_salt else req.tenant


def structured_output(sp) -> StructuredOutput | None:
    """meshserve.v1's StructuredOutput as the engine's (None when unset); raises InvalidSampling naming the field."""
    if not sp.HasField("structured"):
        return None
    so = sp.structured
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidSampling("structured: set one of json_schema, json_object, regex, grammar, choice")
    value = getattr(so, kind)
    if kind == "choice":
        value = tuple(value.values)
    elif kind == "json_object" and not value:
        raise InvalidSampling("structured.json_object: set it to true, or leave structured unset")
    elif isinstance(value, str) and not value:
        raise InvalidSampling(f"structured.{kind}: empty")
    return StructuredOutput(**{kind: value}, after_reasoning=so.after_reasoning)


def sampling_params(sp) -> SamplingParams:
    """A SamplingParameters message as SamplingParams: every field of the same name (an unset `optional` one takes
    SamplingParams' default; repeated fields and maps as tuples and dicts), and `structured`. Raises
    InvalidSampling."""
    kw = {}
    fields = sp.DESCRIPTOR.fields_by_name
    for name in field_names():
        if name in PROTO_BY_HAND:
            continue
        field = fields[name]
        if field.has_presence and not sp.HasField(name):
            continue
        value = getattr(sp, name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = dict(value)
        elif is_repeated(field):
            value = tuple(value)
        kw[name] = value
    return SamplingParams(**kw, structured=structured_output(sp))


def tokenize_prompt(which: str | None, req, tokenizer) -> list[int]:
    """The prompt of a GenerateRequest or TokenizeRequest as token ids (`which`: its prompt field); raises
    InvalidArgument naming the field. The ids of a token_ids prompt are checked against the model by the engine."""
    if which == "text":
        if not req.text:
            raise InvalidArgument("text: the prompt is empty")
        if tokenizer is None:
            raise InvalidArgument("text: this model has no tokenizer; send token_ids")
        add = req.add_special_tokens if req.HasField("add_special_tokens") else True
        return tokenizer.encode(req.text, add_special_tokens=add)
    if which == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids:
            raise InvalidArgument("token_ids: the prompt is empty")
        return ids
    if which == "chat":
        chat = req.chat
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return encode_chat(tokenizer, [{"role": m.role, "content": m.content} for m in chat.messages],
                           field="chat.messages", add_generation_prompt=add_gen)
    raise InvalidArgument("prompt: empty; set one of text, token_ids or chat")


def _check_shape(which: str | None, req) -> list[int] | None:
    """The prompt's shape where it is not tokenized (a gateway); the ids of a token_ids prompt, None for the others."""
    if which == "token_ids":
        return tokenize_prompt(which, req, None)
    if which == "text":
        if not req.text:
            raise InvalidArgument("text: the prompt is empty")
        return None
    if which == "chat":
        if not req.chat.messages:
            raise InvalidArgument("chat.messages: the conversation is empty")
        check_roles("chat.messages", req.chat.messages)
        return None
    raise InvalidArgument("prompt: empty; set one of text, token_ids or chat")


def read_generate(req, max_request_bytes: int, *, tokenizer=None, tokenize: bool = True,
                  time_remaining: float | None = None) -> GenerateCall:
    """The request's header, sampling parameters and prompt, in that order (raises InvalidArgument / InvalidSampling:
    `status_details` says them). tokenize: the prompt as token ids (the instance; `tokenizer` None: a model without
    one), else text and chats left as they are (the gateway). time_remaining: the call's (s), for the deadline."""
    which = check_request_header(req, max_request_bytes)
    params = sampling_params(req.sampling)
    ids = tokenize_prompt(which, req, tokenizer) if tokenize else _check_shape(which, req)
    deadline = None if time_remaining is None else time.monotonic() + time_remaining
    return GenerateCall(PROMPT_FIELDS[which], ids, params, int(req.priority), deadline)
