"""Print the import circles (strongly connected components of more than one module, or a module importing
itself) among dscore, dscore_plugins and dscore_accelerators.

Every import statement counts: module level, under ``TYPE_CHECKING`` and inside functions (as grimp and
import-linter see them). ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module,
else of ``pkg``. Exit status 1 when there is a circle.

    python tools/import_cycles.py            # all three roots
    python tools/import_cycles.py --json     # machine-readable
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"dscore": REPO / "dscore", "dscore_plugins": REPO / "plugins" / "dscore_plugins",
         "dscore_accelerators": REPO / "accelerators" / "dscore_accelerators"}


def modules(roots: dict[str, Path] | None = None) -> dict[str, Path]:
    """Dotted module name -> file, for every ``*.py`` under each root package folder (default :data:`ROOTS`)."""
    out: dict[str, Path] = {}
    for base in (ROOTS if roots is None else roots).values():
        for path in base.rglob("*.py"):
            rel = path.relative_to(base.parent).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in mods else base)
            for t in targets:
                # the nearest module of ours that the name falls in
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges[mod].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    found = cycles(graph(modules()))
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        for comp in found:
            print(f"circle of {len(comp)}: " + ", ".join(comp))
        print(f"{len(found)} import circle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
