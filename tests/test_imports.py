"""The house rules of imports (docs/architecture.md): one direction, no cycles, no hidden edges.

Layers, lowest first; a module may import its own layer and those below, never above:

    base      config, storage, log, benchutil, assets    (nothing of flashdraft but the base)
    model     flashdraft.model
    data      flashdraft.data                            (the target, for generation)
    export    flashdraft.export                          (serving formats of the model)
    eval      flashdraft.eval
    train     flashdraft.train                           (in-training eval, exports)
    recipes   flashdraft.demo
    commands  flashdraft.commands, flashdraft.cli

Imports inside functions count as much as top-level ones (a deferred import must not dodge
a cycle); they are allowed only for optional or heavy third-party packages.

Around the package: bench/ (its benchmarks) and experiments/ (research on top of it) import
flashdraft, never the reverse, and bench/ never imports experiments/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flashdraft

PACKAGE = Path(flashdraft.__file__).parent
LAYERS = ["base", "model", "data", "export", "eval", "train", "recipes", "commands"]
BASE = {"config", "storage", "log", "benchutil", "assets", "__init__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "base"
    head = parts[1]
    if head in BASE:
        return "base"
    if head in ("commands", "cli"):
        return "commands"
    if head == "demo":
        return "recipes"
    return head


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported flashdraft module, line, inside a function) for every import of `path`."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if child.module == "flashdraft":
                    found.extend((f"flashdraft.{a.name}", child.lineno, inner) for a in child.names)
                elif child.module.startswith("flashdraft."):
                    found.append((child.module, child.lineno, inner))
            elif isinstance(child, ast.Import):
                found.extend(
                    (a.name, child.lineno, inner)
                    for a in child.names
                    if a.name.startswith("flashdraft")
                )
            visit(child, inner)

    visit(tree, False)
    return found


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str, modules: dict[str, Path]) -> str:
    """`flashdraft.train` (a package) or `flashdraft.train.config` (a module)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def test_every_module_is_placed_in_a_layer() -> None:
    for name in all_modules():
        assert layer(name) in LAYERS, name


def test_imports_flow_one_way() -> None:
    modules = all_modules()
    wrong = []
    for name, path in modules.items():
        for target, line, _ in imports(path):
            target = resolve(target, modules)
            if target == "flashdraft":
                continue
            if LAYERS.index(layer(target)) > LAYERS.index(layer(name)):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_flashdraft_import_is_deferred_into_a_function() -> None:
    deferred = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} inside a function"
        for path in all_modules().values()
        for target, line, nested in imports(path)
        if nested and not target.startswith("flashdraft.commands")
    ]
    assert not deferred, "\n".join(deferred)


def test_there_are_no_import_cycles() -> None:
    modules = all_modules()
    graph = {
        name: {resolve(t, modules) for t, _, _ in imports(path)} - {name, "flashdraft"}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# ---- the scripts around the package ----------------------------------------------------------

ROOT = PACKAGE.parent


def _script_names(folder: str) -> set[str]:
    return {p.stem for p in (ROOT / folder).glob("*.py")}


def _all_imported_names(path: Path) -> set[str]:
    """Every top-level module name `path` imports (absolute imports, at any depth)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
    return names


def test_the_package_never_imports_the_scripts_around_it() -> None:
    """bench/ and experiments/ import flashdraft, never the reverse: the product must not
    depend on a benchmark or on research code."""
    scripts = _script_names("bench") | _script_names("experiments") | {"bench", "experiments"}
    wrong = [
        f"{path.relative_to(ROOT)} imports {sorted(_all_imported_names(path) & scripts)}"
        for path in all_modules().values()
        if _all_imported_names(path) & scripts
    ]
    assert not wrong, "\n".join(wrong)


def test_the_benchmarks_never_import_the_experiments() -> None:
    """bench/ holds the product's own benchmarks: they run without experiments/."""
    research = _script_names("experiments") - _script_names("bench")
    wrong = [
        f"{path.relative_to(ROOT)} imports {sorted(_all_imported_names(path) & research)}"
        for path in sorted((ROOT / "bench").glob("*.py"))
        if _all_imported_names(path) & research
    ]
    assert not wrong, "\n".join(wrong)
