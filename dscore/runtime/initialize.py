"""``dscore.initialize``: validate the config, build the runtime, assemble the engine from the registry.

Order of work (DeepSpeed ``deepspeed/__init__.py::initialize`` initialises torch.distributed *before*
validating the config; dscore validates first so a bad ds_config fails fast without touching the
network, using the world size from the environment discovery of :mod:`dscore.comm.env`, or from an
already initialised process group):

1. check ``model`` and find the config (``config`` / ``config_params`` / ``args.deepspeed_config`` /
   deprecated ``args.deepscale_config``);
2. plugin manager with the config's ``plugins.disable``; ``check_healthy()``; registry; ``load_config``;
3. :meth:`dscore.runtime.runtime.Runtime.create` (accelerator, ``init_distributed``, plugin fingerprint
   check across ranks);
4. ``dscore_configure`` hook; precision mode (the ``PrecisionSpec`` whose ``config_key`` block is
   enabled, else the default one); module to the device and cast;
5. optimizer (client instance / callable / ``optimizer.type``); ZeRO stage object
   (``registry.zero_stage(config.zero_stage)``); LR scheduler over ``zero_stage.optimizer``;
6. training data loader; monitors (rank 0, every enabled block); ``dscore_engine_created`` hook.

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

from dscore.errors import ConfigError, DscoreError, PluginLoadError, PluginValidationError
from dscore.plugin_manager import create_plugin_manager
from dscore.protocols.precision import PrecisionMode
from dscore.protocols.zero import ZeroStage, ZeroStageContext
from dscore.registry import Registry
from dscore.runtime.dataloader import DscoreDataLoader
from dscore.runtime.engine import DscoreEngine
from dscore.runtime.optimizer_builder import build_lr_scheduler, choose_optimizer
from dscore.specs import MonitorSpec, PrecisionSpec

if TYPE_CHECKING:
    from dscore.accelerator import Accelerator
    from dscore.config.model import DscoreConfig
    from dscore.runtime.runtime import Runtime

__all__ = ["initialize", "InitializeError"]

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
        mpu: model-parallel unit; not supported yet (only data parallelism).
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
    if mpu is not None:
        raise InitializeError(
            "mpu= (model parallelism) is not supported by dscore yet; only data parallelism is available"
        )

    _check_args_local_rank(args)

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
    if "activation_checkpointing" in cfg.raw:  # a config without the block keeps an earlier configure()
        from dscore import checkpointing

        checkpointing.configure(deepspeed_config=cfg, accelerator=runtime.accelerator)
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
        log.info("engine %s built (%s)", engine_spec.name, type(engine).__name__)
        runtime.plugin_manager.call("dscore_engine_created", engine=engine)
        return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def build_standard_engine(ctx: Any) -> DscoreEngine:
    """The standard engine's factory (registered by the built-in ``engine`` plugin as ``standard``).

    Builds the :class:`DscoreEngine` for any ``torch.nn.Module`` from an
    :class:`dscore.protocols.EngineContext`: precision, optimizer, ZeRO stage, LR scheduler, data
    loader and monitors (see the module docstring for the order).
    """
    engine, _, _, _ = _assemble(
        ctx.runtime,
        ctx.config,
        model=ctx.model,
        client_optimizer=ctx.client_optimizer,
        model_parameters=ctx.model_parameters,
        training_data=ctx.training_data,
        client_lr_scheduler=ctx.client_lr_scheduler,
        collate_fn=ctx.collate_fn,
    )
    return engine


def _assemble(
    runtime: Runtime,
    cfg: DscoreConfig,
    *,
    model: torch.nn.Module,
    client_optimizer: Any,
    model_parameters: Iterable[Any] | None,
    training_data: Any,
    client_lr_scheduler: Any,
    collate_fn: Any,
) -> tuple[DscoreEngine, Any, Any, Any]:
    registry, accelerator, comm = runtime.registry, runtime.accelerator, runtime.comm
    rank = int(comm.get_rank())
    dp_world = int(comm.get_world_size())

    # 4. precision and module placement
    precision = _select_precision(cfg, registry)
    _check_device_dtype(precision, accelerator)
    model.to(accelerator.device())
    module = precision.prepare_module(model) or model
    stage_number = int(cfg.zero_stage)
    loss_scaler = precision.make_loss_scaler(zero_stage=stage_number)

    # 5. optimizer, ZeRO stage, scheduler
    choice = choose_optimizer(cfg, registry, client_optimizer)
    zero_stage = _build_zero_stage(
        runtime,
        cfg,
        module=module,
        model_parameters=model_parameters,
        client_optimizer=client_optimizer,
        precision=precision,
        loss_scaler=loss_scaler,
        comm=comm,
    )
    scheduler = build_lr_scheduler(
        cfg, registry, zero_stage.optimizer if choice.has_optimizer else None, client_lr_scheduler
    )

    # 6. data, monitors, engine
    loader = None
    if training_data is not None:
        loader = DscoreDataLoader(
            training_data,
            batch_size=int(cfg.train_micro_batch_size_per_gpu),
            dp_world_size=dp_world,
            dp_rank=rank,
            collate_fn=collate_fn,
            drop_last=cfg.dataloader_drop_last,
            pin_memory=getattr(accelerator, "device_type", "cpu") != "cpu",
        )
    monitors = _create_monitors(cfg, registry, rank)
    engine = DscoreEngine(
        module=module,
        config=cfg,
        runtime=runtime,
        zero_stage=zero_stage,
        precision=precision,
        loss_scaler=loss_scaler,
        lr_scheduler=scheduler,
        training_dataloader=loader,
        monitors=monitors,
        rank=rank,
        dp_world_size=dp_world,
    )
    log.info(
        "engine ready: ZeRO stage %d, precision %s, optimizer %s, scheduler %s, world %d, micro batch %d, "
        "gradient accumulation %d",
        stage_number,
        precision.name,
        choice.description,
        type(scheduler).__name__ if scheduler is not None else "none",
        dp_world,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def _build_zero_stage(
    runtime: Runtime,
    cfg: DscoreConfig,
    *,
    module: torch.nn.Module,
    model_parameters: Iterable[Any] | None,
    client_optimizer: Any,
    precision: PrecisionMode,
    loss_scaler: Any,
    comm: Any,
) -> ZeroStage:
    """The ZeRO stage plugin object for ``cfg.zero_stage`` over ``module``, reducing over ``comm``.

    Raises:
        ConfigError: ZeRO stage 1 or 2 without an optimizer, or a client optimizer it cannot use.
    """
    registry = runtime.registry
    stage_number = int(cfg.zero_stage)
    param_groups = _param_groups(module, model_parameters, client_optimizer)
    choice = choose_optimizer(cfg, registry, client_optimizer, runtime=runtime)
    if stage_number in (1, 2) and not choice.has_optimizer:
        raise ConfigError(
            f"ZeRO stage {stage_number} requires an optimizer (it partitions optimizer state): set optimizer.type "
            "in ds_config or pass optimizer= to dscore.initialize, or use zero_optimization.stage 0 or 3",
            path="zero_optimization.stage",
        )
    section = cfg.section("zero_optimization")
    stage_spec = registry.zero_stage(stage_number, implementation=section.implementation)
    stage_cls = registry.load(stage_spec)
    missing = sorted(getattr(stage_cls, "__abstractmethods__", ()))
    if missing:
        record = registry.provider(stage_spec)
        raise PluginLoadError(
            f"plugin {record.label()}: ZeRO stage {stage_spec.name!r} ({stage_spec.factory}) does not implement "
            f"{', '.join(missing)} of dscore.protocols.ZeroStage; implement them (see CONTRIBUTING.md, "
            "'Write a ZeRO stage') or disable the plugin with DSCORE_DISABLE_PLUGINS=" + record.name,
            plugin=record.name,
            distribution=record.distribution,
            version=record.version,
        )
    ctx = ZeroStageContext(
        module=module,
        param_groups=param_groups,
        client_optimizer=choice.client_optimizer,
        optimizer_factory=choice.factory,
        config=cfg,
        section=section,
        runtime=runtime,
        comm=comm,
        precision=precision,
        loss_scaler=loss_scaler,
    )
    zero_stage: ZeroStage = stage_cls(ctx)
    return zero_stage


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
        raise ConfigError(f"plugins.disable must be a list of plugin names, got {disable!r}", path="plugins.disable")
    return list(disable)


def _data_parallel_world_size(distributed_port: int) -> tuple[int, str]:
    """World size for the batch triangle without creating a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "the existing torch.distributed process group"
    from dscore.comm.env import discover_env

    env = discover_env(distributed_port=distributed_port, quiet=True)
    return env.world_size, f"world size {env.world_size} discovered from the environment ({env.source})"


def _select_precision(cfg: DscoreConfig, registry: Registry) -> PrecisionMode:
    """The precision whose ``config_key`` block has ``enabled: true``, else the default (``config_key=None``).

    Raises:
        ConfigError: two precision blocks are enabled.
        ComponentNotFoundError: no default precision is registered.
    """
    enabled: list[PrecisionSpec] = []
    default: PrecisionSpec | None = None
    for spec in registry.specs("precision"):
        assert isinstance(spec, PrecisionSpec)
        if spec.config_key is None:
            default = default or spec
            continue
        if _block_enabled(cfg, spec, registry):
            enabled.append(spec)
    if len(enabled) > 1:
        keys = " and ".join(f"{s.config_key}.enabled" for s in enabled)
        raise ConfigError(
            f"{keys} are both true; enable at most one precision mode", path=f"{enabled[0].config_key}.enabled"
        )
    chosen = enabled[0] if enabled else default
    if chosen is None:
        chosen = registry.get_typed(PrecisionSpec, "fp32", config_path="fp16.enabled/bf16.enabled")
    return _build_precision(chosen, cfg, registry)


def _build_precision(spec: PrecisionSpec, cfg: DscoreConfig, registry: Registry) -> PrecisionMode:
    """``spec``'s factory called with a :class:`~dscore.protocols.PrecisionContext` (its validated block)."""
    from dscore.protocols.context import PrecisionContext
    from dscore.runtime.context import current_runtime

    section = cfg.section(spec.config_key) if spec.config_key else None
    ctx = PrecisionContext(config=cfg, section=section, runtime=current_runtime(), path=spec.config_key or "")
    mode = registry.load(spec)(ctx)
    assert isinstance(mode, PrecisionMode), f"{spec.factory} did not build a PrecisionMode"
    return mode


def _check_device_dtype(precision: PrecisionMode, accelerator: Accelerator) -> None:
    """Warn when fp16/bf16 is enabled on a device that reports no native support for it.

    DeepSpeed refuses (``ValueError "Type fp16 is not supported on your device."``); dscore only warns,
    because torch still computes correctly there (e.g. fp16 on CPUs without AVX512-FP16, just slowly),
    which keeps fp16 configs testable on any machine.
    """
    name = precision.name
    check = {"fp16": "is_fp16_supported", "bf16": "is_bf16_supported"}.get(name)
    if check and hasattr(accelerator, check) and not getattr(accelerator, check)():
        log.warning(
            "%s is enabled but the %s accelerator reports no native %s support; expect slow emulated math",
            name,
            getattr(accelerator, "device_type", "?"),
            name,
        )


def _param_groups(
    module: torch.nn.Module, model_parameters: Iterable[Any] | None, client_optimizer: Any = None
) -> list[dict[str, Any]]:
    """The parameter-group structure the ZeRO stage partitions and the optimizer steps.

    * A client optimizer *instance* defines the structure, as in DeepSpeed (its ZeRO wrappers read
      ``optimizer.param_groups``; ``model_parameters`` only feeds optimizers built from the config or
      a callable). Group ``i`` of the result is group ``i`` of the client optimizer: same
      hyper-parameters, same parameters minus frozen ones. Empty and all-frozen groups are *kept* (with
      ``params: []``) so per-group lists in a client scheduler (``LambdaLR`` lambdas, ``base_lrs``) and
      ``get_lr()`` keep lining up with the groups the user built.
    * Otherwise ``model_parameters`` (default: the module's parameters) is normalised: an iterable of
      group dicts keeps every group (frozen parameters dropped, empty groups kept); an iterable of
      tensors or ``(name, tensor)`` pairs becomes one group of its trainable tensors (none: ``[]``).

    Raises:
        ConfigError: an element of ``model_parameters`` is none of these; a group dict has no
            ``params``; a client optimizer holds a tensor that is not a parameter of the model (names
            the group and position).
    """
    if isinstance(client_optimizer, torch.optim.Optimizer):
        return _client_optimizer_groups(module, client_optimizer, model_parameters)
    source = module.parameters() if model_parameters is None else model_parameters
    items = list(source)
    if not items:
        return []
    if all(isinstance(x, dict) for x in items):
        groups = []
        for gi, g in enumerate(items):
            if "params" not in g:
                raise ConfigError(
                    f"model_parameters group {gi} has no 'params' key; each group dict needs 'params' "
                    "(a list of tensors) plus optional hyper-parameters such as 'lr'"
                )
            raw = g["params"]
            raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
            groups.append({**g, "params": [p for p in raw if p.requires_grad]})
        return groups
    params: list[torch.Tensor] = []
    for x in items:
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor):
            x = x[1]
        if not isinstance(x, torch.Tensor):
            raise ConfigError(
                f"model_parameters must hold tensors, (name, tensor) pairs or parameter-group dicts; got {type(x).__name__}"
            )
        if x.requires_grad:
            params.append(x)
    return [{"params": params}] if params else []


def _client_optimizer_groups(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, model_parameters: Iterable[Any] | None
) -> list[dict[str, Any]]:
    """Groups mirroring ``optimizer.param_groups`` (see :func:`_param_groups`)."""
    owned = {id(p) for p in module.parameters()}
    groups: list[dict[str, Any]] = []
    for gi, g in enumerate(optimizer.param_groups):
        for pos, p in enumerate(g["params"]):
            if id(p) not in owned:
                raise ConfigError(
                    f"the client optimizer's param_groups[{gi}] holds a tensor (position {pos}, shape "
                    f"{tuple(p.shape)}) that is not a parameter of the model passed to dscore.initialize; build "
                    "the optimizer over the model's own parameters (model.parameters() or groups of them)"
                )
        groups.append({**g, "params": [p for p in g["params"] if p.requires_grad]})
    if model_parameters is not None:
        given = {id(p) for p in _flat_tensors(model_parameters)}
        held = {id(p) for g in groups for p in g["params"]}
        if given and given != held:
            log.warning(
                "model_parameters and the client optimizer hold different parameters; the client optimizer's "
                "param_groups decide what is trained (as in DeepSpeed)"
            )
    return groups


def _flat_tensors(model_parameters: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for x in model_parameters:
        if isinstance(x, dict):
            raw = x.get("params", [])
            out.extend([raw] if isinstance(raw, torch.Tensor) else list(raw))
        elif isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor):
            out.append(x[1])
        elif isinstance(x, torch.Tensor):
            out.append(x)
    return [p for p in out if p.requires_grad]


def _create_monitors(cfg: DscoreConfig, registry: Registry, rank: int) -> list[Any]:
    """Every monitor whose config block is enabled, on global rank 0 only (DeepSpeed's ``MonitorMaster``).

    Raises:
        PluginValidationError: a monitor's ``config_key`` names no registered section, or a section model
            without an ``enabled`` field (checked on every rank, before anything is built).
    """
    enabled = [s for s in registry.specs("monitor") if isinstance(s, MonitorSpec) and _block_enabled(cfg, s, registry)]
    if rank != 0:
        return []
    from dscore.protocols.context import MonitorContext
    from dscore.runtime.context import current_runtime

    runtime = current_runtime()
    out = []
    for spec in enabled:
        assert isinstance(spec, MonitorSpec)
        block = cfg.section(spec.config_key)
        ctx = MonitorContext(config=cfg, section=block, runtime=runtime, path=spec.config_key)
        out.append(registry.load(spec)(ctx))
        log.info("monitor %s enabled (%s)", spec.name, spec.config_key)
    return out


def _block_enabled(cfg: DscoreConfig, spec: MonitorSpec | PrecisionSpec, registry: Registry) -> bool:
    """``<spec.config_key>.enabled`` for a monitor or precision spec: the rule is that the block a
    component is switched on by is a registered section whose model has an ``enabled`` field (a section
    with required fields that the user left out counts as not enabled).

    Raises:
        PluginValidationError: the section is not registered, or its model has no ``enabled`` field
            (either would silently never build the component); names the plugin, spec and section.
    """
    key = spec.config_key
    assert key is not None
    fields = type(cfg).model_fields
    what = f"{spec.kind.replace('_', ' ')} {spec.name!r}"
    if key not in fields:
        record = registry.provider(spec)
        raise PluginValidationError(
            f"plugin {record.label()}: {what} is switched on by ds_config section {key!r} (config_key), but no "
            f"active plugin registers that section; register a ConfigSectionSpec(name={key!r}, model=...) with "
            f"an `enabled: bool` field, or disable the plugin with DSCORE_DISABLE_PLUGINS={record.name}"
        )
    block = cfg.section(key)
    if block is not None and "enabled" not in type(block).model_fields:
        record = registry.provider(spec)
        raise PluginValidationError(
            f"plugin {record.label()}: {what} is switched on by {key}.enabled, but the model of ds_config "
            f"section {key!r} ({type(block).__name__}) has no 'enabled' field, so it could never be enabled; "
            "add `enabled: bool = False` to the section model"
        )
    return block is not None and bool(block.enabled)
