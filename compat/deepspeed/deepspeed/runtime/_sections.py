"""dscore's registered ds_config section models, looked up by their key (``zero_optimization``, ``fp16``, ...).

DeepSpeed's config classes (``DeepSpeedZeroConfig``, ``DeepSpeedFP16Config``, ...) are dscore's section models
of the same keys, found through :func:`dscore.config.build_config_model` so a plugin that replaces a section
also replaces the DeepSpeed name.
"""

from __future__ import annotations

import functools
import typing
from typing import Any

__all__ = ["field_model", "section_model"]


@functools.cache
def section_model(key: str) -> Any:
    """The pydantic model class of ds_config section ``key``.

    Raises:
        dscore.errors.ConfigError: no installed plugin registers that section.
    """
    from dscore.config import build_config_model
    from dscore.errors import ConfigError
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    _, sections = build_config_model(Registry(create_plugin_manager()))
    if key not in sections:
        raise ConfigError(f"ds_config section {key!r} is not registered by any installed dscore plugin "
                          f"(registered: {sorted(sections)})")
    return sections[key].model


def field_model(key: str, field: str) -> Any:
    """The model class of a nested field (``field_model("zero_optimization", "offload_param")``), without
    its ``| None``."""
    annotation = section_model(key).model_fields[field].annotation
    models = [a for a in (typing.get_args(annotation) or (annotation,)) if isinstance(a, type) and a is not type(None)]
    return models[0]
