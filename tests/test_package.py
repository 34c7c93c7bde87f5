"""The package's import graph, read from the sources (ast): every ``import`` and ``from ... import`` of
one lfmspark module by another, at module level or inside a function, is an arrow; the arrows have no
cycle, and the layers point one way (the runtime never imports the tools that drive it; the
scheduler and the model runner never import each other)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_folders() -> dict[str, Path]:
    """``{"lfmspark.runtime": ROOT / "runtime", ...}`` from pyproject.toml's package-dir table."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    return {pkg: ROOT / folder for pkg, folder in re.findall(r'^"([\w.]+)"\s*=\s*"([\w/]+)"', table, re.M)}


def modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in package_folders().items():
        for path in folder.glob("*.py"):
            found[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
        for sub in folder.iterdir():          # subpackages not named in the table (ops.attention, ...)
            if sub.is_dir() and (sub / "__init__.py").exists() and f"{pkg}.{sub.name}" not in package_folders():
                for path in sub.glob("*.py"):
                    name = f"{pkg}.{sub.name}" if path.stem == "__init__" else f"{pkg}.{sub.name}.{path.stem}"
                    found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The lfmspark modules ``name`` imports: ``from X import y`` is module ``X.y`` where that is a
    module, else ``X``."""
    package = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    edges = graph()
    assert "lfmspark.runtime.engine" in edges and "lfmspark.ops.routing" in edges    # the walk found the package
    assert cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_arrows_point_one_way():
    edges = graph()
    below_tools = [m for m in edges if not m.startswith(("lfmspark.tools", "lfmspark.serve"))]
    assert not [(m, t) for m in below_tools for t in edges[m] if t.startswith("lfmspark.tools")]
    scheduler, runner = "lfmspark.runtime.scheduler", "lfmspark.runtime.model_runner"
    assert runner not in edges[scheduler] and scheduler not in edges[runner]
    assert not [m for m in edges if "lfmspark.runtime.engine" in edges[m] and m.startswith(
        ("lfmspark.runtime.scheduler", "lfmspark.runtime.model_runner", "lfmspark.runtime.requests"))]


def test_importing_the_package_points_the_compile_caches_at_lfmspark_cache_dir(tmp_path):
    """``import lfmspark`` sets Inductor's cache directory before any of its imports can make Inductor
    fix one (graphs/compile.py), and Triton's (the ops' kernels) at its ``triton`` folder: a fresh
    interpreter, with only ``LFMSPARK_CACHE_DIR`` set."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["LFMSPARK_CACHE_DIR"] = str(tmp_path / "inductor")
    code = ("import lfmspark\n"
            "import triton\n"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "print(cache_dir())\n"
            "print(triton.knobs.cache.dir)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(tmp_path / "inductor"), str(tmp_path / "inductor" / "triton")]
