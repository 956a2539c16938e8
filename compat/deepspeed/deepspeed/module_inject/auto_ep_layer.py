"""``deepspeed.module_inject.auto_ep_layer``: DeepSpeed's AutoEP MoE layer and its routing helpers.

dscore does not provide this module's DeepSpeed objects; each name imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: dscore's AutoEP layer is
``dscore.moe.autoep.AutoEPMoELayer``, built by ``dscore.moe.autoep.apply_autoep`` from the expert_parallel config
block (its constructor and split plans are dscore's own).
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(
    __name__, "DeepSpeed's AutoEP layer objects are not provided; dscore's AutoEP is dscore.moe.autoep (apply_autoep, "
    "AutoEPMoELayer) driven by the expert_parallel config block"
)
