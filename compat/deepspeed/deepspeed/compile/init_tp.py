"""``deepspeed.compile.init_tp``: part of DeepSpeed 0.19.8's DeepCompile, not provided by dscore (see
:mod:`deepspeed.compile`). ``AUTOTP_MIN_TORCH_VERSION`` is 0.19.8's constant (the oldest torch its AutoTP compile
pass accepts), kept as a fact; every other name is refused when used."""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr
from deepspeed.compile import REASON

AUTOTP_MIN_TORCH_VERSION = 2.6

__getattr__ = refused_module_getattr(__name__, REASON)
