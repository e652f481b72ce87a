"""The package layers (docs/DEVELOPING.md, "Layers"): no package imports a package above it, imports inside functions
included, so the package graph has no cycle; the kernel imports nothing of postrl beyond itself; every dotted
``postrl.`` name in the README and docs/ resolves to a module or attribute."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# The kernel: the bottom layer (docs/DEVELOPING.md). It imports no other postrl package.
KERNEL = {"postrl", "postrl.errors", "postrl.batch", "postrl.registry", "postrl.stages", "postrl.fields", "postrl.context",
          "postrl.generation", "postrl.logprobs", "postrl.groups", "postrl.seeding", "postrl.io", "postrl.jsonstate", "postrl.heads",
          "postrl.reasoning_steps"}
# Layers, bottom to top: a package may import its own layer's packages only as the graph allows (no cycle) and the
# layers below. The kernel and the self-contained sandbox are layer 0.
LAYERS = [
    {"postrl", "postrl.sandbox", *KERNEL},  # postrl: the package's facade (errors and registry; the rest on first use)
    {"postrl.calibration", "postrl.models", "postrl.rollout", "postrl.data"},
    {"postrl.reward_models", "postrl.accel"},
    {"postrl.rewards", "postrl.shaping", "postrl.advantages", "postrl.losses", "postrl.selection"},
    {"postrl.environments"},
    {"postrl.config", "postrl.recipes"},
    {"postrl.diagnostics", "postrl.evaluate"},
    {"postrl.step"},
    {"postrl.train"},
    {"postrl.report", "postrl.integrations", "postrl.compare", "postrl.launch"},
    {"postrl.benchmark", "postrl.cli", "postrl.__main__"},
]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in (SRC / "postrl").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _top(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else name


def module_graph() -> dict[str, set[str]]:
    """Module -> the postrl modules it imports (module level and inside functions), from the source (ast); an import
    of ``a.b.c`` counts for the longest prefix that is a module."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")
                    base = ".".join(up[: len(up) - (node.level - 1)] + ([base] if base else []))
                targets = [base + "." + a.name for a in node.names] + [base]
            else:
                continue
            graph[m].update(r for r in map(resolve, targets) if r and r != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(frozenset(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def _package_edges() -> dict[str, set[str]]:
    """package -> the packages it imports (module level and inside functions), as the import_cycles tool counts."""
    edges: dict[str, set[str]] = {}
    for m, targets in module_graph().items():
        edges.setdefault(_top(m), set()).update(_top(r) for r in targets if _top(r) != _top(m))
    return edges


def test_every_package_has_a_layer():
    missing = set(_package_edges()) - set().union(*LAYERS)
    assert not missing, f"packages without a layer in tests/test_layers.py and docs/DEVELOPING.md: {sorted(missing)}"


def test_no_package_imports_a_layer_above_it():
    level = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    up = [(a, b) for a, targets in _package_edges().items() for b in targets if level[b] > level[a]]
    assert not up, f"imports that climb a layer: {sorted(up)}"


def test_the_kernel_imports_only_the_kernel():
    edges = _package_edges()
    bad = {k: sorted(edges.get(k, set()) - KERNEL) for k in KERNEL if edges.get(k, set()) - KERNEL}
    assert not bad, f"kernel modules importing packages above the kernel: {bad}"


def test_cycles_finds_the_strongly_connected_components():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_packages():
    found = [sorted(c) for c in cycles(_package_edges())]
    assert not found, f"package cycles: {found}"


def _doc_names() -> list[tuple[str, str]]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for d in docs:
        for name in re.findall(r"`(postrl(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", d.read_text()):
            found.append((d.name, name))
    return sorted(set(found))


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc, name", _doc_names())
def test_dotted_names_in_the_docs_resolve(doc, name):
    parts = name.split(".")
    if parts[1] == "integrations" and len(parts) > 2 and parts[2] in ("trl", "verl"):
        pytest.importorskip(parts[2])
    assert _resolves(name), f"{doc} names `{name}`, which is no module or attribute"
