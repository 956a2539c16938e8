"""The launcher back ends come from the plugin registry: the built-in ``launch`` plugin's specs, the default
back end, unknown and disabled names, and a back end registered by another plugin."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
from launcher_helpers import dscore_cmd, launcher_env

from dscore import hookimpl
from dscore.errors import ComponentNotFoundError, LauncherError, PluginConflictError
from dscore.launcher.accel import AcceleratorLaunchInfo
from dscore.launcher.options import add_arguments
from dscore.launcher.plan import build_plan
from dscore.launcher.ranks import ProcessSpec
from dscore.launcher.runners import (
    RUNNERS,
    Runner,
    RunnerContext,
    UnknownLauncherError,
    default_launcher,
    get_runner,
    launcher_names,
    load_runner,
    resolve_launcher,
)
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry
from dscore.specs import LauncherSpec

CPU = AcceleratorLaunchInfo(name="cpu")
BUILTIN = ["pdsh", "ssh", "openmpi", "mpich", "impi", "mvapich", "slurm"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def hostfile(tmp_path: Path) -> str:
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    return str(path)


class EchoRunner(Runner):
    """A back end of another plugin: one ``echo`` per host of the node launcher's command line."""

    binary = "echo"
    uses_shell = True

    def commands(self, ctx: RunnerContext) -> list[ProcessSpec]:
        return [
            ProcessSpec(argv=["echo", self.remote_shell_command(ctx, str(i))], env={}, host=h, label=f"echo {h}")
            for i, h in enumerate(ctx.world_info)
        ]


class _EchoPlugin:
    def __init__(self, *, default: bool = False, runner: str = f"{__name__}:EchoRunner") -> None:
        self.default, self.runner = default, runner

    @hookimpl
    def dscore_register_launchers(self) -> list[LauncherSpec]:
        return [LauncherSpec(name="echo", aliases=("say",), runner=self.runner, default=self.default)]


def _registry(*extra: tuple[str, object], disable: str = "") -> Registry:
    return Registry(create_plugin_manager(extra_plugins=list(extra), environ={"DSCORE_DISABLE_PLUGINS": disable}))


# ------------------------------------------------------------------------------------- built-in back ends
def test_builtin_back_ends_are_the_launch_plugin_units() -> None:
    registry = _registry()
    assert launcher_names(registry) == BUILTIN
    assert list(RUNNERS) == BUILTIN and "SLURM" in RUNNERS and "mpi" not in RUNNERS
    for spec in registry.specs("launcher"):
        assert isinstance(spec, LauncherSpec)
        assert registry.provider(spec).name == "launch" and registry.provider(spec).builtin
        runner = load_runner(spec, registry)
        assert runner.name == spec.name and RUNNERS[spec.name] is type(runner)
        # the spec lists, without importing the runner, the programs the runner tries
        assert spec.executables == (runner.programs or (runner.binary,)), spec.name
    assert default_launcher(registry).name == "pdsh"
    assert [s.name for s in registry.specs("launcher") if isinstance(s, LauncherSpec) and s.default] == ["pdsh"]


def test_default_back_end_comes_from_the_spec(hostfile: str) -> None:
    plan = build_plan(parse("-H", hostfile, "t.py"), environ={}, cwd="/p", accel=CPU, registry=_registry())
    assert plan.runner == "pdsh" and plan.commands[0].argv[0] == "pdsh" and plan.backend is not None
    # another plugin's default back end with the built-in one is a conflict naming both providers
    both = _registry(("echoes", _EchoPlugin(default=True)))
    with pytest.raises(PluginConflictError, match=r"'pdsh' from launch .*'echo' from echoes"):
        build_plan(parse("-H", hostfile, "t.py"), environ={}, cwd="/p", accel=CPU, registry=both)
    # ... and the only default once launcher:pdsh is disabled
    plan = build_plan(parse("-H", hostfile, "t.py"), environ={}, cwd="/p", accel=CPU,
                      registry=_registry(("echoes", _EchoPlugin(default=True)), disable="launcher:pdsh"))  # fmt: skip
    assert plan.runner == "echo" and [c.argv[0] for c in plan.commands] == ["echo", "echo"]


def test_unknown_launcher_is_the_registry_not_found_error() -> None:
    with pytest.raises(UnknownLauncherError) as info:
        resolve_launcher("mpi", _registry())
    err = info.value
    assert isinstance(err, LauncherError) and isinstance(err, ComponentNotFoundError)
    assert err.kind == "launcher" and err.name == "mpi" and set(err.suggestions) >= {"mpich", "impi"}
    assert "choose one of pdsh, ssh, openmpi, mpich, impi, mvapich, slurm. Did you mean" in str(err)
    assert sorted(err.available) == sorted(BUILTIN)


# --------------------------------------------------------------------------------------- disabled units
def test_disabled_launcher_unit_is_refused_naming_it(hostfile: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSCORE_DISABLE_PLUGINS", "launcher:slurm")
    assert "slurm" not in RUNNERS and "pdsh" in RUNNERS
    for argv in (("-H", hostfile, "--launcher", "slurm"), ("--num_gpus", "1", "--launcher", "SLURM")):
        with pytest.raises(UnknownLauncherError, match=r"'launcher:slurm' in DSCORE_DISABLE_PLUGINS") as info:
            build_plan(parse(*argv, "t.py"), environ={}, cwd="/p", accel=CPU)
        assert "remove launcher:slurm from DSCORE_DISABLE_PLUGINS" in str(info.value)
    # the other back ends and the local path still work
    assert build_plan(parse("-H", hostfile, "--launcher", "ssh", "t.py"), environ={}, cwd="/p", accel=CPU).runner == "ssh"
    assert build_plan(parse("--num_gpus", "1", "t.py"), environ={}, cwd="/p", accel=CPU).runner == "local"


def test_disabled_default_refuses_only_what_needs_it(hostfile: str) -> None:
    registry = _registry(disable="launcher:pdsh")
    with pytest.raises(UnknownLauncherError, match=r"default --launcher = 'pdsh' .*'launcher:pdsh'.*--launcher NAME"):
        build_plan(parse("-H", hostfile, "t.py"), environ={}, cwd="/p", accel=CPU, registry=registry)
    assert build_plan(parse("--num_gpus", "2", "t.py"), environ={}, cwd="/p", accel=CPU, registry=registry).runner == "local"
    plan = build_plan(parse("-H", hostfile, "--no_ssh", "--node_rank", "1", "--master_addr", "a", "t.py"),
                      environ={}, cwd="/p", accel=CPU, registry=registry)  # fmt: skip
    assert plan.runner == "no_ssh" and [p.rank for p in plan.processes] == [2, 3]
    # the whole plugin disabled: its name is what the message says to re-enable
    with pytest.raises(UnknownLauncherError, match=r"plugin launch .*is disabled.*remove launch from"):
        build_plan(parse("-H", hostfile, "t.py"), environ={}, cwd="/p", accel=CPU, registry=_registry(disable="launch"))


def test_cli_refuses_a_disabled_launcher_naming_the_unit(hostfile: str) -> None:
    argv = dscore_cmd("--dry_run", "-H", hostfile, "--launcher", "slurm", "t.py")
    res = subprocess.run(argv, env=launcher_env(DSCORE_DISABLE_PLUGINS="launcher:slurm"), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2 and "'launcher:slurm'" in res.stderr and "disabled" in res.stderr, res.stderr
    listing = subprocess.run([*dscore_cmd()[:-1], "plugins", "list", "--json"],
                             env=launcher_env(DSCORE_DISABLE_PLUGINS="launcher:slurm"), capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    row = {r["name"]: r for r in json.loads(listing.stdout)}["launch"]
    assert row["disabled_units"] == ["launcher:slurm"] and "slurm" not in row["provides"]["launcher"]
    res = subprocess.run(argv, env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "runner: slurm" in res.stdout, res.stderr


# ------------------------------------------------------------------------------ another plugin's back end
def test_third_party_back_end_through_the_registry(hostfile: str) -> None:
    registry = _registry(("echoes", _EchoPlugin()))
    assert launcher_names(registry) == [*BUILTIN, "echo"]
    plan = build_plan(parse("-H", hostfile, "--launcher", "say", "t.py", "--x"), environ={}, cwd="/p", accel=CPU,
                      registry=registry)  # fmt: skip
    assert plan.runner == "echo" and plan.binary == "echo" and isinstance(plan.backend, EchoRunner)
    assert [c.argv[0] for c in plan.commands] == ["echo", "echo"]
    assert "--node_rank=1" in plan.commands[1].argv[1] and plan.commands[1].argv[1].endswith("t.py --x")
    assert [(p.host, p.rank, p.local_rank) for p in plan.processes] == [
        ("worker-0", 0, 0), ("worker-0", 1, 1), ("worker-1", 2, 0), ("worker-1", 3, 1)]  # fmt: skip
    assert get_runner("ECHO", registry).name == "echo"


def test_runner_that_is_not_a_runner_is_refused() -> None:
    registry = _registry(("odd", _EchoPlugin(runner="argparse:ArgumentParser")))
    with pytest.raises(LauncherError, match=r"launcher 'echo' of plugin odd: .*not a subclass of dscore.launcher"):
        get_runner("echo", registry)
