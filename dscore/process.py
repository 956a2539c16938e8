"""Process-wide policy: everything dscore changes about the process beyond its own objects, in one place.

A few things dscore does affect the whole process, not only the engine that asks for them: the C
allocator's thresholds, functions of ``torch.distributed``, ``atexit`` hooks, a signal handler, variables
of ``os.environ``. Each is a named :class:`ProcessPolicy` in :data:`POLICIES` (what it changes, when it is
applied, the variables that tune it) and the code that needs it applies it through :func:`apply`::

    from dscore import process

    process.apply("shm_exit_flush", atexit.register, flush_pending_sends)

:func:`apply` calls the action only when the policy is on; off, it does nothing and returns ``None``.
``DSCORE_PROCESS_POLICIES`` switches them: unset or ``all`` (default: every policy on, dscore's normal
behaviour), ``none`` (dscore changes nothing process-wide; the costs are in each record's ``off_cost``), or
a comma-separated list of the policies to keep on. A policy whose own variable is set to ``0``
(:attr:`ProcessPolicy.zero_turns_off`) is off too. ``dscore report`` (``--json``: key
``process_policies``) shows each one's state and why (:func:`policy_states`).

``python -m dscore.process`` prints the states; ``--write-docs`` regenerates
``docs/environment-variables.md`` (this table and every ``DSCORE_*`` variable, from
:data:`dscore.env_vars.ENV_VARS`); ``--check-docs`` exits 1 when that file is out of date or a variable read in
the code has no record. ``tests/unit/test_process_policies.py`` and ``tests/unit/test_env_vars.py`` keep both true.

Torch-free; importing it imports nothing beyond the standard library and :mod:`dscore.errors`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from dscore.errors import ConfigError, did_you_mean

__all__ = [
    "DOC_PATH",
    "POLICIES",
    "POLICY_ENV",
    "REGENERATE",
    "ProcessPolicy",
    "apply",
    "enabled",
    "main",
    "policy",
    "policy_state",
    "policy_states",
    "render_docs",
    "selected_policies",
    "stale_lines",
]

log = logging.getLogger("dscore.process")

P = ParamSpec("P")
T = TypeVar("T")

#: the switch: ``all`` (default), ``none`` or a comma-separated list of policy names
POLICY_ENV = "DSCORE_PROCESS_POLICIES"
#: the command that regenerates the document
REGENERATE = "python -m dscore.process --write-docs"
_REPO = Path(__file__).resolve().parents[1]
#: where ``--write-docs`` puts the tables (a checkout's ``docs/``)
DOC_PATH = _REPO / "docs" / "environment-variables.md"


@dataclass(frozen=True)
class ProcessPolicy:
    """One process-wide policy.

    Attributes:
        name: what ``DSCORE_PROCESS_POLICIES`` and :func:`apply` call it.
        changes: what it changes in the process.
        applied_when: where and when dscore applies it (at most once per process unless said).
        off_cost: what turning it off means for the process.
        env: the ``DSCORE_*`` variables that tune it (records in :data:`dscore.env_vars.ENV_VARS`).
        zero_turns_off: one of ``env`` whose value ``0`` turns the policy off as well.
    """

    name: str
    changes: str
    applied_when: str
    off_cost: str
    env: tuple[str, ...] = ()
    zero_turns_off: str | None = None


#: every process-wide policy dscore has; all on by default
POLICIES: tuple[ProcessPolicy, ...] = (
    ProcessPolicy(
        "malloc_mmap_threshold",
        "glibc `mallopt`: `M_MMAP_THRESHOLD` fixed at `DSCORE_MALLOC_MMAP_THRESHOLD` bytes (which turns glibc's "
        "dynamic threshold off) and `M_TRIM_THRESHOLD` at twice that, for every allocation of the process.",
        "once, by the first ZeRO stage-3 engine whose parameters live on the CPU (or are offloaded), and by "
        "NVMe optimizer offload; only with glibc on Linux.",
        "freed gathered buffers and swap buffers stay in glibc's heap: peak RSS grows by the released "
        "buffers (measured: +200 MiB on a 34M-parameter model with NVMe offload).",
        env=("DSCORE_MALLOC_MMAP_THRESHOLD",), zero_turns_off="DSCORE_MALLOC_MMAP_THRESHOLD",
    ),
    ProcessPolicy(
        "torch_group_pins",
        "rebinds default arguments of loaded `torch.distributed` functions that hold the default process "
        "group object (`group=group.WORLD` evaluated at import) to `None`, torch's value for \"the default "
        "group, looked up at call time\".",
        "when an engine takes the default group, before dscore destroys a group it created, and at exit.",
        "those defaults keep the group, and its gloo worker threads, alive past `destroy_process_group` into "
        "interpreter finalization, where a worker dropping a tensor can abort the process (exit 134).",
    ),
    ProcessPolicy(
        "group_exit_hook",
        "an `atexit` hook that destroys the default process group dscore created (a user's group is left "
        "alone), releases torch's references to it and waits for gloo's workers, before the interpreter "
        "finalizes.",
        "registered once, when `init_distributed` creates or adopts the default group or an engine takes it.",
        "a group dscore created lives into interpreter finalization (unless an engine closed it): the "
        "torch exit abort becomes possible again; `torch_group_pins` and `exit_drain` no longer run at exit.",
    ),
    ProcessPolicy(
        "shm_exit_flush",
        "an `atexit` hook that waits (at most 60 s) for this rank's gloo sends of shared-memory exchanges "
        "still in flight (payloads the outbox could not take) and receives the gloo parts of exchanges it "
        "dropped unwaited, so a rank that is done does not exit before its peers got their data.",
        "registered once, when the first group sets up its same-host shared-memory channel (after "
        "`group_exit_hook`, so it runs before it: `atexit` runs the last registered first).",
        "a peer may wait for data this rank never delivered until its own timeout.",
    ),
    ProcessPolicy(
        "p2p_exit_flush",
        "an `atexit` hook that completes the gloo point-to-point transfers of works dropped without `wait()`.",
        "registered once, when the first such work is collected with transfers pending.",
        "a peer's matching transfers, and every later message on that gloo pair, may never complete.",
    ),
    ProcessPolicy(
        "exit_drain",
        "waits (GIL released, at most `DSCORE_EXIT_DRAIN_S` seconds) until gloo's worker threads are parked, "
        "so none drops a tensor while the interpreter finalizes.",
        "at exit (from `group_exit_hook`), and after destroying a group that something still references.",
        "a worker still finishing a collective at exit can abort the process in finalization (a torch "
        "limitation, exit 134).",
        env=("DSCORE_EXIT_DRAIN_S",), zero_turns_off="DSCORE_EXIT_DRAIN_S",
    ),
    ProcessPolicy(
        "nvme_sigterm_cleanup",
        "a SIGTERM handler that removes this process's NVMe-offload swap folders, then dies of the signal as "
        "the default action would (same exit status).",
        "installed once, by the first NVMe swap manager, from the main thread, only where SIGTERM still has "
        "its default action (a user's handler is never replaced).",
        "a rank stopped by SIGTERM (a launcher ending a failed job) leaves its swap folder; `dscore report` "
        "lists it as stale.",
    ),
    ProcessPolicy(
        "process_mesh",
        "a process-wide list of weak references to the engines `dscore.initialize` built (and to the meshes "
        "`UlyssesSPAttentionHF.register_with_transformers` built before one), so the group accessors "
        "(`dscore.parallel.groups`, `deepspeed.utils.groups`) called outside an engine call read the mesh of "
        "the live engines (the most recent; two live engines with different meshes are an error naming "
        "both), else the most recent live mesh noted since the last `initialize`.",
        "at every `dscore.initialize`, once the engine is built, and at every `register_with_transformers`; "
        "an engine leaves the list at `close()` or when it is collected.",
        "the accessors work only inside `engine.forward` / `backward` / `step` or under "
        "`dscore.runtime.context.use_runtime(engine.runtime)`; elsewhere (Accelerate's Ulysses data-loader "
        "adapter, the Trainer's sequence-parallel loss) they raise \"no parallel mesh is current\".",
    ),
    ProcessPolicy(
        "rendezvous_env",
        "`os.environ.setdefault` of the discovered `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, "
        "`MASTER_PORT` (only variables not set yet), as DeepSpeed does.",
        "when `init_distributed` discovers the rendezvous from `os.environ` (MPI, SLURM, ... variables) and "
        "creates the group; `LOCAL_RANK` also when it adopts an existing group.",
        "code that reads those variables later (user code, `torch.distributed.run`-style helpers) does not "
        "find them when the launcher set only MPI/SLURM variables.",
    ),
)

_BY_NAME = {p.name: p for p in POLICIES}


def policy(name: str) -> ProcessPolicy:
    """The record of policy ``name``.

    Raises:
        ConfigError: no policy has that name (the message suggests the closest names).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(_unknown(name, "is not a process policy")) from None


def _unknown(name: str, what: str) -> str:
    close = did_you_mean(name, _BY_NAME)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return f"{name!r} {what}{hint}; the policies are {', '.join(_BY_NAME)}"


def _selection(env: Mapping[str, str]) -> tuple[frozenset[str], str, bool]:
    """``(names on, the switch as text, whether it was a list of names)``; raises as :func:`selected_policies`."""
    raw = env.get(POLICY_ENV, "").strip()
    if not raw:
        return frozenset(_BY_NAME), f"{POLICY_ENV} is unset (default all)", False
    items = [s.strip() for s in raw.split(",") if s.strip()]
    lowered = [s.lower() for s in items]
    if lowered == ["all"]:
        return frozenset(_BY_NAME), f"{POLICY_ENV}=all", False
    if lowered == ["none"]:
        return frozenset(), f"{POLICY_ENV}=none", False
    if "all" in lowered or "none" in lowered:
        raise ConfigError(f"{POLICY_ENV}={raw!r}: 'all' and 'none' stand alone, not in a list of policy names")
    for item in items:
        if item not in _BY_NAME:
            raise ConfigError(f"{POLICY_ENV}={raw!r}: " + _unknown(item, "is not a process policy"))
    return frozenset(items), f"{POLICY_ENV}={raw}", True


def selected_policies(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The policies ``DSCORE_PROCESS_POLICIES`` keeps on (before each policy's own ``0``, see
    :func:`policy_state`).

    Args:
        environ: where to read the variable (default ``os.environ``).

    Raises:
        ConfigError: the variable names an unknown policy (with a did-you-mean), or mixes ``all``/``none``
            with names.
    """
    return _selection(os.environ if environ is None else environ)[0]


def _is_zero(text: str) -> bool:
    try:
        return float(text) == 0
    except ValueError:
        return False


def policy_state(name: str, environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether policy ``name`` is on, and why.

    Raises:
        ConfigError: ``name`` is not a policy, or ``DSCORE_PROCESS_POLICIES`` is malformed.
    """
    record = policy(name)
    env = os.environ if environ is None else environ
    names, switch, listed = _selection(env)
    if name not in names:
        return False, f"not listed in {switch}" if listed else switch
    own = record.zero_turns_off
    if own is not None and _is_zero(env.get(own, "").strip()):
        return False, f"{own}={env.get(own, '').strip()}"
    return True, f"listed in {switch}" if listed else switch


def enabled(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether policy ``name`` is on (see :func:`policy_state`; same errors)."""
    return policy_state(name, environ)[0]


def apply(name: str, action: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T | None:
    """Apply process policy ``name``: call ``action(*args, **kwargs)`` when the policy is on.

    Every process-wide change dscore makes goes through here (``process.apply("group_exit_hook",
    atexit.register, hook)``). The switch is read at each call, so a test or a user may change
    ``DSCORE_PROCESS_POLICIES`` at run time.

    Returns:
        what ``action`` returned, or ``None`` when the policy is off (``action`` is not called).

    Raises:
        ConfigError: ``name`` is not a policy, or ``DSCORE_PROCESS_POLICIES`` is malformed.
        whatever ``action`` raises.
    """
    on, why = policy_state(name)
    if not on:
        log.debug("process policy %s is off (%s): not applied", name, why)
        return None
    return action(*args, **kwargs)


def policy_states(environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per policy for ``dscore report``: ``{name, on, why, env, changes, applied_when, off_cost}``
    (``env``: each tuning variable's current value, ``None`` when unset).

    Raises:
        ConfigError: ``DSCORE_PROCESS_POLICIES`` is malformed.
    """
    env = os.environ if environ is None else environ
    rows = []
    for p in POLICIES:
        on, why = policy_state(p.name, env)
        rows.append({"name": p.name, "on": on, "why": why, "env": {v: env.get(v) for v in p.env},
                     "changes": p.changes, "applied_when": p.applied_when, "off_cost": p.off_cost})
    return rows


# --------------------------------------------------------------------------------------------- the document


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _applied_in(roots: list[Path]) -> dict[str, list[str]]:
    """policy name -> files calling ``apply("<name>", ...)`` (read with :mod:`ast`)."""
    import ast

    found: dict[str, set[str]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute | ast.Name)
                    and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "apply"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value in _BY_NAME
                ):
                    found.setdefault(str(node.args[0].value), set()).add(str(path.relative_to(root.parent)))
    return {k: sorted(v) for k, v in found.items()}


def render_docs(roots: list[Path] | None = None) -> str:
    """The ``docs/environment-variables.md`` text: the policy table, then every ``DSCORE_*`` variable.

    Args:
        roots: the folders whose sources are scanned (default :func:`dscore.env_vars.source_roots`).
    """
    from dscore import env_vars

    bases = env_vars.source_roots() if roots is None else roots
    applied = _applied_in(bases)
    lines = [
        "# Environment variables and process-wide policies",
        "",
        f"Generated by `{REGENERATE}` from the records in `dscore/process.py` (policies) and",
        "`dscore/env_vars.py` (variables). Do not edit by hand; `tests/unit/test_env_vars.py` fails when a",
        "`DSCORE_*` variable read in `dscore/`, `plugins/` or `accelerators/` has no record or this file is stale.",
        "",
        "## Process-wide policies",
        "",
        f"Everything dscore changes about the whole process. All are on by default; `{POLICY_ENV}=none` turns",
        f"them all off, `{POLICY_ENV}=a,b` keeps only `a` and `b`. `dscore report` shows each one's state.",
        "",
        "| policy | what it changes | when it is applied | when off | variables | applied in |",
        "|---|---|---|---|---|---|",
    ]
    for p in POLICIES:
        variables = ", ".join(f"`{v}`" for v in p.env)
        where = ", ".join(f"`{f}`" for f in applied.get(p.name, []))
        lines.append(
            f"| `{p.name}` | {_cell(p.changes)} | {_cell(p.applied_when)} | {_cell(p.off_cost)} | {variables} | {where} |"
        )
    lines += ["", "## `DSCORE_*` variables", "", *env_vars.render_table(env_vars.scan_reads(bases), bases)]
    return "\n".join(lines) + "\n"


def _without_where(text: str) -> list[str]:
    # the last column of each table ("applied in" / "read in") names files: it drifts as code moves
    out = []
    for line in text.splitlines():
        if line.startswith("| ") and line.endswith(" |") and " | " in line:
            body = line[: -len(" |")]
            line = body[: body.rfind(" | ")]
        out.append(line)
    return out


def stale_lines(current: str, roots: list[Path] | None = None) -> list[str]:
    """Lines of the regenerated document missing from ``current`` (the *applied in* / *read in* columns
    are left out of the comparison: they list files and drift as code moves)."""
    have = set(_without_where(current))
    return [line for line in _without_where(render_docs(roots)) if line not in have]


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(_REPO))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dscore.process [--write-docs | --check-docs]`` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m dscore.process", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write-docs", action="store_true", help=f"regenerate {_relative(DOC_PATH)}")
    group.add_argument("--check-docs", action="store_true",
                       help="exit 1 when the document is stale or a DSCORE_* variable read in the code has no record")
    args = parser.parse_args(argv)
    if args.write_docs or args.check_docs:
        from dscore import env_vars

        reads = env_vars.scan_reads()
        missing, orphans = env_vars.undocumented(reads), env_vars.unread(reads)
        for name in missing:
            sys.stderr.write(f"{name} is read in the code but has no record in dscore/env_vars.py (ENV_VARS)\n")
        for name in orphans:
            sys.stderr.write(f"{name} has a record in dscore/env_vars.py but nothing reads it\n")
        if args.write_docs:
            DOC_PATH.write_text(render_docs(), encoding="utf-8")
            sys.stderr.write(f"wrote {DOC_PATH}\n")
            return 1 if missing or orphans else 0
        stale = stale_lines(DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else "")
        if stale:
            sys.stderr.write(f"{_relative(DOC_PATH)} is out of date ({len(stale)} line(s)): run {REGENERATE}\n")
        return 1 if missing or orphans or stale else 0
    try:
        rows = policy_states()
    except ConfigError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        sys.stdout.write(f"{r['name'].ljust(width)}  {'on ' if r['on'] else 'off'}  {r['why']}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
