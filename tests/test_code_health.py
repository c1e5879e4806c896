"""Properties of the source tree itself: the written layer order of draftwise's packages holds and no
import cycle joins its modules (function-level imports included: a lazy import hides a dependency, it
does not remove it), and no comment points at documents the repository does not contain."""
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


# The layer order, bottom to top: a module imports from its own layer and the layers below it, never
# from one above. Names are module paths under draftwise ("" is the package itself, which exports
# the LLM); the longest matching name places a module.
LAYERS = [
    ("config", "outputs", "sampling_params", "inputs", "machine"),   # data crossing every boundary
    ("kernels",),                           # the C++ kernels and the one ISA dispatch point
    ("formats", "layers"),                  # GGUF block formats; linears, attention, norms
    ("models",),                            # model families and their loading
    ("distributed",),                       # tensor-parallel sharding of a model; Ray helpers
    ("sample", "spec_decode", "structured_output"),
    ("step",),                              # the engine <-> worker step contract
    ("worker",),                            # the model's whole life: load, KV tensors, steps
    ("engine",),                            # requests, scheduling, detokenization
    ("engine_args", "entrypoints", ""),     # LLM, the OpenAI server, Ray Serve
    ("training",),
    ("bench",),
    ("entrypoints.cli",),                   # the command line dispatches to everything
]


def layer_of(module: str) -> int | None:
    name = module.removeprefix("draftwise").removeprefix(".")
    best = None
    for rank, names in enumerate(LAYERS):
        for n in names:
            if name == n or (n and name.startswith(n + ".")):
                if best is None or len(n) > best[0]:
                    best = (len(n), rank)
    return None if best is None else best[1]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        if layer_of(mod) is None:
            out.append(f"{mod} has no place in LAYERS")
            continue
        out += [f"{mod} imports {d} from a layer above it" for d in sorted(deps)
                if d in graph and layer_of(d) is not None and layer_of(d) > layer_of(mod)]
    return out


def test_layer_order():
    assert layer_violations(_import_graph()) == []


def test_layer_order_finds_an_upward_import():
    graph = {"draftwise.engine.engine": {"draftwise.models.loader"},
             "draftwise.models.loader": {"draftwise.engine.engine"}, "draftwise.newpkg.x": set()}
    assert layer_violations(graph) == ["draftwise.models.loader imports draftwise.engine.engine from a layer above it",
                                       "draftwise.newpkg.x has no place in LAYERS"]


def test_the_engine_reaches_the_model_only_through_the_worker():
    model_side = ("draftwise.models", "draftwise.layers", "draftwise.kernels", "draftwise.distributed")
    graph = _import_graph()
    hits = [f"{m} -> {d}" for m, deps in graph.items() if m.startswith("draftwise.engine.")
            for d in deps if d.startswith(model_side)]
    assert hits == []


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


def _long_functions(package: str, limit: int) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                out += [f"{os.path.relpath(path, ROOT)}:{n.name} ({n.end_lineno - n.lineno + 1} lines)"
                        for n in ast.walk(ast.parse(open(path).read()))
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and n.end_lineno - n.lineno + 1 > limit]
    return out


def test_entrypoint_functions_read_alone():
    """The server is made of small handlers: none over ~80 lines (a closure holding routes,
    streaming and choice merging cannot be tested or read alone)."""
    assert _long_functions("entrypoints", 85) == []


# The command line is the one place that imports draftwise's own modules inside functions: each
# subcommand's modules load only when it runs (`draftwise --help` loads none of them).
LAZY_IMPORTS_ALLOWED = {"draftwise.entrypoints.cli"}


def function_level_imports(path: str) -> list[int]:
    """Line numbers of draftwise imports inside a function of the file at `path`."""
    tree = ast.parse(open(path).read())
    lines = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("draftwise"):
                    lines.add(node.lineno)
                elif isinstance(node, ast.Import) and any(a.name.startswith("draftwise") for a in node.names):
                    lines.add(node.lineno)
    return sorted(lines)


def test_draftwise_imports_are_at_the_top_of_each_module():
    hits = []
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                mod = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                if mod not in LAZY_IMPORTS_ALLOWED:
                    hits += [f"{mod}:{line}" for line in function_level_imports(path)]
    assert hits == []


def test_function_level_import_finder(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom draftwise import x\n\ndef f():\n    import json\n    from draftwise.a import b\n")
    assert function_level_imports(str(src)) == [6]
