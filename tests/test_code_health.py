"""Properties of the source tree itself: no import cycle between draftwise's modules (function-level
imports included: a lazy import hides a cycle, it does not remove it), and no comment pointing at
documents the repository does not contain."""
import ast
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "draftwise")


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
            mod = rel.removesuffix(".__init__")
            deps = set()
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftwise"):
                    deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names if a.name.startswith("draftwise")}
            graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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


def test_no_import_cycles():
    assert _cycles(_import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_references_to_documents_outside_the_repository():
    pattern = re.compile(r"seed 00[0-9]|issue #?[0-9]+", re.IGNORECASE)
    hits = []
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith((".py", ".cpp", ".md", ".json")):
                with open(os.path.join(dirpath, f), errors="replace") as fh:
                    hits += [f"{f}:{i}" for i, line in enumerate(fh, 1) if pattern.search(line)]
    assert hits == []
