"""``deepspeed.runtime.precision_config``: ``DeepSpeedFP16Config`` / ``DeepSpeedBF16Config`` (dscore's models of
the ``fp16`` / ``bf16`` sections: DeepSpeed 0.19.8's fields and defaults) and ``get_fp16_config`` /
``get_bfloat16_config`` (the section of a ds_config dict, validated; ``bfloat16`` is accepted for ``bf16``)."""

from __future__ import annotations

from typing import Any

__all__ = ["DeepSpeedBF16Config", "DeepSpeedFP16Config", "get_bfloat16_config", "get_fp16_config"]  # noqa: F822


def get_fp16_config(param_dict: dict[str, Any]) -> Any:
    """``param_dict["fp16"]`` as a ``DeepSpeedFP16Config`` (defaults when absent)."""
    from deepspeed.runtime._sections import section_model

    return section_model("fp16")(**param_dict.get("fp16", {}))


def get_bfloat16_config(param_dict: dict[str, Any]) -> Any:
    """``param_dict["bf16"]`` (or its old name ``"bfloat16"``) as a ``DeepSpeedBF16Config``."""
    from deepspeed.runtime._sections import section_model

    return section_model("bf16")(**param_dict.get("bf16", param_dict.get("bfloat16", {})))


def __getattr__(name: str) -> Any:
    if name in ("DeepSpeedFP16Config", "DeepSpeedBF16Config"):
        from deepspeed.runtime._sections import section_model

        value = section_model("fp16" if name == "DeepSpeedFP16Config" else "bf16")
        globals()[name] = value
        return value
    raise AttributeError(f"deepspeed.runtime.precision_config.{name} is not provided by dscore's compatibility layer")
