"""The ``zero_optimization`` section (torch-free), with DeepSpeed 0.19.8's fields, defaults and aliases.

Legacy forms are migrated before validation by :meth:`ZeroConfig.migrate_legacy`, each with a warning
naming the new key: ``"zero_optimization": true`` (stage 1, ``allgather_bucket_size`` from the top-level
``allgather_size``), ``false`` (stage 0), ``cpu_offload``, ``cpu_offload_param``,
``cpu_offload_use_pin_memory`` (dropped) and ``stage3_gather_fp16_weights_on_model_save``. Keys DeepSpeed
0.19.8 removed (``mics_shard_size``, ``mics_hierarchical_params_gather``, ``zeropp_loco_param``) and
ZenFlow are dropped with a warning when inert and refused otherwise.

``"auto"`` is accepted for ``reduce_bucket_size``, ``stage3_prefetch_bucket_size`` and
``stage3_param_persistence_threshold``; dscore fills them from the model's hidden size h (h*h,
int(0.9*h*h), 10*h) when the model is known.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StrictBool, ValidationInfo, field_validator, model_validator

from dscore.config.base import Float, Int, NonNegativeInt, PositiveInt, SectionModel, no_effect, not_implemented
from dscore.errors import ConfigError

__all__ = ["OffloadParamConfig", "OffloadOptimizerConfig", "LeafModuleConfig", "ZeroConfig"]

ZeroStageNumber = Annotated[Int, Field(ge=0, le=3)]
Ratio = Annotated[Float, Field(ge=0.0, le=1.0)]
OffloadDevice = Literal["none", "cpu", "nvme"]


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


class _Offload(SectionModel):
    device: OffloadDevice = "none"
    """Where to offload: ``"none"``, ``"cpu"`` or ``"nvme"`` (case-insensitive)."""
    nvme_path: str | None = None
    """Directory on an NVMe device; required with ``device: "nvme"`` (created if missing; swap files go
    to a per-run subfolder ``dscore-swap-<run id>/rank<N>`` removed at ``engine.close()`` and exit)."""
    pin_memory: bool = True
    """Use page-locked CPU memory (default true since DeepSpeed 0.19)."""

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        return _lower(value)

    @model_validator(mode="after")
    def _nvme(self) -> _Offload:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError('nvme_path is required when device is "nvme"')
        return self


class OffloadParamConfig(_Offload):
    """``zero_optimization.offload_param``: move stage-3 parameters to CPU or NVMe (stage 3 only)."""

    buffer_count: PositiveInt = 5
    """Number of parameter buffers in the NVMe swap pool."""
    buffer_size: PositiveInt = 100_000_000
    """Size of each NVMe swap buffer in elements."""
    max_in_cpu: NonNegativeInt = 1_000_000_000
    """Parameter elements kept in CPU memory when offloading to NVMe."""


class OffloadOptimizerConfig(_Offload):
    """``zero_optimization.offload_optimizer``: keep optimizer state (and its step) on CPU or NVMe."""

    buffer_count: PositiveInt = 4
    """Number of optimizer-state buffers in the NVMe swap pool."""
    pipeline_read: bool = False
    """Overlap reading the next sub-group's state from NVMe with the step."""
    pipeline_write: bool = False
    """Overlap writing the previous sub-group's state to NVMe with the step."""
    fast_init: bool = Field(False, json_schema_extra=no_effect("a DeepSpeed NVMe start-up speed knob; dscore initialises swap files its own way"))
    """Initialise NVMe-offloaded state quickly (skip zero-filling)."""
    ratio: Ratio = Field(1.0, json_schema_extra=not_implemented("partial optimizer offload (DeepSpeed's Twin-Flow); dscore offloads all of it"))
    """Fraction of the optimizer state offloaded (0..1); below 1 needs ZeRO stage 3."""
    super_offload: bool = Field(False, json_schema_extra=not_implemented("DeepSpeed SuperOffload"))
    """DeepSpeed SuperOffload (CPU optimizer pipelining on superchips)."""
    cpuadam_cores_perc: Annotated[Float, Field(gt=0.0, le=1.0)] = Field(0.8, json_schema_extra=no_effect("dscore's CPU optimizer uses torch's intra-op threads (OMP_NUM_THREADS)"))
    """Fraction of CPU cores the CPU optimizer uses."""

    @property
    def pipeline(self) -> bool:
        """``pipeline_read or pipeline_write``."""
        return self.pipeline_read or self.pipeline_write


class LeafModuleConfig(SectionModel):
    """``zero_optimization.leaf_module``: modules ZeRO-3 gathers as a whole on entry, with no hooks on
    their submodules (DeepSpeed 0.19.8's schema; see :mod:`dscore.zero.leaf`). A single string is taken
    as a one-element list."""

    classes: list[str] = Field(
        default_factory=lambda: [
            "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
            "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
            "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
        ]
    )
    """Module class names, plain (``"MixtralSparseMoeBlock"``) or qualified; default: transformers'
    Mixtral, Qwen2-MoE and Qwen3-MoE sparse MoE blocks."""
    names: list[str] = Field(default_factory=list)
    """Module names as in ``model.named_modules()`` (``"model.layers.0.mlp"``)."""
    name_suffixes: list[str] = Field(default_factory=list)
    """Suffixes of module names (``"mlp"``)."""

    @model_validator(mode="before")
    @classmethod
    def _one_string(cls, value: Any) -> Any:
        if isinstance(value, dict):
            value = {k: [v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v
                     for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _dedupe(self) -> LeafModuleConfig:
        for key in ("classes", "names", "name_suffixes"):
            object.__setattr__(self, key, list(dict.fromkeys(getattr(self, key))))
        return self


# the deprecated keys migrate_legacy rewrites (also when the model is built directly)
_LEGACY_KEYS = (
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "stage3_gather_fp16_weights_on_model_save",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "zeropp_loco_param",
    "zenflow",
)


class ZeroConfig(SectionModel):
    """``zero_optimization``: the ZeRO stage and its tuning knobs (DeepSpeed 0.19.8 defaults)."""

    dscore_auto: ClassVar[dict[str, str]] = {
        "reduce_bucket_size": "hidden^2",
        "prefetch_bucket_size": "0.9*hidden^2",
        "param_persistence_threshold": "10*hidden",
    }

    stage: ZeroStageNumber = 0
    """0: plain data parallelism; 1: partition optimizer state; 2: also gradients; 3: also parameters."""
    implementation: str | None = None
    """dscore: the name of the registered ZeRO stage implementation to use for ``stage`` (``dscore plugins
    list --kind zero_stage``); unset uses the default one (``stage0`` ... ``stage3``). Checked when the
    engine is built: an unknown name lists the installed ones with close matches."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter instead of all-reduce (stages 1-2)."""
    reduce_bucket_size: PositiveInt | Literal["auto"] = 500_000_000
    """Elements reduced per bucket (> 0; ``"auto"`` = hidden_size**2)."""
    use_multi_rank_bucket_allreduce: bool = Field(True, json_schema_extra=no_effect("a DeepSpeed communication tuning knob; dscore reduces each bucket with one collective"))
    """Combine buckets bound for several ranks into one all-reduce."""
    allgather_partitions: bool = True
    """All-gather updated partitions (true) or broadcast them rank by rank (false)."""
    allgather_bucket_size: PositiveInt = 500_000_000
    """Elements all-gathered per bucket."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; ``None`` resolves to ``stage == 3``."""
    compute_grad_norm: bool = Field(True, json_schema_extra=no_effect("dscore computes the global norm anyway (one scalar all-reduce; engine.get_global_grad_norm() returns it); DeepSpeed's other conditions (gradient_clipping 0, no offload) are checked"))
    """Compute the global gradient norm; false (no clipping, no norm logging) only for stages 1 and 2."""
    load_from_fp32_weights: bool = True
    """Stages 1-3, loading a checkpoint: restore the fp32 master weights from the checkpoint's fp32 copy
    (true) or rebuild them from the loaded 16-bit module weights (false; optimizer state is still loaded)."""
    elastic_checkpoint: bool = Field(False, json_schema_extra=no_effect("dscore's ZeRO checkpoints always load at any data-parallel world size"))
    """Save optimizer state so it can be loaded with a different data-parallel size (stages 1-2)."""
    offload_param: OffloadParamConfig | None = None
    """Parameter offload (stage 3), or ``None``; ``{}`` gives ``device: "none"``."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer-state offload (stages 1-3), or ``None``."""
    sub_group_size: PositiveInt = 1_000_000_000
    """Elements per optimizer step sub-group: with ``offload_optimizer.device: "nvme"`` (stages 1-3) the
    unit swapped in, stepped and swapped out (rounded up to a multiple of 16384)."""
    prefetch_bucket_size: NonNegativeInt | Literal["auto"] = Field(50_000_000, alias="stage3_prefetch_bucket_size")
    """Elements prefetched ahead of use (stage 3; ``"auto"`` = int(0.9 * hidden_size**2))."""
    param_persistence_threshold: NonNegativeInt | Literal["auto"] = Field(
        100_000, alias="stage3_param_persistence_threshold"
    )
    """Parameters smaller than this many elements stay unpartitioned (stage 3; ``"auto"`` = 10 * hidden_size)."""
    model_persistence_threshold: NonNegativeInt = Field(sys.maxsize, alias="stage3_model_persistence_threshold", json_schema_extra=no_effect("dscore keeps every unit under stage3_param_persistence_threshold gathered, without a total cap"))
    """Upper bound on the total elements kept unpartitioned (stage 3)."""
    max_live_parameters: NonNegativeInt = Field(1_000_000_000, alias="stage3_max_live_parameters")
    """Parameter elements kept gathered at once before releasing (stage 3)."""
    max_reuse_distance: NonNegativeInt = Field(1_000_000_000, alias="stage3_max_reuse_distance")
    """Keep a gathered parameter if it is reused within this many elements of fetches (stage 3)."""
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """Gather a full 16-bit state dict when saving the model (stage 3)."""
    module_granularity_threshold: NonNegativeInt = Field(0, alias="stage3_module_granularity_threshold", json_schema_extra=no_effect("a DeepSpeed hook-overhead knob; set leaf modules explicitly (leaf_module, set_z3_leaf_modules)"))
    """Fetch modules with fewer parameters than this as one leaf (stage 3; 0 disables)."""
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params", json_schema_extra=no_effect("a DeepSpeed communication tuning knob; dscore gathers with all-gather"))
    """Fetch parameters with all-reduce instead of all-gather (stage 3)."""
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential", json_schema_extra=no_effect("a DeepSpeed communication tuning knob; dscore gathers each unit with one all-gather"))
    """All-gather parameters one at a time (stage 3)."""
    ignore_unused_parameters: bool = Field(True, json_schema_extra=no_effect("dscore always treats a parameter without a gradient as a zero gradient, at every stage"))
    """Tolerate parameters that receive no gradient (stage 2 and 3)."""
    legacy_stage1: bool = Field(False, json_schema_extra=no_effect("DeepSpeed's old stage-1 code path; dscore has one stage 1"))
    """DeepSpeed's old stage-1 implementation (kept for compatibility)."""
    round_robin_gradients: bool = Field(False, json_schema_extra=no_effect("dscore's stage 1/2 buckets are already balanced across ranks"))
    """Stage 1/2 with offload: copy gradients to CPU in round-robin order across ranks."""
    parameter_alignment: bool = Field(False, json_schema_extra=no_effect("a DeepSpeed memory-layout knob"))
    """Align partition boundaries to the parameter boundaries."""
    zero_hpz_partition_size: NonNegativeInt = 1
    """ZeRO++ hierarchical partitioning (hpZ, stage 3): after a unit's all-gather over the data-parallel
    group, each rank keeps a secondary partition sharded over its group of this many contiguous ranks, and
    the next gathers (backward, further micro steps until the optimizer step) read it inside that group
    (:mod:`dscore_plugins.zeropp.hpz`). 0 and 1 disable it (DeepSpeed's ``ge=0``); it must divide the ZeRO group's
    size (checked when the engine is built)."""
    zero_quantized_weights: bool = False
    """ZeRO++ quantized weights (stage 3): the training all-gathers of non-persistent units send int8 blocks
    (at most 2048 elements, splitting each rank's chunk evenly) with an fp32 scale each
    (:mod:`dscore_plugins.zeropp.qwz`); partitions, optimizer, checkpoints and user gathers stay exact."""
    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++ (stage 3): quantize the all-gathers of frozen parameters only."""
    zero_quantized_gradients: bool = False
    """ZeRO++ quantized gradients (qgZ, stage 3 with ``reduce_scatter``): the gradient reduce-scatter sends
    int4 blocks (at most 256 elements, two values per byte) with an fp32 scale each, as an intra-node then an
    inter-node all-to-all; nodes are ``LOCAL_WORLD_SIZE`` consecutive global ranks. On a single node the
    reduce-scatter stays exact, as in DeepSpeed (:mod:`dscore_plugins.zeropp.qgz`)."""
    memory_efficient_linear: bool = Field(True, json_schema_extra=no_effect("DeepSpeed's ZeRO-3 linear autograd function; dscore uses torch's"))
    """Use ZeRO-3's memory-efficient linear autograd function."""
    override_module_apply: bool = Field(True, json_schema_extra=no_effect("dscore does not gather parameters around module.apply(); wrap re-initialisation in dscore.zero.GatheredParameters(params, modifier_rank=0)"))
    """ZeRO-3: gather parameters around ``module.apply``."""
    pipeline_loading_checkpoint: bool = Field(False, json_schema_extra=no_effect("a DeepSpeed checkpoint-loading schedule knob"))
    """Load checkpoint shards per pipeline stage."""
    log_trace_cache_warnings: bool = Field(False, json_schema_extra=no_effect("dscore logs no trace-cache warnings"))
    """Log ZeRO-3 trace-cache invalidation warnings."""
    enable_sanity_checks: StrictBool = Field(False, json_schema_extra=no_effect("DeepSpeed's debug consistency checks"))
    """Extra (slow) consistency checks of partitioned parameters."""
    save_muon_momentum_buffer_in_memory: bool = Field(False, json_schema_extra=no_effect("dscore has no Muon optimizer"))
    """Keep Muon's momentum buffer in memory when saving."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Modules ZeRO-3 treats as leaves (stage 3; :func:`dscore.zero.set_z3_leaf_modules` does the same
    from code)."""

    def elements(self, name: str) -> int:
        """An element-count field (``reduce_bucket_size``, ``prefetch_bucket_size``,
        ``param_persistence_threshold``) as an int: this model's default while ``"auto"`` is unresolved
        because the model's hidden size is unknown."""
        value = getattr(self, name)
        if isinstance(value, int):
            return value
        default = type(self).model_fields[name].default
        assert isinstance(default, int), name
        return default

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        # built directly (DeepSpeedZeroConfig(**section)) the loader's migrate_legacy has not run: DeepSpeed's
        # model takes its deprecated keys itself, with a warning on DeepSpeed's logger (dscore's, under compat)
        if isinstance(data, dict) and any(k in data for k in _LEGACY_KEYS):
            return cls.migrate_legacy(data, root={}, warn=logging.getLogger("dscore").warning)
        return data

    @model_validator(mode="after")
    def _elastic_checkpoint_at_stage3(self) -> ZeroConfig:
        if self.stage == 3 and self.elastic_checkpoint:  # DeepSpeed 0.19.8 warns here, on every construction
            logging.getLogger("dscore").warning(
                "zero_optimization.elastic_checkpoint: ZeRO-3 elastic checkpointing is deprecated and no longer "
                "supported by DeepSpeed; dscore's ZeRO checkpoints load at any data-parallel world size (or use "
                "universal checkpointing)"
            )
        return self

    @model_validator(mode="after")
    def _resolve(self) -> ZeroConfig:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError(f"compute_grad_norm: false is supported only with stage 1 or 2, not stage {self.stage}")
        # ZeRO++: quantized weights, quantized gradients (qgZ) and hpZ are implemented (stage 3 only)
        if (self.zero_quantized_weights or self.zero_quantized_nontrainable_weights) and self.stage != 3:
            raise ValueError(
                "zero_quantized_weights / zero_quantized_nontrainable_weights quantize ZeRO stage 3's parameter "
                f"all-gathers; they need stage 3, not stage {self.stage}"
            )
        if self.zero_quantized_gradients and self.stage != 3:
            raise ValueError(
                "zero_quantized_gradients (ZeRO++ qgZ) quantizes ZeRO stage 3's gradient reduce-scatter; it needs "
                f"stage 3, not stage {self.stage}"
            )
        if self.zero_quantized_gradients and not self.reduce_scatter:
            raise ValueError(
                "zero_quantized_gradients (ZeRO++ qgZ) replaces the gradient reduce-scatter; it needs "
                "reduce_scatter: true (DeepSpeed asserts the same)"
            )
        return self

    @field_validator("zero_hpz_partition_size", mode="after")
    @classmethod
    def _check_hpz(cls, hpz: int, info: ValidationInfo) -> int:
        """hpZ needs stage 3 and composes with offload_param only on the host (the group size against the
        world is checked when the engine is built: :mod:`dscore_plugins.zeropp.hpz`)."""
        if hpz <= 1:
            return hpz
        stage = info.data.get("stage", 0)
        if stage != 3:
            raise ValueError(
                "ZeRO++ hierarchical partitioning (hpZ) keeps secondary copies of ZeRO stage 3's parameter "
                f"partitions; it needs zero_optimization.stage 3, not {stage} (0 or 1 disable it)"
            )
        offload = info.data.get("offload_param")
        if offload is not None and offload.device == "nvme":
            raise ValueError(
                'ZeRO++ hierarchical partitioning (hpZ) cannot be combined with offload_param.device "nvme": '
                "the secondary partitions would live in host memory, which NVMe offload exists to spare; use "
                'offload_param.device "cpu" or "none", or zero_hpz_partition_size 1'
            )
        return hpz

    @classmethod
    def migrate_legacy(cls, value: Any, *, root: dict[str, Any], warn: Callable[[str], None]) -> Any:
        """Rewrite DeepSpeed's legacy forms of the section into the current ones (see module docstring).

        Raises:
            ConfigError: a legacy key given together with its replacement, a legacy flag that is not a
                boolean, or a removed key / ZenFlow block that would change training.
        """
        if isinstance(value, bool):
            if value:
                size = root.pop("allgather_size", 500_000_000)
                warn(
                    '"zero_optimization": true is deprecated; migrated to "zero_optimization": {"stage": 1, '
                    f'"allgather_bucket_size": {size!r}}} (zero_optimization.stage)'
                )
                return {"stage": 1, "allgather_bucket_size": size}
            warn('"zero_optimization": false is deprecated; migrated to zero_optimization.stage = 0')
            return {"stage": 0}
        if not isinstance(value, dict):
            return value
        value = dict(value)
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old not in value:
                continue
            flag = value.pop(old)
            path = f"zero_optimization.{old}"
            if not isinstance(flag, bool):
                raise ConfigError(f"{path}: must be true or false, got {flag!r}", path=path)
            if new in value:
                raise ConfigError(
                    f"{path}: the deprecated {old!r} and its replacement zero_optimization.{new} cannot be given "
                    "together; keep only the new key",
                    path=path,
                )
            warn(f"{path} is deprecated; use zero_optimization.{new} (migrated: {flag})")
            if flag:
                value[new] = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in value:
            value.pop("cpu_offload_use_pin_memory")
            warn(
                "zero_optimization.cpu_offload_use_pin_memory is deprecated and ignored; use "
                "zero_optimization.offload_optimizer.pin_memory / offload_param.pin_memory"
            )
        old = "stage3_gather_fp16_weights_on_model_save"
        if old in value:
            flag = value.pop(old)
            if "gather_16bit_weights_on_model_save" in value or "stage3_gather_16bit_weights_on_model_save" in value:
                raise ConfigError(
                    f"zero_optimization.{old}: the deprecated key and its replacement "
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save cannot be given together",
                    path=f"zero_optimization.{old}",
                )
            warn(f"zero_optimization.{old} is deprecated; use zero_optimization.gather_16bit_weights_on_model_save")
            value["gather_16bit_weights_on_model_save"] = flag
        inert: dict[str, Callable[[Any], bool]] = {
            "mics_shard_size": lambda v: (
                v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v <= 0)
            ),
            "mics_hierarchical_params_gather": lambda v: v in (False, None),
            "zeropp_loco_param": lambda v: v in (None, {}, False),
            # DeepSpeed builds ZenFlowConfig() from {} (ZenFlow on, with defaults): only None/false is inert
            "zenflow": lambda v: v in (None, False),
        }
        for key, is_inert in inert.items():
            if key not in value:
                continue
            path = f"zero_optimization.{key}"
            sub = value.pop(key)
            feature = "ZenFlow" if key == "zenflow" else "MiCS / ZeRO++ LoCo (removed in DeepSpeed 0.19.8)"
            if is_inert(sub):
                warn(f"{path} ({feature}) has no effect as written and is ignored")
            else:
                raise ConfigError(
                    f"{path}: dscore does not implement {feature}, but {key} = {sub!r} would change training; "
                    "remove the key",
                    path=path,
                )
        return value
