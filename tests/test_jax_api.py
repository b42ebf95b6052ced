"""The JAX API the project uses, read from the source with ast (every import and every attribute chain on `jax`,
`lax` or an imported JAX module, in the packages and the tests): each name must exist in the installed JAX and take
the keywords and the number of positional arguments the project passes; the experimental and private names, jaxlib's
and the `jax.config` options must equal the checked-in list `jax_compat/USED_API.txt`, the one file to read against
a new JAX's changelog (a new use is added there in the same change). Run under each JAX the project supports."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("jax_compat", "models", "pallas_kernels", "sharding", "serving", "tests")
USED_API = ROOT / "jax_compat" / "USED_API.txt"
# What the list holds: the names whose stability JAX does not promise, and its configuration options.
LISTED_PREFIXES = ("jax.experimental", "jax._src", "jaxlib", "jax.extend", "jax.config:")


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


class Use:
    """Where a JAX name is used, and the keywords / positional counts of its calls."""

    def __init__(self):
        self.files: set[str] = set()
        self.keywords: set[str] = set()
        self.calls: list[tuple[int, frozenset[str], bool, str]] = []  # (positional, keywords, starred, where)


def jax_uses(root: Path = ROOT, packages=SCANNED) -> dict[str, Use]:
    """Full dotted JAX name -> its uses; `jax.config:NAME` for each configuration option read or updated."""
    uses: dict[str, Use] = {}

    def add(name: str, where: str) -> Use:
        use = uses.setdefault(name, Use())
        use.files.add(where)
        return use

    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            if "jax" not in text:
                continue
            where = str(path.relative_to(root))
            alias, chains, calls, inner = {"jax": "jax"}, [], {}, set()
            for node in ast.walk(ast.parse(text, where)):  # one pass: imports, attribute chains, calls
                if isinstance(node, ast.Attribute):
                    chains.append(node)
                    inner.add(id(node.value))
                elif isinstance(node, ast.Call):
                    calls[id(node.func)] = node
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] in ("jax", "jaxlib"):
                            alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                            add(a.name, where)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level \
                        and node.module.split(".")[0] in ("jax", "jaxlib"):
                    for a in node.names:
                        alias[a.asname or a.name] = f"{node.module}.{a.name}"
                        add(f"{node.module}.{a.name}", where)
            for node in chains:
                if id(node) in inner:  # a prefix of a longer chain
                    continue
                chain = _chain(node)
                if not chain or chain[0] not in alias:
                    continue
                name = ".".join([alias[chain[0]], *chain[1:]])
                if name.startswith("jax.numpy"):
                    continue
                if name.startswith("jax.config.jax_"):
                    add("jax.config:" + name.rsplit(".", 1)[1], where)
                    continue
                use = add(name, where)
                call = calls.get(id(node))
                if call is not None:
                    keywords = frozenset(k.arg for k in call.keywords if k.arg)
                    starred = any(isinstance(a, ast.Starred) for a in call.args) or any(
                        k.arg is None for k in call.keywords)
                    use.keywords |= keywords
                    use.calls.append((len(call.args), keywords, starred, f"{where}:{call.lineno}"))
                    if name == "jax.config.update" and call.args and isinstance(call.args[0], ast.Constant):
                        add("jax.config:" + call.args[0].value, where)
    return uses


def listed(uses: dict[str, Use]) -> list[str]:
    """The lines of USED_API.txt for `uses`: each listed name, with the keywords the project passes to it."""
    out = []
    for name in sorted(uses):
        if name.startswith(LISTED_PREFIXES):
            kw = sorted(uses[name].keywords)
            out.append(f"{name}({', '.join(kw)})" if kw else name)
    return out


def resolve_name(name: str):
    """The object a dotted JAX name names in the installed JAX (importing modules as needed); AttributeError or
    ImportError when it is not there."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            if i == 1:
                raise
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


@pytest.fixture(scope="module")
def uses():
    return jax_uses()


def used_api_file() -> dict[str, tuple[int, ...]]:
    """USED_API.txt: line -> the JAX release from which the name exists (`NAME  # since 0.11`: code that uses it
    tests for it first), () for any release."""
    out = {}
    for line in USED_API.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            entry, _, note = line.partition("#")
            since = note.strip().removeprefix("since ").split()[0] if note.strip().startswith("since ") else ""
            out[entry.strip()] = tuple(int(p) for p in since.split(".")) if since else ()
    return out


def _jax_release() -> tuple[int, ...]:
    return tuple(int(p) for p in jax.__version__.split(".")[:2])


def test_the_listed_experimental_and_private_names_are_the_ones_used(uses):
    want = listed(uses)
    have = list(used_api_file())
    missing, stale = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    assert not missing and not stale, (
        f"jax_compat/USED_API.txt is out of date: add {missing}, remove {stale} (check each new name against JAX's "
        "changelog for the releases in jax_compat.TESTED_JAX)")


def test_every_used_name_exists_in_this_jax(uses):
    newer = {line.partition("(")[0] for line, since in used_api_file().items() if since > _jax_release()}
    missing = []
    for name, use in sorted(uses.items()):
        if name in newer:
            continue
        try:
            if name.startswith("jax.config:"):
                getattr(jax.config, name.split(":", 1)[1])
            else:
                resolve_name(name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name} ({sorted(use.files)[0]}): {type(e).__name__}: {e}")
    assert not missing, f"jax {jax.__version__} lacks:\n" + "\n".join(missing)


def signature_errors(uses: dict[str, Use]) -> tuple[list[str], int]:
    """(each call whose keywords or positional count do not bind to the installed JAX's signature, how many calls
    were checked); calls of what Python cannot read a signature of (C++ functions) are not checked."""
    wrong, checked = [], 0
    for name, use in sorted(uses.items()):
        if not use.calls or name.startswith("jax.config:"):
            continue
        try:
            sig = inspect.signature(resolve_name(name))
        except (TypeError, ValueError, AttributeError, ImportError):  # a C++ function, or not there (test above)
            continue
        for positional, keywords, starred, where in use.calls:
            checked += 1
            try:
                sig.bind_partial(*range(0 if starred else positional), **dict.fromkeys(keywords))
            except TypeError as e:
                wrong.append(f"{where}: {name}({positional} positional, {sorted(keywords)}): {e}")
    return wrong, checked


def test_every_call_fits_the_signature_in_this_jax(uses):
    wrong, checked = signature_errors(uses)
    assert checked > 300, checked
    assert not wrong, f"jax {jax.__version__}:\n" + "\n".join(wrong)


def test_the_reader_sees_aliases_calls_and_options(tmp_path):
    """The reader on a small module: an aliased experimental import, a call's keywords, a config option."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import jax\nfrom jax.experimental import pallas as pl\nfrom jax.experimental.pallas import tpu as pltpu\n"
        "def f(x):\n    jax.config.update('jax_enable_x64', True)\n    y = jax.config.jax_compilation_cache_dir\n"
        "    return pl.pallas_call(x, grid=(1,), out_shape=None)(pltpu.SemaphoreType.DMA, jax.lax.rsqrt(y))\n")
    found = jax_uses(tmp_path, ("pkg",))
    assert listed(found) == ["jax.config:jax_compilation_cache_dir", "jax.config:jax_enable_x64",
                             "jax.experimental.pallas", "jax.experimental.pallas.pallas_call(grid, out_shape)",
                             "jax.experimental.pallas.tpu", "jax.experimental.pallas.tpu.SemaphoreType.DMA"]
    assert found["jax.lax.rsqrt"].calls[0][:2] == (1, frozenset())
    assert signature_errors(found)[0] == []
    (tmp_path / "pkg" / "m.py").write_text("import jax\njax.jit(abs, no_such_option=1)\njax.lax.rsqrt(1, 2, 3)\n")
    wrong, checked = signature_errors(jax_uses(tmp_path, ("pkg",)))
    assert checked == 2 and len(wrong) == 2 and "no_such_option" in wrong[0] and "jax.lax.rsqrt" in wrong[1]
