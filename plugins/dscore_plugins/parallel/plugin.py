"""Manifest of the built-in ``parallel`` plugin (torch-free: specs only).

Model transforms, run by ``dscore.initialize`` in ascending ``order``:

* ``autotp`` (100): AutoTP training, owns ``tensor_parallel`` (the ``tp`` mesh dimension);
* ``autoep`` (200): AutoEP, owns ``expert_parallel``;
* ``ulysses`` (300): Ulysses sequence parallelism over the ``sp`` mesh dimension (``sequence_parallel_size``
  is a core key: the mesh and the batch triangle read it);
* ``activation_checkpointing`` (400): applies the ``activation_checkpointing`` block to ``dscore.checkpointing``.

Each unit's ``exports`` module holds the user-facing names a thin core module re-exports
(``dscore.parallel.autotp``, ``dscore.moe.autoep``, ``dscore.parallel.ulysses``, ``dscore.checkpointing``; the
section models behind ``dscore.config.parallel`` / ``expert_parallel`` / ``activation_checkpointing``).
"""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, ModelTransformSpec

__all__ = [
    "CONFIG_SECTIONS",
    "MODEL_TRANSFORMS",
    "dscore_register_config_sections",
    "dscore_register_model_transforms",
]

_PKG = "dscore_plugins.parallel"

CONFIG_SECTIONS: tuple[ConfigSectionSpec, ...] = (
    ConfigSectionSpec(
        name="tensor_parallel",
        model=f"{_PKG}.config_tp:TensorParallelConfig",
        exports=f"{_PKG}.config_tp",
        description="AutoTP training: Linear layers split over a tensor-parallel group (dscore.parallel.autotp)",
    ),
    ConfigSectionSpec(
        name="expert_parallel",
        model=f"{_PKG}.config_ep:ExpertParallelConfig",
        exports=f"{_PKG}.config_ep",
        description="AutoEP: Hugging Face MoE blocks made expert-parallel (dscore.moe.autoep)",
    ),
    ConfigSectionSpec(
        name="activation_checkpointing",
        model=f"{_PKG}.config_ac:ActivationCheckpointingConfig",
        exports=f"{_PKG}.config_ac",
        description="Settings of dscore.checkpointing.checkpoint (applied by dscore.initialize)",
    ),
)

MODEL_TRANSFORMS: tuple[ModelTransformSpec, ...] = (
    ModelTransformSpec(
        name="autotp",
        transform=f"{_PKG}.transforms:AutoTPTransform",
        config_key="tensor_parallel",
        order=100,
        mesh_dims=("tp",),
        exports=f"{_PKG}.autotp",
        description="AutoTP: split Linear/embedding layers over the tensor-parallel group, exact clipping",
    ),
    ModelTransformSpec(
        name="autoep",
        transform=f"{_PKG}.transforms:AutoEPTransform",
        config_key="expert_parallel",
        order=200,
        exports=f"{_PKG}.autoep",
        description="AutoEP: Hugging Face MoE blocks made expert-parallel over the data-parallel ranks",
    ),
    ModelTransformSpec(
        name="ulysses",
        transform=f"{_PKG}.transforms:UlyssesTransform",
        order=300,
        mesh_dims=("sp",),
        exports=f"{_PKG}.ulysses",
        description="Ulysses sequence parallelism: all-to-all attention over sequence_parallel_size ranks",
    ),
    ModelTransformSpec(
        name="activation_checkpointing",
        transform=f"{_PKG}.transforms:ActivationCheckpointingTransform",
        config_key="activation_checkpointing",
        order=400,
        exports=f"{_PKG}.checkpointing",
        description="activation checkpointing: the activation_checkpointing block applied to dscore.checkpointing",
    ),
)


@hookimpl
def dscore_register_config_sections() -> tuple[ConfigSectionSpec, ...]:
    """``tensor_parallel``, ``expert_parallel`` and ``activation_checkpointing``."""
    return CONFIG_SECTIONS


@hookimpl
def dscore_register_model_transforms() -> tuple[ModelTransformSpec, ...]:
    """AutoTP, AutoEP, Ulysses and activation checkpointing."""
    return MODEL_TRANSFORMS
