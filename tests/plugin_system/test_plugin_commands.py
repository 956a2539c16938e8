"""A plugin adds a `dscore <name>` subcommand; one that shadows a built-in command is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fakedist import write_distribution

MANIFEST = """
from dscore import hookimpl
from dscore.specs import CommandSpec

@hookimpl
def dscore_register_commands():
    return [CommandSpec(name="{name}", module="fakeplug_cmd.cli", help="say hello from a plugin")]
"""

CLI = """
def add_arguments(parser):
    parser.add_argument("--who", default="world")

def run(args):
    print(f"hello {args.who}")
    return 3
"""


def _dscore(site: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "dscore", *argv], capture_output=True, text=True, env=env, timeout=120)


def test_plugin_command_runs_and_is_listed(tmp_path: Path) -> None:
    write_distribution(tmp_path, "dscore-fake-cmd", "1.0", {"hello_cmd": "fakeplug_cmd.plugin"},
                       {"fakeplug_cmd.plugin": MANIFEST.format(name="hello"), "fakeplug_cmd.cli": CLI})
    proc = _dscore(tmp_path, "hello", "--who", "dscore")
    assert (proc.returncode, proc.stdout.strip()) == (3, "hello dscore"), proc.stderr
    listing = _dscore(tmp_path, "--help")
    assert "hello" in listing.stdout and "say hello from a plugin" in listing.stdout


def test_plugin_command_shadowing_a_builtin_is_an_error(tmp_path: Path) -> None:
    write_distribution(tmp_path, "dscore-fake-cmd", "1.0", {"hello_cmd": "fakeplug_cmd.plugin"},
                       {"fakeplug_cmd.plugin": MANIFEST.format(name="run"), "fakeplug_cmd.cli": CLI})
    proc = _dscore(tmp_path, "--help")
    assert proc.returncode == 2
    assert "hello_cmd (dscore-fake-cmd 1.0) registers command 'run'" in proc.stderr
    assert "DSCORE_DISABLE_PLUGINS=hello_cmd" in proc.stderr
