"""``deepspeed.compile.passes.contract``: part of DeepSpeed 0.19.8's DeepCompile, not provided by dscore (see :mod:`deepspeed.compile`)."""

from __future__ import annotations

from deepspeed._not_provided import refused_module_getattr
from deepspeed.compile import REASON

__getattr__ = refused_module_getattr(__name__, REASON)
