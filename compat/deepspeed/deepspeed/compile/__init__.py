"""``deepspeed.compile``: DeepSpeed 0.19.8's DeepCompile modules, whose feature dscore does not have.

dscore refuses the ``compile.deepcompile`` config key (``docs/config-keys.md``). Here DeepCompile's module
layout imports, ``util.is_deepcompile_supported()`` answers False, and every other name is a stand-in that
raises :class:`deepspeed._not_provided.NotProvidedError` when used (never at import).
"""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr

REASON = ("dscore has no DeepCompile (the compile.deepcompile config key is refused); use torch.compile "
          "on the model before deepspeed.initialize")

__getattr__ = refused_module_getattr(__name__, REASON)
