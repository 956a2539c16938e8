"""``dscore.initialize``: validate the config, build the runtime, assemble the engine from the registry.

Order of work (DeepSpeed ``deepspeed/__init__.py::initialize`` initialises torch.distributed *before*
validating the config; dscore validates first so a bad ds_config fails fast without touching the
network, using the world size from the environment discovery of :mod:`dscore.comm.env`, or from an
already initialised process group):

1. check ``model`` and find the config (``config`` / ``config_params`` / ``args.deepspeed_config`` /
   deprecated ``args.deepscale_config``);
2. plugin manager with the config's ``plugins.disable``; ``check_healthy()``; registry; ``load_config``
   (its batch triangle's world size is DeepSpeed's: ``mpu.get_data_parallel_world_size()``, else
   world / ``sequence_parallel_size``, else world; :func:`dscore.parallel.mesh.batch_world_size`);
3. :meth:`dscore.runtime.runtime.Runtime.create` (accelerator, ``init_distributed``, plugin fingerprint
   check across ranks); the parallel mesh (:func:`dscore.runtime.assembly.build_mesh`, or ``mpu``);
   before that, every enabled model transform's ``prepare`` (:mod:`dscore.runtime.transforms`: refusals,
   activation checkpointing's settings);
4. ``dscore_configure`` hook; the engine plugin builds itself (the standard one:
   :func:`dscore.runtime.assembly.assemble`): precision mode (the ``PrecisionSpec`` whose ``config_key``
   block is enabled, else the default one); every enabled model transform's ``apply`` in order (AutoTP,
   AutoEP, Ulysses, ...); module to the device and cast;
5. optimizer (client instance / callable / ``optimizer.type``); every rank's parameters and buffers made
   rank 0's of its data-parallel group (:mod:`dscore.runtime.replicas`, as DeepSpeed's ``_broadcast_model``);
   ZeRO stage object (``registry.zero_stage(config.zero_stage)``); LR scheduler over ``zero_stage.optimizer``;
6. training data loader; monitors (rank 0, every enabled block); each transform's ``verify`` of the built
   engine; ``dscore_engine_created`` hook.

Returns ``(engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)`` like DeepSpeed.
Nothing is cached between calls: two ``initialize`` calls in one process build two independent engines
(they share the default process group once it exists).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError, DscoreError
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry
from dscore.runtime.assembly import build_mesh, build_standard_engine, raw_mesh_degrees
from dscore.runtime.transforms import prepare_transforms, refuse_missing_transforms, verify_transforms

if TYPE_CHECKING:
    from dscore.runtime.engine import DscoreEngine

__all__ = ["initialize", "InitializeError", "build_standard_engine"]

log = logging.getLogger("dscore.runtime.initialize")


class InitializeError(DscoreError, ValueError):
    """``dscore.initialize`` was called with arguments it cannot use (no model, no config, two configs)."""


def initialize(
    args: argparse.Namespace | None = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset[Any] | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    config: Any = None,
    config_params: Any = None,
    *,
    strict: bool | None = None,
) -> tuple[DscoreEngine, Any, Any, Any]:
    """Build a training engine (DeepSpeed's ``deepspeed.initialize`` signature).

    Args:
        args: an :class:`argparse.Namespace` carrying ``deepspeed_config`` (or the deprecated
            ``deepscale_config``), e.g. from :func:`dscore.add_config_arguments`.
        model: the :class:`torch.nn.Module` to train (required; pass it by keyword).
        optimizer: a ``torch.optim.Optimizer`` instance or ``callable(param_groups) -> optimizer``.
        model_parameters: the parameters (or parameter-group dicts) to train; default: the model's
            parameters with ``requires_grad``. Ignored with a client optimizer *instance*, whose own
            ``param_groups`` decide the groups (as in DeepSpeed; empty and frozen groups are kept).
        training_data: a map-style dataset; the engine builds a sharded loader over it.
        lr_scheduler: a scheduler instance or ``callable(optimizer) -> scheduler``.
        distributed_port: rendezvous port when the environment does not give ``MASTER_PORT``.
        mpu: a :class:`dscore.parallel.ParallelMesh` built before ``initialize`` (as
            ``UlyssesSPAttentionHF.register_with_transformers`` returns); its sizes must equal the config's
            (a config without ``sequence_parallel_size`` takes the mpu's); its data-parallel size is the
            batch triangle's world size, as in DeepSpeed.
        dist_init_required: None = create the process group when none exists; False = one must exist.
        collate_fn: merges samples into a batch for the training loader.
        config: ds_config as a dict, a path, or url-safe base64 text.
        config_params: used only when ``config`` is None (DeepSpeed's legacy name).
        strict: dscore only: forwarded to :func:`dscore.config.load_config` (False = unknown keys warn).

    Returns:
        ``(engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)``. The optimizer is
        None when there is neither a client optimizer nor ``optimizer.type``, the ZeRO stage is 0 and
        bf16 is off (ZeRO stage 3 then returns its parameter manager, which gathers, saves and loads);
        the loader is None without ``training_data``; the scheduler is None without
        ``scheduler.type`` or a client scheduler, and always without an optimizer.

    Raises:
        InitializeError: no model, no config, or configs from two sources.
        ConfigError: the config is invalid (raised before any process-group work); ZeRO stage 1 or 2
            without an optimizer (DeepSpeed: "zero stage 2 requires an optimizer"); a client optimizer
            holding tensors that are not the model's parameters (names the group), or not known to be
            ZeRO-safe without ``zero_allow_untested_optimizer: true``; a client scheduler bound to
            another optimizer.
        PluginValidationError / PluginLoadError / ComponentNotFoundError: a plugin is broken or missing.
        DistributedError: the process group cannot be created or ranks run different plugins.
    """
    if model is None:
        hint = ""
        if isinstance(args, torch.nn.Module):
            hint = " (the first positional argument is `args`; call dscore.initialize(model=model, ...))"
        raise InitializeError(f"dscore.initialize requires a model{hint}")
    if not isinstance(model, torch.nn.Module):
        raise InitializeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_args_local_rank(args)
    # torch.compile(model): the engine wraps the original module and re-installs the compiled call on it
    from dscore.runtime.compile import unwrap_compiled

    model, dynamo_ctx = unwrap_compiled(model)

    # 1-2. config, validated before any process-group work
    from dscore.config import load_config
    from dscore.config.loader import read_source

    source = _config_source(args, config, config_params)
    data, source_name, source_warnings = read_source(source)
    for message in source_warnings:
        log.warning("%s", message)
    disable = _raw_disable_list(data)
    manager = create_plugin_manager(disable=disable)
    manager.check_healthy()
    registry = Registry(manager)
    world_size, world_source = _data_parallel_world_size(distributed_port)
    mpu_of = getattr(model, "mpu", None)
    model_grid = mpu_of() if callable(mpu_of) else None  # a pipeline model's topology
    if model_grid is not None and hasattr(model_grid, "get_data_parallel_world_size"):
        world_size = int(model_grid.get_data_parallel_world_size())
        world_source = f"the data-parallel size {world_size} of the model's pipeline topology"
    else:
        from dscore.parallel.mesh import batch_world_size

        data = _config_with_mpu_degrees(data, mpu)
        world_size, world_source = batch_world_size(world_size, data, source=world_source, mpu=mpu)
    cfg = load_config(
        data,
        world_size=world_size,
        registry=registry,
        strict=strict,
        source_name=source_name,
        world_size_source=world_source,
    )
    if cfg.pending_auto:
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        cfg = cfg.resolve_model_auto(hidden)  # raises ConfigError naming the paths when unknown
    # a config needing a disabled model transform (or a mesh degree nothing implements) fails before the network
    refuse_missing_transforms(registry, cfg, raw_mesh_degrees(cfg.raw))

    # 3. runtime: accelerator, process group, plugin fingerprint check
    from dscore.runtime.runtime import Runtime

    runtime = Runtime.create(
        config=cfg,
        plugin_manager=manager,
        registry=registry,
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    if args is not None and getattr(args, "local_rank", None) is not None:
        args.local_rank = int(runtime.comm.get_local_rank())  # as DeepSpeed: the launcher's value wins
    # every enabled model transform, in order: refuse what it cannot combine with (a pipeline model), set
    # process-wide settings (activation checkpointing); a config without its block keeps an earlier configure()
    prepare_transforms(runtime, cfg, model, pipeline_model=model_grid is not None)
    runtime.mesh = build_mesh(runtime, cfg, mpu=mpu)
    from dscore.runtime.context import use_runtime

    with use_runtime(runtime):
        # engines are plugins: the one whose predicate accepts the model (highest priority) builds itself
        from dscore.protocols.engine import EngineContext

        # historic hook: plugins registered later still receive it (pluggy refuses a plain call)
        if manager.has_implementations("dscore_configure"):
            manager.pm.hook.dscore_configure.call_historic(kwargs={"config": cfg})
        engine_spec = registry.select_engine(model, cfg)
        engine_ctx = EngineContext(
            config=cfg,
            runtime=runtime,
            model=model,
            client_optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            client_lr_scheduler=lr_scheduler,
            collate_fn=collate_fn,
        )
        engine = registry.load(engine_spec)(engine_ctx)
        if dynamo_ctx is not None:
            engine._compile_state.adopt(engine.module, dynamo_ctx, regions=engine.zero_stage_impl.compile_regions)
        verify_transforms(runtime, cfg, engine_name=engine_spec.name, engine=engine, model=model)
        _check_engine_used_mesh(engine, engine_spec.name, runtime.mesh)
        log.info("engine %s built (%s)", engine_spec.name, type(engine).__name__)
        runtime.plugin_manager.call("dscore_engine_created", engine=engine)
        from dscore.parallel.groups import note_engine

        note_engine(engine)  # the group accessors' mesh outside engine calls (policy process_mesh)
        return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def _check_engine_used_mesh(engine: Any, name: str, mesh: Any) -> None:
    """An engine plugin that ignores tensor/sequence parallelism must not train as if it did not exist
    (whether it applied each model transform is the transform's ``verify``, run before this).

    Raises:
        ConfigError: the engine's data-parallel size is not the mesh's (names the engine).
    """
    dp = getattr(engine, "dp_world_size", None)
    if (mesh.tp_size > 1 or mesh.sp_size > 1) and dp is not None and int(dp) != mesh.dp_size:
        raise ConfigError(
            f"the engine {name!r} counts {dp} data-parallel ranks but the mesh has {mesh.dp_size} "
            f"(world / (tp {mesh.tp_size} x sp {mesh.sp_size})); build it with dp_world_size=runtime.mesh.dp_size",
            path="sequence_parallel_size" if mesh.sp_size > 1 else "tensor_parallel.autotp_size",
        )


def _config_with_mpu_degrees(data: dict[str, Any], mpu: Any) -> dict[str, Any]:
    """The config with the sequence-parallel degree of a given ``mpu`` where the config names none.

    Accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` passes the mesh of
    ``UlyssesSPAttentionHF.register_with_transformers`` as ``mpu`` and writes no ``sequence_parallel_size``
    (DeepSpeed reads the degree from the mpu); dscore's Ulysses transform and mesh read the config, so the
    degree is copied there (a copy; the caller's dict is untouched). A config that states a degree keeps
    it: :func:`dscore.runtime.assembly.build_mesh` refuses an mpu that disagrees.
    """
    from dscore.parallel.mesh import ParallelMesh

    if not isinstance(mpu, ParallelMesh) or "sequence_parallel_size" in data or mpu.sp_size <= 1:
        return data
    log.info("sequence_parallel_size %d taken from the mpu passed to initialize", mpu.sp_size)
    return {**data, "sequence_parallel_size": mpu.sp_size}


def _check_args_local_rank(args: Any) -> None:
    """DeepSpeed's check: a non-negative ``args.local_rank`` must equal the launcher's ``LOCAL_RANK``.

    ``--local_rank`` (set by old launchers, or by hand) and the environment's ``LOCAL_RANK`` disagreeing
    means the process would pick another device than the launcher meant. A negative value (argparse's
    usual ``-1`` default) or a missing ``LOCAL_RANK`` skips the check.

    Raises:
        InitializeError: ``args.local_rank`` is not an int, or disagrees with ``LOCAL_RANK`` (both named).
    """
    value = getattr(args, "local_rank", None) if args is not None else None
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InitializeError(f"args.local_rank must be an int, got {value!r} ({type(value).__name__})")
    env = os.environ.get("LOCAL_RANK")
    if value < 0 or env is None or not env.strip():
        return
    if int(env) != value:
        raise InitializeError(
            f"mismatch in local rank setting: args.local_rank={value} but the environment has LOCAL_RANK={env}. "
            "Drop --local_rank (the launcher sets LOCAL_RANK), or make them agree"
        )


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """Pick the one config source (DeepSpeed's rules 4-7 of ``initialize``; ``config`` with
    ``config_params`` is refused too, where DeepSpeed silently ignores ``config_params``)."""
    if config is not None and config_params is not None:
        raise InitializeError(
            "a ds_config was given twice: as config= and as config_params= to dscore.initialize (DeepSpeed would "
            "silently ignore config_params); pass only one"
        )
    if config is None:
        config = config_params
    arg_cfg = getattr(args, "deepspeed_config", None) if args is not None else None
    legacy = getattr(args, "deepscale_config", None) if args is not None else None
    if (arg_cfg is not None or legacy is not None) and config is not None:
        raise InitializeError(
            "a ds_config was given twice: in args (--deepspeed_config/--deepscale_config) and as "
            "config=/config_params= to dscore.initialize; pass only one"
        )
    if config is not None:
        return config
    if arg_cfg is not None or legacy is not None:
        return args  # read_source handles deepscale_config (warning) and both-given (error)
    raise InitializeError(
        "dscore.initialize requires a ds_config: pass config= (dict, path or base64) or parse "
        "--deepspeed_config with dscore.add_config_arguments(parser) and pass args="
    )


def _raw_disable_list(data: dict[str, Any]) -> list[str]:
    plugins = data.get("plugins")
    disable = plugins.get("disable") if isinstance(plugins, dict) else None
    if disable is None:
        return []
    if not isinstance(disable, list) or not all(isinstance(x, str) for x in disable):
        raise ConfigError(
            f"plugins.disable must be a list of plugin names or kind:name units, got {disable!r}", path="plugins.disable"
        )
    return list(disable)


def _data_parallel_world_size(distributed_port: int) -> tuple[int, str]:
    """World size for the batch triangle without creating a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "the existing torch.distributed process group"
    from dscore.comm.env import discover_env

    env = discover_env(distributed_port=distributed_port, quiet=True)
    return env.world_size, f"world size {env.world_size} discovered from the environment ({env.source})"
