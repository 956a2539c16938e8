"""Pipeline parallelism (DeepSpeed's ``deepspeed.pipe``).

``PipelineModule(layers=[...], num_stages=N, loss_fn=...)`` describes the model as layers cut into
stages; ``dscore.initialize(model=pipeline_module, config=...)`` then returns the pipeline engine (the
engine plugin's ``pipeline`` unit, selected by the model's type) with ``train_batch(data_iter)`` and
``eval_batch(data_iter)``. The model definition lives here, in the core: :mod:`dscore.pipe.module` (the
model), :mod:`dscore.pipe.topology` (pipe x data groups), :mod:`dscore.pipe.partition` (layer
partitioning), :mod:`dscore.pipe.errors`. The machinery that runs it — the 1F1B schedule, the
point-to-point activation transfer and the per-layer checkpoints — is the pipeline engine plugin's.

``layer_state_dicts`` and ``load_into_layers`` (read a pipeline checkpoint, e.g. into a plain model) are
thin names: on first access they resolve through the ``exports`` module of the ``engine`` unit
``pipeline`` in the registry (:mod:`dscore.exports`), so with that unit disabled
(``DSCORE_DISABLE_PLUGINS=engine:pipeline``) importing them raises the registry's error naming it.

Importing this package imports torch.
"""

from __future__ import annotations

from dscore.exports import thin_getattr
from dscore.pipe.errors import PipelineError
from dscore.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from dscore.pipe.topology import PipeDataParallelTopology, PipelineGrid, ProcessTopology

#: The names provided by the pipeline engine unit's ``exports`` module.
_PROVIDED = ("layer_state_dicts", "load_into_layers")

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipelineError",
    "PipelineGrid",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
    *_PROVIDED,
]

__getattr__ = thin_getattr(__name__, "engine", "pipeline", _PROVIDED)
