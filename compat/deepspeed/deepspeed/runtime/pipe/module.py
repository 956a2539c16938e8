"""``deepspeed.runtime.pipe.module``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` on :mod:`dscore.pipe`.

``LayerSpec`` and ``TiedLayerSpec`` are dscore's. ``PipelineModule`` is dscore's with DeepSpeed 0.19.8's
signature: its extra argument ``dynamic_shape`` (variable activation shapes between micro-batches) is taken
as ``False`` (dscore exchanges activation shapes once and raises a clear ``PipelineError`` when a later
micro-batch's shapes differ); ``dynamic_shape=True`` is refused with :class:`NotProvidedError`.
``deepspeed.initialize(model=pipeline_module, ...)`` returns dscore's pipeline engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from deepspeed._not_provided import NotProvidedError
from dscore.pipe import LayerSpec, ProcessTopology, TiedLayerSpec
from dscore.pipe import PipelineModule as _DscorePipelineModule

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


class PipelineModule(_DscorePipelineModule):
    """DeepSpeed's ``PipelineModule(layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False,
    seed_fn=None, base_seed=1234, partition_method='parameters', activation_checkpoint_interval=0,
    activation_checkpoint_func=checkpoint, checkpointable_layers=None, dynamic_shape=False)``.

    The arguments are :class:`dscore.pipe.PipelineModule`'s (see it for their meaning and errors), plus
    ``dynamic_shape``.

    Raises:
        NotProvidedError: ``dynamic_shape=True``.
        ConfigError / DistributedError: as :class:`dscore.pipe.PipelineModule`.
    """

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        if dynamic_shape:
            raise NotProvidedError(
                "deepspeed.pipe.PipelineModule(dynamic_shape=True) (DeepSpeed 0.19.8) is not provided by dscore: "
                "its pipeline engine exchanges activation shapes once per batch; pad micro-batches to one shape "
                "and pass dynamic_shape=False"
            )
        super().__init__(
            layers, num_stages=num_stages, topology=topology, loss_fn=loss_fn, seed_layers=seed_layers,
            seed_fn=seed_fn, base_seed=base_seed, partition_method=partition_method,
            activation_checkpoint_interval=activation_checkpoint_interval,
            activation_checkpoint_func=activation_checkpoint_func, checkpointable_layers=checkpointable_layers,
        )
        self.dynamic_shape = False
