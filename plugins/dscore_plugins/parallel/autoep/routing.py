"""AutoEP routing: the model-family presets (where a block keeps router and experts), the resolved layer
spec and the top-k router rules (see :mod:`dscore_plugins.parallel.autoep.convert` for the whole design)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LayerSpec", "Preset", "PRESETS", "route"]

_KEY = "expert_parallel"


@dataclass(frozen=True)
class Preset:
    """Where a model family keeps its MoE block's parts and how it routes (DeepSpeed's ``MoEModelPreset``)."""

    layer_pattern: str
    router: str
    experts: str
    w1: str
    w2: str
    num_experts_attr: str
    top_k_attr: str
    score_func: str
    route_norm: bool
    route_norm_from_config: bool
    shared_experts: str = ""
    shared_experts_gate: str = ""
    hf_model_types: tuple[str, ...] = ()
    #: Qwen casts the routing weights to the activations' dtype before weighting; the others keep fp32.
    weights_in_input_dtype: bool = False
    #: DeepSeek-V2: group-limited routing only with ``topk_method == "group_limited_greedy"`` (group max).
    groups_need_topk_method: bool = False


_LAYERS = r"model\.layers\.\d+\.mlp"

#: DeepSpeed 0.19.8's presets dscore implements (``deepspeed/module_inject/auto_ep_presets/``).
PRESETS: dict[str, Preset] = {
    "mixtral": Preset(_LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "num_local_experts",
                      "num_experts_per_tok", "softmax", True, True, hf_model_types=("mixtral",)),
    "qwen3_moe": Preset(_LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "num_experts",
                        "num_experts_per_tok", "softmax", True, True, "shared_expert", "shared_expert_gate",
                        ("qwen3_moe", "qwen2_moe"), weights_in_input_dtype=True),
    "deepseek_v2": Preset(_LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "n_routed_experts",
                          "num_experts_per_tok", "softmax", False, False, "shared_experts",
                          hf_model_types=("deepseek_v2",), groups_need_topk_method=True),
    "deepseek_v3": Preset(_LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "n_routed_experts",
                          "num_experts_per_tok", "sigmoid", False, True, "shared_experts",
                          hf_model_types=("deepseek_v3",)),
}  # fmt: skip


@dataclass(frozen=True)
class LayerSpec:
    """One detected MoE block and its resolved routing (DeepSpeed's ``MoELayerSpec``)."""

    name: str
    preset: str
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_size: int
    score_func: str
    score_apply: str
    route_norm: bool
    route_scale: float
    num_expert_groups: int | None
    num_limited_groups: int | None
    group_score_func: str
    activation: str
    weights_in_input_dtype: bool
    router: str
    experts: str
    w1: str
    w2: str
    shared_experts: str
    shared_experts_gate: str


# --------------------------------------------------------------------------------------------- routing


def route(
    logits: torch.Tensor,
    spec: LayerSpec,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits [T, N]`` (any float dtype) under ``spec``.

    Returns:
        ``(weights [T, k] fp32, experts [T, k] int64)``: weights are the chosen experts' unbiased scores,
        renormalised when ``spec.route_norm`` and multiplied by ``spec.route_scale``.
    """
    z = logits.float()
    scores = torch.sigmoid(z) if spec.score_func == "sigmoid" else torch.softmax(z, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float().unsqueeze(0)
    if spec.num_expert_groups is not None and spec.num_limited_groups is not None:
        g = spec.num_expert_groups
        grouped = choice.view(choice.shape[0], g, spec.num_experts // g)
        if spec.group_score_func == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_scores, k=spec.num_limited_groups, dim=-1, sorted=False).indices
        masked = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(masked.unsqueeze(-1), float("-inf")).view_as(scores)
    experts = torch.topk(choice, k=spec.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if spec.route_norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.route_scale != 1.0:
        weights = weights * spec.route_scale
    return weights, experts
