"""``deepspeed``, provided by dscore: DeepSpeed's import paths mapped onto dscore's public API.

This is the compatibility distribution of dscore (``compat/deepspeed`` in the dscore repository). Code written
against DeepSpeed 0.19.8 - the Hugging Face ``Trainer``, Accelerate, TRL, Lightning's converter, user
scripts - imports ``deepspeed`` and runs on dscore. It is a thin skin: every behaviour lives in dscore; here
names are mapped and the values client libraries write are converted at the edge (see
:func:`dscore.config.client_values.convert_client_values`). What dscore does not implement is refused
with a dscore error, never imitated.

``__version__`` is the DeepSpeed version whose semantics dscore follows, with a local tag naming dscore
(``0.19.8+dscore0.1.0``); ``__dscore__`` is True so tools can tell this package from DeepSpeed.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from deepspeed import _refused_tree

try:
    __version__ = version("deepspeed")
except PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0.19.8+dscore"
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in __version__.split("+")[0].split(".")[:3])
__git_hash__ = None
__git_branch__ = None
__dscore__ = True

__all__ = [
    "DeepSpeedEngine",
    "__version__",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "compile",
    "init_distributed",
    "initialize",
    "ops",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]

# name -> "module:attribute" ("" = the module itself); resolved on first access so that
# `import deepspeed` stays as light as `import dscore` (transformers imports it at module level)
_LAZY: dict[str, str] = {
    "initialize": "deepspeed._initialize:initialize",
    "DeepSpeedEngine": "dscore.runtime.engine:DscoreEngine",
    "init_distributed": "deepspeed.comm:init_distributed",
    "tp_model_init": "dscore.parallel:tp_model_init",
    "add_config_arguments": "dscore.config:add_config_arguments",
    "comm": "deepspeed.comm:",
    "compile": "deepspeed.compile:",
    "zero": "deepspeed.zero:",
    "ops": "deepspeed.ops:",
    "runtime": "deepspeed.runtime:",
    "utils": "deepspeed.utils:",
    "accelerator": "deepspeed.accelerator:",
    "checkpoint": "deepspeed.checkpoint:",
    "checkpointing": "deepspeed.checkpointing:",
    "launcher": "deepspeed.launcher:",
    "get_accelerator": "deepspeed.accelerator:get_accelerator",
    "DeepSpeedConfig": "deepspeed.runtime.config:DeepSpeedConfig",
    "DeepSpeedConfigError": "deepspeed.runtime.config:DeepSpeedConfigError",
    # DeepSpeed 0.19.8 re-exports these from subpackages dscore refuses (deepspeed._refused_tree)
    "DeepSpeedTransformerLayer": "deepspeed.ops.transformer:DeepSpeedTransformerLayer",
    "DeepSpeedTransformerConfig": "deepspeed.ops.transformer:DeepSpeedTransformerConfig",
    "InferenceEngine": "deepspeed.inference.engine:InferenceEngine",
    "DeepSpeedInferenceConfig": "deepspeed.inference.config:DeepSpeedInferenceConfig",
}
# top-level names of DeepSpeed 0.19.8 whose feature dscore lacks: refused when used (deepspeed._not_provided)
_REFUSED: dict[str, str] = {
    "init_inference": _refused_tree.refused_reason("deepspeed.inference") or "",
    "OnDevice": "DeepSpeed's OnDevice (build a module's parameters on a device or the meta device) is not provided: "
    "build the model under deepspeed.zero.Init to partition it at construction, or with torch.device('meta') "
    "as a context manager",
}


# DeepSpeed 0.19.8's subpackages whose feature dscore lacks import as refuse-on-use stand-ins
_refused_tree.install()


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None and name in _REFUSED:
        from deepspeed._not_provided import not_provided

        globals()[name] = value = not_provided(f"deepspeed.{name}", _REFUSED[name])
        return value
    if target is None:
        raise AttributeError(
            f"module 'deepspeed' (dscore's compatibility layer) has no attribute {name!r}; dscore provides "
            "the DeepSpeed API that Hugging Face Trainer, Accelerate, TRL and Lightning use (see dscore's "
            "README, 'Coming from DeepSpeed')"
        )
    module_name, _, attr = target.partition(":")
    module = import_module(module_name)
    value = getattr(module, attr) if attr else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
