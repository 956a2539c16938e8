"""AutoEP: expert parallelism for the Hugging Face MoE blocks DeepSpeed 0.19.8's AutoEP names.

``expert_parallel: {"enabled": true, "autoep_size": E}`` (:class:`dscore_plugins.parallel.config_ep.
ExpertParallelConfig`) makes ``dscore.initialize`` replace every detected MoE block (Mixtral, Qwen2-MoE /
Qwen3-MoE, DeepSeek-V2 / V3 in transformers >= 5, whose experts are fused ``gate_up_proj [N, 2F, H]`` /
``down_proj [N, H, F]`` tensors) with an :class:`AutoEPMoELayer`: each rank of an expert-parallel group keeps
``N / E`` experts; tokens go to the rank holding their expert through an all-to-all over that group and come
back through a second one (DeepSpeed's AutoEP semantics: ``deepspeed/module_inject/auto_ep*.py``; this is
an independent implementation).

**Routing** (DeepSpeed's ``TokenChoiceTopKRouter`` rules, which equal the Hugging Face routers for the
model's own settings): the block's router module is kept and called, so its logits are what the model's
output recorder captures (``router_logits``, the auxiliary loss the HF model computes from them); from the
logits, in fp32: ``scores = softmax`` or ``sigmoid`` (``score_func``); ``scores + e_score_correction_bias``
(DeepSeek-V3) choose; with ``num_expert_groups`` only the best ``num_limited_groups`` groups compete (group
score: top-2 sum, or the max for DeepSeek-V2's ``group_limited_greedy``); the ``top_k`` experts' unbiased
scores are renormalised (``route_norm``: ``w / (sum w + 1e-20)``) and scaled (``routed_scaling_factor`` /
``route_scale``).

**Capacity**: no token is ever dropped (the Hugging Face blocks drop none). The all-to-all moves equal
``[N, C, H]`` buffers, ``C`` = the largest number of routes any expert receives on any rank of the group (one
``all_reduce(max)`` per forward): DeepSpeed's ``drop_tokens=False`` capacity. Padding slots are zero rows,
which a bias-free gated expert maps to zero, and no token reads them back.

**Combine**: ``out[t] = sum_e w[t, e] * expert_e(x[t])`` added in ascending expert order, the order of the
Hugging Face loop, so fp32 results match it to rounding.

The layer is a :class:`dscore.moe.layer.MoE`: the engine gives it its groups, its expert parameters are
tagged ``allreduce = False`` / ``group_name = "ep_size_<E>"`` (their gradients are reduced over the
expert-data-parallel group only) and checkpoints name every expert by its global index
(``<block>.deepspeed_moe.experts.deepspeed_experts.<n>.gate_up_proj``, :mod:`dscore.moe.checkpoint`), so a
checkpoint saved at one ``autoep_size`` loads at another.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dscore.errors import ConfigError
from dscore.moe.groups import expert_groups
from dscore_plugins.parallel.autoep.layer import AutoEPExpert, AutoEPMoELayer, _gate_fn
from dscore_plugins.parallel.autoep.routing import _KEY, PRESETS, LayerSpec, Preset

if TYPE_CHECKING:
    from dscore_plugins.parallel.config_ep import ExpertParallelConfig

__all__ = ["apply_autoep", "detect_moe_layers", "hf_state_dict", "remap_parameters"]

log = logging.getLogger("dscore.moe.autoep")


# --------------------------------------------------------------------------------------------- detection


def _candidates(cfg: ExpertParallelConfig, model_config: Any) -> list[tuple[str, Preset]]:
    """The preset(s) to detect with, config overrides applied (DeepSpeed's ``resolve_preset_candidates``)."""
    name = cfg.preset_model
    model_type = getattr(model_config, "model_type", None)
    known = next((n for n, p in PRESETS.items() if model_type in p.hf_model_types), None) if model_type else None
    if name is not None and known is not None and known != name:
        raise ConfigError(
            f"{_KEY}.preset_model {name!r} does not fit the model: model.config.model_type {model_type!r} is "
            f"preset {known!r} (its routing differs); set preset_model to {known!r} or leave it null",
            path=f"{_KEY}.preset_model",
        )
    name = name or known
    if name is not None:
        base = PRESETS[name]
    elif cfg.moe_layer_pattern is not None:
        name = "custom"
        base = Preset(cfg.moe_layer_pattern, "gate", "experts", "gate_up_proj", "down_proj", "num_local_experts",
                      "num_experts_per_tok", "softmax", True, True)  # fmt: skip
    else:
        raise ConfigError(
            f"{_KEY}.enabled: the model (model_type {model_type!r}) is none of the families AutoEP knows "
            f"({', '.join(t for p in PRESETS.values() for t in p.hf_model_types)}); set {_KEY}.preset_model to "
            f"one of {', '.join(PRESETS)} or {_KEY}.moe_layer_pattern for a custom layout",
            path=f"{_KEY}.preset_model",
        )
    over: dict[str, Any] = {}
    for key, fld in (("moe_layer_pattern", "layer_pattern"), ("router_pattern", "router"),
                     ("expert_pattern", "experts"), ("expert_w1", "w1"), ("expert_w2", "w2"),
                     ("num_experts_attr", "num_experts_attr"), ("top_k_attr", "top_k_attr"),
                     ("shared_experts_pattern", "shared_experts"),
                     ("shared_experts_gate_pattern", "shared_experts_gate")):  # fmt: skip
        value = getattr(cfg, key)
        if value is not None:
            over[fld] = value
    if cfg.has_shared_experts is False:
        over["shared_experts"] = over["shared_experts_gate"] = ""
    elif cfg.has_shared_experts is None and name == "custom":
        over.setdefault("shared_experts", "")
    return [(name, replace(base, **over) if over else base)]


def _activation(cfg: ExpertParallelConfig, experts: nn.Module, where: str) -> tuple[str, Any]:
    """The configured activation and the callable to use; refuse one the experts' ``act_fn`` contradicts."""
    name = cfg.expert_activation or "swiglu"
    fn = _gate_fn(name)
    act = getattr(experts, "act_fn", None)
    if act is None:
        return name, fn
    probe = torch.linspace(-8.0, 8.0, steps=161)
    with torch.no_grad():
        try:
            seen = act(probe)
        except Exception:  # an act_fn that needs a device or dtype of its own: trust the configured form
            return name, fn
    if torch.allclose(seen.float(), fn(probe), atol=1e-5):
        return name, act
    if cfg.expert_activation is None:
        raise ConfigError(
            f"{_KEY}: the experts of {where} use an activation ({type(act).__name__}) that is not SwiGLU's SiLU "
            f"gate; set {_KEY}.expert_activation to the form they use (one of swiglu, geglu_tanh)",
            path=f"{_KEY}.expert_activation",
        )
    return name, fn


def _resolve(cfg: ExpertParallelConfig, preset_name: str, preset: Preset, model_config: Any, name: str,
             module: nn.Module, router: nn.Module, experts: nn.Module) -> LayerSpec:  # fmt: skip
    w1 = getattr(experts, preset.w1, None)
    w2 = getattr(experts, preset.w2, None)
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor) or w1.dim() != 3 or w2.dim() != 3:
        raise ConfigError(
            f"{_KEY}: {name}.{preset.experts} has no fused 3-D expert weights {preset.w1!r} / {preset.w2!r} "
            "(transformers >= 5 layout [N, 2F, H] / [N, H, F]); set expert_w1 / expert_w2 to their names",
            path=f"{_KEY}.expert_w1",
        )
    n, two_f, hidden = w1.shape
    if w2.shape != (n, hidden, two_f // 2) or two_f % 2:
        raise ConfigError(
            f"{_KEY}: {name}: {preset.w1} {tuple(w1.shape)} / {preset.w2} {tuple(w2.shape)} are not the fused "
            "gate+up layout [N, 2F, H] / [N, H, F] dscore implements",
            path=f"{_KEY}.expert_w1",
        )
    rw = getattr(router, "weight", None)
    configured = getattr(model_config, preset.num_experts_attr, None)
    if configured is not None and int(configured) != n:
        raise ConfigError(
            f"{_KEY}: {name} holds {n} experts but model.config.{preset.num_experts_attr} = {configured}",
            path=f"{_KEY}.num_experts_attr",
        )
    if isinstance(rw, torch.Tensor) and tuple(rw.shape) != (n, hidden):
        raise ConfigError(
            f"{_KEY}: {name}.{preset.router}.weight is {tuple(rw.shape)}, expected [{n}, {hidden}]",
            path=f"{_KEY}.router_pattern",
        )
    if getattr(router, "bias", None) is not None:
        raise ConfigError(
            f"{_KEY}: {name}.{preset.router} has a bias; AutoEP presets route with a bias-free gate",
            path=f"{_KEY}.router_pattern",
        )
    jitter = getattr(model_config, "router_jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise ConfigError(
            f"{_KEY}: model.config.router_jitter_noise = {jitter} (input jitter in training) is not implemented "
            "by AutoEP (DeepSpeed ignores it with a warning); set it to 0",
            path=f"{_KEY}.enabled",
        )
    if isinstance(cfg.top_k, int):
        top_k = cfg.top_k
    else:
        value = getattr(model_config, preset.top_k_attr, None)
        if value is None:
            raise ConfigError(
                f"{_KEY}.top_k: 'auto' needs model.config.{preset.top_k_attr}; set top_k or top_k_attr",
                path=f"{_KEY}.top_k",
            )
        top_k = int(value)
    if top_k > n:
        raise ConfigError(f"{_KEY}.top_k = {top_k} exceeds the {n} experts of {name}", path=f"{_KEY}.top_k")
    score_func: str
    if cfg.score_func != "auto":
        score_func = cfg.score_func
    else:
        from_model = getattr(model_config, "scoring_func", None)
        score_func = from_model if from_model in ("softmax", "sigmoid") else preset.score_func
    if cfg.route_norm is not None:
        route_norm = cfg.route_norm
    elif preset.route_norm_from_config and getattr(model_config, "norm_topk_prob", None) is not None:
        route_norm = bool(model_config.norm_topk_prob)
    else:
        route_norm = preset.route_norm
    if cfg.routed_scaling_factor != "auto":
        route_scale, source = float(cfg.routed_scaling_factor), f"{_KEY}.routed_scaling_factor"
    elif getattr(model_config, "routed_scaling_factor", None) is not None:
        route_scale, source = float(model_config.routed_scaling_factor), "model.config.routed_scaling_factor"
    else:
        route_scale, source = float(cfg.route_scale), ""
    if source and cfg.route_scale != 1.0:  # DeepSpeed's precedence, and its warning: never dropped silently
        log.warning("AutoEP %s: %s = %s overrides %s.route_scale = %s", name, source, route_scale, _KEY,
                    cfg.route_scale)  # fmt: skip
    groups, limited, group_score = cfg.num_expert_groups, cfg.num_limited_groups, "top2_sum"
    use_model_groups = not preset.groups_need_topk_method or (
        getattr(model_config, "topk_method", None) == "group_limited_greedy"
    )
    if preset.groups_need_topk_method and use_model_groups:
        group_score = "max"
    if use_model_groups and preset_name != "custom":
        groups = groups if groups is not None else getattr(model_config, "n_group", None)
        limited = limited if limited is not None else getattr(model_config, "topk_group", None)
    if (groups is None) != (limited is None):
        raise ConfigError(
            f"{_KEY}: group-limited routing of {name} needs both num_expert_groups and num_limited_groups "
            f"(got {groups} and {limited})",
            path=f"{_KEY}.num_expert_groups",
        )
    if groups is not None and limited is not None:
        if n % groups or limited > groups or (group_score == "top2_sum" and n // groups < 2):
            raise ConfigError(
                f"{_KEY}: num_expert_groups {groups} / num_limited_groups {limited} do not fit the {n} experts "
                f"of {name} (groups must divide the experts, limited <= groups, >= 2 experts per group)",
                path=f"{_KEY}.num_expert_groups",
            )
        if top_k > limited * (n // groups):
            raise ConfigError(
                f"{_KEY}.top_k = {top_k} exceeds the {limited * (n // groups)} experts of the "
                f"{limited} allowed group(s) of {name}",
                path=f"{_KEY}.top_k",
            )
    if cfg.has_shared_experts is True and getattr(module, preset.shared_experts or "_", None) is None:
        raise ConfigError(
            f"{_KEY}.has_shared_experts is true but {name} has no shared-experts child "
            f"{preset.shared_experts or '(no shared_experts_pattern set)'!r}; their output would be left out of "
            f"the block: set {_KEY}.shared_experts_pattern to the child's name, or has_shared_experts false / null",
            path=f"{_KEY}.has_shared_experts",
        )
    for key, child in (("shared_experts_pattern", preset.shared_experts),
                       ("shared_experts_gate_pattern", preset.shared_experts_gate)):  # fmt: skip
        if getattr(cfg, key) is not None and child and getattr(module, child, None) is None:
            raise ConfigError(
                f"{_KEY}.{key} = {child!r}: {name} has no such child (it would be left out of the block)",
                path=f"{_KEY}.{key}",
            )
    activation, _ = _activation(cfg, experts, name)
    return LayerSpec(
        name=name, preset=preset_name, num_experts=n, top_k=top_k, hidden_size=hidden, ffn_size=two_f // 2,
        score_func=score_func, score_apply="pre" if cfg.score_apply == "pre" else "post", route_norm=route_norm,
        route_scale=route_scale, num_expert_groups=groups, num_limited_groups=limited, group_score_func=group_score,
        activation=activation, weights_in_input_dtype=preset.weights_in_input_dtype, router=preset.router,
        experts=preset.experts, w1=preset.w1, w2=preset.w2, shared_experts=preset.shared_experts,
        shared_experts_gate=preset.shared_experts_gate,
    )  # fmt: skip


def detect_moe_layers(model: nn.Module, cfg: ExpertParallelConfig) -> list[LayerSpec]:
    """The MoE blocks of ``model`` AutoEP replaces, with their resolved routing (DeepSpeed's ``ep_parser``).

    A module whose name fully matches the preset's layer pattern and that has both the router and the
    experts child is a block; a matching module without experts (a dense MLP layer) is skipped.

    Raises:
        ConfigError: no preset fits the model, no block is found, or a block's layout / routing settings
            are not ones AutoEP can honour (each names its ``expert_parallel`` key).
    """
    model_config = getattr(model, "config", None)
    specs: list[LayerSpec] = []
    [(preset_name, preset)] = _candidates(cfg, model_config)
    pattern = re.compile(preset.layer_pattern)
    for name, module in model.named_modules():
        if not pattern.fullmatch(name):
            continue
        experts = getattr(module, preset.experts, None)
        router = getattr(module, preset.router, None)
        if experts is None or router is None:
            continue
        specs.append(_resolve(cfg, preset_name, preset, model_config, name, module, router, experts))
    if not specs:
        raise ConfigError(
            f"{_KEY}.enabled: no MoE block found for preset {preset_name!r} (modules matching "
            f"{preset.layer_pattern!r} with children {preset.router!r} and {preset.experts!r}); choose the "
            f"matching preset_model or set moe_layer_pattern / router_pattern / expert_pattern",
            path=f"{_KEY}.preset_model",
        )
    return specs


# --------------------------------------------------------------------------------------------- apply


def apply_autoep(
    model: nn.Module, cfg: ExpertParallelConfig, comm: Any, mesh: Any = None
) -> dict[int, list[nn.Parameter]]:
    """Replace every detected MoE block of ``model`` in place with an :class:`AutoEPMoELayer` (collective).

    Args:
        model: the Hugging Face model (before placement / precision casting).
        cfg: the validated ``expert_parallel`` block (``enabled`` true).
        comm: the data-parallel :class:`dscore.comm.Comm` whose ranks form the expert groups.
        mesh: the run's :class:`dscore.parallel.mesh.ParallelMesh`; its expert groups are used when it
            keeps them (``mesh.expert_groups``), else groups over ``comm``.

    Returns:
        ``id(old expert weight) -> this rank's new expert parameters`` (to remap user parameter lists).

    Raises:
        ConfigError: ``autoep_size`` does not divide the world size or a block's expert count, or as
            :func:`detect_moe_layers`.
    """
    ep = int(cfg.autoep_size)
    world = int(comm.get_world_size())
    if world % ep:
        raise ConfigError(
            f"{_KEY}.autoep_size = {ep} must divide the data-parallel world size {world}; valid: "
            f"{[d for d in range(1, world + 1) if world % d == 0]}",
            path=f"{_KEY}.autoep_size",
        )
    specs = detect_moe_layers(model, cfg)
    for spec in specs:
        if spec.num_experts % ep:
            raise ConfigError(
                f"{_KEY}.autoep_size = {ep} must divide the {spec.num_experts} experts of {spec.name}; valid: "
                f"{[d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0 and world % d == 0]}",
                path=f"{_KEY}.autoep_size",
            )
    from_mesh = getattr(mesh, "expert_groups", None)
    groups = from_mesh(ep) if callable(from_mesh) else expert_groups(comm, ep)
    replaced: dict[int, list[nn.Parameter]] = {}
    for spec in specs:
        parent_name, _, child = spec.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        source = getattr(parent, child)
        experts = getattr(source, spec.experts)
        _, act = _activation(cfg, experts, spec.name)
        layer = AutoEPMoELayer(source, spec, ep, groups.ep_rank, act)
        layer.deepspeed_moe.set_ep_comm(groups.ep_comm)
        new = list(layer.deepspeed_moe.parameters())  # exactly this rank's expert parameters
        for p in experts.parameters(recurse=False):
            replaced[id(p)] = new
        setattr(parent, child, layer)
        log.info(
            "AutoEP: %s (%s) -> %d of %d experts on expert-parallel rank %d of %d, top-%d %s%s",
            spec.name, spec.preset, layer.num_local_experts, spec.num_experts, groups.ep_rank, ep, spec.top_k,
            spec.score_func, f", groups {spec.num_limited_groups}/{spec.num_expert_groups}"
            if spec.num_expert_groups else "",
        )  # fmt: skip
    return replaced


def remap_parameters(model_parameters: Iterable[Any] | None, replaced: dict[int, list[nn.Parameter]]) -> Any:
    """``model_parameters`` with each replaced expert weight swapped for this rank's new expert parameters
    (a flat iterable or parameter-group dicts; ``None`` stays ``None``). Each new parameter appears once."""
    if model_parameters is None or not replaced:
        return model_parameters
    items = list(model_parameters)
    seen: set[int] = set()

    def swap(params: Iterable[Any]) -> list[Any]:
        out: list[Any] = []
        for p in params:
            tensor = p[1] if isinstance(p, tuple) and len(p) == 2 else p
            if isinstance(tensor, torch.Tensor) and id(tensor) in replaced:
                for q in replaced[id(tensor)]:
                    if id(q) not in seen:
                        seen.add(id(q))
                        out.append(q)
            else:
                out.append(tensor if isinstance(p, tuple) else p)
        return out

    if items and all(isinstance(g, dict) for g in items):
        return [{**g, "params": swap([g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"])}
                for g in items]  # fmt: skip
    return swap(items)


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict under the names and shapes of the unconverted Hugging Face model: each AutoEP
    layer's experts gathered over its expert-parallel group and stacked back into ``<block>.<experts>.<w1>``
    ``[N, 2F, H]`` / ``<w2>`` ``[N, H, F]`` (so ``save_pretrained`` / ``load_state_dict`` of the original class
    take it). Collective over every layer's expert-parallel group; call it on every rank.

    Raises:
        ConfigError: an AutoEP layer with ``ep_size > 1`` has no expert-parallel group, or the parameters
            are ZeRO-3 partitions.
    """
    if any(hasattr(p, "ds_shape") for p in model.parameters()):
        raise ConfigError(
            "hf_state_dict needs full parameters, but the model is partitioned by ZeRO stage 3 (engine.save_16bit_model "
            "writes the experts under dscore's per-expert names, not the Hugging Face fused layout); load the "
            "checkpoint into an engine at ZeRO stage 0-2 (checkpoints load across stages) and call it there",
            path="zero_optimization.stage",
        )
    layers = {name: m for name, m in model.named_modules() if isinstance(m, AutoEPMoELayer)}
    out = {
        k: v for k, v in model.state_dict().items() if ".deepspeed_moe." not in k and not k.startswith("deepspeed_moe.")
    }
    for name, layer in layers.items():
        prefix = f"{name}." if name else ""
        experts = [m for m in layer.deepspeed_moe.modules() if isinstance(m, AutoEPExpert)]  # local order
        for attr, hf_name in (("gate_up_proj", layer.spec.w1), ("down_proj", layer.spec.w2)):
            local = torch.stack([getattr(e, attr).detach() for e in experts])
            if layer.ep_size > 1:
                comm = layer.deepspeed_moe.ep_comm
                if comm is None:
                    raise ConfigError(
                        f"AutoEP layer {name} has no expert-parallel group: build it through dscore.initialize",
                        path=f"{_KEY}.autoep_size",
                    )
                full = local.new_empty((layer.num_experts, *local.shape[1:]))
                comm.all_gather_into_tensor(full, local.contiguous())
            else:
                full = local.clone()
            out[f"{prefix}{layer.spec.experts}.{hf_name}"] = full
    return out
