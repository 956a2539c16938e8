"""The mixture-of-experts layer (DeepSpeed 0.19.8's ``deepspeed.moe.layer.MoE``: same arguments, same
``(output, l_aux, exp_counts)`` return)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dscore.errors import ConfigError
from dscore.moe.experts import Experts
from dscore.moe.groups import expert_groups, group_name
from dscore.moe.sharded_moe import MOELayer, TopKGate

__all__ = ["MoE"]

log = logging.getLogger("dscore.moe")


class MoE(nn.Module):
    """A mixture-of-experts layer with ``num_experts`` copies of ``expert`` spread over ``ep_size`` ranks.

    Args:
        hidden_size: model width ``M`` (input and output size).
        expert: the expert module (deep-copied ``num_experts / ep_size`` times on each rank).
        num_experts: experts in the layer (all ranks of an expert-parallel group together).
        ep_size: expert-parallel size: ranks the experts are spread over (divides the data-parallel world).
        k: experts per token (top-k gating).
        capacity_factor / eval_capacity_factor: expert capacity factor in training / eval.
        min_capacity: smallest capacity per expert.
        use_residual: Residual MoE (Rajbhandari et al. 2022): ``out = moe · c0 + mlp(x) · c1`` with
            ``c = softmax(Linear(hidden_size, 2)(x))`` and ``mlp`` the given ``expert``.
        noisy_gate_policy: ``None``/``"None"``, ``"Jitter"`` (input jitter) or ``"RSample"`` (Gumbel noise
            on top-1 logits), training only.
        drop_tokens: drop routes beyond capacity (False: capacity = the largest expert load, no drops).
        use_rts: random token selection when an expert is over capacity (top-1).
        use_tutel: must be False (Tutel kernels are not available in dscore).
        enable_expert_tensor_parallelism: must be False (dscore has no tensor parallelism).
        top2_2nd_expert_sampling: Gumbel sampling of the second expert (top-2, training).

    Raises:
        ConfigError: ``num_experts`` not divisible by ``ep_size``, an unknown ``noisy_gate_policy``,
            ``k`` out of range, or an option dscore does not implement (named).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ConfigError(f"MoE: num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        if use_tutel:
            raise ConfigError("MoE(use_tutel=True): Tutel kernels are not available in dscore; use use_tutel=False")
        if enable_expert_tensor_parallelism:
            raise ConfigError("MoE(enable_expert_tensor_parallelism=True): dscore has no tensor parallelism; use False")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.expert_group_name = group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        log.info(
            "MoE layer: num_experts %d | num_local_experts %d | expert_parallel_size %d",
            num_experts, self.num_local_experts, ep_size,
        )  # fmt: skip
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)  # fmt: skip
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        self.ep_rank = 0

    def set_deepspeed_parallelism(
        self, comm: Any = None, use_data_before_expert_parallel_: bool = False, *, mesh: Any = None
    ) -> None:
        """Create (or reuse) the expert groups of ``ep_size`` over ``comm`` (default: the active
        :func:`dscore.comm.active_comm`) and use them: the groups of ``mesh`` (the run's
        :class:`dscore.parallel.mesh.ParallelMesh`) when given. Collective. ``dscore.initialize`` calls it
        with the engine's mesh.

        Raises:
            ConfigError: ``use_data_before_expert_parallel_`` (not implemented), ``ep_size`` does not
                divide the world size, or the mesh has tensor / sequence parallelism.
        """
        if use_data_before_expert_parallel_:
            raise ConfigError("use_data_before_expert_parallelism is not implemented by dscore")
        if comm is None:
            from dscore.comm.api import active_comm

            comm = active_comm()
        groups = expert_groups(comm, self.ep_size, mesh=mesh)
        self.ep_rank = groups.ep_rank
        self.deepspeed_moe.set_ep_comm(groups.ep_comm)

    @property
    def global_expert_ids(self) -> list[int]:
        """Global indices of this rank's experts (``ep_rank · num_local_experts + l``)."""
        return [self.ep_rank * self.num_local_experts + i for i in range(self.num_local_experts)]

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden_states``: ``[..., hidden_size]``.

        Returns:
            ``(output [same shape], l_aux (scalar fp32), exp_counts [num_experts] int64)``.
        """
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mlp_out = self.mlp(hidden_states)
            if isinstance(mlp_out, tuple):
                mlp_out = mlp_out[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp_out * coef[..., 1:]
        assert self.deepspeed_moe.l_aux is not None and self.deepspeed_moe.exp_counts is not None
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
