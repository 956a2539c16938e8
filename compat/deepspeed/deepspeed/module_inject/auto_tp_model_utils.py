"""``deepspeed.module_inject.auto_tp_model_utils``: DeepSpeed's AutoTP model helpers (alibi).

dscore does not provide this module's feature; each name imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: DeepSpeed's AutoTP model helpers are not provided; dscore's AutoTP is config-driven (tensor_parallel.autotp_size in the config, or dscore.parallel.autotp.tp_model_init) and its layers are dscore.parallel.tp_layers
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(__name__, "DeepSpeed's AutoTP model helpers are not provided; dscore's AutoTP is config-driven (tensor_parallel.autotp_size in the config, or dscore.parallel.autotp.tp_model_init) and its layers are dscore.parallel.tp_layers")
