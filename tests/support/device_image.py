"""The device machines' image, seen from this one: the packages it has (scripts/device_image.txt), the modules of
every installed package it lacks (`missing_modules`), and an import hook that refuses those (`write_refusing_hook`):
a `sitecustomize.py` that makes them look not installed to Python and its subprocesses, logging each refusal."""
from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent.parent
IMAGE_LIST = ROOT / "scripts" / "device_image.txt"
PROJECT = "meshserve"


def image_packages() -> set[str]:
    """Canonical names of the packages on the device image."""
    return {canonicalize_name(line.strip()) for line in IMAGE_LIST.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def _module_prefixes(dist) -> set[str]:
    """The import names a distribution provides: its top-level packages and modules, or `ns.pkg` inside a namespace
    package (a top-level directory without __init__.py, e.g. google.rpc)."""
    out = set()
    files = dist.files or []
    tops = {f.parts[0] for f in files if len(f.parts) > 1}
    for f in files:
        parts = f.parts
        if not parts or parts[0].endswith((".dist-info", ".data")) or parts[0] in ("..", "bin", "__pycache__"):
            continue
        if len(parts) == 1:
            if parts[0].endswith((".py", ".so", ".pyd")):
                out.add(parts[0].split(".")[0])
            continue
        namespace = not any(g.parts[:2] == (parts[0], "__init__.py") for g in files)
        if namespace and len(parts) > 2 and parts[0] in tops:
            out.add(f"{parts[0]}.{parts[1].split('.')[0]}")
        elif not namespace:
            out.add(parts[0])
    return {m for m in out if m.isidentifier() or all(p.isidentifier() for p in m.split("."))}


def needed_by(roots: set[str], dists: dict) -> set[str]:
    """The installed distributions `roots` require, transitively (markers evaluated here, no extras)."""
    seen, todo = set(), [r for r in roots if r in dists]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in dists[name].requires or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                dep = canonicalize_name(req.name)
                if dep in dists and dep not in seen:
                    todo.append(dep)
    return seen


def missing_modules() -> dict[str, str]:
    """module prefix -> the distribution providing it, for every installed distribution the image lacks (this
    project aside) that no image package installed here requires: the image's own versions of its packages bring
    their own requirements (huggingface-hub here may need a client the image's version does not). A prefix some
    image package also provides (a shared namespace) is not included."""
    image = image_packages()
    dists = {canonicalize_name(d.metadata["Name"] or ""): d for d in importlib.metadata.distributions()}
    allowed = image | needed_by(image, dists)
    kept, refused = set(), {}
    for name, dist in dists.items():
        if not name or name == PROJECT:
            continue
        for prefix in _module_prefixes(dist):
            (kept.add(prefix) if name in allowed else refused.setdefault(prefix, name))
    kept_tops = {m.split(".")[0] for m in kept}
    out = {}
    for module, dist in refused.items():
        top = module.split(".")[0]
        if module in kept or top in kept:
            continue
        out[module if top in kept_tops else top] = dist  # a namespace no image package shares: refused whole
    return out


_HOOK = '''"""Written by tests/support/device_image.py: the packages the device image lacks are not installed here."""
import importlib.abc
import importlib.util
import json
import os
import sys

_REFUSED = json.loads({refused!r})
_LOG = {log!r}


def _refused(name):
    for prefix in (name, name.split(".")[0], ".".join(name.split(".")[:2])):
        if prefix in _REFUSED:
            return prefix
    return None


def _log(kind, name, prefix):
    with open(_LOG, "a") as f:
        f.write(json.dumps([os.getpid(), kind, name, _REFUSED[prefix]]) + "\\n")


class _NotOnTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        prefix = _refused(name)
        if prefix is None:
            return None
        _log("import", name, prefix)
        raise ModuleNotFoundError(f"No module named {{name!r}} ({{_REFUSED[prefix]}} is not on the device image)",
                                  name=name)


_find_spec = importlib.util.find_spec


def _find_spec_not_refused(name, package=None):
    # a probe (`find_spec(x) is not None`) sees these packages as absent, as on the image
    full = importlib.util.resolve_name(name, package) if name.startswith(".") else name
    prefix = _refused(full)
    if prefix is None:
        return _find_spec(name, package)
    _log("probe", full, prefix)
    return None


importlib.util.find_spec = _find_spec_not_refused
sys.meta_path.insert(0, _NotOnTheImage())
for _name in [m for m in sys.modules if _refused(m)]:  # none should be loaded yet; drop any that are
    del sys.modules[_name]
'''


def write_refusing_hook(directory: Path) -> Path:
    """Writes `directory/sitecustomize.py` (put `directory` first on PYTHONPATH) and returns the log it appends each
    refusal to, one JSON line [pid, "import" | "probe" (importlib.util.find_spec), module, distribution]."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "refused.jsonl"
    log.write_text("")
    (directory / "sitecustomize.py").write_text(_HOOK.format(refused=json.dumps(missing_modules()), log=str(log)))
    return log
