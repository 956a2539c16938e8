"""Every ``DSCORE_*`` environment variable the runtime reads: one record each, and the scan that keeps the list true.

:data:`ENV_VARS` is the single source of ``docs/environment-variables.md`` (written by
``python -m dscore.process --write-docs``, see :mod:`dscore.process`). :func:`scan_reads` reads the source
of ``dscore/`` and of every built-in plugin package (:data:`dscore.plugin_manager.BUILTIN_PLUGINS`) with
:mod:`ast` and returns each ``DSCORE_*`` name found as a whole string literal outside a docstring (the way
every variable is spelled where it is read: ``os.environ.get("DSCORE_X")``, ``os.getenv("DSCORE_X")``,
``environ["DSCORE_X"]`` or a module constant ``X_ENV = "DSCORE_X"`` read later). This module itself is not
scanned. ``tests/unit/test_env_vars.py`` fails when a scanned name has no record here, when a record's
name is read nowhere, or when the generated document is out of date.

Torch-free; importing it imports nothing beyond the standard library.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV_VARS", "EnvVar", "by_name", "render_table", "scan_reads", "source_roots", "undocumented", "unread"]

#: what counts as one of dscore's variable names in a string literal
NAME_PATTERN = re.compile(r"DSCORE_[A-Z][A-Z0-9_]*")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: ``name``, ``default`` (the behaviour when it is unset, as text) and
    ``meaning`` (what it changes, the values it takes, and what a bad value does)."""

    name: str
    default: str
    meaning: str


#: every DSCORE_* variable read by dscore and its built-in plugins, sorted by name
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("DSCORE_ARRIVAL_TIMEOUT", "120",
           "Seconds a rank waits for every other rank to call the same collective API (`initialize`, "
           "`save_checkpoint`, `load_checkpoint`, `zero.Init`, ...) before raising `CollectiveArrivalError` "
           "naming the ranks that did not arrive. `0` turns the check off; anything but a number >= 0 is a "
           "`DistributedError`."),
    EnvVar("DSCORE_CHECKPOINT_FSYNC", "off",
           "`1`/`true`/`yes`/`on`: every file and directory of a checkpoint save is fsynced before the save is "
           "published, so it survives a power loss or kernel crash (costs the disk write time). Off, a save is "
           "still atomic against a killed process (temporary folder and renames), and a file torn by a power "
           "loss is caught at load by the size recorded in `_COMPLETE`."),
    EnvVar("DSCORE_CPU_SIMD", "detected",
           "The SIMD level the CPU ops are compiled for: `avx512`, `avx2` or `scalar` (default: the best level "
           "`/proc/cpuinfo` shows on x86-64 Linux, else `scalar`). A level below the detected one is allowed; "
           "another word or a level above the CPU's is an `OpBuildError`. The level is part of the op cache key."),
    EnvVar("DSCORE_DISABLE_PLUGINS", "none disabled",
           "Comma-separated plugin names (the whole plugin) or `kind:name` units (`comm_transport:shm`, "
           "`op_builder:fused_adam`, `launcher:slurm`) left out of the registry, like the config's "
           "`plugins.disable`. Essential ones (the `cpu` accelerator) cannot be disabled."),
    EnvVar("DSCORE_DISABLE_PLUGIN_AUTOLOAD", "off",
           "`1`/`true`/`yes`: load only the built-in plugins and the third-party plugins named in "
           "`DSCORE_PLUGINS`; every other installed entry point is listed as disabled."),
    EnvVar("DSCORE_EXIT_DRAIN_S", "30",
           "Seconds dscore waits, at exit and after destroying a process group, for gloo's worker threads to "
           "park, so that none drops a tensor while the interpreter finalizes (torch's exit abort). `0`: no "
           "wait (the `exit_drain` process policy is then off). Running out is logged at WARNING; a malformed "
           "value is logged and the default used."),
    EnvVar("DSCORE_GLOO_NATIVE", "0",
           "`1`: gloo groups use gloo's own collectives for everything (no pairwise point-to-point "
           "reduce-scatter/all-gather, no same-host shared memory). Read once per group."),
    EnvVar("DSCORE_MALLOC_MMAP_THRESHOLD", "1048576 (1 MiB)",
           "Bytes: the glibc `M_MMAP_THRESHOLD` that ZeRO stage 3 with parameters on the CPU (and NVMe "
           "optimizer offload) fixes once per process, so freed gathered buffers of at least that size go "
           "back to the OS instead of growing the heap; `M_TRIM_THRESHOLD` is set to twice that. `0` leaves "
           "the allocator alone (the `malloc_mmap_threshold` process policy is then off). Not an integer: "
           "`ConfigError`. Other allocators and non-glibc systems are never touched."),
    EnvVar("DSCORE_OPS_LOCK_TIMEOUT", "900",
           "Seconds an op build waits for another process building the same op into the same cache folder "
           "(its file lock) before raising `OpBuildError` naming the holder. An op builder's `lock_timeout_s` "
           "argument takes precedence."),
    EnvVar("DSCORE_PLUGINS", "empty",
           "With `DSCORE_DISABLE_PLUGIN_AUTOLOAD=1`: the comma-separated third-party plugins that are loaded "
           "anyway."),
    EnvVar("DSCORE_PROCESS_POLICIES", "all",
           "Which process-wide policies dscore applies (`dscore report` lists them; see the table above): "
           "`all`, `none`, or a comma-separated list of policy names (the others are off). An unknown name "
           "is a `ConfigError` that suggests the closest one."),
    EnvVar("DSCORE_SHM", "1",
           "`0` turns off the same-host shared-memory channel of the gloo pairwise collectives: every "
           "payload then goes by TCP (gloo point-to-point). Platforms without Linux `memfd`/`pidfd_open`/"
           "descriptor passing never use it."),
    EnvVar("DSCORE_SHM_BYTES", "268435456 (256 MiB)",
           "Bytes of address space of each rank's shared-memory outbox (pages cost memory only once "
           "written); an exchange that does not fit goes by TCP. Not a number >= 0: `DistributedError`."),
    EnvVar("DSCORE_SHM_TIMEOUT", "1800",
           "Seconds a rank waits for a peer to post a shared-memory exchange before raising "
           "`DistributedError` (a peer that exited is noticed sooner). Must be a positive number."),
    EnvVar("DSCORE_SWAP_INDEX", "~/.cache/dscore/swap_roots",
           "Path of the swap index: the file listing every `nvme_path` NVMe offload used on this machine, "
           "where `dscore report` looks for swap folders left by killed runs."),
    EnvVar("DSCORE_TEST_START_METHOD", "forkserver",
           "How `dscore.testing.run_distributed` starts its ranks: `forkserver` (torch preloaded once) or "
           "`spawn` (a fresh interpreter per rank); any other value means `spawn`."),
    EnvVar("DSCORE_TIMEOUT", "10",
           "Minutes: the collective timeout of a process group dscore creates (`init_distributed`, "
           "`initialize`) when no `timeout` argument is given; `DEEPSPEED_TIMEOUT` is read when it is unset. "
           "Must be a positive number (`DistributedError`)."),
)


def by_name() -> dict[str, EnvVar]:
    """``{name: record}`` of :data:`ENV_VARS`."""
    return {v.name: v for v in ENV_VARS}


def source_roots() -> list[Path]:
    """The folders scanned: ``dscore/`` and the top-level package of every built-in plugin's manifest."""
    from dscore.plugin_manager import BUILTIN_PLUGINS

    roots = [Path(__file__).resolve().parent]
    for top in sorted({module.split(".")[0] for _name, module in BUILTIN_PLUGINS}):
        spec = importlib.util.find_spec(top)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            path = Path(location).resolve()
            if path.is_dir() and path not in roots:
                roots.append(path)
    return roots


def scan_reads(roots: list[Path] | None = None) -> dict[str, list[tuple[Path, int]]]:
    """``{name: [(file, line), ...]}`` of every ``DSCORE_*`` name spelled as a whole string literal outside a
    docstring in the ``.py`` files under ``roots`` (default :func:`source_roots`); this module is skipped.

    Files that do not parse are skipped (they cannot run either).
    """
    found: dict[str, list[tuple[Path, int]]] = {}
    me = Path(__file__).resolve()
    for root in source_roots() if roots is None else roots:
        for path in sorted(root.rglob("*.py")):
            if path.resolve() == me:
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            docstrings = {
                id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
            }
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in docstrings
                    and NAME_PATTERN.fullmatch(node.value)
                ):
                    found.setdefault(node.value, []).append((path, node.lineno))
    return found


def undocumented(reads: dict[str, list[tuple[Path, int]]]) -> list[str]:
    """Names found by :func:`scan_reads` that have no record in :data:`ENV_VARS`."""
    known = by_name()
    return sorted(n for n in reads if n not in known)


def unread(reads: dict[str, list[tuple[Path, int]]]) -> list[str]:
    """Records of :data:`ENV_VARS` whose name :func:`scan_reads` found nowhere."""
    return sorted(v.name for v in ENV_VARS if v.name not in reads)


def _where(places: list[tuple[Path, int]], roots: list[Path]) -> str:
    files = set()
    for path, _line in places:
        for root in roots:
            try:
                files.add(str(path.relative_to(root.parent)))
                break
            except ValueError:
                continue
        else:
            files.add(path.name)
    shown = sorted(files)
    return ", ".join(f"`{f}`" for f in shown[:4]) + (", ..." if len(shown) > 4 else "")


def render_table(reads: dict[str, list[tuple[Path, int]]], roots: list[Path] | None = None) -> list[str]:
    """Markdown lines of the variable table (one row per record; the last column lists the files reading
    it, relative to their package's parent folder)."""
    bases = source_roots() if roots is None else roots
    lines = ["| variable | default | what it does | read in |", "|---|---|---|---|"]
    for v in sorted(ENV_VARS, key=lambda r: r.name):
        meaning = v.meaning.replace("|", "\\|")
        lines.append(f"| `{v.name}` | {v.default} | {meaning} | {_where(reads.get(v.name, []), bases)} |")
    return lines
