"""``deepspeed.runtime.zero.offload_states``: DeepSpeed 0.19.8's ZeRO-3 internals of this module import and raise
:class:`deepspeed._not_provided.NotProvidedError` when used. dscore's counterpart is public: ``engine.offload_states`` / ``reload_states`` (:mod:`dscore.runtime.offload_states`).
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(
    __name__, "a DeepSpeed ZeRO-3 internal; use engine.offload_states(include=...) / engine.reload_states()"
)
