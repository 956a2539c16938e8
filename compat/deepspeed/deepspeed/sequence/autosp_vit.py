"""``deepspeed.sequence.autosp_vit``: DeepSpeed's AutoSP ViT attention.

dscore does not provide this module's feature; each name imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: dscore has no AutoSP ViT attention; dscore's sequence parallelism is Ulysses (deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF, dscore.parallel.ulysses)
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(__name__, "dscore has no AutoSP ViT attention; dscore's sequence parallelism is Ulysses (deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF, dscore.parallel.ulysses)")
