"""The ``pipeline`` ds_config section (torch-free), owned by the built-in engine plugin.

Keys and defaults are DeepSpeed 0.19.8's: ``stages`` ``"auto"``, ``partition`` ``"best"``,
``seed_layers`` false, ``activation_checkpoint_interval`` 0, ``pipe_partitioned`` true,
``grad_partitioned`` true. The model (a :class:`dscore.pipe.PipelineModule`) is what defines the
pipeline; the block is checked against it by the pipeline engine:

* ``stages``: ``"auto"`` takes the module's ``num_stages``; an integer must equal it.
* ``partition``: ``"best"`` takes the module's ``partition_method``; another value must equal it.
* ``seed_layers``: ``true`` requires a module built with ``seed_layers=True`` (layers are built before the
  engine exists, so the engine cannot reseed them afterwards).
* ``activation_checkpoint_interval``: a value > 0 sets the module's interval when the module has none;
  two different non-zero values are refused.
* ``pipe_partitioned`` / ``grad_partitioned``: split activations / gradients sent between stages across
  the tensor-parallel group. dscore has no tensor parallelism (size 1), where the split is the whole
  tensor: accepted, no effect.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, StrictBool, StrictStr

from dscore.config.base import PositiveInt, SectionModel, no_effect

_TP1 = "dscore has no tensor parallelism (size 1), where the split is the whole tensor"

__all__ = ["PipelineConfig"]


class PipelineConfig(SectionModel):
    """``pipeline``: pipeline-parallel settings, checked against the ``PipelineModule``."""

    stages: PositiveInt | Literal["auto"] = "auto"
    """Number of pipeline stages; ``"auto"`` = the module's ``num_stages``."""
    partition: StrictStr = "best"
    """Partition method; ``"best"`` = the module's ``partition_method``."""
    seed_layers: StrictBool = False
    """Layers are seeded with ``base_seed + index`` before being built (must match the module)."""
    activation_checkpoint_interval: NonNegativeInt = 0
    """Layers per activation-checkpointed chunk (0 = the module's setting)."""
    pipe_partitioned: StrictBool = Field(True, json_schema_extra=no_effect(_TP1))
    """Split activations across the tensor-parallel group (size 1 in dscore: no effect)."""
    grad_partitioned: StrictBool = Field(True, json_schema_extra=no_effect(_TP1))
    """Split gradients across the tensor-parallel group (size 1 in dscore: no effect)."""
