"""The code's shape: no import circle among p2ptrain's modules (issue 36). Function-level and TYPE_CHECKING imports
count too: they are the same dependency, deferred."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import p2ptrain

PACKAGE = Path(p2ptrain.__file__).parent


def import_graph() -> Dict[str, Set[str]]:
    """module -> the p2ptrain modules it imports, anywhere in its file."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("p2ptrain", *path.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    assert circles(import_graph()) == []


MAX_MODULE_LINES = 400
GENERATED = {"p2ptrain/proto/p2ptrain_pb2.py"}


def test_no_module_passes_400_lines():
    long = {str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
            for path in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in long.items() if n > MAX_MODULE_LINES and name not in GENERATED} == {}


def test_the_core_has_no_mixins():
    """The optimizer and the averager hold their parts (docs/overview.md, "The parts of a peer"): a class of
    p2ptrain/diloco or p2ptrain/averaging has at most one base class, and none is named a mixin. The two codecs that
    give hivemind's own compression (fp32, fp16) p2ptrain's checked decoding are the known exception: both bases are
    codecs of the same message, and neither reads the other's attributes."""
    codecs = {"compression.py:NoneCodec", "compression.py:Fp16Codec"}
    found = []
    for package in ("diloco", "averaging"):
        for path in (PACKAGE / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and (len(node.bases) > 1 or node.name.endswith("Mixin")):
                    found.append(f"{path.name}:{node.name}")
    assert [name for name in found if name not in codecs] == []
