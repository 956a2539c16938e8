"""Multi-node back ends, the core side: the contract a back end implements and how ``dscore run`` finds one.

A back end (``--launcher NAME``) is a :class:`Runner` subclass registered by a plugin with a
:class:`~dscore.specs.LauncherSpec` (hook ``dscore_register_launchers``); the built-in ones (pdsh, ssh,
openmpi, mpich, impi, mvapich, slurm) live in the ``launch`` plugin. ``dscore run`` resolves the name
through the plugin :class:`~dscore.registry.Registry` (:func:`get_runner`; without ``--launcher``, the
spec with ``default=True``: pdsh, as in DeepSpeed), so an unknown name gets the registry's close matches
and a disabled unit (``DSCORE_DISABLE_PLUGINS=launcher:slurm``) is refused naming ``launcher:slurm``.

The contract (all public, what a third-party back end uses):

* :class:`RunnerContext` - everything known about the job: world info (host -> slots after filtering),
  hostfile entries, rendezvous address, script and arguments, the exported variables
  (:class:`~dscore.launcher.envfile.EnvVar`, quoted with :func:`~dscore.launcher.envfile.shell_export`),
  ``--launcher_args``, ``--ssh_port``, ``--venv_script`` and the per-rank options;
* :class:`Runner` - ``validate(ctx)`` raises :class:`~dscore.errors.LauncherError` for what the back end
  cannot honour, ``commands(ctx)`` returns the :class:`~dscore.launcher.ranks.ProcessSpec` (s) this process
  starts and supervises, ``processes(ctx)`` the per-rank layout ``--dry_run`` shows,
  ``cleanup_commands(ctx)`` what stops leftovers after a failure, ``program()`` the executable;
* :data:`NODE_MODULE` (``python -m dscore.launcher.node``), the per-node entry a remote shell or an MPI
  program starts; :meth:`Runner.remote_shell_command` and :meth:`Runner.mpi_rank_argv` build its command
  lines, :func:`dscore.launcher.node.parse_failure_line` reads its failure line from a command's output.

Which program: :meth:`Runner.program` takes the first of :attr:`Runner.programs` on ``PATH`` and falls back
to the last; :func:`check_program` checks it before anything starts (for a generic ``mpirun``, that its
``--version`` names the runner's flavour, :attr:`Runner.flavour_marker`).
"""

from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from dscore.errors import ComponentNotFoundError, LauncherError, PluginConflictError
from dscore.launcher.envfile import EnvVar, shell_export
from dscore.launcher.hostfile import Host
from dscore.launcher.node import encode_world_info
from dscore.launcher.ranks import ProcessSpec, build_rank_processes
from dscore.launcher.resources import WorldInfo
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry
from dscore.specs import LauncherSpec

__all__ = [
    "RunnerContext",
    "Runner",
    "RUNNERS",
    "NODE_MODULE",
    "UnknownLauncherError",
    "check_program",
    "default_launcher",
    "get_runner",
    "launcher_names",
    "launcher_registry",
    "load_runner",
    "resolve_launcher",
]

log = logging.getLogger("dscore.launcher")

_which = shutil.which  # indirection so plan tests can pretend no MPI program is installed

#: The per-node launcher module started on every host.
NODE_MODULE = "dscore.launcher.node"


@dataclass
class RunnerContext:
    """Everything a runner needs to build its commands.

    Attributes:
        world_info: host -> slots after filtering (hostfile order).
        hosts: host name -> hostfile entry (for ``user@host``).
        master_addr / master_port: rendezvous address (never empty here).
        script / script_args: the training script and its arguments, unchanged.
        python: interpreter path used on every host.
        cwd: working directory the ranks start in.
        exports: variables exported to every node.
        launcher_args: ``--launcher_args`` split with :func:`shlex.split`.
        filtered_by: the filter option that shaped ``world_info`` (for messages), or "".
    """

    world_info: WorldInfo
    hosts: dict[str, Host]
    master_addr: str
    master_port: int
    script: str
    script_args: list[str]
    python: str
    cwd: str
    exports: list[EnvVar] = field(default_factory=list)
    launcher_args: list[str] = field(default_factory=list)
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    local_rank_spelling: str = "local_rank"
    ssh_port: int | None = None
    venv_script: str | None = None
    visible_devices_vars: tuple[str, ...] = ()
    each_rank_log: str | None = None
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    filtered_by: str = ""

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return sum(len(s) for s in self.world_info.values())

    def target(self, host: str) -> str:
        """``user@host`` when the hostfile gave a user, else ``host``."""
        entry = self.hosts.get(host)
        return entry.target if entry else host


class Runner:
    """Base class of a multi-node back end (the contract a launcher plugin implements).

    ``dscore run`` builds one with ``cls()`` (no arguments) and sets :attr:`name` to the spec's name, then
    calls :meth:`validate`, :meth:`processes`, :meth:`commands` and :meth:`cleanup_commands` with the
    job's :class:`RunnerContext`, and :meth:`program` for the executable checked before the job starts.

    Subclasses set :attr:`binary` (or :attr:`programs`), :attr:`uses_shell` and :attr:`passes_local_rank`
    and implement :meth:`commands`; they extend :meth:`validate` for inputs they cannot honour, and may
    use :meth:`remote_shell_command` (shell-based back ends), :meth:`mpi_rank_argv` (back ends whose
    program starts every rank) and :meth:`uniform_slots`.
    """

    #: the ``--launcher`` name (set from the spec when loaded through the registry).
    name = ""
    #: the executable started, when :attr:`programs` is empty.
    binary = ""
    #: programs tried in order; the first on PATH is used (the last is the generic fallback).
    programs: tuple[str, ...] = ()
    #: text that ``<generic program> --version`` must contain for this flavour ("" = no check).
    flavour_marker = ""
    #: True when a remote POSIX shell runs the per-node launcher on every host (``user@host`` entries,
    #: slot-specific filters and the visible-devices variables are then honoured per host).
    uses_shell = False
    #: True when the ranks get ``--local_rank=N`` (unless ``--no_local_rank``).
    passes_local_rank = False

    def program(self) -> str:
        """The executable this runner starts: the first of :attr:`programs` on ``PATH``, else the last."""
        candidates = self.programs or (self.binary,)
        for name in candidates:
            if _which(name):
                return name
        return candidates[-1]

    def validate(self, ctx: RunnerContext) -> None:
        """Reject inputs the backend cannot honour.

        Raises:
            LauncherError: naming the option and value and what the runner accepts.
        """
        if not self.uses_shell:
            users = [ctx.hosts[h].target for h in ctx.world_info if h in ctx.hosts and ctx.hosts[h].user]
            if users:
                raise LauncherError(
                    f"--launcher {self.name}: hostfile entries with a user ({', '.join(users)}) need an ssh-based "
                    "runner; use --launcher pdsh or ssh, or configure the user in ~/.ssh/config"
                )
            slot_specific = {h: s for h, s in ctx.world_info.items() if s != list(range(len(s)))}
            if slot_specific:
                detail = ", ".join(f"{h}:{','.join(map(str, s))}" for h, s in slot_specific.items())
                raise LauncherError(
                    f"--launcher {self.name} places ranks by count and cannot honour slot-specific "
                    f"{ctx.filtered_by or 'filters'} ({detail}); filter whole hosts (e.g. -i host1@host2) or use "
                    "--launcher pdsh or ssh"
                )

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """The command(s) the launcher runs locally to start the job (supervised like local ranks; a
        :attr:`ProcessSpec.watch` callback lets a command report a remote rank's failure).

        Raises:
            NotImplementedError: a subclass that does not build commands.
        """
        raise NotImplementedError(f"runner {self.name!r} does not build commands")

    def cleanup_commands(self, ctx: RunnerContext) -> list[list[str]]:
        """Commands run after an interrupted or failed job to stop leftovers on remote hosts."""
        return []

    def processes(self, ctx: RunnerContext) -> list[ProcessSpec]:
        """Per-rank layout (host, rank, local rank, environment, argv as run on the host)."""
        out: list[ProcessSpec] = []
        for node_rank in range(len(ctx.world_info)):
            out += build_rank_processes(
                ctx.world_info,
                node_rank,
                master_addr=ctx.master_addr,
                master_port=ctx.master_port,
                script=ctx.script,
                script_args=ctx.script_args,
                python=ctx.python,
                module=ctx.module,
                no_python=ctx.no_python,
                no_local_rank=ctx.no_local_rank or not self.passes_local_rank,
                local_rank_spelling=ctx.local_rank_spelling,
                visible_devices_vars=ctx.visible_devices_vars if self.uses_shell else (),
                bind_cores_to_rank=False,
                environ={},
            )
        return out

    # ----------------------------------------------------------------- helpers for subclasses
    def uniform_slots(self, ctx: RunnerContext) -> int:
        """The slot count every host has (runners that place ranks by a per-node count need one).

        Raises:
            LauncherError: the hosts have different slot counts, naming each.
        """
        counts = {h: len(s) for h, s in ctx.world_info.items()}
        if len(set(counts.values())) != 1:
            detail = ", ".join(f"{h}={n}" for h, n in counts.items())
            raise LauncherError(
                f"--launcher {self.name} needs the same number of slots on every host, got {detail}; use "
                "--num_gpus N, fix the hostfile, or use --launcher pdsh, ssh or openmpi"
            )
        return next(iter(counts.values()))

    def mpi_rank_argv(self, ctx: RunnerContext) -> list[str]:
        """argv of one rank started by an MPI-style program: ``python -u -m dscore.launcher.node --mpi
        --master_addr=A --master_port=P [--expand_env=NAME ...] script args`` (the node entry reads its rank
        from the MPI variables); with ``--venv_script``, wrapped in ``/bin/sh -c '. script && exec ...'``."""
        # --venv_script: sourced by a POSIX shell on the node right before the rank (no remote shell here)
        argv = ["/bin/sh", "-c", '. "$0" && exec "$@"', ctx.venv_script] if ctx.venv_script else []
        argv += [ctx.python, "-u", "-m", NODE_MODULE, "--mpi", f"--master_addr={ctx.master_addr}"]
        argv += [f"--master_port={ctx.master_port}"]
        argv += [f"--expand_env={v.name}" for v in ctx.exports if v.expand]
        argv += ["--module"] * ctx.module + ["--no_python"] * ctx.no_python
        return argv + [ctx.script, *ctx.script_args]

    def node_argv(self, ctx: RunnerContext, node_rank: str) -> list[str]:
        """argv of the per-node launcher on one host (``python -u -m dscore.launcher.node --world_info=...
        --node_rank=R ...``) without the script; ``node_rank`` may be a placeholder such as pdsh's ``%n``."""
        argv = [ctx.python, "-u", "-m", NODE_MODULE, f"--world_info={encode_world_info(ctx.world_info)}"]
        argv += [f"--node_rank={node_rank}", f"--master_addr={ctx.master_addr}", f"--master_port={ctx.master_port}"]
        argv += [f"--visible_devices_env={var}" for var in ctx.visible_devices_vars]
        argv += ["--module"] * ctx.module + ["--no_python"] * ctx.no_python + ["--no_local_rank"] * ctx.no_local_rank
        if ctx.local_rank_spelling != "local_rank":
            argv.append(f"--local_rank_spelling={ctx.local_rank_spelling}")
        if ctx.each_rank_log:
            argv.append(f"--enable_each_rank_log={ctx.each_rank_log}")
        if ctx.bind_cores_to_rank:
            argv.append("--bind_cores_to_rank")
        if ctx.bind_core_list:
            argv.append(f"--bind_core_list={ctx.bind_core_list}")
        return argv

    def remote_shell_command(self, ctx: RunnerContext, node_rank: str, extra: Sequence[str] = ()) -> str:
        """The command line a remote POSIX shell runs on one host: exports, ``cd``, the node launcher.

        Every argument is quoted with :func:`shlex.quote`, so an argument with spaces stays one element
        of the rank's ``sys.argv`` and nothing is interpreted by the remote shell.
        """
        parts = [shell_export(v) + ";" for v in ctx.exports]
        parts.append(f"cd {shlex.quote(ctx.cwd)};")
        if ctx.venv_script:
            parts.append(f"source {shlex.quote(ctx.venv_script)};")
        argv = self.node_argv(ctx, node_rank) + list(extra) + [ctx.script, *ctx.script_args]
        parts.append(shlex.join(argv))
        return " ".join(parts)


# ------------------------------------------------------------------------------ the registered back ends
class UnknownLauncherError(LauncherError, ComponentNotFoundError):
    """``--launcher NAME`` names no registered back end, or one whose unit or plugin is disabled.

    Both a :class:`~dscore.errors.LauncherError` (bad ``dscore run`` input) and the registry's
    :class:`~dscore.errors.ComponentNotFoundError` (``kind="launcher"``, ``name``, ``available``,
    ``suggestions``).
    """


def launcher_registry() -> Registry:
    """A fresh registry of the installed plugins (``DSCORE_DISABLE_PLUGINS`` etc. read from ``os.environ``)."""
    return Registry(create_plugin_manager())


def launcher_names(registry: Registry | None = None) -> list[str]:
    """The registered back ends' names in registration order (built-ins first: pdsh, ssh, openmpi, ...)."""
    registry = launcher_registry() if registry is None else registry
    return [spec.name for spec in registry.specs("launcher")]


def resolve_launcher(name: str, registry: Registry | None = None) -> LauncherSpec:
    """The spec of the back end ``--launcher name`` (case-insensitive, aliases included).

    Raises:
        UnknownLauncherError: no such back end (listing the registered ones and close matches), or its
            unit (``launcher:<name>``) or plugin is disabled (naming it and how to re-enable it).
        PluginConflictError: two plugins register the name.
        PluginLoadError: not found while a broken plugin may have provided it.
    """
    registry = launcher_registry() if registry is None else registry
    try:
        return registry.get_typed(LauncherSpec, name, config_path="--launcher")
    except UnknownLauncherError:
        raise
    except ComponentNotFoundError as exc:
        manager = registry.manager
        if manager.disabled_unit_providers("launcher", name) or manager.disabled_providers("launcher", name):
            message = str(exc)
        else:
            close = f" Did you mean {' or '.join(repr(s) for s in exc.suggestions)}?" if exc.suggestions else ""
            message = (
                f"--launcher {name!r} is not a known launcher; choose one of {', '.join(launcher_names(registry))}."
                f"{close} A plugin providing it may not be installed (see `dscore plugins list`)."
            )
        raise UnknownLauncherError(
            message, kind="launcher", name=name, available=exc.available, suggestions=exc.suggestions
        ) from None


def default_launcher(registry: Registry | None = None) -> LauncherSpec:
    """The back end used when ``--launcher`` is not given: the spec registered with ``default=True``.

    Raises:
        PluginConflictError: two plugins each register a default back end (both are named).
        UnknownLauncherError: the default's unit or plugin is disabled (naming it), or none is registered.
    """
    registry = launcher_registry() if registry is None else registry
    defaults = [s for s in registry.specs("launcher") if isinstance(s, LauncherSpec) and s.default]
    providers = {registry.provider(s).name for s in defaults}
    if len(providers) > 1:
        labels = ", ".join(f"{s.name!r} from {registry.provider(s).label()}" for s in defaults)
        raise PluginConflictError(
            f"several plugins register a default launcher back end ({labels}); pass --launcher NAME, or disable "
            "one of them with DSCORE_DISABLE_PLUGINS=launcher:<name>"
        )
    if defaults:
        return defaults[0]
    manager = registry.manager
    disabled = [s for r in manager.active_records() for s in r.unit_specs_disabled]
    disabled += [s for r in manager.disabled_records() for s in manager.disabled_specs(r)]
    names = launcher_names(registry)
    for spec in disabled:
        if isinstance(spec, LauncherSpec) and spec.default:
            try:  # raises the registry's error naming the disabled unit or plugin
                return registry.get_typed(LauncherSpec, spec.name, config_path="the default --launcher")
            except ComponentNotFoundError as exc:
                others = f" ({', '.join(names)})" if names else ""
                raise UnknownLauncherError(
                    f"{exc} Or pass --launcher NAME to use another back end{others}.",
                    kind="launcher", name=spec.name, available=names, suggestions=[],
                ) from None
    raise UnknownLauncherError(
        "no launcher back end is registered as the default; pass --launcher NAME"
        + (f" (registered: {', '.join(names)})" if names else " (none is registered: see `dscore plugins list`)"),
        kind="launcher", name="", available=names, suggestions=[],
    )


def load_runner(spec: LauncherSpec, registry: Registry | None = None) -> Runner:
    """Import ``spec.runner``, build it with ``cls()`` and name it after the spec.

    Raises:
        PluginLoadError: the import string cannot be imported (naming the plugin).
        LauncherError: the object is not a :class:`Runner` subclass.
    """
    registry = launcher_registry() if registry is None else registry
    cls = registry.load(spec, "runner")
    if not (isinstance(cls, type) and issubclass(cls, Runner)):
        raise LauncherError(
            f"launcher {spec.name!r} of plugin {registry.provider(spec).label()}: runner={spec.runner!r} is "
            f"{cls!r}, not a subclass of dscore.launcher.runners.Runner"
        )
    runner = cls()
    runner.name = spec.name
    return runner


def get_runner(name: str, registry: Registry | None = None) -> Runner:
    """The back end ``--launcher name`` (case-insensitive), built and named.

    Raises:
        UnknownLauncherError: unknown or disabled (see :func:`resolve_launcher`).
        PluginConflictError, PluginLoadError: as :func:`resolve_launcher` and :func:`load_runner`.
    """
    registry = launcher_registry() if registry is None else registry
    return load_runner(resolve_launcher(name, registry), registry)


class _RegisteredRunners(Mapping[str, type[Runner]]):
    """name -> runner class of the registered back ends, read from a fresh registry at each use."""

    def _specs(self) -> dict[str, LauncherSpec]:
        registry = launcher_registry()
        return {s.name: s for s in registry.specs("launcher") if isinstance(s, LauncherSpec)}

    def __getitem__(self, name: str) -> type[Runner]:
        return type(get_runner(name))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in {n.lower() for n in self._specs()}

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._specs()))

    def __len__(self) -> int:
        return len(self._specs())

    def __repr__(self) -> str:
        return f"RUNNERS({', '.join(self)})"


#: name -> runner class of every registered back end, in the order ``--launcher`` lists them (a live view of
#: the plugin registry: a plugin's back end appears here, a disabled one does not).
RUNNERS: Mapping[str, type[Runner]] = _RegisteredRunners()


def check_program(runner: Runner, program: str) -> str:
    """Check that ``program`` exists and, for a generic name, is the runner's MPI flavour.

    Returns:
        A description for the log (``"/usr/bin/mpirun.openmpi (Open MPI 4.1.4)"``).

    Raises:
        LauncherError: not on ``PATH``, or ``mpirun --version`` names another flavour.
    """
    path = shutil.which(program)
    if path is None:
        tried = ", ".join(runner.programs or (program,))
        what = f"one of {tried}, none of which is" if len(runner.programs) > 1 else f"{program!r}, which is not"
        raise LauncherError(
            f"--launcher {runner.name} needs {what} on PATH; install it or choose another launcher "
            f"({', '.join(launcher_names())}), or --no_ssh on each node"
        )
    if not runner.flavour_marker:
        return path
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False, stdin=subprocess.DEVNULL
        )
        version = (out.stdout + out.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"<{program} --version failed: {exc}>"
    if not re.search(runner.flavour_marker, version):
        first = version.splitlines()[0] if version else "(no output)"
        raise LauncherError(
            f"--launcher {runner.name}: {path} is not {runner.name} ({program} --version says {first!r}) and none of "
            f"{', '.join(runner.programs[:-1])} is on PATH; install {runner.name} or choose the launcher matching "
            "your mpirun"
        )
    first = version.splitlines()[0] if version else ""
    return f"{path} ({first})" if first else path
