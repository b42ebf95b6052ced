"""The import graph, read from the source with ast (every import, those inside functions too, so none can hide a
loop): the one-way direction of ARCHITECTURE.md between packages, no cycle between packages or between modules,
`serving.core` free of gRPC and HTTP, the request contract (`serving.params`) on the bottom floor, the OpenAI app
(`serving.api`) and the wire (`serving.wire`) free of both frontends, and the gateway reaching the instances only
through the wire (never `serving.server` or `serving.core`). Also the house cap of 900 lines per source file."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "pallas_kernels", "sharding", "serving", "jax_compat")
# Which packages each package may import (ARCHITECTURE.md: serving -> models, sharding, pallas_kernels;
# models -> sharding and pallas_kernels; sharding and pallas_kernels import neither). jax_compat (where JAX releases
# differ) is below them all and imports none of them.
MAY_IMPORT = {"serving": {"models", "sharding", "pallas_kernels", "jax_compat"},
              "models": {"sharding", "pallas_kernels", "jax_compat"},
              "sharding": {"jax_compat"}, "pallas_kernels": {"jax_compat"}, "jax_compat": set()}
# Module prefixes a part of the tree must not import.
FORBIDDEN = {
    "serving.core": ("grpc", "grpc_health", "serving.server", "serving.gateway", "serving.bench", "serving.api", "http",
                     "fastapi", "starlette", "uvicorn"),
    "serving.gateway": ("serving.core", "serving.server"),
    # The OpenAI app both frontends implement: the gateway uses it too, so it knows the engine only by duck typing.
    "serving.api": ("serving.core", "serving.server", "serving.gateway", "serving.wire", "grpc"),
    # meshserve.v1 and its client: both sides of the process boundary import it, so it imports neither.
    "serving.wire": ("serving.core", "serving.server", "serving.gateway", "serving.api"),
    # The request contract under everything: pure Python, no engine, wire or web framework.
    "serving.params": ("serving", "models", "sharding", "pallas_kernels", "grpc", "google", "numpy", "jax",
                       "fastapi", "starlette", "pydantic"),
}
# Everything of the project a part of the tree may import (besides itself): the gateway talks to instances over the
# network only, so it has the wire, the OpenAI app, telemetry, the request contract, the key store and transport
# options both servers share, and a tokenizer.
ONLY = {"serving.gateway": ("serving.api", "serving.wire", "serving.telemetry", "serving.params", "serving.auth",
                            "serving.transport", "models.tokenizer")}


def _modules(root: Path, packages) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):  # generated gRPC code
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (annotations only: no dependency at run time)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return skip


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the modules it imports: the project's own as modules of the graph (`from pkg import sub` names
    the submodule), anything else as its full dotted name."""
    modules = _modules(root, packages)

    def resolve(name: str) -> str:
        probe = name
        while probe and probe not in modules:
            probe = probe.rpartition(".")[0]
        return probe or name

    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    deps.add(full if full in modules else resolve(base))
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _within(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def violations(graph: dict[str, set[str]], packages=PACKAGES) -> list[str]:
    """Every edge against MAY_IMPORT or FORBIDDEN, and every module cycle, as a line a person can act on."""
    out = []
    for module, deps in sorted(graph.items()):
        top = module.split(".")[0]
        for dep in sorted(deps):
            dep_top = dep.split(".")[0]
            if dep_top in packages and dep_top != top and dep_top not in MAY_IMPORT.get(top, set()):
                out.append(f"{module} imports {dep}: package {top} must not import {dep_top}")
            for part, banned in FORBIDDEN.items():
                if _within(module, part) and dep != part and not _within(dep, part) and any(
                        _within(dep, b) for b in banned):
                    out.append(f"{module} imports {dep}: {part} must not import {dep}")
            for part, allowed in ONLY.items():
                if _within(module, part) and dep_top in packages and not _within(dep, part) and not any(
                        _within(dep, a) for a in allowed):
                    out.append(f"{module} imports {dep}: {part} imports only {', '.join(allowed)} of the project")
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return out


def test_the_import_graph_follows_the_architecture():
    graph = import_graph()
    assert len(graph) > 80 and "serving.core.engine" in graph
    assert violations(graph) == []


def test_the_checker_catches_cycles_and_wrong_directions(tmp_path):
    """The checker itself on a small tree with a module cycle hidden in a function, a package pointing the wrong
    way and core importing gRPC."""
    files = {
        "sharding/__init__.py": "",
        "sharding/a.py": "def f():\n    from sharding import b\n",
        "sharding/b.py": "from sharding.a import f\nimport models.x\n",
        "models/__init__.py": "",
        "models/x.py": "import sharding.a\n",
        "serving/__init__.py": "",
        "serving/core/__init__.py": "",
        "serving/core/e.py": "import grpc\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import serving.server\n",
        "serving/server/__init__.py": "",
        "serving/server/client.py": "",
        "serving/gateway/__init__.py": "",
        "serving/gateway/g.py": "from serving.server import client\nimport serving.wire\n",
        "serving/wire/__init__.py": "",
        "serving/params.py": "import numpy\nfrom serving import wire\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(import_graph(tmp_path, ("models", "sharding", "serving")), ("models", "sharding", "serving"))
    assert "sharding.b imports models.x: package sharding must not import models" in found
    assert "serving.core.e imports grpc: serving.core must not import grpc" in found
    assert any(line.startswith("import cycle: ") and "sharding.a" in line and "sharding.b" in line for line in found)
    assert not any(line.startswith("serving.core.e imports serving.server") for line in found)  # TYPE_CHECKING only
    assert "serving.gateway.g imports serving.server.client: serving.gateway must not import serving.server.client" \
        in found
    assert any(line.startswith("serving.gateway.g imports serving.server.client: serving.gateway imports only")
               for line in found)
    assert not any(line.startswith("serving.gateway.g imports serving.wire") for line in found)
    assert "serving.params imports numpy: serving.params must not import numpy" in found
    assert "serving.params imports serving.wire: serving.params must not import serving.wire" in found


MAX_LINES = 900  # STYLE.md: no file past 900 lines
SOURCE_DIRS = ("models", "serving", "sharding", "pallas_kernels", "jax_compat", "tests")


def long_files(root: Path = ROOT, dirs=SOURCE_DIRS, limit: int = MAX_LINES) -> list[str]:
    """'path: N lines' for every .py under `dirs` longer than `limit` (generated gRPC code, *_pb2*.py, excepted)."""
    out = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            n = len(path.read_text().splitlines())
            if n > limit:
                out.append(f"{path.relative_to(root)}: {n} lines (at most {limit}: split it along a seam)")
    return out


def test_no_source_file_is_past_900_lines(tmp_path):
    assert long_files() == []
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "serving" / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "serving" / "big_pb2.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_files(tmp_path, ("serving",)) == [f"serving/long.py: {MAX_LINES + 1} lines (at most {MAX_LINES}: "
                                                  "split it along a seam)"]
