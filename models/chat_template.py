"""Chat templates: the sandboxed jinja2 environment they render in (transformers' settings, extensions and globals)
and `render_chat_template`, which renders one to the prompt string from plain-data messages, tools and documents.
Templates come from the Hub or a GGUF file: untrusted code, hence the sandbox and the plain-data inputs."""
from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

# What transformers reads a message's reasoning from; the first is the name templates use.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                         tools: Sequence[Mapping[str, Any]] | None = None,
                         documents: Sequence[Mapping[str, Any]] | None = None,
                         variables: Mapping[str, Any] | None = None) -> str:
    """`source` rendered for `messages` as transformers' `apply_chat_template(tokenize=False)` does; `variables`
    (special tokens, template keyword arguments) reach the template as globals. A template's `raise_exception(...)`
    surfaces as `jinja2.TemplateError`."""
    return _compiled(source).render(
        messages=normalize_messages(messages),
        tools=plain_data(tools),
        documents=plain_data(documents),
        add_generation_prompt=add_generation_prompt,
        **plain_data(dict(variables or {})),
    )


_COMPILED: dict[str, jinja2.Template] = {}


def _compiled(source: str) -> jinja2.Template:
    template = _COMPILED.get(source)
    if template is None:
        if len(_COMPILED) >= 64:  # a server sees a handful of templates; requests may bring their own
            _COMPILED.clear()
        template = _COMPILED[source] = _JINJA_ENV.from_string(source)
    return template


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    # As transformers: drop None-valued keys (OpenAI's content=None), alias reasoning fields.
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {type(message).__name__}: {message!r}")
        message = plain_data({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def plain_data(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types, so the sandbox never sees methods of richer objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' version: no HTML escaping, json.dumps options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes, closing a route to CPython internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes, got {name!r}")


def _make_jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Same settings as transformers: templates from the Hub are untrusted code, hence the sandbox.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_JINJA_ENV = _make_jinja_env()
