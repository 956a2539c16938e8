"""Meta and hygiene: torch stays out of `import dscore` and `dscore plugins list`, the core never imports
built-in plugins by name, entry points match installed metadata, every hookspec is documented."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from dscore import hookspecs
from dscore.plugin_manager import BUILTIN_PLUGINS

REPO = Path(__file__).resolve().parents[2]


def _run_py(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_import_dscore_does_not_import_torch() -> None:
    proc = _run_py("import sys, dscore; dscore.hookimpl; print('torch' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("argv", [["plugins", "list", "--json"], ["plugins", "list"], ["--help"]])
def test_cli_listing_does_not_import_torch(argv: list[str]) -> None:
    code = (
        "import sys, io, contextlib\n"
        "from dscore.cli.main import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        f"    rc = main({argv!r})\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(rc, heavy[:3])\n"
    )
    proc = _run_py(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0 []"


def test_plugins_list_json_shape_lists_every_builtin() -> None:
    proc = subprocess.run([sys.executable, "-m", "dscore", "plugins", "list", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    declared = [name for name, _ in BUILTIN_PLUGINS]
    by_name = {r["name"]: r for r in rows}
    for name in declared:
        row = by_name[name]
        assert set(row) == {
            "name", "distribution", "version", "builtin", "status", "error", "provides", "warnings", "disabled_units"
        }
        assert row["builtin"] is True and row["distribution"] == "dscore"
        assert row["status"] == "active", f"built-in plugin {name} is {row['status']}: {row['error']}"
        assert row["provides"], f"built-in plugin {name} provides nothing"
        for names in row["provides"].values():
            assert names == sorted(names)


def test_generic_names_are_not_importable(tmp_path: Path) -> None:
    # run outside the checkout: a folder in the current directory is always a namespace package
    code = "import importlib.util as u; print([n for n in ('plugins', 'accelerators', 'csrc') if u.find_spec(n)])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert importlib.util.find_spec("dscore_plugins") is not None


def _builtin_list_lines(tree: ast.Module) -> set[int]:
    """Line numbers of the BUILTIN_PLUGINS assignment: the one place the core names the built-ins."""
    lines: set[int] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "BUILTIN_PLUGINS" for t in targets):
            lines |= set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def test_core_never_imports_builtin_plugins_by_name() -> None:
    offenders = []
    for path in sorted((REPO / "dscore").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        allowed = _builtin_list_lines(tree) if path.name == "plugin_manager.py" and path.parent.name == "dscore" else set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", 0) in allowed:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                # import strings such as "dscore_plugins.zero.stage3:Stage3" smuggled past the registry
                if node.value.startswith(("dscore_plugins", "dscore_accelerators")):
                    names = [node.value]
            for name in names:
                if name.split(".")[0] in {"dscore_plugins", "dscore_accelerators"}:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not offenders, "the core names built-ins only in plugin_manager.BUILTIN_PLUGINS:\n" + "\n".join(offenders)


def test_builtins_are_listed_not_entry_points() -> None:
    """Built-ins come from BUILTIN_PLUGINS (no reinstall to edit one); dscore declares no entry points of its
    own, and every manifest in the list exists."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("entry-points", {})
    assert "dscore" not in declared
    names = [name for name, _ in BUILTIN_PLUGINS]
    assert len(names) == len(set(names))
    for _, module in BUILTIN_PLUGINS:
        assert importlib.util.find_spec(module) is not None, module


def test_every_hookspec_is_documented_with_an_example() -> None:
    specs = [name for name in dir(hookspecs) if name.startswith("dscore_")]
    assert len(specs) >= 16
    for name in specs:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        for part in ("Called:", "Must not:", "Example::"):
            assert part in doc, f"hookspec {name} lacks {part!r} in its docstring"
    assert set(hookspecs.REGISTRATION_HOOKS) | set(hookspecs.LIFECYCLE_HOOKS) <= set(specs)


def test_every_hookspec_is_exercised_somewhere() -> None:
    """Each hook is implemented by a built-in plugin or referenced by a test (datasette's meta-test idea)."""
    texts = [p.read_text() for root in ("plugins", "accelerators", "tests", "examples", "dscore") for p in (REPO / root).rglob("*.py") if p.name != "hookspecs.py"]
    blob = "\n".join(texts)
    missing = [name for name in dir(hookspecs) if name.startswith("dscore_") and name not in blob]
    assert not missing, f"hookspecs never implemented nor tested: {missing}"
