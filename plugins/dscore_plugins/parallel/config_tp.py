"""The ``tensor_parallel`` block (AutoTP training) of ds_config (torch-free).

Keys and defaults are DeepSpeed 0.19.8's ``TPTrainingConfig``
(``deepspeed/runtime/tensor_parallel/config.py``) and ``TPLayerSpec``
(``deepspeed/module_inject/autotp_config.py``): ``autotp_size`` 0 (0 and 1 mean off), ``tp_overlap_comm``
false, ``keep_module_on_host`` false, ``dtype`` (a dtype name), ``preset_model`` null, ``partition_config``
null (``use_default_specs`` true, ``layer_specs`` with ``patterns`` / ``partition_type`` / ``shape`` /
``partition_dim`` / ``gather_output`` / ``model_types``).

dscore is stricter than DeepSpeed: unknown keys are errors, ``partition_type`` is checked here, and keys
DeepSpeed accepts but dscore cannot honour (``tp_overlap_comm: true``, ``vocab_parallel_lm_head: true``,
``tp.tp_grain_size`` above 1, ``injection_policy_tuple``, ``kernel_inject``) are refused naming the key.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from dscore.config.base import SectionModel, no_effect, not_implemented

__all__ = ["LayerSpecConfig", "PartitionConfig", "TensorParallelConfig", "PRESET_MODELS"]

#: ``preset_model`` names dscore knows (DeepSpeed's presets of Llama-style models; the others are refused).
PRESET_MODELS: tuple[str, ...] = ("llama", "qwen2", "mistral")

_DTYPES = (
    "fp32",
    "float32",
    "fp16",
    "float16",
    "half",
    "bf16",
    "bfloat16",
    "torch.float32",
    "torch.float16",
    "torch.bfloat16",
)


class LayerSpecConfig(SectionModel):
    """One entry of ``partition_config.layer_specs``: how parameters whose name matches split."""

    patterns: list[str]
    """Regular expressions matched (``re.match``) against full parameter names (``layers.0.q_proj.weight``)."""
    partition_type: Literal["column", "row", "skip"] = "column"
    """``column``: split the output features (dim 0 of a Linear weight); ``row``: split the input features,
    all-reduce the output and add the bias after; ``skip``: keep the module whole."""
    shape: list[int | list[int]] | None = None
    """Sub-parameter layout of a fused weight along ``partition_dim`` (``[3, -1]``: three equal parts, such
    as fused qkv, each split separately). Only equal parts are supported."""
    partition_dim: StrictInt | None = None
    """Which dim of ``shape`` holds the sub-parameters (default 0 for column, 1 for row)."""
    gather_output: StrictBool = False
    """Column only: all-gather the split output back to full width."""
    model_types: list[str] | None = None
    """Apply only to models whose ``config.model_type`` is one of these."""
    grad_allreduce: StrictBool = Field(default=False, json_schema_extra=not_implemented("DeepSpeed's experimental extra all-reduce"))
    """Accepted only as false (DeepSpeed's experimental extra all-reduce)."""

    @field_validator("patterns")
    @classmethod
    def _valid_patterns(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("patterns must list at least one regular expression")
        for p in value:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"pattern {p!r} is not a valid regular expression: {exc}") from exc
        return value

    @field_validator("partition_type", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("grad_allreduce")
    @classmethod
    def _no_grad_allreduce(cls, value: bool) -> bool:
        if value:
            raise ValueError("grad_allreduce: true is not implemented by dscore (leave it false)")
        return value

    @model_validator(mode="after")
    def _shape(self) -> LayerSpecConfig:
        if self.shape is not None:
            dim = self.sub_param_dim()
            if not 0 <= dim < len(self.shape):
                raise ValueError(f"partition_dim {dim} is outside shape {self.shape}")
            part = self.shape[dim]
            if isinstance(part, list) or not isinstance(part, int) or part < 1:
                raise ValueError(
                    f"shape[{dim}] = {part!r}: dscore supports only a count of equal sub-parameters there (e.g. [3, -1])"
                )
        if self.gather_output and self.partition_type != "column":
            raise ValueError("gather_output applies to column-split layers only")
        return self

    def sub_param_dim(self) -> int:
        """The dim of :attr:`shape` holding the sub-parameter count."""
        if self.partition_dim is not None:
            return int(self.partition_dim)
        return 0 if self.partition_type == "column" else 1

    def sub_params(self) -> int:
        """How many equal fused sub-parameters the split dim holds (1 without ``shape``)."""
        if self.shape is None:
            return 1
        value = self.shape[self.sub_param_dim()]
        assert isinstance(value, int)
        return value


class PartitionConfig(SectionModel):
    """``tensor_parallel.partition_config``: user layer specs, tried before the built-in ones."""

    use_default_specs: StrictBool = True
    """Also apply the preset / model / built-in rules to parameters no user spec matches."""
    layer_specs: list[LayerSpecConfig] = Field(default_factory=list)
    """User rules, in priority order."""
    lm_head_patterns: list[str] = Field(default_factory=lambda: ["lm_head", "embed_out"])
    """Module names treated as the language-model head (column split, output gathered)."""


class TensorParallelConfig(SectionModel):
    """``tensor_parallel``: AutoTP training (Linear layers split over a tensor-parallel group)."""

    autotp_size: StrictInt = Field(default=0, ge=0)
    """Tensor-parallel degree; 0 or 1 = off. Must divide the world size (with ``sequence_parallel_size``)."""
    tp_overlap_comm: StrictBool = Field(default=False, json_schema_extra=not_implemented("overlapping tensor-parallel communication"))
    """Accepted only as false (dscore's row all-reduce is not overlapped)."""
    keep_module_on_host: StrictBool = False
    """DeepSpeed's switch to load checkpoint shards on the host. dscore splits the module where it is
    (before ``initialize`` moves it to the device), so the split itself never needs device memory for the
    full weights: both values behave the same and are accepted."""
    dtype: str = "fp16"
    """DeepSpeed's model dtype for AutoTP. ``dscore.initialize`` trains in the precision of the fp16/bf16
    blocks; an explicitly set ``dtype`` must agree with it (else a ConfigError), so it can never silently
    differ. fp16 itself is refused with ``autotp_size > 1``."""
    preset_model: str | None = None
    """Built-in rules of a model family (``llama``, ``qwen2``, ``mistral``)."""
    partition_config: PartitionConfig | None = None
    """User layer specs (see :class:`PartitionConfig`)."""
    vocab_parallel_lm_head: StrictBool | None = Field(default=None, json_schema_extra=not_implemented("a vocab-parallel lm_head"))
    """Accepted only as null/false (vocabulary-parallel heads are not implemented)."""
    vocab_parallel_ce_backend: Literal["torch"] = Field(
        default="torch", json_schema_extra=no_effect("dscore has no vocab-parallel lm_head, so no vocab-parallel loss")
    )
    """Only the PyTorch cross-entropy."""
    tp: dict[str, Any] = Field(default_factory=dict, alias="tensor_parallel")
    """DeepSpeed's nested ``tensor_parallel`` block: ``tp_size`` is refused when it disagrees with
    ``autotp_size``; ``tp_grain_size`` must be 1."""

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        if value.lower() not in _DTYPES:
            raise ValueError(f"dtype {value!r} is not one of {', '.join(_DTYPES[:7])}")
        return value.lower()

    @field_validator("tp_overlap_comm")
    @classmethod
    def _no_overlap(cls, value: bool) -> bool:
        if value:
            raise ValueError("tp_overlap_comm: true is not implemented by dscore (set false)")
        return value

    @field_validator("vocab_parallel_lm_head")
    @classmethod
    def _no_vocab_parallel(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("vocab_parallel_lm_head: true is not implemented by dscore (leave it null)")
        return value

    @field_validator("preset_model")
    @classmethod
    def _preset(cls, value: str | None) -> str | None:
        if value is not None and value.lower() not in PRESET_MODELS:
            raise ValueError(f"preset_model {value!r} is not one of {', '.join(PRESET_MODELS)}")
        return None if value is None else value.lower()

    @field_validator("tp")
    @classmethod
    def _nested(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - {"tp_size", "tp_grain_size"})
        if unknown:
            raise ValueError(f"tensor_parallel.tensor_parallel: unknown or unsupported key(s) {unknown}")
        if int(value.get("tp_grain_size", 1)) != 1:
            raise ValueError("tensor_parallel.tensor_parallel.tp_grain_size must be 1")
        return value

    @model_validator(mode="after")
    def _sizes_agree(self) -> TensorParallelConfig:
        nested = self.tp.get("tp_size")
        if nested is not None and int(nested) not in (1, self.size) and not (self.size == 1 and int(nested) == 1):
            raise ValueError(f"tensor_parallel.tensor_parallel.tp_size = {nested} disagrees with autotp_size")
        return self

    @property
    def size(self) -> int:
        """The tensor-parallel degree (``autotp_size``, with 0 meaning 1)."""
        return max(1, int(self.autotp_size))
