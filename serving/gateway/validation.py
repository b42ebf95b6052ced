"""GenerateRequest checks the gateway runs before routing, with the instance server's codes and messages
(`check_generate`: the shared serving.validation checks, the prompt's shape, token ids against vocabulary and context),
and the prompt-length estimate that picks a lane (`estimate_prompt_tokens`). Details: docs/gateway.md."""
from __future__ import annotations

import dataclasses

from serving.wire import meshserve_pb2 as pb
from serving.validation import (InvalidArgument, check_context, check_request_header, check_sampling,
                                check_vocabulary, sampling_fields)

KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer")
PRIORITY_VALUES = (pb.PRIORITY_INTERACTIVE, pb.PRIORITY_BATCH)


@dataclasses.dataclass(slots=True)
class ModelLimits:
    """What the gateway knows of the model behind its instances (from ModelInfo); 0 = not known yet."""
    vocab_size: int = 0
    max_model_len: int = 0
    max_request_bytes: int = 1 << 20


@dataclasses.dataclass(slots=True)
class _Sampling:  # SamplingParams' fields with its defaults, for check_sampling
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    logit_bias: dict | None = None


def check_sampling_fields(sp: pb.SamplingParameters, limits: ModelLimits) -> _Sampling:
    """The instance server's checks in its order: the shared ones, then token ids against the vocabulary (when
    known)."""
    s = _Sampling(**sampling_fields(sp))
    if s.top_k == 0:
        s.top_k = -1
    try:
        check_sampling(s)
        if limits.vocab_size:
            check_vocabulary(s, limits.vocab_size)
    except ValueError as e:
        raise InvalidArgument(f"sampling.{e}") from e
    return s


def check_prompt(which: str | None, req: pb.GenerateRequest, limits: ModelLimits) -> list[int] | None:
    """The prompt's shape (and token ids); returns the ids of a token_ids prompt, None for text and chat."""
    if which == "text":
        if not req.text:
            raise InvalidArgument("text: the prompt is empty")
        return None
    if which == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids:
            raise InvalidArgument("token_ids: the prompt is empty")
        if limits.vocab_size:
            for i, t in enumerate(ids):
                if not 0 <= t < limits.vocab_size:
                    raise InvalidArgument(f"token_ids: token id {t} at position {i} is outside the vocabulary "
                                          f"[0, {limits.vocab_size})")
        return ids
    if which == "chat":
        if not req.chat.messages:
            raise InvalidArgument("chat.messages: the conversation is empty")
        for i, m in enumerate(req.chat.messages):
            if not m.role:
                raise InvalidArgument(f"chat.messages[{i}].role: empty; use one of {', '.join(KNOWN_ROLES)}")
        return None
    raise InvalidArgument("prompt: empty; set one of text, token_ids or chat")


def check_generate(req: pb.GenerateRequest, limits: ModelLimits) -> tuple[_Sampling, list[int] | None]:
    """Every field in the server's order; raises InvalidArgument. Returns the sampling fields and the prompt's
    token ids (None unless the prompt is token ids)."""
    which = check_request_header(req, limits.max_request_bytes, PRIORITY_VALUES)
    sampling = check_sampling_fields(req.sampling, limits)
    ids = check_prompt(which, req, limits)
    if ids is not None and limits.max_model_len:
        check_context("token_ids", len(ids), sampling.max_tokens, limits.max_model_len)
    return sampling, ids


def estimate_prompt_tokens(req: pb.GenerateRequest, tokenizer=None) -> int:
    """Prompt length for lane choice: exact for token ids (or with a tokenizer), else ~4 bytes per token."""
    which = req.WhichOneof("prompt")
    if which == "token_ids":
        return len(req.token_ids.ids)
    if which == "text":
        if tokenizer is not None:
            return len(tokenizer.encode(req.text))
        return len(req.text.encode()) // 4 + 1
    if which == "chat":
        if tokenizer is not None:
            try:
                return len(tokenizer.encode_chat([{"role": m.role, "content": m.content}
                                                  for m in req.chat.messages], add_generation_prompt=True))
            except Exception:  # noqa: BLE001 - the instance reports the template's error
                pass
        return sum(len(m.content.encode()) // 4 + 4 for m in req.chat.messages) + 1
    return 0
