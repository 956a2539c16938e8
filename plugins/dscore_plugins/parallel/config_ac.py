"""The ``activation_checkpointing`` section: settings of :mod:`dscore.checkpointing` (torch-free).

Keys and defaults are DeepSpeed 0.19.8's (``deepspeed/runtime/activation_checkpointing/config.py``):
``partition_activations`` false, ``contiguous_memory_optimization`` false, ``cpu_checkpointing`` false,
``number_checkpoints`` null, ``synchronize_checkpoint_boundary`` false, ``profile`` false. A ``null``
block means the defaults.

The cross-key rules are DeepSpeed's ``configure`` assertions, reported at the key that is missing:
``contiguous_memory_optimization: true`` needs ``partition_activations: true`` and an integer
``number_checkpoints``. dscore additionally refuses what DeepSpeed would accept but cannot honour:
unknown keys, non-boolean flags and a ``number_checkpoints`` below 1.

``partition_activations`` splits the saved inputs of each checkpoint across the *model-parallel* group.
Without AutoTP that group has size 1, and at size 1 DeepSpeed's partition is the whole tensor, so the flag
is accepted and changes nothing about what is saved; it is still the switch
``contiguous_memory_optimization`` requires, as in DeepSpeed. With ``tensor_parallel.autotp_size > 1``
``dscore.initialize`` refuses it (the split is not implemented).
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictBool, ValidationInfo, field_validator, model_validator

from dscore.config.base import PositiveInt, SectionModel

__all__ = ["ActivationCheckpointingConfig"]


class ActivationCheckpointingConfig(SectionModel):
    """``activation_checkpointing``: how :func:`dscore.checkpointing.checkpoint` saves and recomputes.

    ``dscore.initialize`` applies the block with :func:`dscore.checkpointing.configure` when the config
    contains it (a config without the block leaves an earlier ``configure`` call in force).
    """

    partition_activations: StrictBool = False
    """Split each checkpoint's saved inputs across the model-parallel group. dscore's model-parallel
    size is 1, where the partition is the whole tensor (as DeepSpeed at size 1): no memory effect.
    Required by ``contiguous_memory_optimization``."""
    number_checkpoints: PositiveInt | None = None
    """Checkpoints alive at once in a forward (usually the number of checkpointed layers); sizes the
    contiguous buffers. Required with ``contiguous_memory_optimization``."""
    contiguous_memory_optimization: StrictBool = False
    """Copy each checkpoint's saved inputs into preallocated buffers, one per checkpoint slot (up to
    ``number_checkpoints`` alive at once), against fragmentation. Needs homogeneous checkpoints (same
    input sizes), ``partition_activations: true`` and ``number_checkpoints``."""
    cpu_checkpointing: StrictBool = False
    """Move the saved inputs to host memory in the forward and back to the device for the recompute."""
    synchronize_checkpoint_boundary: StrictBool = False
    """Synchronize the accelerator at the start and end of every checkpoint's forward and recompute."""
    profile: StrictBool = False
    """Log the forward and the recompute+backward time of every checkpoint (logger
    ``dscore.checkpointing``, level INFO; synchronizes the accelerator around each)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_defaults(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("contiguous_memory_optimization")
    @classmethod
    def _needs_partition(cls, value: bool, info: ValidationInfo) -> bool:
        # number_checkpoints is declared first so that it is in info.data here
        if value and info.data.get("partition_activations") is False:
            raise ValueError(
                "true requires activation_checkpointing.partition_activations: true (as DeepSpeed: the "
                "contiguous buffers hold the partitioned activations); set partition_activations to true"
            )
        if value and info.data.get("number_checkpoints", 0) is None:
            raise ValueError(
                "true requires activation_checkpointing.number_checkpoints: the number of checkpoints alive in "
                "one forward (e.g. the number of checkpointed layers), an integer >= 1, as DeepSpeed"
            )
        return value
