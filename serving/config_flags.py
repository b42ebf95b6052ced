"""Config dataclass fields that are also command-line flags: `option()` gives a field its flag's help text (and its
choices); `flag_definitions` gives the absl flags of the fields' names, types and defaults, and `from_flags` builds
the dataclass back from the parsed values, so each setting is written once, in its dataclass."""
from __future__ import annotations

import dataclasses
import types
import typing

_MISSING = dataclasses.MISSING


def option(default=_MISSING, help: str = "", *, choices: tuple | None = None, none_as=None,
           flag_default=_MISSING):
    """A dataclass field with a flag. `choices`: an enum flag; `none_as`: the flag's value that stands for the field's
    None (e.g. 0 for "no cap"); `flag_default`: the flag's default where it deliberately differs from the field's."""
    if not help:
        raise ValueError("option() needs the flag's help text")
    metadata = {"help": help, "choices": choices, "none_as": none_as, "flag_default": flag_default}
    return dataclasses.field(default=default, metadata=metadata)


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` that are flags (made with `option`), in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_default(field: dataclasses.Field):
    """The default the field's flag shows: its own where given, else the field's (None as `none_as`; None for a
    required field)."""
    if field.metadata["flag_default"] is not _MISSING:
        return field.metadata["flag_default"]
    default = None if field.default is _MISSING else field.default
    return field.metadata["none_as"] if default is None and field.metadata["none_as"] is not None else default


def _base_type(cls, name: str) -> type:
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint, = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def flag_definitions(cls) -> list[tuple]:
    """One `(absl DEFINE_* function, *its positional arguments)` per flag field of dataclass `cls`, the flag named as
    the field. The entry point calls them itself, so absl files the flags under its module (what `--help` lists)."""
    from absl import flags
    defines = {str: flags.DEFINE_string, int: flags.DEFINE_integer, float: flags.DEFINE_float,
               bool: flags.DEFINE_boolean}
    out = []
    for field in flag_fields(cls):
        help_text, choices = field.metadata["help"], field.metadata["choices"]
        if choices is not None:
            out.append((flags.DEFINE_enum, field.name, flag_default(field), list(choices), help_text))
            continue
        kind = _base_type(cls, field.name)
        if kind not in defines:
            raise TypeError(f"{cls.__name__}.{field.name}: no flag type for {kind!r}; expected one of "
                            f"{[t.__name__ for t in defines]}")
        out.append((defines[kind], field.name, flag_default(field), help_text))
    return out


def from_flags(cls, fv, **overrides):
    """Dataclass `cls` from the parsed flags `fv` (a flag at its `none_as` value gives None); `overrides` win."""
    values = {}
    for field in flag_fields(cls):
        value = getattr(fv, field.name)
        none_as = field.metadata["none_as"]
        values[field.name] = None if none_as is not None and value == none_as else value
    return cls(**(values | overrides))
