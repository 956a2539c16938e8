"""The launch plan: resources, ranks and the exact commands, computed before anything starts.

:func:`build_plan` turns parsed ``dscore run`` options into a :class:`Plan`; ``--dry_run`` prints it
(:meth:`Plan.as_json` has the keys ``runner``, ``world_info``, ``processes`` - each with ``host``, ``rank``,
``local_rank``, ``env``, ``argv`` - and ``commands``) and :func:`execute` runs it.

Resolution order (DeepSpeed's ``runner.main``, see the reference §7.3):

1. the hostfile (:func:`~dscore.launcher.hostfile.load_hostfile`); without one the pool is
   ``localhost`` with the accelerator's visible devices (turned into an include filter and re-set per
   node, as DeepSpeed does), ``--num_gpus`` processes, or the accelerator's device count;
2. include/exclude/--num_nodes/--num_gpus (:func:`~dscore.launcher.resources.select_resources`);
3. multi-node iff ``(--force_multi or several hosts) and not --no_ssh``; else the ranks are started
   directly by this process (``local``), or with ``--no_ssh`` only the ranks of ``--node_rank``.

The back end comes from the plugin registry (:mod:`dscore.launcher.runners`): ``--launcher NAME`` is
resolved there on every path (an unknown or disabled name is refused even for a local run, as DeepSpeed
refuses a bad choice), and a multi-node plan without ``--launcher`` uses the spec registered with
``default=True`` (pdsh). A local or ``--no_ssh`` plan without ``--launcher`` needs no back end at all.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dscore.errors import LauncherError
from dscore.launcher.accel import AcceleratorLaunchInfo, resolve_launch_info
from dscore.launcher.envfile import collect_exports
from dscore.launcher.hostfile import DEFAULT_HOSTFILE, Host, load_hostfile
from dscore.launcher.ports import check_master_port, pick_master_port
from dscore.launcher.ranks import ProcessSpec, build_rank_processes, check_core_binding_tool
from dscore.launcher.resources import WorldInfo, select_resources
from dscore.launcher.runners import (
    Runner,
    RunnerContext,
    check_program,
    default_launcher,
    launcher_names,
    launcher_registry,
    load_runner,
    resolve_launcher,
)
from dscore.launcher.supervise import PidFile, become_subreaper, supervise
from dscore.registry import Registry

__all__ = ["Plan", "build_plan", "dumps", "execute", "format_plan"]

log = logging.getLogger("dscore.launcher")


@dataclass
class Plan:
    """A resolved launch.

    Attributes:
        runner: ``"local"``, ``"no_ssh"`` or a multi-node runner name.
        world_info: host -> slots of the whole job.
        master_addr / master_port: rendezvous address.
        processes: every rank of the job (for ``no_ssh``: this node's ranks).
        commands: what this process starts (the ranks themselves for local/no_ssh).
        cleanup: commands run after an interrupted or failed multi-node job.
        binary: executable that must exist to run ``commands`` (multi-node runners), or "".
        accelerator: accelerator name used for the visible-devices variable.
        save_pid: write the pid file while running.
        backend: the multi-node back end that built ``commands`` (checks ``binary`` before the job
            starts), or None for local / ``no_ssh`` plans.
    """

    runner: str
    world_info: WorldInfo
    master_addr: str
    master_port: int
    processes: list[ProcessSpec]
    commands: list[ProcessSpec]
    cleanup: list[list[str]] = field(default_factory=list)
    binary: str = ""
    accelerator: str = "cpu"
    save_pid: bool = False
    backend: Runner | None = field(default=None, repr=False, compare=False)

    def as_json(self) -> dict[str, Any]:
        """JSON-ready dict (see the module docstring for the keys)."""
        return {
            "runner": self.runner,
            "accelerator": self.accelerator,
            "world_info": {h: list(s) for h, s in self.world_info.items()},
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "processes": [
                {"host": p.host, "rank": p.rank, "local_rank": p.local_rank, "env": dict(p.env), "argv": list(p.argv)}
                for p in self.processes
            ],
            "commands": [{"host": c.host, "argv": list(c.argv), "env": dict(c.env)} for c in self.commands],
            "cleanup": [list(c) for c in self.cleanup],
        }


def format_plan(plan: Plan) -> str:
    """Human-readable plan (``--dry_run`` without ``--json``)."""
    lines = [f"runner: {plan.runner}   accelerator: {plan.accelerator}   master: {plan.master_addr}:{plan.master_port}"]
    lines.append("world info:")
    lines += [f"  {h}: {len(s)} slot(s) {s}" for h, s in plan.world_info.items()]
    lines.append("processes:")
    for p in plan.processes:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env.items())
        lines.append(f"  rank {p.rank} (local {p.local_rank}) on {p.host}: {env}")
        lines.append(f"      {shlex.join(p.argv)}")
    lines.append("commands:")
    for c in plan.commands:
        env = "".join(f"{k}={shlex.quote(v)} " for k, v in c.env.items())
        lines.append(f"  [{c.host}] {env}{shlex.join(c.argv)}")
    return "\n".join(lines)


def _local_pool(
    args: argparse.Namespace, accel: AcceleratorLaunchInfo, environ: Mapping[str, str]
) -> tuple[WorldInfo, str, tuple[str, ...], list[int] | None]:
    """Pool without a hostfile; returns (pool, include filter, variables to unset in the ranks, and the
    visible devices that the pool's slots index, or None when slots are device ids)."""
    unset: tuple[str, ...] = ()
    include = args.include
    var = next((v for v in accel.visible_devices_vars if environ.get(v, "").strip()), None)
    visible = environ.get(var, "") if var else ""
    if args.no_ssh and args.num_nodes > 1:
        per_node = args.num_gpus if args.num_gpus >= 1 else accel.device_count()
        return {f"node{i}": list(range(per_node)) for i in range(args.num_nodes)}, include, unset, None
    if args.num_nodes > 1:
        raise LauncherError(
            f"--num_nodes {args.num_nodes} needs a hostfile listing the nodes: none was given with -H/--hostfile "
            f"and the default {DEFAULT_HOSTFILE} does not exist, so only this machine is available. Write "
            f"'<host> slots=<n>' lines to {DEFAULT_HOSTFILE} or pass -H PATH (or use --no_ssh --node_rank R "
            "--master_addr A on every node)"
        )
    if var and visible:
        unset = (var,)
        try:
            slots = [int(x) for x in visible.split(",") if x.strip()]
        except ValueError:
            raise LauncherError(
                f"{var}={visible!r} is not a comma-separated list of device indices; unset it or give indices"
            ) from None
        if args.include or args.exclude or args.num_nodes > 1 or args.num_gpus >= 0:
            # DeepSpeed #1331: DeepSpeed drops the variable here and pins ranks to physical devices outside
            # the job's; dscore reads slots (and --num_gpus) as positions in the visible list
            log.warning(
                "%s=%s: the slots of --include/--exclude/--num_gpus index this list (localhost:0 is device %d); "
                "DeepSpeed would ignore the variable and use physical device ids",
                var,
                visible,
                slots[0],
            )
            return {"localhost": list(range(len(slots)))}, include, unset, slots
        log.info("%s=%s: launching on these devices (include localhost:%s)", var, visible, ",".join(map(str, slots)))
        include = "localhost:" + ",".join(map(str, slots))
        return {"localhost": sorted(set(slots) | set(range(max(slots) + 1)))}, include, unset, None
    if args.num_gpus >= 1:
        return {"localhost": list(range(args.num_gpus))}, include, unset, None
    return {"localhost": list(range(accel.device_count()))}, include, unset, None


def build_plan(
    args: argparse.Namespace,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: str | None = None,
    accel: AcceleratorLaunchInfo | None = None,
    registry: Registry | None = None,
) -> Plan:
    """Resolve ``dscore run`` options into a :class:`Plan` without starting anything.

    Args:
        args: parsed options (see :mod:`dscore.launcher.options`).
        environ: environment (default ``os.environ``).
        cwd: working directory (default ``os.getcwd()``).
        accel: accelerator facts (default: :func:`~dscore.launcher.accel.resolve_launch_info`).
        registry: where the back ends are looked up (default: the installed plugins, with
            ``DSCORE_DISABLE_PLUGINS`` read from ``os.environ``).

    Raises:
        HostfileError: bad or missing explicit hostfile.
        LauncherError: conflicting or out-of-range options, an unknown or disabled launcher
            (:class:`~dscore.launcher.runners.UnknownLauncherError`), a runner that cannot honour the
            request, a bad ``.deepspeed_env``, or an empty master address.
        PluginConflictError, PluginLoadError: two plugins claim the back end, or its module cannot be imported.
    """
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    registry = launcher_registry() if registry is None else registry
    spec = resolve_launcher(args.launcher, registry) if args.launcher is not None else None
    if args.module and args.no_python:
        raise LauncherError("--module and --no_python cannot be used together (a module needs python)")
    if args.json and not args.dry_run:
        raise LauncherError("--json only applies to --dry_run; add --dry_run")
    hosts = load_hostfile(args.hostfile)
    if accel is None:
        # Probing (which may import torch) only when the device count or remote exports are needed.
        needs_count = hosts is None and args.num_gpus < 1
        needs_exports = not args.no_ssh and (args.force_multi or (hosts is not None and len(hosts) > 1))
        accel = resolve_launch_info(environ, probe=needs_count or needs_exports)
    unset: tuple[str, ...] = ()
    include = args.include
    visible_list: list[int] | None = None
    if hosts is None:
        pool, include, unset, visible_list = _local_pool(args, accel, environ)
        host_entries: dict[str, Host] = {}
    else:
        pool = {h.name: list(range(h.slots)) for h in hosts}
        host_entries = {h.name: h for h in hosts}
    num_nodes = args.num_nodes
    if hosts is None and args.no_ssh and num_nodes > 1:
        num_nodes = -1  # the synthetic pool already has exactly num_nodes nodes
    num_gpus = args.num_gpus if not (hosts is None and include != args.include) else -1
    world = select_resources(pool, include=include, exclude=args.exclude, num_nodes=num_nodes, num_gpus=num_gpus)
    if visible_list is not None:  # positions in the visible-devices list -> the devices themselves
        world = {h: [visible_list[i] for i in s] for h, s in world.items()}
    multi = (args.force_multi or len(world) > 1) and not args.no_ssh

    if args.no_ssh:
        if args.node_rank < 0 or args.node_rank >= len(world):
            raise LauncherError(
                f"--no_ssh needs --node_rank in 0..{len(world) - 1} ({len(world)} node(s): {', '.join(world)}), "
                f"got {args.node_rank}"
            )
        if not args.master_addr:
            raise LauncherError("--no_ssh needs --master_addr (the address of node 0, reachable from every node)")
    elif args.node_rank >= 0:
        raise LauncherError(f"--node_rank {args.node_rank} is only used with --no_ssh; add --no_ssh or drop it")

    master_port = _master_port(args, local=not multi and not args.no_ssh)
    local_rank_spelling = getattr(args, "local_rank_spelling", "local_rank")
    if args.no_local_rank and local_rank_spelling != "local_rank":
        raise LauncherError(
            f"--no_local_rank with --local_rank_spelling {local_rank_spelling}: the first passes no local-rank "
            "argument at all; drop one of them"
        )
    common = dict(
        master_port=master_port,
        script=args.user_script,
        script_args=list(args.user_args),
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        local_rank_spelling=local_rank_spelling,
        each_rank_log=args.enable_each_rank_log,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
    )
    if not multi:
        master = args.master_addr or "127.0.0.1"
        node_rank = args.node_rank if args.no_ssh else 0
        procs = build_rank_processes(
            world,
            node_rank,
            master_addr=master,
            visible_devices_vars=accel.visible_devices_vars,
            environ=environ,
            **common,  # type: ignore[arg-type]
        )
        for p in procs:
            p.unset = unset
        return Plan(
            runner="no_ssh" if args.no_ssh else "local",
            world_info=world,
            master_addr=master,
            master_port=master_port,
            processes=procs,
            commands=procs,
            accelerator=accel.name,
            save_pid=args.save_pid,
        )

    runner: Runner = load_runner(spec if spec is not None else default_launcher(registry), registry)
    if local_rank_spelling != "local_rank" and not runner.passes_local_rank:
        raise LauncherError(
            f"--local_rank_spelling {local_rank_spelling} with --launcher {runner.name}: its ranks get no "
            "local-rank argument (they read LOCAL_RANK from the environment); drop --local_rank_spelling"
        )
    master = args.master_addr or next(iter(world))
    if not args.master_addr:
        log.info(
            "--master_addr not given: using the first host %r (pass --master_addr if other nodes cannot resolve it)",
            master,
        )
    ctx = RunnerContext(
        world_info=world,
        hosts=host_entries,
        master_addr=master,
        master_port=master_port,
        script=args.user_script,
        script_args=list(args.user_args),
        python=sys.executable,
        cwd=cwd,
        exports=collect_exports(environ, cwd=cwd, extra_prefixes=accel.export_prefixes),
        launcher_args=shlex.split(args.launcher_args),
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        local_rank_spelling=local_rank_spelling,
        ssh_port=args.ssh_port,
        venv_script=args.venv_script,
        visible_devices_vars=accel.visible_devices_vars,
        each_rank_log=args.enable_each_rank_log,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
        filtered_by=f"--include {args.include!r}"
        if args.include
        else (f"--exclude {args.exclude!r}" if args.exclude else ""),
    )
    runner.validate(ctx)
    return Plan(
        runner=runner.name,
        world_info=world,
        master_addr=master,
        master_port=master_port,
        processes=runner.processes(ctx),
        commands=runner.commands(ctx),
        cleanup=runner.cleanup_commands(ctx),
        binary=runner.program(),
        accelerator=accel.name,
        save_pid=args.save_pid,
        backend=runner,
    )


#: DeepSpeed's rendezvous port, used across nodes when --master_port is not given.
DEFAULT_MASTER_PORT = 29500


def _master_port(args: argparse.Namespace, *, local: bool) -> int:
    """The rendezvous port: a single-node run without ``--master_port`` gets a free one (logged), an
    explicit one is checked to be free (single node: this node hosts rank 0); across nodes 29500."""
    if args.master_port is None:
        if not local:
            return DEFAULT_MASTER_PORT
        port = pick_master_port()
        log.info("--master_port not given: using free port %d for the rendezvous", port)
        return port
    if local:
        check_master_port(int(args.master_port))
    return int(args.master_port)


def execute(plan: Plan) -> int:
    """Run ``plan`` in this process and return the job's exit code.

    Local and ``no_ssh`` plans start the ranks directly; multi-node plans start the runner command(s).
    Both are supervised by :func:`~dscore.launcher.local.supervise`.

    Raises:
        LauncherError: the runner's executable (or numactl for core binding) is not installed, or the pid
            file exists.
    """
    if plan.binary:
        if plan.backend is not None:
            where = check_program(plan.backend, plan.binary)
            log.info("--launcher %s: starting the job with %s", plan.runner, where)
        elif shutil.which(plan.binary) is None:
            raise LauncherError(
                f"--launcher {plan.runner} needs {plan.binary!r}, which is not on PATH; install it or choose another "
                f"launcher ({', '.join(launcher_names())}), or --no_ssh on each node"
            )
    check_core_binding_tool(plan.commands)
    become_subreaper()
    failure: list[str] = []
    if plan.save_pid:
        with PidFile():
            code = supervise(plan.commands, failure=failure)
    else:
        code = supervise(plan.commands, failure=failure)
    if code != 0:
        for argv in plan.cleanup:
            log.info("stopping leftovers on the remote hosts: %s", shlex.join(argv))
            try:
                subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, timeout=60)
            except (OSError, subprocess.SubprocessError) as exc:
                log.error("clean-up command failed (%s): %s", exc, shlex.join(argv))
        if failure and plan.runner not in ("local", "no_ssh"):
            log.error("job failed: %s; dscore run exits with %d", failure[0], code)
    return code


def dumps(plan: Plan) -> str:
    """``--dry_run --json`` output."""
    return json.dumps(plan.as_json(), indent=2)
