"""Registration dataclasses: what a plugin hands to dscore for each component kind.

A plugin's registration hook (see :mod:`dscore.hookspecs`) returns an iterable of these specs. They are
frozen, keyword-only and torch-free: anything heavy (a class, a factory, a pydantic model that imports
torch) is given as an *import string* ``"package.module:attribute"`` that dscore resolves only when the
component is selected (:func:`dscore.specs.resolve`). That keeps ``dscore plugins list`` and
``import dscore`` fast and free of torch.

Names are compared case-insensitively; ``aliases`` hold extra spellings (DeepSpeed's, e.g. ``"Adam"``
and ``"adam"`` are the same optimizer, ``"WarmupLR"`` is the scheduler ``warmuplr``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "ComponentSpec",
    "AcceleratorSpec",
    "CommBackendSpec",
    "OptimizerSpec",
    "LRSchedulerSpec",
    "ZeroStageSpec",
    "ZeroFeatureSpec",
    "PrecisionSpec",
    "OpBuilderSpec",
    "ConfigSectionSpec",
    "MonitorSpec",
    "CommandSpec",
    "EngineSpec",
    "LauncherSpec",
    "CommTransportSpec",
    "CheckpointLayoutSpec",
    "ModelTransformSpec",
    "SPEC_KINDS",
    "resolve",
]


def resolve(import_string: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute.

    Raises:
        ImportError: the module cannot be imported (the original error is chained).
        AttributeError: the attribute path does not exist in the module.
        ValueError: the string has no ``:``.
    """
    module_name, sep, attr_path = import_string.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"import string {import_string!r} must look like 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True, kw_only=True)
class ComponentSpec:
    """Fields shared by every registration.

    Attributes:
        name: the component's canonical name, unique per kind (case-insensitive).
        aliases: other accepted spellings, also unique per kind.
        description: one line shown by ``dscore plugins list`` and in errors.
        exports: a module (``"pkg.mod"``, no ``:``) holding the user-facing names this unit provides, which a
            thin dscore module re-exports by kind and name (:func:`dscore.exports.thin_getattr`), e.g. the
            ``ulysses`` model transform's module behind ``dscore.parallel.ulysses.UlyssesSPAttentionHF``.
            Empty when the unit has none.
    """

    kind: ClassVar[str] = "component"
    name: str
    aliases: tuple[str, ...] = ()
    description: str = ""
    exports: str = ""

    def all_names(self) -> tuple[str, ...]:
        """The canonical name followed by the aliases."""
        return (self.name, *self.aliases)


@dataclass(frozen=True, kw_only=True)
class AcceleratorSpec(ComponentSpec):
    """An accelerator (device family) such as ``cpu`` or ``cuda``.

    Attributes:
        device_type: the torch device type string (``"cuda"``, ``"cpu"``, ``"hpu"``).
        accelerator: import string of the accelerator class (instantiated with no arguments).
        probe: import string of a cheap, side-effect-free function ``() -> ProbeResult`` saying whether
            the device is usable here. It must not create a device context.
        priority: higher probes first during automatic selection (``cpu`` is the lowest).
    """

    kind: ClassVar[str] = "accelerator"
    device_type: str
    accelerator: str
    probe: str
    priority: int = 0


@dataclass(frozen=True, kw_only=True)
class CommBackendSpec(ComponentSpec):
    """A collective-communication backend usable by ``torch.distributed``.

    Attributes:
        torch_backend: the backend name given to ``torch.distributed.init_process_group``.
        device_types: device types this backend serves (``("cpu",)`` for gloo).
        requires: import strings of modules that must be importable (e.g. ``"oneccl_bindings_for_pytorch"``).
    """

    kind: ClassVar[str] = "comm_backend"
    torch_backend: str
    device_types: tuple[str, ...]
    requires: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec(ComponentSpec):
    """An optimizer selected by ``optimizer.type``.

    Capabilities are declared here, once; dscore never guesses them from class names.

    Attributes:
        factory: import string of ``factory(param_groups: list[dict], ctx: OptimizerContext[Params]) ->
            torch.optim.Optimizer`` (:class:`dscore.protocols.OptimizerContext`; ``ctx.section`` is
            ``optimizer.params`` validated by ``params_model``).
        params_model: import string of a pydantic model validating ``optimizer.params`` (torch-free). It
            holds the optimizer's defaults; without one the factory gets
            :class:`dscore.protocols.OpaqueParams`.
        offload_capable: True when ``optimizer.type`` may be used with ZeRO optimizer offload (its optimizer
            steps fp32 CPU tensors — through ``offload_factory`` when that is set).
        offload_factory: import string of the factory used instead of ``factory`` under ZeRO optimizer
            offload (same signature), or None to use ``factory`` there too. DeepSpeed swaps ``Adam`` for its
            CPU Adam op under offload; this is how a plugin expresses that swap.
        zero_supported: True when the optimizer is correct over ZeRO partitions (element-wise update, no
            cross-parameter state): DeepSpeed's ``ZERO_SUPPORTED_OPTIMIZERS``. A *client* optimizer under
            ZeRO stages 1-3 whose exact class is in ``classes`` of such a spec needs no
            ``zero_allow_untested_optimizer``.
        classes: import strings of the exact optimizer classes ``factory`` builds (``"torch.optim:AdamW"``).
            Client optimizers (instances or callable results) are matched against them, by exact class, to
            apply ``zero_supported`` and — for specs that are ``offload_capable`` without an
            ``offload_factory`` — offload capability.
    """

    kind: ClassVar[str] = "optimizer"
    factory: str
    params_model: str | None = None
    offload_capable: bool = False
    offload_factory: str | None = None
    zero_supported: bool = False
    classes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class LRSchedulerSpec(ComponentSpec):
    """An LR scheduler selected by ``scheduler.type``.

    Attributes:
        factory: import string of ``factory(optimizer, ctx: SchedulerContext[Params])`` returning an object
            with ``step()``, ``get_last_lr()``, ``state_dict()``, ``load_state_dict()``
            (:class:`dscore.protocols.SchedulerContext`; ``ctx.section`` is the validated ``scheduler.params``).
        params_model: import string of a pydantic model validating ``scheduler.params`` (torch-free).
    """

    kind: ClassVar[str] = "lr_scheduler"
    factory: str
    params_model: str | None = None


@dataclass(frozen=True, kw_only=True)
class ZeroStageSpec(ComponentSpec):
    """A ZeRO stage implementation, selected by ``zero_optimization.stage`` (and ``.implementation``).

    Attributes:
        stage: the ZeRO level (0-3) it implements: the config's ``zero_optimization.stage`` it serves and
            what the engine's checks and the checkpoint layout assume.
        factory: import string of the :class:`dscore.protocols.ZeroStage` class the engine instantiates
            as ``cls(ctx: ZeroStageContext)``.
        default: True when it is the implementation used for its ``stage`` unless
            ``zero_optimization.implementation`` names another (two default specs for one stage from
            different plugins are a conflict). A third-party variant sets False and is chosen by name.
    """

    kind: ClassVar[str] = "zero_stage"
    stage: int
    factory: str
    default: bool = True


@dataclass(frozen=True, kw_only=True)
class ZeroFeatureSpec(ComponentSpec):
    """An option of a ZeRO stage that changes how one of its collectives runs (ZeRO++'s ``hpz``, ``qwz``,
    ``qgz``), asked for by the stage when a ``zero_optimization`` key turns it on.

    Not a stage: ``zero_optimization.stage``/``implementation`` never select it. A stage that supports the
    option looks it up by name (``registry.get("zero_feature", name, config_path=...)``) only when the config
    sets one of ``config_keys``, so disabling the unit (``zero_feature:hpz``) refuses such a config with the
    registry's error naming the unit, and leaves every other config as it was.

    Attributes:
        factory: import string of what the stage builds the option with (the built-ins: a
            :class:`dscore.zero.partition.GatherStrategy` factory for hpZ and qwZ, a reduce-scatter for qgZ;
            its signature is the stage's contract with the option, documented by the providing module).
        config_keys: the ``zero_optimization`` keys that turn it on (``("zero_hpz_partition_size",)``),
            named in ``dscore plugins list`` and in the stage's errors.
        stages: the ZeRO stages that support it.
    """

    kind: ClassVar[str] = "zero_feature"
    factory: str
    config_keys: tuple[str, ...] = ()
    stages: tuple[int, ...] = (3,)


@dataclass(frozen=True, kw_only=True)
class PrecisionSpec(ComponentSpec):
    """A training precision mode (``fp32``, ``fp16``, ``bf16``).

    Attributes:
        config_key: the top-level config block that enables it (``"fp16"``), or ``None`` for the default.
        factory: import string of ``factory(ctx: PrecisionContext[Section | None]) -> PrecisionMode``
            (:class:`dscore.protocols.PrecisionContext`; ``ctx.section`` is the validated ``config_key``
            block, None for the default mode).
    """

    kind: ClassVar[str] = "precision"
    config_key: str | None
    factory: str


@dataclass(frozen=True, kw_only=True)
class OpBuilderSpec(ComponentSpec):
    """A C++/CUDA op builder (JIT-compiled with ninja on first use).

    Attributes:
        builder: import string of the ``OpBuilder`` subclass.
        device_types: device types the op runs on.
        build_env_var: the ``DS_BUILD_<OP>`` variable that asks for an ahead-of-time build.
    """

    kind: ClassVar[str] = "op_builder"
    builder: str
    device_types: tuple[str, ...]
    build_env_var: str


@dataclass(frozen=True, kw_only=True)
class ConfigSectionSpec(ComponentSpec):
    """A ds_config top-level section owned by a plugin.

    ``name`` is the top-level key (``"zero_optimization"``); aliases are legacy spellings of the key
    (``"bfloat16"``).

    Attributes:
        model: import string of the pydantic v2 model (torch-free) validating the section.
    """

    kind: ClassVar[str] = "config_section"
    model: str


@dataclass(frozen=True, kw_only=True)
class MonitorSpec(ComponentSpec):
    """A training monitor (tensorboard, csv, wandb, ...).

    Attributes:
        config_key: the top-level config block that configures and enables it (``"csv_monitor"``).
        factory: import string of ``factory(ctx: MonitorContext[Section]) -> monitor`` with
            ``write_events(list[tuple[str, float, int]])`` and ``close()`` (``ctx.section`` is the validated
            ``config_key`` block, ``ctx.rank`` the global rank).
    """

    kind: ClassVar[str] = "monitor"
    config_key: str
    factory: str


@dataclass(frozen=True, kw_only=True)
class CommandSpec(ComponentSpec):
    """A ``dscore <name>`` subcommand.

    Attributes:
        module: import string of a module (``"pkg.cli.mycmd"``, no ``:``) defining
            ``add_arguments(parser: argparse.ArgumentParser) -> None`` and
            ``run(args: argparse.Namespace) -> int``. The module must not import torch at import time.
        help: one line for ``dscore --help``.
    """

    kind: ClassVar[str] = "command"
    module: str
    help: str = ""


@dataclass(frozen=True, kw_only=True)
class EngineSpec(ComponentSpec):
    """A training engine that ``dscore.initialize`` may build (the standard engine, the pipeline engine).

    ``dscore.initialize`` asks every engine's ``predicate`` whether it handles the model and the validated
    config and builds the one that does (DeepSpeed picks ``PipelineEngine`` for a ``PipelineModule`` and
    ``DeepSpeedEngine`` otherwise). Among several that answer yes, the highest ``priority`` wins; a tie at
    the top is a :class:`~dscore.errors.PluginConflictError`; none is a
    :class:`~dscore.errors.ComponentNotFoundError` listing the engines asked.

    Attributes:
        predicate: import string of ``predicate(model, config) -> bool``: True when this engine handles
            ``model`` (the user's module) with ``config`` (the validated ``DscoreConfig``). Must be cheap
            and side-effect free (no collectives).
        factory: import string of ``factory(ctx: dscore.protocols.EngineContext) -> engine`` returning the
            engine object ``dscore.initialize`` returns first (it must have ``optimizer``,
            ``training_dataloader`` and ``lr_scheduler`` attributes).
        priority: ties between engines that all accept a model are broken by the highest priority
            (the standard engine is 0, the pipeline engine 100: a pipeline model goes to the pipeline
            engine even though the standard engine's predicate accepts any module).
    """

    kind: ClassVar[str] = "engine"
    predicate: str
    factory: str
    priority: int = 0


@dataclass(frozen=True, kw_only=True)
class LauncherSpec(ComponentSpec):
    """A multi-node launcher back end, selected by ``dscore run --launcher NAME`` (DeepSpeed's
    ``--launcher``: ``pdsh``, ``openmpi``, ``mpich``, ``impi``, ``mvapich``, ``slurm``; ``ssh`` is dscore's).

    Attributes:
        runner: import string of a :class:`dscore.launcher.runners.Runner` subclass, built as ``cls()`` by
            ``dscore run`` and named after the spec; with the job's
            :class:`~dscore.launcher.runners.RunnerContext` it validates the request and builds the
            command(s) this process starts (``validate``, ``commands``, ``processes``, ``cleanup_commands``,
            ``program``: the contract in :mod:`dscore.launcher.runners`).
        executables: the programs the back end starts, in the order its runner tries them (the first on
            ``PATH`` is used), listed without importing the runner.
        default: True for the back end used when ``--launcher`` is not given (DeepSpeed's ``pdsh``); two
            default specs from different plugins are a conflict.
    """

    kind: ClassVar[str] = "launcher"
    runner: str
    executables: tuple[str, ...] = ()
    default: bool = False


@dataclass(frozen=True, kw_only=True)
class CommTransportSpec(ComponentSpec):
    """A way :class:`dscore.comm.Comm` moves a collective's data (gloo point-to-point, same-host shared
    memory, or a third party's), chosen per call like engines are.

    For each collective that may leave the backend (a sum/average all-reduce or reduce-scatter, or an
    all-gather, of contiguous CPU tensors) :class:`~dscore.comm.Comm` asks its registered transports in
    descending ``priority`` (ties by name) and runs it on the first whose object accepts it
    (``transport.accepts(op, group, tensors)``); the native transport (the backend's own collectives, kept
    in the core) is the fallback and the only one a device tensor takes. ``name`` is the unit a user
    disables (``comm_transport:shm``).

    Attributes:
        factory: import string of ``factory(ctx: dscore.protocols.transport.TransportContext) -> Transport``
            (the :class:`dscore.protocols.transport.Transport` contract), built once per
            :class:`~dscore.comm.Comm`, at its first collective that may leave the backend.
        priority: higher is asked first (the built-ins: ``shm`` 200, ``p2p`` 100).
        op_builders: names of the op builders the transport needs (its C++ part, e.g. ``("shm_sync",)``): one
            that is disabled or not registered leaves the transport out, never breaks the core.
    """

    kind: ClassVar[str] = "comm_transport"
    factory: str
    priority: int = 0
    op_builders: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class CheckpointLayoutSpec(ComponentSpec):
    """An on-disk checkpoint layout (dscore's own, DeepSpeed's ``mp_rank_*`` / ``*_optim_states.pt``),
    chosen by ``engine.checkpoint_layout`` at save and recorded in (or detected from) the checkpoint at load.

    Attributes:
        layout: import string of the layout object (:class:`dscore.protocols.CheckpointLayout`) with
            ``detect(save_dir, tag) -> bool``, ``resolve_tag``, ``write(...)``, ``read(...)`` and
            ``fp32_state_dict(...)``, plus the optional conversions ``dscore checkpoint export/import`` use.
        detect_priority: load-time detection (a checkpoint whose ``_COMPLETE`` manifest names no layout) asks
            layouts in descending order and takes the first whose ``detect`` says yes (a layout with marker
            files of its own goes first).
    """

    kind: ClassVar[str] = "checkpoint_layout"
    layout: str
    detect_priority: int = 0


@dataclass(frozen=True, kw_only=True)
class ModelTransformSpec(ComponentSpec):
    """A change ``dscore.initialize`` makes to the user's model before the engine is built (AutoTP, AutoEP,
    Ulysses sequence parallelism, activation checkpointing), applied in ``order``.

    ``name`` is also the unit a user disables (``model_transform:autotp``).

    Attributes:
        transform: import string of the transform object (``dscore.protocols.ModelTransform``):
            ``enabled(config) -> bool`` (cheap, no collectives) and ``apply(ctx) -> None`` that rewrites
            ``ctx.model`` / ``ctx.model_parameters`` in place of the plain model (optional steps: ``prepare``,
            ``adjust_stage``, ``wrap_stage``, ``verify``). A class is instantiated with no arguments.
        config_key: the ds_config section it owns (``"tensor_parallel"``), registered by the same plugin
            through a :class:`ConfigSectionSpec`; None when it reads only core keys.
        order: transforms run in ascending order (ties by name); the built-ins use 100 (AutoTP), 200
            (AutoEP), 300 (Ulysses) and 400 (activation checkpointing) so a third party can go between.
        mesh_dims: the device-mesh dimensions whose degree this transform gives a meaning to (``"tp"`` for
            AutoTP, ``"sp"`` for Ulysses): a config with ``tensor_parallel.autotp_size`` /
            ``sequence_parallel_size`` above 1 and no active, enabled transform declaring that dimension is
            refused (so a disabled transform never trains as if the mesh were plain).
    """

    kind: ClassVar[str] = "model_transform"
    transform: str
    config_key: str | None = None
    order: int = 1000
    mesh_dims: tuple[str, ...] = ()


#: kind name -> spec class, in the order ``dscore plugins list`` shows them.
SPEC_KINDS: dict[str, type[ComponentSpec]] = {
    cls.kind: cls
    for cls in (
        AcceleratorSpec,
        CommBackendSpec,
        OptimizerSpec,
        LRSchedulerSpec,
        ZeroStageSpec,
        ZeroFeatureSpec,
        PrecisionSpec,
        OpBuilderSpec,
        ConfigSectionSpec,
        MonitorSpec,
        CommandSpec,
        EngineSpec,
        LauncherSpec,
        CommTransportSpec,
        CheckpointLayoutSpec,
        ModelTransformSpec,
    )
}
