"""``deepspeed.module_inject.layers``: DeepSpeed's AutoTP layer classes.

``GatherReplacedLayerParams`` is dscore's (:class:`dscore.parallel.tp_layers.GatherReplacedLayerParams`: the
full tensors of AutoTP-split parameters inside the context). dscore does not provide the rest of this module;
each other name imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: DeepSpeed's AutoTP layer classes are not provided; dscore's AutoTP is config-driven (tensor_parallel.autotp_size in the config, or dscore.parallel.autotp.tp_model_init) and its layers are dscore.parallel.tp_layers
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr
from dscore.parallel.tp_layers import GatherReplacedLayerParams

__all__ = ["GatherReplacedLayerParams"]

__getattr__ = refused_module_getattr(__name__, "DeepSpeed's AutoTP layer classes are not provided; dscore's AutoTP is config-driven (tensor_parallel.autotp_size in the config, or dscore.parallel.autotp.tp_model_init) and its layers are dscore.parallel.tp_layers")
