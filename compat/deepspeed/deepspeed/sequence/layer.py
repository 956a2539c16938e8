"""``deepspeed.sequence.layer``: DeepSpeed's ``DistributedAttention`` and its all-to-all helpers.

dscore does not provide this module's feature; each name imports and raises
:class:`deepspeed._not_provided.NotProvidedError` when used: DeepSpeed's DistributedAttention wrapper is not provided; dscore's sequence parallelism is Ulysses (deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF, dscore.parallel.ulysses), whose seq_to_heads / heads_to_seq are the all-to-alls
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(__name__, "DeepSpeed's DistributedAttention wrapper is not provided; dscore's sequence parallelism is Ulysses (deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF, dscore.parallel.ulysses), whose seq_to_heads / heads_to_seq are the all-to-alls")
