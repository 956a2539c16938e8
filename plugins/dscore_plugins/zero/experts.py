"""MoE expert parameters in the partitioned ZeRO stages: which group each parameter is partitioned over,
and the fan-out over one gradient reducer per group.

DeepSpeed 0.19.8 (``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py``, restated): an optimizer
group made of expert parameters (``split_params_into_different_moe_groups_for_optimizer``) is partitioned,
gathered and reduce-scattered over its *expert-data-parallel* (EDP) group, the ranks that hold the same
experts; every other group over the data-parallel group. Expert gradients are summed over the EDP group
and divided by the whole data-parallel world size, as the other gradients are (a token's loss reaches
its expert through the all-to-all, so the expert's gradient sums over every rank's tokens).

Expert partitions of one rank are disjoint from every other rank's (a rank holds a chunk of its EDP
group's experts; other EP ranks hold other experts), so the global gradient norm is the sum of squares
over the whole data-parallel group, as for dense partitions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dscore.errors import ConfigError
from dscore.moe.checkpoint import ExpertNaming
from dscore.moe.groups import expert_groups
from dscore.moe.utils import is_moe_param
from dscore.zero.reducer import GradientReducer

__all__ = [
    "ReducerSet",
    "expert_comm",
    "globalize_state",
    "group_comm",
    "localize_state",
    "refuse_nvme_with_experts",
]


def expert_comm(comm: Any, p: torch.Tensor, mesh: Any = None) -> Any:
    """The comm parameter ``p`` is partitioned over: its EDP group's for an MoE expert parameter
    (``group_name = "ep_size_<E>"``; a group of ``mesh``, the run's mesh, when given), else ``comm`` (the
    data-parallel group's). Collective on first use of an ``ep_size`` (:func:`dscore.moe.groups.expert_groups`)."""
    if not is_moe_param(p):
        return comm
    ep_size = int(p.group_name.rsplit("_", 1)[1])  # type: ignore[attr-defined]
    return expert_groups(comm, ep_size, mesh=mesh).edp_comm


def group_comm(comm: Any, gi: int, params: Sequence[torch.nn.Parameter], mesh: Any = None) -> Any:
    """The comm optimizer group ``gi`` is partitioned over: ``comm``, or for a group of MoE expert
    parameters its expert-data-parallel one (``mesh``: as :func:`expert_comm`).

    Raises:
        ConfigError: the group mixes expert parameters with others (or expert-parallel sizes): build the
            groups with ``split_params_into_different_moe_groups_for_optimizer`` (DeepSpeed requires it).
    """
    experts = [p for p in params if is_moe_param(p)]
    if not experts:
        return comm
    if len(experts) != len(params) or len({p.group_name for p in experts}) != 1:  # type: ignore[attr-defined]
        raise ConfigError(
            f"optimizer parameter group {gi} mixes MoE expert parameters with other parameters; under "
            "zero_optimization.stage >= 1 expert parameters need groups of their own: pass "
            "dscore.moe.utils.split_params_into_different_moe_groups_for_optimizer({'params': ...}) "
            "to dscore.initialize (as DeepSpeed requires)"
        )
    return expert_comm(comm, experts[0], mesh)


def refuse_nvme_with_experts(section: Any) -> None:
    """Refuse NVMe offload (``offload_param`` / ``offload_optimizer`` ``device: nvme``) for a model with MoE
    expert parameters at stage 3: its swap files are not verified with expert-data-parallel partitions.

    Raises:
        ConfigError: naming the key; ``device: cpu`` or ``none`` is valid.
    """
    for key in ("offload_param", "offload_optimizer"):
        sub = getattr(section, key, None)
        if sub is not None and getattr(sub, "device", None) == "nvme":
            raise ConfigError(
                f"zero_optimization.{key}.device 'nvme' with MoE expert parameters (dscore.moe.layer.MoE) is not "
                "implemented at stage 3; use device 'cpu' or 'none'",
                path=f"zero_optimization.{key}.device",
            )


def globalize_state(module: torch.nn.Module, out: dict[str, Any]) -> dict[str, Any]:
    """Rename a :func:`dscore.zero.layout.partitioned_state_dict` result's experts to their global
    indices and add the other EP ranks' experts (collective over each EP group; :mod:`dscore.moe.checkpoint`).
    No-op for a model without MoE layers."""
    naming = ExpertNaming(module)
    if not naming:
        return out
    out["param_names"] = naming.globalize_names(out["param_names"])
    out["state"] = naming.globalize(out["state"])
    out["fp32_params"] = naming.globalize(out["fp32_params"])
    for group in out["param_groups"]:
        group["param_names"] = naming.globalize_names(group["param_names"])
    return out


def localize_state(module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`globalize_state` for loading: this rank's experts under their local names
    (a shallow copy; other ranks' experts dropped). No-op for a model without MoE layers."""
    naming = ExpertNaming(module)
    if not naming:
        return state
    state = dict(state)
    state["state"] = naming.localize(state.get("state", {}))
    if state.get("fp32_params"):
        state["fp32_params"] = naming.localize(state["fp32_params"])
    return state


class ReducerSet:
    """One :class:`dscore.zero.reducer.GradientReducer` per process group (the data-parallel group's first,
    then each EDP group's), driven as one: every call goes to each in that order. Each reducer's buckets
    launch in the same order on every rank of its group, so the groups cannot pair collectives wrongly.

    Args:
        reducers: the reducers (at least one).
    """

    def __init__(self, reducers: Sequence[GradientReducer]) -> None:
        self.reducers = list(reducers)

    def register_hooks(self) -> list[Any]:
        """Every reducer's post-accumulate-grad hooks."""
        return [h for r in self.reducers for h in r.register_hooks()]

    def begin(self, **kwargs: Any) -> None:
        """:meth:`GradientReducer.begin` on each."""
        for r in self.reducers:
            r.begin(**kwargs)

    def end(self) -> None:
        """:meth:`GradientReducer.end` on each."""
        for r in self.reducers:
            r.end()

    def flush(self) -> None:
        """Launch what is left and wait, reducer by reducer."""
        for r in self.reducers:
            r.flush()

    def reset(self) -> None:
        """:meth:`GradientReducer.reset` on each."""
        for r in self.reducers:
            r.reset()

    def buffers(self) -> list[torch.Tensor]:
        """Every reducer's gradient buffers."""
        return [t for r in self.reducers for t in r.buffers()]

    @property
    def copy_seconds(self) -> float:
        """Seconds spent copying gradients into staging since :meth:`begin`, all reducers together."""
        return sum(r.copy_seconds for r in self.reducers)
