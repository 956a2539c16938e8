"""Entry point of the ``dscore`` command.

Only the chosen subcommand's module is imported, so ``dscore plugins list`` stays free of torch. Each
subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``. Built-in subcommands live
in :mod:`dscore.cli`; plugins add more through ``dscore_register_commands``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from dscore import __version__
from dscore.errors import DscoreError

__all__ = ["BUILTIN_COMMANDS", "main"]

#: name -> (module, one-line help)
BUILTIN_COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("dscore.cli.run", "launch a training script on one node or many (the `deepspeed` launcher)"),
    "plugins": ("dscore.cli.plugins", "list installed plugins and what they provide"),
    "config": ("dscore.cli.config", "validate a ds_config.json and print the resolved values"),
    "report": ("dscore.cli.report", "versions, accelerator and op compatibility (the `ds_report`)"),
    "ops": ("dscore.cli.ops", "list and build the C++/CUDA ops ahead of time"),
    "checkpoint": ("dscore.cli.checkpoint", "inspect and export checkpoints"),
}


def _plugin_commands() -> dict[str, tuple[str, str]]:
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.specs import CommandSpec

    registry = Registry(create_plugin_manager())
    found: dict[str, tuple[str, str]] = {}
    for spec in registry.specs("command"):
        assert isinstance(spec, CommandSpec)
        if spec.name in BUILTIN_COMMANDS:
            provider = registry.provider(spec)
            raise DscoreError(
                f"plugin {provider.label()} registers command {spec.name!r}, which is a built-in dscore "
                f"command; disable it with DSCORE_DISABLE_PLUGINS={provider.name}"
            )
        registry.get("command", spec.name)  # raises on a conflict between two plugins
        found[spec.name] = (spec.module, spec.help or spec.description)
    return found


def _top_help(commands: dict[str, tuple[str, str]]) -> str:
    width = max(len(n) for n in commands)
    lines = [
        f"usage: dscore <command> [options]   (dscore {__version__})",
        "",
        "commands:",
    ]
    for name, (_, text) in commands.items():
        lines.append(f"  {name.ljust(width)}  {text}")
    lines += ["", "Run `dscore <command> --help` for the options of one command."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dscore`` command line; returns the process exit code.

    Exit codes: 0 success, 2 bad input (any :class:`~dscore.errors.DscoreError`, printed as one
    message without a traceback), 130 interrupted, otherwise what the subcommand returns.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="[dscore] %(levelname)s %(message)s")
    try:
        if not args or args[0] in {"-h", "--help"}:
            commands = dict(BUILTIN_COMMANDS)
            commands.update(_plugin_commands())
            print(_top_help(commands))
            return 0
        if args[0] == "--version":
            print(f"dscore {__version__}")
            return 0
        name = args[0]
        if name in BUILTIN_COMMANDS:
            module_name, help_text = BUILTIN_COMMANDS[name]
        else:
            commands = _plugin_commands()
            if name not in commands:
                from dscore.errors import did_you_mean

                known = sorted(BUILTIN_COMMANDS) + sorted(commands)
                close = did_you_mean(name, known)
                hint = f" Did you mean {' or '.join(close)}?" if close else ""
                print(f"dscore: unknown command {name!r}. Commands: {', '.join(known)}.{hint}", file=sys.stderr)
                return 2
            module_name, help_text = commands[name]
        module: ModuleType = importlib.import_module(module_name)
        parser = argparse.ArgumentParser(prog=f"dscore {name}", description=help_text, allow_abbrev=False)
        module.add_arguments(parser)
        parsed = parser.parse_args(args[1:])
        return int(module.run(parsed) or 0)
    except DscoreError as exc:
        print(f"dscore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `dscore plugins list | head`: the reader left; not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
