"""``deepspeed.module_inject``: DeepSpeed 0.19.8's module-injection package (AutoTP, AutoEP).

Its submodules import; their names raise :class:`deepspeed._not_provided.NotProvidedError` when used and say
what dscore offers instead: AutoTP is config-driven (``tensor_parallel.autotp_size``, or
:func:`dscore.parallel.autotp.tp_model_init`), AutoEP is :mod:`dscore.moe.autoep`. The kernel-injection
replacers of this package (``replace_transformer_layer``, ...) are DeepSpeed inference's, refused the same way.
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

__getattr__ = refused_module_getattr(
    __name__, "DeepSpeed's kernel-injection replacers are inference features dscore does not have; dscore's AutoTP "
    "is config-driven (tensor_parallel.autotp_size, dscore.parallel.autotp.tp_model_init)"
)
