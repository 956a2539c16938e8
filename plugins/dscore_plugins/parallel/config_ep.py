"""The ``expert_parallel`` block (AutoEP) of ds_config (torch-free).

Keys and defaults are DeepSpeed 0.19.8's ``AutoEPConfig`` / ``parse_autoep_config``
(``deepspeed/module_inject/auto_ep_config.py``, ``auto_ep_presets/base.py``): ``enabled`` false,
``autoep_size`` 1, ``preset_model`` null, ``top_k`` / ``score_func`` / ``score_apply`` /
``routed_scaling_factor`` ``"auto"``, ``route_norm`` null, ``route_scale`` 1.0, the layer-detection overrides
(``moe_layer_pattern``, ``router_pattern``, ``expert_pattern``, ``expert_w1`` / ``expert_w2`` / ``expert_w3``,
``num_experts_attr``, ``top_k_attr``, ``has_shared_experts``, ``shared_experts_pattern``,
``shared_experts_gate_pattern``, ``expert_activation``), group-limited routing (``num_expert_groups``,
``num_limited_groups``) and DeepSpeed's kernel / transport knobs.

What dscore does with each key (applied by :mod:`dscore.moe.autoep`):

* routing and detection keys are implemented with DeepSpeed's semantics;
* kernel choices that cannot change the numbers (``use_grouped_mm``, ``disable_triton_grouped_mm``,
  ``combine_impl``, ``gate_up_impl``, ``async_split_plan``) are accepted with a warning naming the key;
* features dscore does not have are refused naming the key: ``comm_backend: "deepep"`` (and the DeepEP
  tuning keys ``comm_num_sm`` / ``comm_qp_margin`` / ``comm_max_tokens_per_rank`` / ``row_weighting_impl:
  "fused"`` away from their defaults), ``expert_tensor_parallel_size`` above 1, ``validate_folding_routing``
  (AutoEP + AutoTP folding), a non-null ``load_balance_coeff`` (DeepSpeed refuses it too), separate
  gate/up weights (``expert_w3`` naming a weight) and the clamped SwiGLU activations.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from dscore.config.base import SectionModel, no_effect, not_implemented

__all__ = ["ExpertParallelConfig", "AUTOEP_PRESETS", "EXPERT_ACTIVATIONS"]

#: ``preset_model`` names dscore implements (DeepSpeed 0.19.8 also has ``qwen3_5_moe`` and ``minimax_m3``,
#: refused by name).
AUTOEP_PRESETS: tuple[str, ...] = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
#: DeepSpeed presets dscore does not implement, with why.
UNSUPPORTED_PRESETS: dict[str, str] = {
    "qwen3_5_moe": "Qwen3.5-MoE text backbones are not implemented by dscore's AutoEP",
    "minimax_m3": "MiniMax-M3's clamped SwiGLU experts are not implemented by dscore's AutoEP",
}
#: ``expert_activation`` values dscore computes (DeepSpeed also has ``swiglu_clamped`` and ``swiglu_oai``).
EXPERT_ACTIVATIONS: tuple[str, ...] = ("swiglu", "geglu_tanh")
_DS_ONLY_ACTIVATIONS = ("swiglu_clamped", "swiglu_oai")

log = logging.getLogger("dscore.config.expert_parallel")


def _attr_name(value: str | None, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or "." in value:
        raise ValueError(f"{key} must be a non-empty direct attribute name (no dots), got {value!r}")
    return value


class ExpertParallelConfig(SectionModel):
    """``expert_parallel``: AutoEP, expert parallelism of Hugging Face MoE blocks (:mod:`dscore.moe.autoep`)."""

    enabled: StrictBool = False
    """Replace every detected MoE block with an expert-parallel one."""
    autoep_size: StrictInt = Field(default=1, ge=1)
    """Expert-parallel degree: ranks one layer's experts are spread over. Divides the data-parallel world
    size and every detected layer's expert count. 1 keeps every expert on every rank (no all-to-all)."""
    expert_tensor_parallel_size: StrictInt = Field(
        default=1, ge=1, json_schema_extra=not_implemented("expert tensor parallelism")
    )
    """Accepted only as 1 (DeepSpeed reserves it too)."""
    validate_folding_routing: StrictBool = Field(
        default=False, json_schema_extra=not_implemented("AutoEP + AutoTP folding (tensor_parallel with AutoEP)")
    )
    """Accepted only as false: dscore refuses AutoEP together with ``tensor_parallel.autotp_size > 1``."""
    async_split_plan: StrictBool = Field(
        default=False, json_schema_extra=no_effect("dscore computes the dispatch plan synchronously")
    )
    """DeepSpeed's CUDA-stream overlap of the split-size copy; no numeric effect."""
    preset_model: str | None = None
    """Model family: ``mixtral``, ``qwen3_moe`` (also Qwen2-MoE), ``deepseek_v2``, ``deepseek_v3``; null =
    from ``model.config.model_type``, else a custom preset from ``moe_layer_pattern``."""
    moe_layer_pattern: str | None = None
    """Regular expression (``re.fullmatch``) of MoE block module names; overrides the preset's
    ``model\\.layers\\.\\d+\\.mlp``."""
    expert_pattern: str | None = None
    """Child name of the experts module (default ``experts``)."""
    router_pattern: str | None = None
    """Child name of the router (default ``gate``)."""
    use_grouped_mm: StrictBool = Field(
        default=True, json_schema_extra=no_effect("dscore runs the local experts one by one")
    )
    """DeepSpeed's grouped-GEMM switch; no numeric effect."""
    disable_triton_grouped_mm: StrictBool = Field(
        default=False, json_schema_extra=no_effect("dscore has no Triton grouped GEMM")
    )
    """DeepSpeed's Triton kernel switch; no numeric effect."""
    route_norm: StrictBool | None = None
    """Renormalise the top-k scores to sum 1; null = ``model.config.norm_topk_prob``, else the preset's."""
    route_scale: float = 1.0
    """Factor on the routing weights (overridden by ``routed_scaling_factor`` / the model's)."""
    score_apply: Literal["auto", "pre", "post"] = "auto"
    """Multiply the routing weight into the expert input (``pre``) or output (``post``, every preset's)."""
    combine_impl: Literal["auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"] = Field(
        default="auto", json_schema_extra=no_effect("dscore combines with one weighted index_add")
    )
    """DeepSpeed's combine kernel; no numeric effect (``fused_weighted_sum`` still needs ``score_apply`` post)."""
    row_weighting_impl: Literal["auto", "eager", "fused"] = Field(
        default="auto", json_schema_extra=no_effect("dscore weights rows eagerly; 'fused' (DeepEP only) is refused")
    )
    """``fused`` runs only inside DeepEP and is refused; ``auto`` / ``eager`` are the same here."""
    gate_up_impl: Literal["separate", "fused"] = Field(
        default="separate", json_schema_extra=no_effect("dscore applies the fused gate_up weight as stored")
    )
    """DeepSpeed's gate/up GEMM layout; no numeric effect (``fused`` still needs ``use_grouped_mm``)."""
    comm_backend: Literal["comm", "deepep"] = Field(
        default="comm", json_schema_extra=not_implemented("the DeepEP all-to-all backend")
    )
    """``comm``: the expert-parallel group's all-to-all. ``deepep`` is refused."""
    comm_num_sm: StrictInt = Field(default=12, ge=1, json_schema_extra=not_implemented("DeepEP tuning"))
    """DeepEP only: accepted at its default."""
    comm_qp_margin: StrictInt = Field(default=4, ge=0, json_schema_extra=not_implemented("DeepEP tuning"))
    """DeepEP only: accepted at its default."""
    comm_max_tokens_per_rank: StrictInt = Field(default=0, ge=0, json_schema_extra=not_implemented("DeepEP tuning"))
    """DeepEP only: accepted at its default."""
    num_expert_groups: StrictInt | None = Field(default=None, ge=1)
    """Group-limited routing: experts split into this many groups (null: ``model.config.n_group``)."""
    num_limited_groups: StrictInt | None = Field(default=None, ge=1)
    """Group-limited routing: groups a token may use (null: ``model.config.topk_group``)."""
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    """Router scores: ``auto`` = ``model.config.scoring_func`` when set, else the preset's."""
    top_k: StrictInt | Literal["auto"] = "auto"
    """Experts per token; ``auto`` = ``model.config.<top_k_attr>``."""
    load_balance_coeff: float | None = Field(
        default=None,
        json_schema_extra=not_implemented("auxiliary-loss-free load balancing; DeepSpeed 0.19.8 refuses it too"),
    )
    """Only null: auxiliary-loss-free balancing is refused (DeepSpeed 0.19.8 refuses it too)."""
    routed_scaling_factor: float | Literal["auto"] = "auto"
    """Routing-weight scale; ``auto`` = ``model.config.routed_scaling_factor`` when set, else ``route_scale``."""
    expert_w1: str | None = None
    """Name of the fused gate+up weight ``[E, 2F, H]`` on the experts module (default ``gate_up_proj``)."""
    expert_w2: str | None = None
    """Name of the down weight ``[E, H, F]`` (default ``down_proj``)."""
    expert_w3: str | None = Field(
        default=None, json_schema_extra=not_implemented("separate gate and up expert weights")
    )
    """Only null (the fused gate+up layout); a separate up-projection weight is refused."""
    num_experts_attr: str | None = None
    """``model.config`` attribute with the expert count (preset default)."""
    top_k_attr: str | None = None
    """``model.config`` attribute with top-k (preset default ``num_experts_per_tok``)."""
    has_shared_experts: StrictBool | None = None
    """Whether the block has shared experts (preset default)."""
    shared_experts_pattern: str | None = None
    """Child name of the shared experts (preset default)."""
    shared_experts_gate_pattern: str | None = None
    """Child name of the shared experts' sigmoid gate (Qwen: ``shared_expert_gate``)."""
    expert_activation: str | None = None
    """``swiglu`` (``act(gate) * up`` with SiLU) or ``geglu_tanh``; null = the preset's (``swiglu``),
    checked against the experts' ``act_fn``."""

    @field_validator("preset_model")
    @classmethod
    def _preset(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value in UNSUPPORTED_PRESETS:
            raise ValueError(
                f"preset_model {value!r}: {UNSUPPORTED_PRESETS[value]}; valid: {', '.join(AUTOEP_PRESETS)}"
            )
        if value not in AUTOEP_PRESETS:
            raise ValueError(f"preset_model {value!r} is not one of {', '.join(AUTOEP_PRESETS)}")
        return value

    @field_validator("moe_layer_pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        import re

        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"moe_layer_pattern {value!r} is not a valid regular expression: {exc}") from exc
        return value

    @field_validator(
        "expert_pattern",
        "router_pattern",
        "expert_w1",
        "expert_w2",
        "num_experts_attr",
        "top_k_attr",
        "shared_experts_pattern",
        "shared_experts_gate_pattern",
    )
    @classmethod
    def _names(cls, value: str | None, info: Any) -> str | None:
        return _attr_name(value, info.field_name)

    @field_validator("expert_activation")
    @classmethod
    def _activation(cls, value: str | None) -> str | None:
        if value is None or value in EXPERT_ACTIVATIONS:
            return value
        if value in _DS_ONLY_ACTIVATIONS:
            raise ValueError(
                f"expert_activation {value!r} (a clamped SwiGLU) is not implemented by dscore; valid: "
                f"{', '.join(EXPERT_ACTIVATIONS)}"
            )
        raise ValueError(f"expert_activation {value!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"top_k must be >= 1 or 'auto', got {value}")
        return value

    @field_validator("route_scale", "routed_scaling_factor")
    @classmethod
    def _finite(cls, value: Any, info: Any) -> Any:
        import math

        if isinstance(value, float | int) and not math.isfinite(float(value)):
            raise ValueError(f"{info.field_name} must be a finite number, got {value!r}")
        return value

    @field_validator("row_weighting_impl")
    @classmethod
    def _no_fused_rows(cls, value: str) -> str:
        if value == "fused":
            raise ValueError(
                "row_weighting_impl 'fused' runs only inside the DeepEP backend, which dscore does not implement; "
                "valid: 'auto', 'eager'"
            )
        return value

    @model_validator(mode="after")
    def _combinations(self) -> ExpertParallelConfig:
        if self.combine_impl == "fused_weighted_sum" and self.score_apply == "pre":
            raise ValueError("combine_impl 'fused_weighted_sum' requires score_apply 'post' (or 'auto')")
        if self.gate_up_impl == "fused" and not self.use_grouped_mm:
            raise ValueError("gate_up_impl 'fused' requires use_grouped_mm true (DeepSpeed's rule)")
        if (
            self.num_expert_groups is not None
            and self.num_limited_groups is not None
            and self.num_limited_groups > self.num_expert_groups
        ):
            raise ValueError(
                f"num_limited_groups ({self.num_limited_groups}) must be <= num_expert_groups ({self.num_expert_groups})"
            )
        unused = sorted(self.model_fields_set - {"enabled"})
        if not self.enabled and unused:  # DeepSpeed ignores them silently; dscore says so
            log.warning(
                "expert_parallel.enabled is false: %s %s ignored (AutoEP is off; set expert_parallel.enabled true "
                "to use them)", ", ".join(f"expert_parallel.{k}" for k in unused), "is" if len(unused) == 1 else "are",
            )  # fmt: skip
        return self
