"""The plugin import contract, as a checker anyone can run on their own plugin distribution.

The rule (CONTRIBUTING.md, "The contract"): plugin code imports only *public* dscore names. A module path
segment or an imported name starting with ``_`` (``dscore.zero._comm``, ``from dscore.persistence import
_write``) is private: it may change or vanish in any release. Dunder names (``__version__``) are public.

The check reads the source's AST only (nothing is imported, torch is never loaded), so it sees imports at
any depth, inside functions and ``if TYPE_CHECKING:`` blocks too. Relative imports are the package's own
business and are not checked. dscore's own test suite runs it over the built-in plugins; third parties run
``dscore plugins check-imports src/`` (exit status 1 on a violation) or call :func:`check_paths`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

__all__ = ["check_paths", "is_private", "private_dscore_imports", "python_files"]


def is_private(segment: str) -> bool:
    """True for ``_name`` (private), False for ``name`` and dunders such as ``__version__``."""
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def private_dscore_imports(source: str, filename: str = "<src>") -> list[str]:
    """Every import of a private dscore module or name in ``source``, as ``"LINE: what"``.

    Args:
        source: Python source text.
        filename: used in the ``SyntaxError`` raised for unparsable source.

    Returns:
        ``"3: private module dscore.zero._comm"`` / ``"5: private name dscore.zero._helper"`` entries in
        the order found (AST walk order: breadth first).

    Raises:
        SyntaxError: ``source`` is not valid Python.
    """
    out: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            names = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] != "dscore":
                continue
            if any(is_private(p) for p in parts[1:]):
                out.append(f"{node.lineno}: private module {module}")
            for name in names:
                if is_private(name):
                    out.append(f"{node.lineno}: private name {module}.{name}")
    return out


def python_files(paths: Iterable[str | Path]) -> list[Path]:
    """The ``.py`` files named by ``paths`` (files as given, directories searched recursively, sorted;
    ``__pycache__`` and hidden directories such as ``.venv`` skipped).

    Raises:
        FileNotFoundError: a path does not exist (named).
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(
                sorted(
                    p
                    for p in path.rglob("*.py")
                    if not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(path).parts)
                )
            )
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return found


def check_paths(paths: Iterable[str | Path]) -> list[str]:
    """Run the import contract over files and directories; return one ``"FILE:LINE: what"`` per violation.

    A file that does not parse is reported as ``"FILE:LINE: syntax error ..."`` (a violation too: it
    cannot be checked). An empty list means the code imports only public dscore names.

    Raises:
        FileNotFoundError: a path does not exist.
    """
    violations: list[str] = []
    for path in python_files(paths):
        try:
            hits = private_dscore_imports(path.read_text(encoding="utf-8"), str(path))
        except SyntaxError as exc:
            violations.append(f"{path}:{exc.lineno or 0}: syntax error, cannot check: {exc.msg}")
            continue
        violations.extend(f"{path}:{hit}" for hit in hits)
    return violations
