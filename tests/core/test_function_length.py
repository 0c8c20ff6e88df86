"""No function in the package is over ``MAX_LINES`` lines, counted from the ``def`` line to its
last line (docstring included, decorators not): longer ones get their one-idea blocks extracted
as helpers."""

from __future__ import annotations

import ast
from pathlib import Path

import lookahead_opd

MAX_LINES = 60
PACKAGE = Path(lookahead_opd.__file__).resolve().parent


def _long_functions(root: Path, limit: int) -> list[str]:
    """``path:line name (n lines)`` for every function or method under ``root`` over ``limit``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    rel = path.relative_to(root.parent).as_posix()
                    found.append(f"{rel}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_package_is_found():
    assert (PACKAGE / "__init__.py").is_file()
    assert len(list(PACKAGE.rglob("*.py"))) > 10


def test_no_function_is_over_the_limit():
    offenders = _long_functions(PACKAGE, MAX_LINES)
    assert not offenders, (
        f"functions over {MAX_LINES} lines (extract helpers):\n" + "\n".join(offenders)
    )


def test_the_check_sees_long_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))  # + the def line
    (pkg / "mod.py").write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}\n")
    assert _long_functions(pkg, MAX_LINES) == [f"pkg/mod.py:5 long ({MAX_LINES + 1} lines)"]
