"""Pipeline parallelism (DeepSpeed's ``deepspeed.pipe``).

``PipelineModule(layers=[...], num_stages=N, loss_fn=...)`` describes the model as layers cut into
stages; ``dscore.initialize(model=pipeline_module, config=...)`` then returns the pipeline engine (a
plugin selected by the model's type) with ``train_batch(data_iter)`` and ``eval_batch(data_iter)``.
See :mod:`dscore.pipe.module` (the model), :mod:`dscore.pipe.topology` (pipe x data groups),
:mod:`dscore.pipe.schedule` (1F1B), :mod:`dscore.pipe.p2p` (activation transfer) and
:mod:`dscore.pipe.checkpoint` (per-layer checkpoints).

Importing this package imports torch.
"""

from __future__ import annotations

from dscore.pipe.checkpoint import layer_state_dicts, load_into_layers
from dscore.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from dscore.pipe.p2p import PipelineError
from dscore.pipe.topology import PipeDataParallelTopology, PipelineGrid, ProcessTopology

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipelineError",
    "PipelineGrid",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
    "layer_state_dicts",
    "load_into_layers",
]
