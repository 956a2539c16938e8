"""Activation checkpointing settings: what ``dscore.checkpointing.configure`` sets and ``checkpoint`` reads
(DeepSpeed's ``deepspeed.checkpointing``).

``checkpoint(fn, *args)`` runs ``fn(*args)`` without keeping its intermediate activations; only the
inputs are saved for backward. The backward pass runs ``fn`` again (the *recompute*) with the CPU and
accelerator random-number-generator states the forward started with, so dropout draws the same mask,
then back-propagates through the recomputed graph. Gradients equal those of a plain forward.

Settings come from the ``activation_checkpointing`` ds_config block (``dscore.initialize`` calls
:func:`configure` when the config contains the block) or from :func:`configure` directly, whose
argument names are DeepSpeed's:

* ``partition_activations`` splits saved inputs across the model-parallel group. dscore has no
  model-parallel group (size 1), where DeepSpeed's partition is the whole tensor: accepted, no effect.
  With it on, an ``mpu_`` reporting a model-parallel world size above 1 is refused, not ignored.
* ``checkpoint_in_cpu`` (``cpu_checkpointing``) keeps the saved inputs in host memory and copies them
  back to their device for the recompute.
* ``contiguous_checkpointing`` (``contiguous_memory_optimization``) copies saved inputs into buffers
  preallocated once per (checkpoint slot, argument index); ``num_checkpoints``
  (``number_checkpoints``) slots can be alive at once. DeepSpeed's rules apply: it requires
  ``partition_activations`` and ``num_checkpoints``, and all checkpoints must have inputs of one size.
* ``synchronize`` (``synchronize_checkpoint_boundary``) synchronizes the accelerator at the start and
  end of each checkpoint's forward and recompute; ``profile`` logs both times (logger
  ``dscore.checkpointing``).

The settings are process-wide (as DeepSpeed's): ``checkpoint`` is called from inside a model's
``forward`` and has no engine handle. It is re-entrant autograd (an ``autograd.Function``, DeepSpeed's
``CheckpointFunction`` design), so module hooks run again during the recompute: under ZeRO stage 3 the
stage's forward hooks gather the parameters the recompute needs, and its gradient hooks see the
gradients the inner backward produces. Unlike torch's re-entrant checkpoint, outputs require grad even
when no input does (parameters inside ``fn`` still get gradients), so the first layer can be wrapped.
Under ``torch.no_grad()`` ``fn`` is simply called.

This module does not import torch; the autograd function lives in
:mod:`dscore_plugins.parallel.checkpointing.function`, ``checkpoint`` in the package.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dscore.errors import ConfigError, DscoreError

__all__ = [
    "CheckpointSettings",
    "CheckpointingError",
    "configure",
    "current",
    "is_configured",
    "reset",
    "set_num_layers",
    "settings",
]

log = logging.getLogger("dscore.checkpointing")


class CheckpointingError(DscoreError, RuntimeError):
    """Activation checkpointing cannot do what was asked (more live checkpoints than
    ``number_checkpoints``, inputs that do not fit the contiguous buffers, a second backward through a
    checkpoint whose contiguous slot was reused, model parallelism above 1 with partitioning)."""


@dataclass(frozen=True)
class CheckpointSettings:
    """The settings :func:`checkpoint` uses (field names are the ds_config keys).

    ``accelerator`` is a :class:`dscore.accelerator.Accelerator` (``get_rng_state``,
    ``set_rng_state``, ``synchronize``, ``device_type``) or ``None``: then the device module of the
    inputs' device (``torch.get_device_module``) is used, and nothing for CPU-only inputs.
    """

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    accelerator: Any = None


_settings = CheckpointSettings()
_configured = False
_generation = 0  # bumped by configure/reset: contiguous buffers of an older generation are dropped
_FUNCTION_MODULE = "dscore_plugins.parallel.checkpointing.function"


def settings() -> CheckpointSettings:
    """The settings in force (the defaults until :func:`configure` is called)."""
    return _settings


def current() -> tuple[CheckpointSettings, int]:
    """``(settings, buffer generation)`` in force: what a checkpoint taken now uses (the generation is bumped by
    :func:`configure`, :func:`reset` and :func:`set_num_layers`; contiguous buffers of older ones are dropped)."""
    return _settings, _generation


def is_configured() -> bool:
    """True once :func:`configure` has been called (DeepSpeed's ``is_configured``)."""
    return _configured


def _block_from(deepspeed_config: Any) -> Mapping[str, Any]:
    """The ``activation_checkpointing`` block of a ds_config given as a DscoreConfig, a section model, a
    dict (the whole config) or anything :func:`dscore.config.loader.read_source` reads (path, base64)."""
    from dscore_plugins.parallel.config_ac import ActivationCheckpointingConfig

    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config.model_dump()
    section = getattr(deepspeed_config, "activation_checkpointing", None)
    if isinstance(section, ActivationCheckpointingConfig):
        return section.model_dump()
    if isinstance(deepspeed_config, Mapping):
        data: Any = deepspeed_config
        name = "<dict>"
    else:
        from dscore.config.loader import read_source

        data, name, _ = read_source(deepspeed_config)
    from pydantic import ValidationError

    try:
        return ActivationCheckpointingConfig.model_validate(data.get("activation_checkpointing")).model_dump()
    except ValidationError as exc:
        first = exc.errors()[0]
        path = ".".join(["activation_checkpointing", *(str(p) for p in first["loc"])])
        raise ConfigError(f"{name}: {path}: {first['msg']}", path=path, source=name) from None


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
    *,
    accelerator: Any = None,
) -> None:
    """Configure activation checkpointing (DeepSpeed's ``deepspeed.checkpointing.configure``).

    As in DeepSpeed, settings start from the defaults, then the ``activation_checkpointing`` block of
    ``deepspeed_config`` (when given) applies, then every keyword that is not ``None`` overrides it.
    Contiguous buffers of an earlier configuration are dropped.

    Args:
        mpu_: DeepSpeed's model-parallel unit; dscore has no model parallelism. Accepted when its
            ``get_model_parallel_world_size()`` is 1 (or it has no such method).
        deepspeed_config: a :class:`dscore.config.DscoreConfig`, a ds_config dict, a path / base64 text,
            or an :class:`~dscore.config.ActivationCheckpointingConfig`.
        partition_activations: ``partition_activations`` (no effect at model-parallel size 1).
        contiguous_checkpointing: ``contiguous_memory_optimization``.
        num_checkpoints: ``number_checkpoints``.
        checkpoint_in_cpu: ``cpu_checkpointing``.
        synchronize: ``synchronize_checkpoint_boundary``.
        profile: ``profile``.
        accelerator: dscore only: the :class:`dscore.accelerator.Accelerator` whose RNG state is saved and
            restored and which is synchronized (``dscore.initialize`` passes the runtime's).

    Raises:
        ConfigError: the config block is invalid, a keyword has the wrong type, or the combination breaks
            DeepSpeed's rules (contiguous checkpointing without ``partition_activations`` or without
            ``num_checkpoints``); the path names the ds_config key.
        CheckpointingError: ``mpu_`` reports a model-parallel world size above 1 with partitioning on.
    """
    global _settings, _configured
    from dscore_plugins.parallel.config_ac import ActivationCheckpointingConfig

    values: dict[str, Any] = dict(_block_from(deepspeed_config)) if deepspeed_config is not None else {}
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    from pydantic import ValidationError

    try:
        block = ActivationCheckpointingConfig.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        path = ".".join(["activation_checkpointing", *(str(p) for p in first["loc"])])
        msg = str(first["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"configure: {path}: {msg}", path=path) from None
    mp_size = _model_parallel_size(mpu_)
    if block.partition_activations and mp_size > 1:
        raise CheckpointingError(
            f"partition_activations with a model-parallel world size of {mp_size}: dscore has no model-parallel "
            "group to partition saved activations across; pass mpu_=None or set partition_activations to false"
        )
    if block.partition_activations:
        log.info(
            "activation_checkpointing.partition_activations: model-parallel size is 1, so each rank keeps its "
            "whole saved inputs (as DeepSpeed at model-parallel size 1)"
        )
    _settings = CheckpointSettings(**block.model_dump(), accelerator=accelerator)
    _configured = True
    _drop_buffers()


def _drop_buffers() -> None:
    """Start a new buffer generation and let go of the idle contiguous buffers now (slots still held by
    un-back-propagated checkpoints keep their own buffers alive until then)."""
    global _generation
    _generation += 1
    impl = sys.modules.get(_FUNCTION_MODULE)  # not imported: the settings stay torch-free
    if impl is not None:
        impl._pools.clear()


def _model_parallel_size(mpu: Any) -> int:
    getter = getattr(mpu, "get_model_parallel_world_size", None) if mpu is not None else None
    return int(getter()) if callable(getter) else 1


def reset() -> None:
    """Drop the contiguous buffers (DeepSpeed's ``reset``); settings stay. Checkpoints already taken
    keep the buffers they hold until their backward."""
    _drop_buffers()


def set_num_layers(nlayers: int) -> None:
    """Set ``number_checkpoints`` (DeepSpeed's ``set_num_layers``) and drop the contiguous buffers.

    Raises:
        ConfigError: ``nlayers`` is not an integer >= 1 (path ``activation_checkpointing.number_checkpoints``).
    """
    global _settings
    if isinstance(nlayers, bool) or not isinstance(nlayers, int) or nlayers < 1:
        raise ConfigError(
            f"set_num_layers: activation_checkpointing.number_checkpoints must be an integer >= 1, got {nlayers!r}",
            path="activation_checkpointing.number_checkpoints",
        )
    _settings = replace(_settings, number_checkpoints=nlayers)
    _drop_buffers()


def _reset_for_tests() -> None:
    """Back to the unconfigured defaults (tests only)."""
    global _settings, _configured
    _settings = CheckpointSettings()
    _configured = False
    _drop_buffers()
