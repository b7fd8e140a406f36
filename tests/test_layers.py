"""The import graph of astrai_pl/ (files as nodes, imports as edges, lazy ones included): no cycle, and no
import from a lower layer to a higher one. `python tests/test_layers.py` prints the graph."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "astrai_pl"

# Top to bottom; a module may import its own layer and the layers below. "" is astrai_pl/__init__.py.
LAYERS = (
    ("verbs", "cli", "demo", "sweep", "config_reference"),  # entry points (verbs: `astrai-pl`'s table of verbs)
    ("serve",),  # the HTTP server
    ("callbacks",),  # side concerns of a training run
    ("evaluation",),  # lm-eval over the engine: the evaluate verb and the Evaluate callback use it
    ("commands",),  # generate / chat, and the engine loading every verb shares
    ("objectives",),  # the LightningModules
    ("parallel", "deferred_init"),  # configure_model: FSDP2, TP, activation checkpointing, compile; meta builds
    ("strategy",),  # FSDP2Strategy and its sharded checkpoints
    ("data", "inference"),
    ("checkpoint",),  # persistence below everything that trains or serves
    ("model", "tokenizer"),
    ("hub",),  # hub ids to local snapshots, below everything that reads a model, tokenizer or data set
    ("ops", "jsonl", "atomic", "warning_filters", "command_options"),
    ("",),
)


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the file `path` (module `name`) imports anywhere in its body."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            anchor = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join(anchor + ([node.module] if node.module else []))
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    return {name: imported_modules(name, path, set(paths)) for name, path in sorted(paths.items())}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles, each as the modules along it (first repeated last)."""
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == 1:
                found.append(stack[stack.index(other):] + [other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def layer_of(module: str, layers=LAYERS) -> int | None:
    """Index in `layers` of the top-level module or package `module` belongs to (None: undeclared)."""
    top = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(layers) if top in names), None)


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import from a module to one in a higher layer, as 'importer -> imported'."""
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
            if layer_of(b, layers) < layer_of(a, layers)]


def test_every_module_has_a_layer():
    undeclared = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not undeclared, f"declare the layer of {undeclared} in LAYERS"


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_no_module_imports_a_higher_layer():
    assert upward_imports(import_graph()) == []


def test_the_commands_import_neither_objectives_nor_data():
    packages = {m.split(".")[1] for m in import_graph()["astrai_pl.commands"]}
    assert packages & {"objectives", "data"} == set()


def test_the_checks_find_a_cycle_and_an_upward_import():
    graph = {"astrai_pl.model.a": {"astrai_pl.objectives.b"}, "astrai_pl.objectives.b": {"astrai_pl.model.a"}}
    assert cycles(graph) == [["astrai_pl.model.a", "astrai_pl.objectives.b", "astrai_pl.model.a"]]
    assert upward_imports(graph) == ["astrai_pl.model.a -> astrai_pl.objectives.b"]


def print_graph(graph: dict[str, set[str]]) -> None:
    for i, names in enumerate(LAYERS):
        print(f"layer {i}: {', '.join(n or '(astrai_pl/__init__.py)' for n in names)}")
    for name, imported in graph.items():
        print(f"{name} -> {', '.join(sorted(m.removeprefix('astrai_pl.') for m in imported))}")
    print("cycles:", *[" -> ".join(c) for c in cycles(graph)] or ["none"], sep="\n  ")
    print("upward imports:", *upward_imports(graph) or ["none"], sep="\n  ")


if __name__ == "__main__":
    print_graph(import_graph(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else PACKAGE))
