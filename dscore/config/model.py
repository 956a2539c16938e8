"""The core ds_config model: top-level keys DeepSpeed reads itself, plus the assembled full model.

Plugin-owned sections (``zero_optimization``, ``fp16``, ``bf16``, monitors, ...) are not imported here:
:func:`build_config_model` adds one field per :class:`~dscore.specs.ConfigSectionSpec` found in the
registry to :class:`DscoreConfig` with :func:`pydantic.create_model`. Field names are DeepSpeed's key
names, so ``config.zero_optimization.stage`` reads like the JSON.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, Field, PrivateAttr, StrictBool, create_model, field_validator

from dscore.config.base import (
    MODEL_AUTO_FORMULAS,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    SectionModel,
    no_effect,
    not_implemented,
)
from dscore.errors import ConfigError, PluginConflictError, PluginLoadError
from dscore.specs import ConfigSectionSpec

#: "no default given" for :meth:`DscoreConfig.section`
_REQUIRED: Any = object()

if TYPE_CHECKING:
    from dscore.registry import Registry

__all__ = [
    "OptimizerConfig",
    "SchedulerConfig",
    "CheckpointConfig",
    "ParallelWriteConfig",
    "DataTypesConfig",
    "PluginsConfig",
    "DscoreConfig",
    "SectionInfo",
    "PendingAuto",
    "CORE_KEYS",
    "build_config_model",
    "normalize_dtype",
]

_DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def normalize_dtype(value: Any, *, allowed: tuple[str, ...] = ("fp32", "fp16", "bf16")) -> Any:
    """Map a dtype spelling (case-insensitive ``fp16``/``float16``/``half``/``bf16``/``bfloat16``/
    ``fp32``/``float32``/``float``) to ``"fp16"``, ``"bf16"`` or ``"fp32"``; ``None`` passes through.

    Raises:
        ValueError: any other value (pydantic turns it into a config error at the field's path).
    """
    if value is None:
        return None
    canonical = _DTYPE_ALIASES.get(value.strip().lower()) if isinstance(value, str) else None
    if canonical is None or canonical not in allowed:
        raise ValueError(f"expected one of {list(allowed)} (case-insensitive), got {value!r}")
    return canonical


class OptimizerConfig(SectionModel):
    """The ``optimizer`` block: which registered optimizer to build and its constructor arguments."""

    type: str
    """Name of a registered optimizer, case-insensitive (``Adam``, ``AdamW``, ``Lamb``, ...). Kept as
    written; the registry resolves it."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer, validated by the optimizer plugin's ``params_model`` (its
    defaults are not injected here). ``max_grad_norm`` is refused: use ``gradient_clipping``."""
    legacy_fusion: bool = Field(default=False, json_schema_extra=no_effect("DeepSpeed's legacy fused-optimizer switch"))
    """DeepSpeed's legacy fused-optimizer switch; kept for compatibility, no effect in dscore."""


class SchedulerConfig(SectionModel):
    """The ``scheduler`` block: which registered LR scheduler to build and its arguments."""

    type: str
    """Name of a registered LR scheduler, case-insensitive (``WarmupLR``, ``WarmupDecayLR``, ...)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler, validated by the scheduler plugin's ``params_model``."""


class ParallelWriteConfig(SectionModel):
    """``checkpoint.parallel_write``."""

    pipeline_stage: StrictBool = Field(
        default=False, json_schema_extra=no_effect("a write-parallelism knob; dscore's pipeline engine writes per-stage files itself")
    )
    """Write checkpoints in parallel per pipeline stage (must be a JSON boolean)."""


class CheckpointConfig(SectionModel):
    """The ``checkpoint`` block (defaults as DeepSpeed 0.19.8)."""

    tag_validation: Literal["IGNORE", "WARN", "FAIL"] = "WARN"
    """Check that every rank saves under the same tag: ``Ignore``, ``Warn`` (log a warning on a
    mismatch) or ``Fail`` (raise). Case-insensitive; stored upper-case."""
    load_universal: bool = False
    """Load a universal (reshapeable) checkpoint (reads ``latest_universal``)."""
    use_node_local_storage: bool = Field(
        default=False, json_schema_extra=not_implemented("node-local checkpoint storage: dscore writes to the shared save_dir")
    )
    """Each node writes to its own local storage (rank 0 of every node saves)."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """Parallel checkpoint writing options."""
    checkpoint_serialization: bool = Field(
        default=True, json_schema_extra=no_effect("dscore always writes torch's zipfile format or safetensors")
    )
    """Use torch's zipfile serialization for checkpoint files."""
    writer: dict[str, Any] | None = None
    """Options of a custom checkpoint writer (``type`` plus its arguments), or ``None``."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class DataTypesConfig(SectionModel):
    """The ``data_types`` block."""

    dscore_auto: ClassVar[dict[str, str]] = {"keep_in_fp32_modules": "value"}

    grad_accum_dtype: str | None = None
    """dtype gradients are accumulated in (``fp32``, ``fp16``, ``bf16``); ``None`` = the model's dtype."""
    param_dtype: str | None = None
    """dtype of the trained parameters; must match the enabled precision mode when set."""
    buffer_dtype: str | None = Field(
        default=None, json_schema_extra=not_implemented("casting module buffers to another dtype")
    )
    """dtype of module buffers; ``None`` = unchanged."""
    keep_in_fp32_modules: Literal["auto"] | list[str] = Field(
        default="auto", json_schema_extra=not_implemented("keeping named modules' buffers in fp32 under fp16/bf16")
    )
    """Module names kept in fp32 under fp16/bf16, or ``"auto"`` (the model's own list)."""

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return normalize_dtype(value)


class PluginsConfig(SectionModel):
    """``plugins`` (dscore extension): which installed plugins this run leaves out."""

    disable: list[str] = Field(default_factory=list)
    """Plugins to disable for this run, by plugin name, or single units as ``kind:name``
    (``op_builder:fused_adam``), like ``DSCORE_DISABLE_PLUGINS``."""


@dataclass(frozen=True)
class PendingAuto:
    """A model-dependent ``"auto"`` waiting for the model: where it is and how it is computed."""

    path: str
    """Dotted path as written in the config (``zero_optimization.stage3_prefetch_bucket_size``)."""
    field_names: tuple[str, ...]
    """Attribute names leading to the field (``("zero_optimization", "prefetch_bucket_size")``)."""
    formula: str
    """A key of :data:`dscore.config.base.MODEL_AUTO_FORMULAS`."""


class DscoreConfig(SectionModel):
    """A validated, resolved, immutable ds_config.

    Build one with :func:`dscore.config.load_config`. The fields below are the keys DeepSpeed reads
    itself; the registered plugin sections (``zero_optimization``, ``fp16``, ``bf16``, ``tensorboard``,
    ...) are added as fields of a subclass assembled per registry.
    """

    dscore_auto: ClassVar[dict[str, str]] = {
        "train_batch_size": "batch",
        "train_micro_batch_size_per_gpu": "batch",
        "gradient_accumulation_steps": "batch",
    }

    train_batch_size: PositiveInt
    """Samples per optimizer step over all data-parallel ranks: micro batch x accumulation steps x
    world size. Any two of the three batch keys determine the third."""
    train_micro_batch_size_per_gpu: PositiveInt
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: PositiveInt
    """Micro batches accumulated before each optimizer step."""
    managed_gradient_accumulation: bool = True
    """True: the engine decides accumulation boundaries from ``gradient_accumulation_steps``; false:
    every ``step()`` is a boundary (the caller manages accumulation), as DeepSpeed 0.19.8."""
    steps_per_print: PositiveInt | None = None
    """Log progress every N optimizer steps; ``None`` (the 0.19.8 default) disables it."""
    gradient_clipping: NonNegativeFloat = 1.0
    """Clip gradients to this global L2 norm; 0 disables. Default 1.0, as DeepSpeed 0.19.x (it was 0
    before, so old configs relying on no clipping must say 0)."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before the all-reduce instead of after."""
    gradient_predivide_factor: PositiveFloat = 1.0
    """Divide gradients by this factor before the all-reduce and by world_size/factor after."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """Reduction of data-parallel gradients, case-insensitive ``mean`` or ``sum`` (``sum`` is refused
    with ZeRO stage 3)."""
    communication_data_type: Literal["fp16", "bf16", "fp32"] | None = None
    """dtype gradients are communicated in (case-insensitive); ``None`` = the gradients' dtype."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step and log the breakdown (synchronises the device)."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch of the engine-built data loader."""
    zero_allow_untested_optimizer: bool = False
    """Allow a client optimizer ZeRO has not been tested with."""
    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require dscore's CPU optimizer (a client optimizer is refused)."""
    optimizer: OptimizerConfig | None = None
    """Optimizer built from the config, or ``None`` (a client optimizer, or none)."""
    scheduler: SchedulerConfig | None = None
    """LR scheduler built from the config, or ``None``."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint options."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """dtype options."""
    sequence_parallel_size: PositiveInt = 1
    """Sequence-parallel degree of the device mesh (Ulysses, :mod:`dscore.parallel.ulysses`, gives it its
    meaning); the data-parallel size is world / (sequence_parallel_size x tensor_parallel.autotp_size). A core
    key because the mesh and the batch triangle read it before any model transform runs; the sections
    ``tensor_parallel``, ``expert_parallel`` and ``activation_checkpointing`` belong to the built-in ``parallel``
    plugin."""
    accelerator: str | None = None
    """dscore extension: the accelerator plugin to use (``cpu``, ``cuda``, ...); ``None`` = the
    ``DS_ACCELERATOR`` variable, else automatic selection."""
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)
    """dscore extension: plugin selection for this run."""
    strict: bool = True
    """dscore extension: false turns unknown-key errors into warnings (the keys are dropped)."""

    _warnings: list[str] = PrivateAttr(default_factory=list)
    _source_name: str = PrivateAttr(default="<dict>")
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)
    _pending_auto: tuple[PendingAuto, ...] = PrivateAttr(default=())
    _world_size: int = PrivateAttr(default=1)
    _zero_implementation: str | None = PrivateAttr(default=None)
    # lower-case section key -> disabled PluginRecords that register it (for section()'s error only)
    _disabled_sections: dict[str, list[Any]] = PrivateAttr(default_factory=dict)

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _lower_op(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _comm_dtype(cls, value: Any) -> Any:
        return normalize_dtype(value)

    # ------------------------------------------------------------------ extras
    @property
    def warnings(self) -> list[str]:
        """Everything migrated, ignored or dropped while loading, one message each (a copy)."""
        return list(self._warnings)

    @property
    def source_name(self) -> str:
        """Where the config came from: a file path, ``"<dict>"``, ``"<base64>"``."""
        return self._source_name

    @property
    def raw(self) -> dict[str, Any]:
        """The user's config as given, after legacy migration (a deep copy is not made: do not mutate)."""
        return self._raw

    def get(self, key: str, default: Any = None) -> Any:
        """``raw.get(key, default)``: the config read as the dict that was passed, as DeepSpeed's
        ``engine.config`` is (Hugging Face Trainer reads ``engine.config.get("zero_optimization", {})``)."""
        return self._raw.get(key, default)

    @property
    def world_size(self) -> int:
        """The data-parallel world size the batch triangle was resolved with."""
        return self._world_size

    @property
    def pending_auto(self) -> list[str]:
        """Dotted paths of model-dependent ``"auto"`` values not yet resolved (see
        :meth:`resolve_model_auto`)."""
        return [p.path for p in self._pending_auto]

    @property
    def zero_stage(self) -> int:
        """``zero_optimization.stage`` (0 when no ZeRO section is registered)."""
        zero = getattr(self, "zero_optimization", None)
        return int(getattr(zero, "stage", 0) or 0)

    @property
    def zero_implementation(self) -> str | None:
        """The name of the registered ZeRO stage plugin ``dscore.initialize`` will use
        (``zero_optimization.implementation``, else the default one of ``zero_optimization.stage``), as
        selected when the config was loaded; None when no ZeRO stage plugin is installed for it."""
        return self._zero_implementation

    @property
    def fp16_enabled(self) -> bool:
        """``fp16.enabled`` (False when no fp16 section is registered)."""
        return bool(getattr(getattr(self, "fp16", None), "enabled", False))

    @property
    def bf16_enabled(self) -> bool:
        """``bf16.enabled`` (False when no bf16 section is registered)."""
        return bool(getattr(getattr(self, "bf16", None), "enabled", False))

    def section(self, key: str, default: Any = _REQUIRED) -> Any:
        """The validated section ``key`` (``"zero_optimization"``, a plugin's ``"ema"``).

        A registered section that the user left out is its model's defaults, or ``None`` when the model
        has required fields (an optional block such as ``optimizer``).

        Args:
            key: a top-level key: a section registered by an active plugin or one of the core's.
            default: returned when no active plugin registers ``key``; without it that is an error, so a
                misspelled or unregistered name never reads as "section absent".

        Raises:
            ComponentNotFoundError: ``key`` is not a field of this config and no default was given; names
                the registered sections and close matches, or the installed-but-disabled plugin that
                registers it and how to enable it.
        """
        fields = type(self).model_fields
        if key in fields:
            return getattr(self, key)
        if default is not _REQUIRED:
            return default
        from dscore.errors import ComponentNotFoundError, did_you_mean

        plugin_sections = sorted(k for k in fields if k not in CORE_KEYS)
        core_sections = sorted(k for k in CORE_KEYS if _is_section_field(fields[k].annotation))
        close = did_you_mean(key, list(fields))
        disabled = self._disabled_sections.get(key.lower(), [])
        if disabled:
            from dscore.registry import disabled_message

            message = disabled_message("config_section", repr(key), disabled)
        else:
            message = (
                f"config.section({key!r}): no active plugin registers a ds_config section {key!r}. "
                f"Registered by plugins: {', '.join(plugin_sections) or '(none)'}; core sections: "
                f"{', '.join(core_sections)}."
                + (f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else "")
                + f" Pass a default (config.section({key!r}, None)) where the section is optional."
            )
        raise ComponentNotFoundError(
            message, kind="config_section", name=key, available=[*plugin_sections, *core_sections], suggestions=close
        )

    def resolve_model_auto(self, hidden_size: int | None) -> DscoreConfig:
        """Return a new config with every model-dependent ``"auto"`` filled in from ``hidden_size``.

        Formulas (:data:`dscore.config.base.MODEL_AUTO_FORMULAS`, as the HF Trainer):
        ``zero_optimization.reduce_bucket_size = h*h``, ``stage3_prefetch_bucket_size = int(0.9*h*h)``,
        ``stage3_param_persistence_threshold = 10*h``.

        Args:
            hidden_size: the model's hidden dimension (an int > 0).

        Raises:
            ConfigError: ``hidden_size`` is not a positive int (path ``""``), listing every ``"auto"``
                path that therefore stays unresolved.
        """
        if not self._pending_auto:
            return self
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            paths = ", ".join(self.pending_auto)
            raise ConfigError(
                f'{self._source_name}: cannot resolve "auto" at {paths}: the model\'s hidden size must be a '
                f"positive integer, got {hidden_size!r}",
                path=self._pending_auto[0].path,
                source=self._source_name,
                errors=[(p.path, f'unresolved "auto" (hidden size {hidden_size!r})') for p in self._pending_auto],
            )
        new: BaseModel = self
        raw = _copy_json(self._raw)
        resolved: list[str] = []
        for pending in self._pending_auto:
            value = MODEL_AUTO_FORMULAS[pending.formula](hidden_size)
            new = _replace(new, pending.field_names, value)
            _set_path(raw, pending.path.split("."), value)
            resolved.append(f"{pending.path} = {value} ({pending.formula} with hidden size {hidden_size})")
        assert isinstance(new, DscoreConfig)
        new._raw = raw
        new._pending_auto = ()
        new._warnings = [*self._warnings, *(f'resolved "auto": {r}' for r in resolved)]
        return new


def _replace(obj: BaseModel, names: tuple[str, ...], value: Any) -> BaseModel:
    if len(names) == 1:
        return obj.model_copy(update={names[0]: value})
    child = getattr(obj, names[0])
    return obj.model_copy(update={names[0]: _replace(child, names[1:], value)})


def _set_path(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node: Any = data
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value


def _copy_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_json(v) for v in value]
    return value


def _is_section_field(annotation: Any) -> bool:
    """True when a core field holds a model (``checkpoint``, ``optimizer``), not a scalar."""
    import typing

    args = typing.get_args(annotation) or (annotation,)
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in args)


#: Top-level keys the core defines; a plugin cannot claim them as a section.
CORE_KEYS: frozenset[str] = frozenset(DscoreConfig.model_fields)


@dataclass(frozen=True)
class SectionInfo:
    """A registered section: the spec, its model class and the providing plugin's label."""

    spec: ConfigSectionSpec
    model: type[BaseModel]
    provider: str


def build_config_model(registry: Registry) -> tuple[type[DscoreConfig], dict[str, SectionInfo]]:
    """Assemble the full config model from :class:`DscoreConfig` plus every registered section.

    Args:
        registry: a :class:`dscore.registry.Registry`.

    Returns:
        ``(model_class, sections)`` where ``sections`` maps the section key to its :class:`SectionInfo`.

    Raises:
        PluginConflictError: two plugins register the same section key (or alias), or a plugin claims a
            key the core defines.
        PluginLoadError: a section's ``model`` import string cannot be imported or is not a pydantic model.
    """
    for _, name, providers in registry.conflicts("config_section"):
        labels = "; ".join(r.label() for r in providers)
        raise PluginConflictError(
            f"ds_config section {name!r} is registered by {len(providers)} plugins: {labels}. Disable all but "
            f'one with DSCORE_DISABLE_PLUGINS=<name> or "plugins": {{"disable": [...]}}.'
        )
    sections: dict[str, SectionInfo] = {}
    for spec in registry.specs("config_section"):
        assert isinstance(spec, ConfigSectionSpec)
        record = registry.provider(spec)
        for key in spec.all_names():
            if key in CORE_KEYS:
                raise PluginConflictError(
                    f"plugin {record.label()} registers ds_config section {key!r}, which is a key dscore's core "
                    f"defines; disable it with DSCORE_DISABLE_PLUGINS={record.name}"
                )
        model = registry.load(spec, "model")
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise PluginLoadError(
                f"plugin {record.label()}: ds_config section {spec.name!r} model {spec.model!r} is not a pydantic "
                "model class",
                plugin=record.name,
                distribution=record.distribution,
                version=record.version,
            )
        sections[spec.name] = SectionInfo(spec=spec, model=model, provider=record.label())
    assembly = tuple((name, info.model, info.spec.description) for name, info in sections.items())
    return _assemble(assembly), sections


@functools.lru_cache(maxsize=64)
def _assemble(key: tuple[tuple[str, type[BaseModel], str], ...]) -> type[DscoreConfig]:
    """Create the full model class for one set of sections (memoised: pydantic class creation costs
    tens of milliseconds, and the inputs are immutable classes)."""
    fields: dict[str, Any] = {}
    for name, model, description in key:
        try:
            default = model()
        except Exception:  # the section has required fields: absent means None
            fields[name] = (model | None, None)
        else:
            fields[name] = (model, Field(default=default, description=description or None))
    return create_model("DscoreConfigModel", __base__=DscoreConfig, **fields)  # type: ignore[call-overload]
