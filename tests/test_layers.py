"""specdec's layers import downward only (STYLE.md: data and control flow one way).

The import graph is read statically from the source with :mod:`ast`: every ``import`` statement counts, at
the top of a module, inside a function (a lazy import is still a dependency) or under ``TYPE_CHECKING`` (a
type that names an upper layer is knowledge of it). An edge goes to the module named (``from a.b import c``:
``a.b.c`` when it is a module, else ``a.b``); importing a submodule also runs its packages' ``__init__``,
which is not drawn. Two checks: no cycle between specdec's modules, and each module imports only its own
layer or lower ones (:data:`LAYERS`).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specdec"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("glossary and settings", ("specdec.types", "specdec.children", "specdec.grammar_limits", "specdec.grammar_compile",
                               "specdec.grammar", "specdec.grammar_trial", "specdec.tools", "specdec.params", "specdec.stats")),
    ("arrays, verifiers, models, backends", ("specdec.sampling", "specdec.verify", "specdec.models", "specdec.backends",
                                             "specdec.distribution")),
    ("proposers", ("specdec.proposers",)),
    # the auto policy composes the proposers; its modules before the move (issue 38) are listed where they belong
    ("policy", ("specdec.policy",)),
    ("the step and its callers", ("specdec.sequence", "specdec.prefill", "specdec.output", "specdec.step",
                                  "specdec.policy.step", "specdec.request", "specdec.scheduler", "specdec.engine",
                                  "specdec.metrics")),
    ("public API", ("specdec", "specdec.api")),
    ("statistical check, HTTP server", ("specdec.check", "specdec.server")),
    ("command-line options", ("specdec.options",)),
    ("benchmarks, Ray Serve", ("specdec.bench", "specdec.server.ray_serve")),
    ("command line", ("specdec.cli",)),
]
"""Bottom first. A module belongs to the layer of the longest name that is it or one of its packages
(``specdec.server.ray_serve`` is above ``specdec.server``); ``specdec`` alone is the package's
``__init__``, the public API. A module may import its own layer and those before it."""

KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}
"""Edges allowed to break the rules for now, each with its reason; delete an entry once its edge is gone."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line of its first import}}`` over specdec's own modules."""
    mods = modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target in mods and target != name and target.startswith("specdec"):
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int | None:
    best, layer = -1, None
    for index, (_, names) in enumerate(LAYERS):
        for prefix in names:
            # "specdec" names the package's __init__ only, not everything under it
            if (module == prefix or (prefix != "specdec" and module.startswith(prefix + "."))) and len(prefix) > best:
                best, layer = len(prefix), index
    return layer


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """A closed path through ``component``, each edge with the line of its import."""
    members = set(component)
    path, seen = [component[0]], {component[0]: 0}
    while True:
        nxt = next(w for w in sorted(graph[path[-1]]) if w in members)
        if nxt in seen:
            loop = path[seen[nxt]:] + [nxt]
            return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(loop, loop[1:])) + f" -> {nxt}"
        seen[nxt] = len(path)
        path.append(nxt)


def allowed_graph() -> dict[str, dict[str, int]]:
    return {a: {b: line for b, line in edges.items() if (a, b) not in KNOWN_EXCEPTIONS}
            for a, edges in import_graph().items()}


def test_no_import_cycles():
    graph = allowed_graph()
    found = cycles(graph)
    assert not found, "import cycles between specdec's modules (move the knowledge to the lower layer):\n" + "\n".join(
        f"- {', '.join(c)}\n  e.g. {one_cycle(graph, c)}" for c in found)


def test_every_module_has_a_layer():
    missing = [m for m in modules() if layer_of(m) is None]
    assert not missing, f"modules in no layer of tests/test_layers.py LAYERS: {missing}"


def test_layers_import_downward_only():
    upward = []
    for a, edges in allowed_graph().items():
        for b, line in edges.items():
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb > la:
                upward.append(f"{a} (line {line}, layer {LAYERS[la][0]!r}) imports {b} (layer {LAYERS[lb][0]!r})")
    assert not upward, "imports of an upper layer:\n" + "\n".join(upward)


def test_known_exceptions_still_exist():
    """An exception whose edge is gone is deleted."""
    graph = import_graph()
    gone = [edge for edge in KNOWN_EXCEPTIONS if edge[1] not in graph.get(edge[0], {})]
    assert not gone, f"these edges are gone: delete them from KNOWN_EXCEPTIONS in tests/test_layers.py: {gone}"


def test_the_graph_sees_lazy_and_type_checking_imports():
    """The reader finds imports inside functions and under TYPE_CHECKING, not only the top-level ones."""
    graph = import_graph()
    assert "specdec.server.access" in graph["specdec.options.serve"]  # inside check_serve_args
    assert "specdec.backends.base" in graph["specdec.proposers.base"]  # under TYPE_CHECKING
