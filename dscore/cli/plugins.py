"""``dscore plugins list [--json] [--kind KIND] [--probe]``: what is installed and what each plugin provides.

``dscore plugins check-imports PATH...`` runs the import contract (:mod:`dscore.import_contract`: only
public dscore names) over a plugin's source files; exit status 1 when it finds a violation.

A broken plugin is listed with its one-line reason and the command still exits 0. Nothing heavy is
imported: only the plugins' manifest modules. The status ``active`` means the plugin loaded; whether an
accelerator can be used on this machine is a separate question, answered by ``--probe``: it runs every
accelerator's probe (which imports torch, a few seconds) and adds a "usable here" column (``usable``
in the JSON rows). Without the flag the listing stays torch-free and fast, and the table says how to ask.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from dscore.specs import SPEC_KINDS

if TYPE_CHECKING:
    from dscore.registry import Registry

__all__ = ["add_arguments", "probe_accelerators", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``list`` (the default) and ``check-imports``."""
    sub = parser.add_subparsers(dest="action")
    check = sub.add_parser(
        "check-imports",
        help="check that plugin sources import only public dscore names (the import contract)",
        allow_abbrev=False,
    )
    check.add_argument("paths", nargs="+", metavar="PATH", help="Python files or directories (searched recursively)")
    lst = sub.add_parser("list", help="list installed plugins", allow_abbrev=False)
    for p in (parser, lst):
        p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
        p.add_argument(
            "--kind",
            choices=sorted(SPEC_KINDS),
            help="only plugins providing this kind of component",
        )
        p.add_argument(
            "--probe",
            action="store_true",
            help="also check whether each accelerator is usable on this machine (imports torch; a few seconds)",
        )


def probe_accelerators(registry: Registry) -> dict[str, dict[str, tuple[bool, str]]]:
    """Run every active accelerator's probe: ``{plugin name: {accelerator name: (usable, reason)}}``.

    Probes import torch (and a vendor bridge where installed) but create no device context; a probe that
    fails is reported as not usable with its reason (see :func:`dscore.accelerator.probe_accelerator`).
    """
    from dscore.accelerator import probe_accelerator
    from dscore.specs import AcceleratorSpec

    found: dict[str, dict[str, tuple[bool, str]]] = {}
    for spec in registry.specs("accelerator"):
        if not isinstance(spec, AcceleratorSpec):
            continue
        result = probe_accelerator(spec)
        found.setdefault(registry.provider(spec).name, {})[spec.name] = (bool(result.available), str(result.reason))
    return found


def _check_imports(paths: list[str]) -> int:
    from dscore.import_contract import check_paths, python_files

    try:
        files = python_files(paths)
        violations = check_paths(paths)
    except FileNotFoundError as exc:
        print(f"dscore: error: {exc}", file=sys.stderr)
        return 2
    for line in violations:
        print(line)
    if violations:
        print(
            f"{len(violations)} violation(s) in {len(files)} file(s): plugins may import only public dscore names "
            "(no module or name starting with '_'); see CONTRIBUTING.md, 'The contract'"
        )
        return 1
    print(f"import contract: ok, {len(files)} file(s) checked")
    return 0


def _usable_text(usable: dict[str, tuple[bool, str]] | None) -> str:
    if not usable:
        return "-"
    return "; ".join(
        (f"{name}: " if len(usable) > 1 else "") + ("yes" if ok else "no") + f" ({reason})"
        for name, (ok, reason) in sorted(usable.items())
    )


def run(args: argparse.Namespace) -> int:
    """Print the plugin table (or JSON); always exits 0 unless the output cannot be written.

    ``check-imports`` exits 0 when clean, 1 on a violation, 2 when a path does not exist."""
    if args.action == "check-imports":
        return _check_imports(args.paths)
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    manager = create_plugin_manager()
    registry = Registry(manager)
    records = list(manager.records.values())
    if args.kind:
        records = [r for r in records if args.kind in r.provides or any(u.startswith(args.kind + ":") for u in r.disabled_units)]
    probed = probe_accelerators(registry) if args.probe else None
    for r in records:  # stderr, so the JSON on stdout stays parsable
        for warning in r.warnings:
            print(f"dscore: warning: plugin {r.label()}: {warning}", file=sys.stderr)
    if args.json:
        rows = [r.as_json() for r in records]
        if probed is not None:
            for row in rows:
                found = probed.get(row["name"])
                row["usable"] = (
                    {name: {"usable": ok, "reason": reason} for name, (ok, reason) in sorted(found.items())}
                    if found
                    else None
                )
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0

    from rich.console import Console
    from rich.table import Table

    table = Table(title="dscore plugins", show_lines=False)
    columns = ["plugin", "distribution", "version", "origin", "status", "provides"]
    if probed is not None:
        columns.append("usable here")
    for column in columns:
        table.add_column(column, overflow="fold")
    for r in records:
        provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in r.provides.items())
        if r.disabled_units:
            provides += ("; " if provides else "") + "disabled units: " + ", ".join(sorted(r.disabled_units))
        status = r.status if r.status == "active" else f"{r.status}: {r.error}"
        if r.warnings:
            status += " (warning: " + "; ".join(r.warnings) + ")"
        cells = [r.name, r.distribution, r.version, "built-in" if r.builtin else "third-party", status, provides]
        if probed is not None:
            cells.append(_usable_text(probed.get(r.name)))
        table.add_row(*cells)
    console = Console(width=max(120, Console().width))
    console.print(table)
    if probed is None and any("accelerator" in r.provides for r in records):
        console.print(
            "status 'active' means the plugin loaded, not that its device is present: "
            "`dscore plugins list --probe` checks which accelerators are usable here, "
            "`dscore report` shows the one that would be selected."
        )
    for kind, name, providers in registry.conflicts(args.kind):
        console.print(
            f"[bold red]conflict[/]: {kind} {name!r} is provided by " + ", ".join(p.label() for p in providers)
        )
    return 0
