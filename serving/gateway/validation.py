"""The GenerateRequest checks the gateway runs before routing, with the instance server's codes and messages
(`check_generate`: serving.wire.requests reads the request as an instance does, serving.params.check_prompt checks it
against the model the instances report), and the prompt-length estimate that picks a lane (`estimate_prompt_tokens`).
Details: docs/gateway.md."""
from __future__ import annotations

from serving.params import InvalidArgument, ModelLimits, SamplingParams, check_max_tokens, check_prompt
from serving.wire import meshserve_pb2 as pb
from serving.wire.requests import read_generate, status_details


def check_generate(req: pb.GenerateRequest, limits: ModelLimits) -> tuple[SamplingParams, list[int] | None]:
    """Every field in the instance's order, where the gateway can check it (text and chats are tokenized by the
    instance; an unknown limit is 0); raises InvalidArgument with the instance's details. Returns the sampling
    parameters and the prompt's token ids (None unless the prompt is token ids)."""
    try:
        call = read_generate(req, limits.max_request_bytes, tokenize=False)
        check_prompt(call.field, call.prompt_ids, call.params, limits)
        if call.prompt_ids is not None and limits.max_model_len:
            check_max_tokens(len(call.prompt_ids), call.params.max_tokens, limits.max_model_len)
    except ValueError as e:
        raise InvalidArgument(status_details(e)) from e
    return call.params, call.prompt_ids


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
