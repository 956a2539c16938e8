"""Every hook specification dscore calls, grouped by family.

Three families, all prefixed ``dscore_``:

* **registration** — ``dscore_register_<kinds>()``: no arguments, returns an iterable of specs from
  :mod:`dscore.specs`. Called once per plugin manager on every rank (and in the CLI). Results of all
  plugins are concatenated; selection among them is made by dscore from the config and the registry,
  never by pluggy's ``firstresult``. Implementations must be pure: no torch import, no device probe, no
  file or network access, the same answer on every rank.
* **setup** — ``dscore_add_config_arguments(parser)``, ``dscore_configure(config)``: called once with a
  runtime object, return ``None``.
* **lifecycle** — ``dscore_<noun>_<event>(...)``: called by the engine at coarse events (never per
  parameter or per bucket). Hook wrappers are allowed. When no plugin implements a lifecycle hook the
  engine skips the call entirely, so they cost nothing unless used.

Plugins implement hooks with :data:`dscore.hookimpl`::

    from dscore import hookimpl
    from dscore.specs import OptimizerSpec

    @hookimpl
    def dscore_register_optimizers():
        return [OptimizerSpec(name="myadam", factory="my_pkg.optim:MyAdam")]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from dscore.specs import (
        AcceleratorSpec,
        CheckpointLayoutSpec,
        CommandSpec,
        CommBackendSpec,
        CommTransportSpec,
        ConfigSectionSpec,
        EngineSpec,
        LauncherSpec,
        LRSchedulerSpec,
        ModelTransformSpec,
        MonitorSpec,
        OpBuilderSpec,
        OptimizerSpec,
        PrecisionSpec,
        ZeroFeatureSpec,
        ZeroStageSpec,
    )

__all__ = ["PROJECT_NAME", "hookspec", "hookimpl", "REGISTRATION_HOOKS", "LIFECYCLE_HOOKS"]

PROJECT_NAME = "dscore"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# --------------------------------------------------------------------------------------------------
# Registration hooks
# --------------------------------------------------------------------------------------------------


@hookspec
def dscore_register_accelerators() -> Iterable[AcceleratorSpec]:
    """Register accelerators (device families).

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: all results are concatenated; two specs with the same name or alias are a conflict.
    Must not: import torch or a vendor package, or touch a device. Put that in the spec's ``probe``.

    Example::

        @hookimpl
        def dscore_register_accelerators():
            return [AcceleratorSpec(name="cuda", device_type="cuda", priority=100,
                                    accelerator="my_pkg.cuda:CudaAccelerator",
                                    probe="my_pkg.cuda:probe")]
    """


@hookspec
def dscore_register_comm_backends() -> Iterable[CommBackendSpec]:
    """Register collective-communication backends for ``torch.distributed``.

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: concatenated; duplicate names are a conflict.
    Must not: import torch or the backend's bindings.

    Example::

        @hookimpl
        def dscore_register_comm_backends():
            return [CommBackendSpec(name="gloo", torch_backend="gloo", device_types=("cpu",))]
    """


@hookspec
def dscore_register_optimizers() -> Iterable[OptimizerSpec]:
    """Register optimizers selectable by ``optimizer.type`` in ds_config.

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: concatenated; duplicate names (case-insensitive, aliases included) are a conflict.
    Must not: import torch; give the factory as an import string. The factory is called as
    ``factory(param_groups, ctx)`` with a :class:`dscore.protocols.OptimizerContext` whose ``section`` is
    ``optimizer.params`` validated by ``params_model``.

    Example::

        @hookimpl
        def dscore_register_optimizers():
            return [OptimizerSpec(name="sophia", factory="my_pkg.sophia:build_sophia",
                                  params_model="my_pkg.sophia_config:SophiaParams")]
    """


@hookspec
def dscore_register_lr_schedulers() -> Iterable[LRSchedulerSpec]:
    """Register LR schedulers selectable by ``scheduler.type`` in ds_config.

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: concatenated; duplicate names are a conflict.
    Must not: import torch.

    Example::

        @hookimpl
        def dscore_register_lr_schedulers():
            return [LRSchedulerSpec(name="WarmupLR", aliases=("warmup_lr",),
                                    factory="my_pkg.sched:build_warmup_lr")]  # (optimizer, ctx)
    """


@hookspec
def dscore_register_zero_stages() -> Iterable[ZeroStageSpec]:
    """Register ZeRO stages selectable by ``zero_optimization.stage``.

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: concatenated; two specs with the same ``stage`` number or name are a conflict.
    Must not: import torch.

    Example::

        @hookimpl
        def dscore_register_zero_stages():
            return [ZeroStageSpec(name="stage2", stage=2, factory="my_pkg.zero:Stage2")]
    """


@hookspec
def dscore_register_zero_features() -> Iterable[ZeroFeatureSpec]:
    """Register options of a ZeRO stage (ZeRO++ hpZ, qwZ, qgZ), looked up by the stage by name when a
    ``zero_optimization`` key asks for one.

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: concatenated; duplicate names are a conflict.
    Must not: import torch; the factory is an import string.

    Example::

        @hookimpl
        def dscore_register_zero_features():
            return [ZeroFeatureSpec(name="hpz", factory="my_pkg.hpz:build",
                                    config_keys=("zero_hpz_partition_size",))]
    """


@hookspec
def dscore_register_precisions() -> Iterable[PrecisionSpec]:
    """Register precision modes (fp32, fp16, bf16, ...).

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: concatenated; duplicate names are a conflict. The engine picks the mode whose
    ``config_key`` block has ``enabled: true``, else the one with ``config_key=None``.
    Must not: import torch.

    Example::

        @hookimpl
        def dscore_register_precisions():
            return [PrecisionSpec(name="fp16", config_key="fp16", factory="my_pkg.fp16:Fp16Mode")]  # (ctx)
    """


@hookspec
def dscore_register_op_builders() -> Iterable[OpBuilderSpec]:
    """Register C++/CUDA op builders.

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: concatenated; duplicate names are a conflict.
    Must not: compile, probe compilers, or import torch. Building happens on first ``load()``.

    Example::

        @hookimpl
        def dscore_register_op_builders():
            return [OpBuilderSpec(name="cpu_adam", builder="my_pkg.ops:CPUAdamBuilder",
                                  device_types=("cpu",), build_env_var="DS_BUILD_CPU_ADAM")]
    """


@hookspec
def dscore_register_config_sections() -> Iterable[ConfigSectionSpec]:
    """Register the ds_config top-level sections a plugin owns.

    Called: once per plugin manager whenever a config is validated.
    Combine: concatenated; two owners of one key are a conflict. Keys the core already defines
    (batch sizes, ``gradient_clipping``, ...) cannot be claimed.
    Must not: import torch; the model must be a torch-free pydantic v2 model with ``extra="forbid"``.

    Example::

        @hookimpl
        def dscore_register_config_sections():
            return [ConfigSectionSpec(name="my_monitor", model="my_pkg.config:MyMonitorConfig")]
    """


@hookspec
def dscore_register_monitors() -> Iterable[MonitorSpec]:
    """Register training monitors (tensorboard, csv, wandb, ...).

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: concatenated; every monitor whose ``config_key`` block is enabled is created (rank 0).
    Must not: import the monitor's library.

    Example::

        @hookimpl
        def dscore_register_monitors():
            return [MonitorSpec(name="csv", config_key="csv_monitor", factory="my_pkg.csv:build")]  # (ctx)
    """


@hookspec
def dscore_register_commands() -> Iterable[CommandSpec]:
    """Register ``dscore <name>`` subcommands.

    Called: once each time the ``dscore`` command starts.
    Combine: concatenated; a name clashing with a built-in command or another plugin's is a conflict.
    Must not: import torch; the command's module is imported only when that command runs
    (or when ``dscore --help`` lists commands, which imports nothing but the spec).

    Example::

        @hookimpl
        def dscore_register_commands():
            return [CommandSpec(name="hello", module="my_pkg.cli_hello", help="say hello")]
    """


@hookspec
def dscore_register_engines() -> Iterable[EngineSpec]:
    """Register training engines that ``dscore.initialize`` selects by a predicate over model and config.

    Called: once per plugin manager, on every rank and in the CLI.
    Combine: concatenated; duplicate names are a conflict. ``initialize`` builds the engine whose
    ``predicate`` accepts the model and config, the highest ``priority`` among several (a tie is a conflict).
    Must not: import torch; the predicate and factory are import strings.

    Example::

        @hookimpl
        def dscore_register_engines():
            return [EngineSpec(name="my_engine", predicate="my_pkg.engine:handles",
                               factory="my_pkg.engine:build", priority=50)]
    """


@hookspec
def dscore_register_launchers() -> Iterable[LauncherSpec]:
    """Register multi-node launcher back ends (``dscore run --launcher NAME``).

    Called: once per plugin manager, in the ``dscore run`` process (and the CLI's listings).
    Combine: concatenated; duplicate names or two ``default`` back ends are a conflict.
    Must not: import torch, or look for the back end's programs (the runner's ``program()`` does, when a
    job starts).

    Example::

        @hookimpl
        def dscore_register_launchers():
            return [LauncherSpec(name="flux", runner="my_pkg.flux:FluxRunner", executables=("flux",))]

    where ``FluxRunner`` subclasses :class:`dscore.launcher.runners.Runner`.
    """


@hookspec
def dscore_register_comm_transports() -> Iterable[CommTransportSpec]:
    """Register transports :class:`dscore.comm.Comm` may run a collective on, asked by ``priority``.

    Called: once per plugin manager, on every rank.
    Combine: concatenated; duplicate names are a conflict. Every rank must register the same transports
    (the plugin-set fingerprint checks it), since each collective's transport is chosen on every rank alike.
    Must not: import torch or build an op; name the op in ``op_builders`` and build it in the factory.

    Example::

        @hookimpl
        def dscore_register_comm_transports():
            return [CommTransportSpec(name="rdma", factory="my_pkg.rdma:make_transport", priority=300)]
    """


@hookspec
def dscore_register_checkpoint_layouts() -> Iterable[CheckpointLayoutSpec]:
    """Register on-disk checkpoint layouts (``checkpoint.layout`` at save; detected at load).

    Called: once per plugin manager, on every rank and in ``dscore checkpoint``.
    Combine: concatenated; duplicate names are a conflict.
    Must not: import torch; the layout object is an import string.

    Example::

        @hookimpl
        def dscore_register_checkpoint_layouts():
            return [CheckpointLayoutSpec(name="mine", layout="my_pkg.ckpt:LAYOUT", detect_priority=50)]
    """


@hookspec
def dscore_register_model_transforms() -> Iterable[ModelTransformSpec]:
    """Register model transforms ``dscore.initialize`` applies before the engine is built, in ``order``.

    Called: once per plugin manager, on every rank.
    Combine: concatenated; duplicate names are a conflict; transforms run in ascending ``order``.
    Must not: import torch; the transform object is an import string.

    Example::

        @hookimpl
        def dscore_register_model_transforms():
            return [ModelTransformSpec(name="lora", transform="my_pkg.lora:TRANSFORM", config_key="lora",
                                       order=150)]
    """


# --------------------------------------------------------------------------------------------------
# Setup hooks
# --------------------------------------------------------------------------------------------------


@hookspec
def dscore_add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a plugin's own command-line flags to a training script's parser.

    Called: from :func:`dscore.add_config_arguments`, on every rank, after dscore added
    ``--deepspeed``/``--deepspeed_config``. Return value is ignored.
    Must not: add flags dscore already defines, or parse arguments.

    Example::

        @hookimpl
        def dscore_add_config_arguments(parser):
            parser.add_argument("--my_plugin_flag", action="store_true")
    """


@hookspec(historic=True)
def dscore_configure(config: Any) -> None:
    """Inspect the validated ds_config (a :class:`dscore.config.model.DscoreConfig`) before the engine is built.

    (Typed ``Any`` here so the hook specifications stay below the config models: ``dscore.config`` uses the
    registry, which uses these specifications.)

    Called: once per ``dscore.initialize`` on every rank, after the config was validated and the batch
    triangle resolved. Historic: a plugin registered later still receives it. Return value ignored.
    Must not: mutate the config (it is frozen); raise :class:`dscore.errors.ConfigError` to refuse it.

    Example::

        @hookimpl
        def dscore_configure(config):
            if config.train_batch_size > 4096:
                log.warning("very large batch")
    """


# --------------------------------------------------------------------------------------------------
# Lifecycle hooks
# --------------------------------------------------------------------------------------------------


@hookspec
def dscore_distributed_initialized(rank: int, world_size: int, backend: str) -> None:
    """The default process group exists.

    Called: by :func:`dscore.init_distributed`, on every rank, once per new process group.
    Must not: run collectives (ranks may reach this at different times).

    Example::

        @hookimpl
        def dscore_distributed_initialized(rank, world_size, backend):
            log.info("rank %d/%d on %s", rank, world_size, backend)
    """


@hookspec
def dscore_engine_created(engine: Any) -> None:
    """An engine was assembled by :func:`dscore.initialize`.

    Called: on every rank, once per engine, before ``initialize`` returns.
    Must not: step the optimizer or change the model's parameters.

    Example::

        @hookimpl
        def dscore_engine_created(engine):
            engine.module.register_forward_hook(my_probe)
    """


@hookspec
def dscore_after_optimizer_step(engine: Any, step_applied: bool) -> None:
    """A gradient accumulation boundary was processed by ``engine.step()``.

    Called: on every rank, once per boundary, after the optimizer and LR scheduler stepped (or the step
    was skipped because of an fp16 overflow, then ``step_applied`` is False).
    Must not: run collectives unless every rank's implementation does the same.

    Example::

        @hookimpl
        def dscore_after_optimizer_step(engine, step_applied):
            if step_applied and engine.global_steps % 100 == 0:
                log.info("lr %s", engine.get_lr())
    """


@hookspec
def dscore_checkpoint_saved(engine: Any, save_dir: str, tag: str) -> None:
    """A checkpoint was completely written (completion marker and ``latest`` in place).

    Called: on every rank after the save's final barrier.
    Must not: write into the tag folder (it is complete and may be read by others).

    Example::

        @hookimpl
        def dscore_checkpoint_saved(engine, save_dir, tag):
            upload(os.path.join(save_dir, tag))
    """


@hookspec
def dscore_checkpoint_loaded(engine: Any, load_dir: str, tag: str) -> None:
    """A checkpoint was loaded into the engine.

    Called: on every rank after ``load_checkpoint`` restored all state.
    Must not: change the loaded state in ways other ranks do not.

    Example::

        @hookimpl
        def dscore_checkpoint_loaded(engine, load_dir, tag):
            log.info("resumed from %s at step %d", tag, engine.global_steps)
    """


#: registration hook name -> spec kind it returns.
REGISTRATION_HOOKS: dict[str, str] = {
    "dscore_register_accelerators": "accelerator",
    "dscore_register_comm_backends": "comm_backend",
    "dscore_register_optimizers": "optimizer",
    "dscore_register_lr_schedulers": "lr_scheduler",
    "dscore_register_zero_stages": "zero_stage",
    "dscore_register_zero_features": "zero_feature",
    "dscore_register_precisions": "precision",
    "dscore_register_op_builders": "op_builder",
    "dscore_register_config_sections": "config_section",
    "dscore_register_monitors": "monitor",
    "dscore_register_commands": "command",
    "dscore_register_engines": "engine",
    "dscore_register_launchers": "launcher",
    "dscore_register_comm_transports": "comm_transport",
    "dscore_register_checkpoint_layouts": "checkpoint_layout",
    "dscore_register_model_transforms": "model_transform",
}

#: lifecycle hooks the engine calls only when some plugin implements them.
LIFECYCLE_HOOKS: tuple[str, ...] = (
    "dscore_distributed_initialized",
    "dscore_engine_created",
    "dscore_after_optimizer_step",
    "dscore_checkpoint_saved",
    "dscore_checkpoint_loaded",
)
