"""The AutoEP layer: a Hugging Face MoE block made expert-parallel (its local experts, the token exchange
over the expert-parallel group and the combine; see :mod:`dscore_plugins.parallel.autoep.convert`)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dscore.errors import ConfigError
from dscore.moe.groups import group_name
from dscore.moe.layer import MoE
from dscore.moe.sharded_moe import all_to_all  # all_to_all_single over the EP group; backward is the same exchange
from dscore_plugins.parallel.autoep.routing import _KEY, LayerSpec, route

__all__ = ["AutoEPExpert", "AutoEPMoELayer"]

log = logging.getLogger("dscore.moe.autoep")

# --------------------------------------------------------------------------------------------- dispatch


def _gate_fn(name: str) -> Any:
    return F.silu if name == "swiglu" else (lambda t: F.gelu(t, approximate="tanh"))


class AutoEPExpert(nn.Module):
    """One gated expert MLP: ``down_proj · (act(gate) * up)`` with ``[gate; up] = gate_up_proj · x``.

    Args:
        gate_up_proj: ``[2F, H]`` (copied); down_proj: ``[H, F]`` (copied).
        act: the gate activation (the source experts' ``act_fn`` when it matches the configured form).
        requires_grad: of the two weights (the source's: frozen experts stay frozen).
    """

    def __init__(
        self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: Any, requires_grad: tuple[bool, bool]
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj.detach().clone(), requires_grad=requires_grad[0])
        self.down_proj = nn.Parameter(down_proj.detach().clone(), requires_grad=requires_grad[1])
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, H]`` -> ``[R, H]`` (zero rows stay zero: no biases)."""
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj)


class _LocalExperts(nn.Module):
    """Holds this rank's experts under the names :mod:`dscore.moe.checkpoint` expects."""

    def __init__(self, experts: list[AutoEPExpert]) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(experts)


class _Dispatch(nn.Module):
    """The expert-parallel part of an :class:`AutoEPMoELayer` (``deepspeed_moe``, as in ``MoE``)."""

    def __init__(self, experts: list[AutoEPExpert], ep_size: int) -> None:
        super().__init__()
        self.experts = _LocalExperts(experts)
        self.ep_size = ep_size
        self.ep_comm: Any = None
        self.capacity = 0
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def set_ep_comm(self, ep_comm: Any) -> None:
        """Exchange tokens over ``ep_comm`` (a :class:`dscore.comm.Comm` bound to the expert-parallel group)."""
        self.ep_comm = ep_comm

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, num_experts: int, post: bool
    ) -> torch.Tensor:
        """``x [T, H]``, ``weights [T, k]`` (fp32), ``experts [T, k]`` -> ``[T, H]`` (dtype of ``x``)."""
        t, h = x.shape
        k = experts.shape[1]
        local = len(self.experts.deepspeed_experts)
        flat = experts.reshape(-1)
        counts = torch.bincount(flat, minlength=num_experts)
        self.exp_counts = counts
        # each route's place among its expert's routes, in token order (a stable sort groups them)
        by_expert = torch.argsort(flat, stable=True)
        starts = counts.cumsum(0) - counts
        position = torch.empty_like(flat)
        position[by_expert] = torch.arange(flat.numel(), device=flat.device) - starts[flat[by_expert]]
        cap = counts.max().reshape(1).to(torch.int64)
        if self.ep_size > 1:
            if self.ep_comm is None:
                raise ConfigError(
                    "AutoEP layer has no expert-parallel group: build the model through dscore.initialize",
                    path=f"{_KEY}.autoep_size",
                )
            self.ep_comm.all_reduce(cap, op="max")
        capacity = max(int(cap.item()), 1)
        self.capacity = capacity
        slot = flat * capacity + position  # expert-major: ascending slot = ascending expert, then token order
        token = torch.arange(t, device=x.device).repeat_interleave(k)
        routed = x.index_select(0, token)
        w = weights.reshape(-1)
        if not post:
            routed = (routed * w.unsqueeze(1)).to(x.dtype)
        send = x.new_zeros(num_experts * capacity, h).index_add(0, slot, routed)
        recv = all_to_all(self.ep_comm, send) if self.ep_size > 1 else send
        recv = recv.view(self.ep_size, local, capacity, h)
        outs = [
            expert(recv[:, i].reshape(-1, h)).view(self.ep_size, 1, capacity, h)
            for i, expert in enumerate(self.experts.deepspeed_experts)
        ]
        done = torch.cat(outs, dim=1).reshape(num_experts * capacity, h)
        back = all_to_all(self.ep_comm, done) if self.ep_size > 1 else done
        order = torch.argsort(slot)
        picked = back.index_select(0, slot[order])
        if post:
            picked = (picked * w[order].unsqueeze(1)).to(x.dtype)
        return x.new_zeros(t, h).index_add(0, token[order], picked)


class AutoEPMoELayer(MoE):
    """A Hugging Face MoE block made expert-parallel (see the module docstring).

    Keeps the block's router (``<router>``), shared experts and their gate under their own names; this
    rank's routed experts live in ``deepspeed_moe.experts.deepspeed_experts`` (local index ``l`` is global
    expert ``ep_rank * N / E + l``).

    Args:
        source: the Hugging Face block (its router / shared experts are reused, its experts copied).
        spec: the detected layout and routing.
        ep_size / ep_rank: expert-parallel size and this rank's position in its group.
        act: the gate activation.
    """

    def __init__(self, source: nn.Module, spec: LayerSpec, ep_size: int, ep_rank: int, act: Any) -> None:
        nn.Module.__init__(self)  # MoE's own constructor builds a DeepSpeed gate this layer does not use
        self.spec = spec
        self.use_residual = False
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.expert_group_name = group_name(ep_size)
        self.num_experts = spec.num_experts
        self.num_local_experts = spec.num_experts // ep_size
        self.router_name = spec.router
        setattr(self, spec.router, getattr(source, spec.router))
        experts_src = getattr(source, spec.experts)
        w1, w2 = getattr(experts_src, spec.w1), getattr(experts_src, spec.w2)
        first = ep_rank * self.num_local_experts
        with torch.no_grad():
            local = [
                AutoEPExpert(w1[first + i], w2[first + i], act, (bool(w1.requires_grad), bool(w2.requires_grad)))
                for i in range(self.num_local_experts)
            ]
        for expert in local:
            for p in expert.parameters():
                p.allreduce = False  # type: ignore[attr-defined]
                p.group_name = self.expert_group_name  # type: ignore[attr-defined]
        self.deepspeed_moe = _Dispatch(local, ep_size)  # type: ignore[assignment]  # MoE's slot, same duties
        self.shared_name = spec.shared_experts if getattr(source, spec.shared_experts or "_", None) is not None else ""
        if self.shared_name:
            setattr(self, self.shared_name, getattr(source, self.shared_name))
        self.shared_gate_name = (
            spec.shared_experts_gate
            if self.shared_name and getattr(source, spec.shared_experts_gate or "_", None) is not None
            else ""
        )
        if self.shared_gate_name:
            setattr(self, self.shared_gate_name, getattr(source, self.shared_gate_name))
        router = getattr(source, spec.router)
        self._has_correction_bias = getattr(router, "e_score_correction_bias", None) is not None

    def set_deepspeed_parallelism(
        self, comm: Any = None, use_data_before_expert_parallel_: bool = False, **kwargs: Any
    ) -> None:
        """Use the expert groups of ``ep_size`` over ``comm`` (collective; the engine calls it). Keyword
        arguments (the run's ``mesh``) go to :meth:`MoE.set_deepspeed_parallelism`.

        Raises:
            ConfigError: the groups give this rank another expert-parallel rank than the one whose experts
                the layer was built with, or as :meth:`MoE.set_deepspeed_parallelism`.
        """
        rank = self.ep_rank
        super().set_deepspeed_parallelism(comm, use_data_before_expert_parallel_, **kwargs)
        if self.ep_rank != rank:
            raise ConfigError(
                f"AutoEP layer {self.spec.name} was built for expert-parallel rank {rank}, the groups say "
                f"{self.ep_rank}; build the engine over the communicator the layer was converted with",
                path=f"{_KEY}.autoep_size",
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``hidden_states [B, S, H]`` -> ``[B, S, H]``, the Hugging Face block's contract."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        router = getattr(self, self.router_name)
        out = router(x)
        logits = out[0] if isinstance(out, tuple) else out
        bias = router.e_score_correction_bias if self._has_correction_bias else None
        weights, experts = route(logits, self.spec, bias)
        if self.spec.weights_in_input_dtype:
            weights = weights.to(x.dtype)
        y = self.deepspeed_moe(x, weights, experts, self.num_experts, self.spec.score_apply == "post")
        if self.shared_name:
            shared = getattr(self, self.shared_name)(x)
            if self.shared_gate_name:
                shared = torch.sigmoid(getattr(self, self.shared_gate_name)(x)) * shared
            y = y + shared
        return y.reshape(shape)
