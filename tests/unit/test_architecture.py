"""The package structure docs/architecture.md draws, checked from the imports themselves: every
import (module level or inside a function) goes to the same package or a lower layer, and no
modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "pdserve"

# bottom to top; a unit may import itself and any unit of a lower layer, nothing else
LAYERS = [
    {
        "pdserve",
        "pdserve.sampling_params",
        "pdserve.distributed",
        "pdserve.numa",
        "pdserve.chat",
        "pdserve.lifetime",
    },
    {"pdserve.model", "pdserve.structured", "pdserve.tokenizer"},
    {"pdserve.disagg"},
    {"pdserve.outputs"},
    {"pdserve.engine"},
    {"pdserve.tiny_model"},
    {"pdserve.wire", "pdserve.config"},
    {"pdserve.serve_config"},
    {"pdserve.llm", "pdserve.worker", "pdserve.router"},
    {"pdserve.server"},
    {"pdserve.serve", "pdserve.health_cli", "pdserve.bench"},
    {"pdserve.launch"},
    {"pdserve.cli"},
    {"pdserve.__main__"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _imports(typing: bool = False, packages: bool = False) -> dict[str, set[str]]:
    """module -> the pdserve modules it imports at run time (`from pkg import module` counts as
    that module; imports under `if TYPE_CHECKING:` count only with `typing`; with `packages`, a
    submodule's packages too, whose __init__ runs first, but for the module's own)."""
    paths = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        deps = graph.setdefault(mod, set())
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for top in ast.walk(tree)
            if isinstance(top, ast.If) and _is_type_checking(top.test)
            for n in ast.walk(top)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only and not typing:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pdserve":
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in paths]
                targets = subs or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "pdserve"]
            else:
                continue
            deps.update(targets)
            for t in targets if packages else ():
                parts = t.split(".")
                deps.update(p for k in range(2, len(parts)) if (p := ".".join(parts[:k])) in paths and mod != p)
                deps.difference_update(p for p in list(deps) if mod.startswith(p + "."))  # its own package: begun
    return graph


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def test_every_unit_has_a_layer():
    missing = {_unit(m) for m in _imports()} - set(LAYER)
    assert not missing, f"packages not placed in a layer (add them to LAYERS and docs/architecture.md): {missing}"


def test_no_import_goes_up_a_layer_or_sideways():
    bad = []
    for mod, deps in _imports().items():
        for dep in deps:
            src, dst = _unit(mod), _unit(dep)
            if src != dst and dst != "pdserve" and LAYER[dst] >= LAYER[src]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_circles_between_modules():
    """Type-only imports count (a checker follows them), and so do the packages an import runs."""
    graph = _imports(typing=True, packages=True)
    modules = set(graph)
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph.get(m, ())):
            if dep == "pdserve" or dep not in modules:
                continue
            if state.get(dep) == 1:
                circles.append(path[path.index(dep) :] + [dep] if dep in path else [m, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_every_package_ships():
    """pyproject.toml lists packages by name (kernels/ ships as pdserve_kernels): a new subpackage
    missing there would import from a checkout but not from an installed wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {_module(p) for p in ROOT.rglob("__init__.py")} | {"pdserve_kernels"}
    assert listed == on_disk, (
        f"missing from pyproject: {sorted(on_disk - listed)}; not on disk: {sorted(listed - on_disk)}"
    )


def test_models_are_reached_through_the_registry():
    """The engine, worker and router never import a model package: they ask pdserve/model/registry.py,
    so adding a model is one folder and one registry line."""
    bad = [
        f"{mod} -> {dep}"
        for mod, deps in _imports().items()
        for dep in deps
        if _unit(mod) in {"pdserve.engine", "pdserve.worker", "pdserve.router", "pdserve.llm"}
        and dep.startswith(("pdserve.model.deepseek_v3", "pdserve.model.deepseek_v4"))
    ]
    assert not bad, "model packages imported outside the registry:\n" + "\n".join(sorted(bad))
