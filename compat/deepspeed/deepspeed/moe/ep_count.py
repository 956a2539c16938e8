"""``deepspeed.moe.ep_count``: DeepSpeed's AutoEP token counting.

dscore does not provide this module's feature; each name imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: DeepSpeed's AutoEP token counting is not provided; dscore's MoE is deepspeed.moe.layer.MoE (dscore.moe.layer.MoE) and AutoEP (dscore.moe.autoep)
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(__name__, "DeepSpeed's AutoEP token counting is not provided; dscore's MoE is deepspeed.moe.layer.MoE (dscore.moe.layer.MoE) and AutoEP (dscore.moe.autoep)")
