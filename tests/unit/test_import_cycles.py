"""No import circles among dscore, dscore_plugins and dscore_accelerators: every import statement counts
(module level, under TYPE_CHECKING and inside functions), as `tools/import_cycles.py` (run by `make lint`)
reports them."""

from __future__ import annotations

import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = runpy.run_path(str(REPO / "tools" / "import_cycles.py"))


def test_there_is_no_import_circle() -> None:
    found = TOOL["cycles"](TOOL["graph"](TOOL["modules"]()))
    assert found == [], "import circles (break each with a protocol, a callback or a shared lower module):\n" + "\n".join(
        ", ".join(c) for c in found
    )


def test_the_checker_finds_a_circle_under_type_checking_and_in_functions() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert TOOL["cycles"](edges) == [["a", "b", "c"]]
    assert TOOL["cycles"]({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_type_only_and_lazy_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fakepkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("import fakepkg.a\n")
    edges = TOOL["graph"](TOOL["modules"]({"fakepkg": pkg}))
    assert edges["fakepkg.a"] == {"fakepkg.b"} and edges["fakepkg.b"] == {"fakepkg.a"}
    assert TOOL["cycles"](edges) == [["fakepkg.a", "fakepkg.b"]]
