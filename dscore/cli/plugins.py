"""``dscore plugins list [--json] [--kind KIND]``: what is installed and what each plugin provides.

A broken plugin is listed with its one-line reason and the command still exits 0. Nothing heavy is
imported: only the plugins' manifest modules.
"""

from __future__ import annotations

import argparse
import json
import sys

from dscore.specs import SPEC_KINDS

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``list`` is the only action; it is also the default."""
    sub = parser.add_subparsers(dest="action")
    lst = sub.add_parser("list", help="list installed plugins", allow_abbrev=False)
    for p in (parser, lst):
        p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
        p.add_argument(
            "--kind",
            choices=sorted(SPEC_KINDS),
            help="only plugins providing this kind of component",
        )


def run(args: argparse.Namespace) -> int:
    """Print the plugin table (or JSON); always exits 0 unless the output cannot be written."""
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    manager = create_plugin_manager()
    records = list(manager.records.values())
    if args.kind:
        records = [r for r in records if args.kind in r.provides]
    if args.json:
        json.dump([r.as_json() for r in records], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0

    from rich.console import Console
    from rich.table import Table

    table = Table(title="dscore plugins", show_lines=False)
    for column in ("plugin", "distribution", "version", "origin", "status", "provides"):
        table.add_column(column, overflow="fold")
    for r in records:
        provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in r.provides.items())
        status = r.status if r.status == "active" else f"{r.status}: {r.error}"
        table.add_row(r.name, r.distribution, r.version, "built-in" if r.builtin else "third-party", status, provides)
    console = Console(width=max(120, Console().width))
    console.print(table)
    for kind, name, providers in Registry(manager).conflicts(args.kind):
        console.print(
            f"[bold red]conflict[/]: {kind} {name!r} is provided by " + ", ".join(p.label() for p in providers)
        )
    return 0
