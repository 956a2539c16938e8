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

__all__ = ["HybridEngineConfig", "PipelineConfig"]


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


class HybridEngineConfig(SectionModel):
    """``hybrid_engine``: the RLHF engine (training plus ``engine.generate``), DeepSpeed 0.19.8's keys and defaults.

    ``enabled`` selects the hybrid engine (:mod:`dscore_plugins.engine.hybrid`) for any ``torch.nn.Module``
    that is not a pipeline model (a pipeline model with this block enabled is refused). What each key does in
    dscore is stated on the field.
    """

    enabled: StrictBool = False
    """Build the hybrid engine (``engine.generate``, eval/train switching, latency counters)."""
    max_out_tokens: PositiveInt = 512
    """Most tokens one sequence may hold in a ``generate`` call (prompt plus new tokens); more is an error."""
    inference_tp_size: PositiveInt = 1
    """Tensor-parallel ranks generating together; dscore generates on each rank's whole model: only 1."""
    release_inference_cache: StrictBool = False
    """After each ``generate``: drop the KV cache from the returned output and free cached device memory."""
    pin_parameters: StrictBool = True
    """ZeRO-3: gather every parameter once per ``generate`` call (false: per layer, per forward, with prefetch)."""
    tp_gather_partition_size: PositiveInt = Field(
        8,
        json_schema_extra=no_effect(
            "DeepSpeed reads it only with inference_tp_size > 1 (layers gathered that many at a time), "
            "which dscore refuses"
        ),
    )
    """Layers gathered at a time for tensor-parallel inference (only with ``inference_tp_size > 1``)."""
    enable_cuda_graph: StrictBool = False
    """Capture decode steps in CUDA graphs: refused (off-GPU it cannot run; on GPU dscore does not capture)."""
