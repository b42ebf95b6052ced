"""Finding a GGUF model's files (a file, the parts of a split one, or the one model in a directory) without the
`gguf` package, so that checking a model's format imports nothing the device image lacks; reading them:
`models.gguf`."""
from __future__ import annotations

import glob
import os
import re

from models.safetensors_io import CheckpointError

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(CheckpointError):
    """A GGUF file is malformed or holds something meshserve cannot read; the message names the file and the field."""


def is_gguf(path: str) -> bool:
    """Whether `path` is a GGUF file or a directory whose model is one (no safetensors or Orbax checkpoint in it)."""
    return bool(gguf_files(path))


def gguf_files(path: str) -> list[str]:
    """The GGUF file(s) of the model at `path`: the file itself, all parts of a split model (from any part), or the
    one model in a directory (projector files `mmproj*` aside); [] when `path` holds another format."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in (
                "model.safetensors", "model.safetensors.index.json", "meshserve_model.json")):
            return []
        found = sorted(f for f in glob.glob(os.path.join(glob.escape(path), "*.gguf"))
                       if not os.path.basename(f).startswith("mmproj"))
        models = sorted({_SPLIT.sub(r"\g<stem>-*-of-\g<count>.gguf", os.path.basename(f)) for f in found})
        if len(models) > 1:
            raise GGUFError(f"{path} holds {len(models)} GGUF models ({', '.join(models)}); pass one file as the model")
        return _with_parts(found[0]) if found else []
    if path.endswith(".gguf"):
        if not os.path.exists(path):
            raise FileNotFoundError(f"GGUF file {path!r} does not exist")
        return _with_parts(path)
    return []


def _with_parts(path: str) -> list[str]:
    m = _SPLIT.match(os.path.basename(path))
    if not m:
        return [path]
    count = int(m["count"])
    parts = [os.path.join(os.path.dirname(path), f"{m['stem']}-{k:05d}-of-{count:05d}.gguf")
             for k in range(1, count + 1)]
    missing = [p for p in parts if not os.path.exists(p)]
    if missing:
        raise GGUFError(f"{path} is part of a {count}-file split GGUF; missing: {', '.join(missing)}")
    return parts


