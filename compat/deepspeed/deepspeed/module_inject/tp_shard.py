"""``deepspeed.module_inject.tp_shard``: DeepSpeed's AutoTP shard-size helpers.

dscore does not provide this module's feature; each name imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: DeepSpeed's module-level shard-size state is not provided; dscore's AutoTP is config-driven (tensor_parallel.autotp_size in the config, or dscore.parallel.autotp.tp_model_init) and its layers are dscore.parallel.tp_layers
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(__name__, "DeepSpeed's module-level shard-size state is not provided; dscore's AutoTP is config-driven (tensor_parallel.autotp_size in the config, or dscore.parallel.autotp.tp_model_init) and its layers are dscore.parallel.tp_layers")
