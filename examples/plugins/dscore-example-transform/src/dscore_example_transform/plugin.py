"""Manifest (torch-free): the ``freeze`` config section and the ``freeze`` model transform."""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, ModelTransformSpec

__all__ = ["dscore_register_config_sections", "dscore_register_model_transforms"]


@hookimpl
def dscore_register_config_sections() -> list[ConfigSectionSpec]:
    """``freeze``: which parameters to freeze."""
    return [
        ConfigSectionSpec(
            name="freeze",
            model="dscore_example_transform.config:FreezeConfig",
            description="freeze parameters matching patterns (example transform)",
        )
    ]


@hookimpl
def dscore_register_model_transforms() -> list[ModelTransformSpec]:
    """``freeze``, run before the built-in transforms."""
    return [
        ModelTransformSpec(
            name="freeze",
            transform="dscore_example_transform.transform:FreezeTransform",
            config_key="freeze",
            order=50,
            description="freeze the parameters whose names match freeze.patterns",
        )
    ]
