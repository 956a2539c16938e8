"""dscore: a DeepSpeed-style distributed training runtime for PyTorch, built as a plugin registry.

The public surface mirrors DeepSpeed's::

    engine, optimizer, dataloader, lr_scheduler = dscore.initialize(args=args, model=model,
                                                                    model_parameters=model.parameters())

``import dscore`` imports neither torch nor any plugin: the heavy names below are resolved lazily on
first attribute access.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from dscore.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "hookimpl",
    "initialize",
    "init_distributed",
    "add_config_arguments",
    "zero",
    "comm",
    "checkpointing",
    "pipe",
    "parallel",
    "tp_model_init",
]

# name -> "module:attribute" (attribute "" means the module itself)
_LAZY: dict[str, str] = {
    "initialize": "dscore.runtime.initialize:initialize",
    "add_config_arguments": "dscore.config.arguments:add_config_arguments",
    "init_distributed": "dscore.comm.init:init_distributed",
    "zero": "dscore.zero:",
    "comm": "dscore.comm:",
    "checkpointing": "dscore.checkpointing:",
    "pipe": "dscore.pipe:",
    "parallel": "dscore.parallel:",
    "tp_model_init": "dscore.parallel.autotp:tp_model_init",
}

if TYPE_CHECKING:  # pragma: no cover
    from dscore import checkpointing, comm, parallel, pipe, zero
    from dscore.comm.init import init_distributed
    from dscore.config.arguments import add_config_arguments
    from dscore.parallel.autotp import tp_model_init
    from dscore.runtime.initialize import initialize


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'dscore' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    module = import_module(module_name)
    value = getattr(module, attr) if attr else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
