"""``deepspeed.runtime.zero.leaf_module_config``: the defaults of ``zero_optimization.leaf_module`` and its
model, ``DeepSpeedZeroLeafModuleConfig`` (dscore's, the same fields: ``classes``, ``names``, ``name_suffixes``)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",  # noqa: F822 - dscore's defaults, read from its model on first access
    "DEFAULT_LEAF_MODULE_NAMES",  # noqa: F822
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",  # noqa: F822
    "DeepSpeedZeroLeafModuleConfig",  # noqa: F822
]

_DEFAULTS = {"DEFAULT_LEAF_MODULE_CLASSES": "classes", "DEFAULT_LEAF_MODULE_NAMES": "names",
             "DEFAULT_LEAF_MODULE_NAME_SUFFIXES": "name_suffixes"}


def __getattr__(name: str) -> Any:
    from deepspeed.runtime._sections import field_model

    model = field_model("zero_optimization", "leaf_module")
    if name == "DeepSpeedZeroLeafModuleConfig":
        value = model
    elif name in _DEFAULTS:
        value = list(getattr(model(), _DEFAULTS[name]))
    else:
        raise AttributeError(f"deepspeed.runtime.zero.leaf_module_config.{name} is not provided by dscore's "
                             "compatibility layer")
    globals()[name] = value
    return value
