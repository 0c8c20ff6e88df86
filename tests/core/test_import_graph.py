"""The package's import graph: no circles (imports inside functions count), and a core that
imports nothing from ``integrations``, ``demo`` or ``diagnostic``.

Every module under ``src/lookahead_opd`` is parsed with ``ast``; each ``import`` / ``from``
statement anywhere in it (module level, in functions, under ``if TYPE_CHECKING``) is resolved
to the package's own modules. Importing a package counts as importing its ``__init__``;
``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``.
A module's parent packages are not counted (Python runs them first, but they are not the
module's choice).
"""

from __future__ import annotations

import ast
from pathlib import Path

import lookahead_opd

ROOT = Path(lookahead_opd.__file__).resolve().parent
PACKAGE = "lookahead_opd"
OUTSIDE_CORE = ("integrations", "demo", "diagnostic", "testing")
CORE_MUST_NOT_IMPORT = ("integrations", "demo", "diagnostic", "testing")


def _module_names() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package (``pkg.__init__`` is
    named ``pkg``)."""
    out: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join([PACKAGE, *parts])] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name a ``from ... import`` statement reads from."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node)
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # ``import a.b.c`` of a name inside a.b
                name = name.rpartition(".")[0]
            if name.startswith(PACKAGE) and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = _module_names()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or ``None`` (an iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _is_core(module: str) -> bool:
    parts = module.split(".")
    return len(parts) <= 2 and (len(parts) == 1 or parts[1] not in OUTSIDE_CORE)


def test_the_checker_sees_function_level_and_relative_imports():
    graph = import_graph()
    # a lazy, relative import inside a function (Extrapolator's log_geometry)
    assert "lookahead_opd.geometry" in graph["lookahead_opd.extrapolator"]
    assert "lookahead_opd.integrations.opd.config" in graph["lookahead_opd.integrations.opd.train"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_core_imports_no_integrations():
    bad = [f"{module} -> {target}"
           for module, targets in import_graph().items() if _is_core(module)
           for target in sorted(targets)
           if target.split(".")[1:2] and target.split(".")[1] in CORE_MUST_NOT_IMPORT]
    assert not bad, "the core imports outside it: " + "; ".join(bad)


def test_integrations_import_neither_the_demo_nor_the_diagnostic():
    """The demo and the diagnostic build on the loop, never the reverse (the ``lookahead-opd``
    dispatcher names their modules as strings and imports them only to run them)."""
    bad = [f"{module} -> {target}"
           for module, targets in import_graph().items()
           if module.startswith(f"{PACKAGE}.integrations")
           for target in sorted(targets)
           if target.startswith((f"{PACKAGE}.demo", f"{PACKAGE}.diagnostic"))]
    assert not bad, "the integrations import the demo or the diagnostic: " + "; ".join(bad)


def test_the_opd_config_imports_only_the_options():
    """``OPDConfig`` checks its own values; what needs other modules is ``train.check_run``'s."""
    assert import_graph()[f"{PACKAGE}.integrations.opd.config"] <= {f"{PACKAGE}.options"}
