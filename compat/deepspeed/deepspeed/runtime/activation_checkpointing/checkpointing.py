"""``deepspeed.runtime.activation_checkpointing.checkpointing`` on :mod:`dscore.checkpointing`.

``checkpoint(function, *args)``, ``configure(...)`` (DeepSpeed's argument names: ``mpu_``,
``deepspeed_config``, ``partition_activations``, ``contiguous_checkpointing``, ``num_checkpoints``,
``checkpoint_in_cpu``, ``synchronize``, ``profile``), ``is_configured()``, ``reset()`` and
``set_num_layers(n)`` are dscore's process-wide activation checkpointing (the same object
``deepspeed.checkpointing`` exposes). ``non_reentrant_checkpoint`` is ``checkpoint`` (dscore has one
recompute-in-backward function; its gradients are the same for either of DeepSpeed's spellings).
DeepSpeed's model-parallel RNG tracker (``get_cuda_rng_tracker``, ``model_parallel_cuda_manual_seed``,
``CudaRNGStatesTracker``), its autograd function class ``CheckpointFunction`` and its activation
partitioning helpers are not provided: they import, and raise :class:`NotProvidedError` when used.
"""

from __future__ import annotations

# ruff: noqa: F822 - the provided names of __all__ resolve through __getattr__ (on first use)
from typing import Any

from deepspeed._not_provided import not_provided

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset", "set_num_layers"]

_PROVIDED = ("checkpoint", "configure", "is_configured", "reset", "set_num_layers")

_REASONS = {
    "CheckpointFunction": "dscore's recompute function is internal; call checkpoint(function, *args)",
    "CudaRNGStatesTracker": "dscore has no model-parallel RNG tracker; checkpoint replays the forward's RNG state "
                            "(torch and the device's) in backward",
    "get_cuda_rng_tracker": "dscore has no model-parallel RNG tracker; checkpoint replays the forward's RNG state",
    "model_parallel_cuda_manual_seed": "dscore has no model-parallel RNG tracker; seed with torch.manual_seed",
    "model_parallel_reconfigure_tp_seed": "dscore has no model-parallel RNG tracker",
    "partition_activations_in_checkpoint": "set partition_activations with configure(...) or the "
                                           "activation_checkpointing config block",
    "detach_variable": "a DeepSpeed-internal helper of its checkpoint function",
    "get_partition_start": "a DeepSpeed-internal helper of activation partitioning",
    "get_partition_size": "a DeepSpeed-internal helper of activation partitioning",
    "gather_partitioned_activations": "a DeepSpeed-internal helper of activation partitioning",
    "extract_tensors": "a DeepSpeed-internal helper of its checkpoint function",
    "merge_tensors": "a DeepSpeed-internal helper of its checkpoint function",
    "is_activation_to_checkpoint": "a DeepSpeed-internal helper of its checkpoint function",
    "partition_activations": "a DeepSpeed-internal helper of activation partitioning",
}
globals().update({name: not_provided(f"{__name__}.{name}", why) for name, why in _REASONS.items()})


def __getattr__(name: str) -> Any:
    # resolved on first use, so importing this module needs no registry lookup (as dscore.checkpointing)
    import dscore.checkpointing as impl

    if name in _PROVIDED:
        value = getattr(impl, name)
    elif name == "non_reentrant_checkpoint":
        value = impl.checkpoint
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (DeepSpeed 0.19.8 has none either, "
                             "or dscore's compatibility layer does not list it)")
    globals()[name] = value
    return value
