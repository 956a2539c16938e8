"""Engine assembly: the public building blocks ``dscore.initialize`` and engine plugins share.

:func:`dscore.runtime.initialize.initialize` validates the config and creates the runtime, then builds the
device mesh (:func:`build_mesh`) and asks the selected engine plugin to build itself from an
:class:`dscore.protocols.EngineContext`. The context's helpers (``select_precision``,
``build_zero_stage``, ``create_monitors``) and the standard engine's factory (:func:`build_standard_engine`,
:func:`assemble`) are the functions of this module, so ``dscore.protocols`` reaches no private helper of
``initialize`` and nothing here imports ``initialize`` (no import circle).

The mesh (:class:`dscore.parallel.mesh.ParallelMesh`) holds the data, sequence and tensor groups. :func:`assemble`
runs every enabled model transform (:mod:`dscore.runtime.transforms`, in their ``order``; this module names
none) before the precision cast, lets them adjust the ZeRO stage's inputs and wrap the stage, hands the stage
the gradient group (sequence x data ranks) after making every rank's parameters and buffers rank 0's of that
group (:func:`build_zero_stage`, :mod:`dscore.runtime.replicas`), shards the data loader over the data-parallel ranks only, and
gives the engine ``dp_world_size = world / (tp x sp)``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError, PluginLoadError, PluginValidationError
from dscore.parallel.mesh import raw_mesh_degrees
from dscore.protocols.precision import PrecisionMode
from dscore.protocols.transform import StageInputs
from dscore.protocols.zero import ZeroStage, ZeroStageContext
from dscore.registry import Registry
from dscore.runtime.dataloader import DscoreDataLoader
from dscore.runtime.engine import DscoreEngine
from dscore.runtime.optimizer_builder import build_lr_scheduler, choose_optimizer
from dscore.runtime.placement import to_module
from dscore.runtime.replicas import broadcast_replicas
from dscore.runtime.transforms import ActiveTransforms
from dscore.specs import MonitorSpec, PrecisionSpec

if TYPE_CHECKING:
    from dscore.accelerator import Accelerator
    from dscore.config.model import DscoreConfig
    from dscore.parallel.mesh import ParallelMesh
    from dscore.runtime.runtime import Runtime

__all__ = [
    "assemble",
    "build_mesh",
    "build_standard_engine",
    "build_zero_stage",
    "check_device_dtype",
    "create_monitors",
    "mesh_of",
    "param_groups",
    "raw_mesh_degrees",
    "select_precision",
]

log = logging.getLogger("dscore.runtime.assembly")


def build_mesh(runtime: Runtime, cfg: DscoreConfig, mpu: Any = None) -> ParallelMesh:
    """The run's :class:`~dscore.parallel.mesh.ParallelMesh` (collective over ``runtime.comm``).

    Args:
        mpu: a mesh the user built before ``initialize`` (``UlyssesSPAttentionHF.register_with_transformers``
            returns one); it is used when its sizes equal the config's.

    Raises:
        ConfigError: ``tp x sp`` does not divide the world size, or ``mpu`` has other sizes than the config.
    """
    from dscore.parallel.mesh import ParallelMesh

    tp, sp = raw_mesh_degrees(cfg.raw)  # validated by the sections that own the keys
    world = int(runtime.comm.get_world_size())
    if mpu is not None:
        if not isinstance(mpu, ParallelMesh):
            raise ConfigError(
                f"mpu= must be a dscore.parallel.ParallelMesh (from UlyssesSPAttentionHF.register_with_transformers "
                f"or ParallelMesh.create), got {type(mpu).__name__}; dscore builds its groups from "
                "tensor_parallel.autotp_size and sequence_parallel_size"
            )
        if not mpu.matches(tp=tp, sp=sp, world=world):
            raise ConfigError(
                f"the mpu passed to dscore.initialize has tp {mpu.tp_size} x sp {mpu.sp_size} over {mpu.shape.world} "
                f"ranks but the config says tensor_parallel.autotp_size {tp}, sequence_parallel_size {sp} over "
                f"{world} ranks; make them agree",
                path="sequence_parallel_size",
            )
        return mpu
    return ParallelMesh.create(runtime.comm, tp=tp, sp=sp)


def mesh_of(runtime: Runtime) -> ParallelMesh:
    """The runtime's mesh; a one-dimensional data-parallel mesh over ``runtime.comm`` when none was built
    (a runtime made without ``dscore.initialize``)."""
    mesh = getattr(runtime, "mesh", None)
    if mesh is None:
        from dscore.parallel.mesh import ParallelMesh

        mesh = ParallelMesh.create(runtime.comm)
    return mesh


def build_standard_engine(ctx: Any, *, engine_class: type[DscoreEngine] | None = None) -> DscoreEngine:
    """The standard engine's factory (registered by the built-in ``engine`` plugin as ``standard``).

    Builds the :class:`DscoreEngine` for any ``torch.nn.Module`` from an
    :class:`dscore.protocols.EngineContext`: precision, optimizer, ZeRO stage, LR scheduler, data
    loader and monitors (see the module docstring for the order).

    Args:
        engine_class: a :class:`DscoreEngine` subclass to build instead (an engine plugin adding members to
            the standard engine, e.g. ``generate``); its constructor takes :class:`DscoreEngine`'s arguments.
    """
    engine, _, _, _ = assemble(
        ctx.runtime,
        ctx.config,
        model=ctx.model,
        client_optimizer=ctx.client_optimizer,
        model_parameters=ctx.model_parameters,
        training_data=ctx.training_data,
        client_lr_scheduler=ctx.client_lr_scheduler,
        collate_fn=ctx.collate_fn,
        engine_class=engine_class,
    )
    return engine


def assemble(
    runtime: Runtime,
    cfg: DscoreConfig,
    *,
    model: torch.nn.Module,
    client_optimizer: Any,
    model_parameters: Iterable[Any] | None,
    training_data: Any,
    client_lr_scheduler: Any,
    collate_fn: Any,
    engine_class: type[DscoreEngine] | None = None,
) -> tuple[DscoreEngine, Any, Any, Any]:
    """Build the standard :class:`DscoreEngine` (or ``engine_class``, a subclass) over the runtime's mesh
    (see the module docstring).

    Returns ``(engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)``.

    Raises:
        ConfigError: as :func:`build_zero_stage`; as a model transform's ``apply`` (AutoTP: no layer split, a
            pattern matching nothing, a setting it cannot honour; AutoEP with TP/SP or an optimizer instance).
    """
    registry, accelerator, comm = runtime.registry, runtime.accelerator, runtime.comm
    rank = int(comm.get_rank())
    mesh = mesh_of(runtime)
    dp_world, dp_rank = mesh.dp_size, mesh.dp_rank

    # 4. precision, model transforms (in their order), module placement
    precision = select_precision(cfg, registry)
    check_device_dtype(precision, accelerator)
    transforms = ActiveTransforms.apply(
        runtime,
        cfg,
        mesh=mesh,
        model=model,
        model_parameters=model_parameters,
        client_optimizer=client_optimizer,
        precision=precision,
    )
    model_parameters = transforms.model_parameters
    to_module(model, device=accelerator.device())  # keeps Parameter objects (ties) on out-of-tree devices
    prepared = precision.prepare_module(model)
    module = model if prepared is None else prepared  # never a module's truth value (len() of a container)
    stage_number = int(cfg.zero_stage)
    loss_scaler = precision.make_loss_scaler(zero_stage=stage_number)

    # 5. optimizer, ZeRO stage (its inputs adjusted and the stage wrapped by the transforms), scheduler
    choice = choose_optimizer(cfg, registry, client_optimizer)
    inputs = transforms.adjust_stage(StageInputs(module=module, model_parameters=model_parameters, config=cfg))
    zero_stage = build_zero_stage(
        runtime,
        inputs.config,
        module=inputs.module,
        model_parameters=inputs.model_parameters,
        client_optimizer=client_optimizer,
        precision=precision,
        loss_scaler=loss_scaler,
        comm=mesh.grad_comm,
        already_equal=transforms.replicas_equal,
    )
    zero_stage = transforms.wrap_stage(zero_stage, inputs)
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
            dp_rank=dp_rank,
            collate_fn=collate_fn,
            drop_last=cfg.dataloader_drop_last,
            pin_memory=getattr(accelerator, "device_type", "cpu") != "cpu",
        )
    monitors = create_monitors(cfg, registry, rank)
    engine = (DscoreEngine if engine_class is None else engine_class)(
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
        "engine ready: ZeRO stage %d, precision %s, optimizer %s, scheduler %s, data-parallel world %d "
        "(sp %d, tp %d), model transforms %s, micro batch %d, gradient accumulation %d",
        stage_number,
        precision.name,
        choice.description,
        type(scheduler).__name__ if scheduler is not None else "none",
        dp_world,
        mesh.sp_size,
        mesh.tp_size,
        ", ".join(transforms.names) or "none",
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def build_zero_stage(
    runtime: Runtime,
    cfg: DscoreConfig,
    *,
    module: torch.nn.Module,
    model_parameters: Iterable[Any] | None,
    client_optimizer: Any,
    precision: PrecisionMode,
    loss_scaler: Any,
    comm: Any,
    already_equal: Iterable[torch.Tensor] = (),
) -> ZeroStage:
    """The ZeRO stage plugin object for ``cfg.zero_stage`` over ``module``, reducing over ``comm``.

    Before the stage is built, every rank's parameters and buffers become rank 0's of ``comm``'s group
    (expert parameters: of their expert-data-parallel group; ``zero.Init`` partitions are already rank 0's):
    :func:`dscore.runtime.replicas.broadcast_replicas`, collective over ``comm``. ``already_equal``: tensors
    known to be equal over ``comm``'s group already (the transforms'
    :attr:`~dscore.protocols.transform.TransformContext.replicas_equal`), which the broadcast skips.

    Raises:
        ConfigError: ZeRO stage 1 or 2 without an optimizer, or a client optimizer it cannot use.
    """
    registry = runtime.registry
    stage_number = int(cfg.zero_stage)
    groups = param_groups(module, model_parameters, client_optimizer)
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
        param_groups=groups,
        client_optimizer=choice.client_optimizer,
        optimizer_factory=choice.factory,
        config=cfg,
        section=section,
        runtime=runtime,
        comm=comm,
        precision=precision,
        loss_scaler=loss_scaler,
    )
    # the stage takes the replicas as equal: make them rank 0's (DeepSpeed's _broadcast_model, see replicas.py)
    mesh = getattr(runtime, "mesh", None)
    in_mesh = mesh is not None and comm in (mesh.grad_comm, mesh.dp_comm)
    broadcast_replicas(
        module,
        comm,
        device=runtime.accelerator.device(),
        mesh=mesh if in_mesh else None,
        already_equal=already_equal,
    )
    zero_stage: ZeroStage = stage_cls(ctx)
    from dscore.zero.fragments import attach

    attach(zero_stage, module.parameters())  # the per-parameter accessors find the stage through its parameters
    return zero_stage


def select_precision(cfg: DscoreConfig, registry: Registry) -> PrecisionMode:
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


def check_device_dtype(precision: PrecisionMode, accelerator: Accelerator) -> None:
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


def param_groups(
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


def create_monitors(cfg: DscoreConfig, registry: Registry, rank: int) -> list[Any]:
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
