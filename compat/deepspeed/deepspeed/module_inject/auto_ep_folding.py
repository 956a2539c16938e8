"""``deepspeed.module_inject.auto_ep_folding``: DeepSpeed's AutoEP x AutoTP folding.

dscore does not provide this module's feature; each name imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: DeepSpeed's AutoEP x AutoTP folding objects are not provided; dscore's AutoEP is dscore.moe.autoep (apply_autoep, AutoEPMoELayer, PRESETS) driven by the expert_parallel config block
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(__name__, "DeepSpeed's AutoEP x AutoTP folding objects are not provided; dscore's AutoEP is dscore.moe.autoep (apply_autoep, AutoEPMoELayer, PRESETS) driven by the expert_parallel config block")
