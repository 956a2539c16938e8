"""``deepspeed.runtime.zero.parameter_offload``: DeepSpeed 0.19.8's ZeRO-3 internals of this module import and raise
:class:`deepspeed._not_provided.NotProvidedError` when used. dscore's counterpart is public: the ``zero_stage:stage3`` unit (``engine.zero_stage_impl``).
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(
    __name__, "a DeepSpeed ZeRO-3 internal; dscore's stage 3 is the zero_stage:stage3 plugin unit (engine.zero_stage_impl)"
)
