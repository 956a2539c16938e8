"""The import contract: plugins use only public dscore names; the core never imports a built-in plugin.

The checker itself is public (:mod:`dscore.import_contract`, ``dscore plugins check-imports``) so third
parties run the same rule on their own distributions.

``make lint`` runs import-linter over the contracts in ``pyproject.toml``. import-linter's wildcards cannot
express "any module whose name starts with ``_``", so this test checks the general rule over the AST of
every plugin file (module imports at any depth, inside functions too, and ``from dscore.x import _name``),
and keeps the private-module list of the import-linter contract in step with the tree.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dscore.import_contract import check_paths, private_dscore_imports
from dscore.import_contract import is_private as _private

REPO = Path(__file__).resolve().parents[2]
PLUGIN_ROOTS = [REPO / "plugins", REPO / "accelerators", REPO / "examples" / "plugins"]


def _python_files(roots: list[Path]) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_checker_catches_both_forms() -> None:
    src = (
        "import dscore.zero._comm\n"
        "from dscore.checkpoint._layout import x\n"
        "from dscore.checkpoint import _write\n"
        "def f():\n"
        "    from dscore.zero import _helper\n"
        "from dscore.protocols import ZeroStage\n"
        "from dscore import __version__\n"
        "import dscore_plugins._x\n"
    )
    found = private_dscore_imports(src)
    assert found == [
        "1: private module dscore.zero._comm",
        "2: private module dscore.checkpoint._layout",
        "3: private name dscore.checkpoint._write",
        "5: private name dscore.zero._helper",
    ]


def test_plugins_and_accelerators_import_only_public_dscore_names() -> None:
    files = _python_files(PLUGIN_ROOTS)
    assert len(files) > 30, "the plugin trees were not found"
    violations = [
        f"{path.relative_to(REPO)}:{hit}"
        for path in files
        for hit in private_dscore_imports(path.read_text(encoding="utf-8"), str(path))
    ]
    assert not violations, (
        "plugins must import only public dscore names (dscore.protocols, dscore.specs, dscore.errors, ...); "
        "make the needed name public or move it into the plugin:\n  " + "\n  ".join(violations)
    )


def test_import_linter_contract_lists_every_private_core_module() -> None:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    listed = {
        m for c in contracts if set(c.get("source_modules", ())) == {"dscore_plugins", "dscore_accelerators"}
        for m in c["forbidden_modules"]
    }
    on_disk = set()
    for path in (REPO / "dscore").rglob("*.py"):
        rel = path.relative_to(REPO).with_suffix("")
        if "__pycache__" not in rel.parts and any(_private(p) for p in rel.parts):
            on_disk.add(".".join(rel.parts))
    for path in (REPO / "dscore").rglob("_*"):
        if path.is_dir() and not path.name.startswith("__"):
            on_disk.add(".".join(path.relative_to(REPO).parts))
    assert listed == on_disk, (
        "update [[tool.importlinter.contracts]] 'plugins and accelerators import only public dscore modules' in "
        f"pyproject.toml: missing {sorted(on_disk - listed)}, no longer existing {sorted(listed - on_disk)}"
    )


def test_check_paths_and_cli_report_a_third_party_violation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dscore.cli.main import main

    pkg = tmp_path / "src" / "acme_plugin"
    pkg.mkdir(parents=True)
    (pkg / "ok.py").write_text("from dscore.protocols import ZeroStage\nfrom dscore.zero import unscale_clip_for_step\n")
    (pkg / "bad.py").write_text("import os\n\ndef f():\n    from dscore.zero._comm import x\n")
    (tmp_path / "src" / ".venv").mkdir()
    (tmp_path / "src" / ".venv" / "skip.py").write_text("import dscore._private\n")
    bad = str(pkg / "bad.py")
    assert check_paths([tmp_path / "src"]) == [f"{bad}:4: private module dscore.zero._comm"]
    assert check_paths([pkg / "ok.py"]) == []
    assert main(["plugins", "check-imports", str(tmp_path / "src")]) == 1
    assert f"{bad}:4: private module dscore.zero._comm" in capsys.readouterr().out
    assert main(["plugins", "check-imports", str(pkg / "ok.py")]) == 0
    assert "1 file(s) checked" in capsys.readouterr().out
    assert main(["plugins", "check-imports", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
