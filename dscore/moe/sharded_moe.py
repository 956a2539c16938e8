"""Top-k gating with capacity and the all-to-all expert dispatch (GShard, Lepikhin et al. 2020, Alg. 2;
DeepSpeed 0.19.8's ``deepspeed/moe/sharded_moe.py`` semantics, written anew).

Notation: ``S`` tokens, ``E`` experts, capacity ``C`` tokens per expert, model width ``M``.

**Gating** (all in fp32): ``gates = softmax(x · Wgᵀ)`` ``[S, E]``.

* ``k = 1``: each token's expert is ``argmax(gates)`` (with ``noisy_gate_policy="RSample"`` in training:
  argmax of logits plus Gumbel noise); ``used_token`` masks tokens out. The auxiliary load-balancing loss
  is ``l_aux = E · Σ_e mean_s(gates[:, e]) · mean_s(mask[:, e])``. Capacity
  ``C = max(ceil(S / E · capacity_factor), min_capacity)``; with ``drop_tokens`` an expert keeps at most
  ``C`` of its tokens: with ``use_rts`` a uniformly random choice (Random Token Selection), else the
  first ``C`` in token order; the kept token's combine weight is its gate value (not renormalized).
* ``k = 2``: first expert ``argmax(gates)``, second the argmax of the other experts' logits (plus Gumbel
  noise when ``top2_2nd_expert_sampling``); ``l_aux = E² · mean_e(mean_s(gates)·mean_s(mask1))``;
  capacity uses ``2 · capacity_factor``; a token's slots in an expert's buffer follow token order, first
  choices before second choices, and routes past ``C`` are dropped; the two kept gates are renormalized
  to sum to 1.
* ``k > 2``: the ``k`` largest gates; ``l_aux = E² / k · mean_e(...)``; capacity uses ``k ·
  capacity_factor`` and keeps, per expert, the ``C`` routes with the largest gate values; kept gates are
  renormalized.
* ``drop_tokens=False``: ``C`` is the largest number of tokens any expert received, maximised over the
  expert-parallel group (so every rank's buffers agree), at most ``S`` for ``k = 1``: no token is dropped.

``exp_counts`` is the number of routes each expert received before capacity was applied.

**Dispatch.** Tokens are written into an ``[E, C, M]`` buffer, which one ``all_to_all_single`` over the
expert-parallel group turns into ``[ep_size, E_local, C, M]`` (each rank's buffers for its own experts);
the experts run, a second all-to-all returns the results, and each token's output is the gate-weighted
sum of its experts' outputs. The all-to-all's backward is the same all-to-all of the gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dscore.errors import ConfigError

__all__ = ["MOELayer", "TopKGate", "all_to_all", "top1gating", "top2gating", "topkgating"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 over the expert-parallel group; backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, comm: Any, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        ctx.comm = comm
        src = input.contiguous()
        out = torch.empty_like(src)
        comm.all_to_all_single(out, src)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.comm, grad)


def all_to_all(comm: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of ``tensor`` along dim 0 over ``comm`` (a
    :class:`dscore.comm.Comm` of the expert-parallel group): dim 0 must divide by the group size, chunk ``i``
    goes to rank ``i``; the result has the same shape and dtype. Its backward is the same exchange of the
    gradient (an SDK building block of expert-parallel layers, :class:`MOELayer` and AutoEP's)."""
    out: torch.Tensor = _AllToAll.apply(comm, tensor)
    return out


def _gumbel(shape: torch.Size, device: torch.device) -> torch.Tensor:
    u = torch.rand(shape, device=device).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    return max(int(math.ceil(num_tokens / num_experts * capacity_factor)), int(min_capacity))


# the capacity without token dropping is data-dependent (a host value agreed over the expert group): under
# torch.compile this is one clean graph break per gating call rather than dynamo tracing a collective and .item()
@torch.compiler.disable
def _max_over(count: torch.Tensor, ep_comm: Any) -> int:
    value = count.detach().to(torch.int64).reshape(1).clone()
    if ep_comm is not None and ep_comm.get_world_size() > 1:
        ep_comm.all_reduce(value, op="max")
    return int(value.item())


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_comm: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-1 gating (module docstring). ``logits``: ``[S, E]`` fp32.

    Returns:
        ``(l_aux, combine_weights [S, E, C] fp32, dispatch_mask [S, E, C] bool, exp_counts [E])``.

    Raises:
        ConfigError: fewer tokens than ``min_capacity`` (DeepSpeed asserts the same).
    """
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = int(gates.shape[0]), int(gates.shape[1])
    if num_tokens < min_capacity:
        raise ConfigError(
            f"MoE top-1 gating got {num_tokens} tokens, fewer than min_capacity={min_capacity}: lower "
            "min_capacity or use a larger batch"
        )
    choose = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    indices = torch.argmax(choose, dim=1)
    mask = F.one_hot(indices, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = min(_max_over(exp_counts.max(), ep_comm), num_tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    scores = mask * torch.rand(mask.shape, device=mask.device) if use_rts else mask.float()
    # keep, per expert, the `capacity` highest-scoring routed tokens (random with RTS, else ties: the
    # first in token order, topk's tie order on equal scores is by index when `sorted`)
    if use_rts:
        keep_idx = torch.topk(scores, k=min(capacity, num_tokens), dim=0).indices
        keep = torch.zeros_like(mask).scatter_(0, keep_idx, 1)
        mask = mask * keep
    else:
        mask = mask * (torch.cumsum(mask, dim=0) <= capacity).to(mask.dtype)
    locations = torch.cumsum(mask, dim=0) - 1
    loc_s = torch.sum(locations * mask, dim=1)
    gates = gates * mask.float()
    combine = gates.unsqueeze(2) * F.one_hot(loc_s, num_classes=capacity).float().unsqueeze(1)
    return l_aux, combine, combine.bool(), exp_counts


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_comm: Any = None,
    top2_2nd_expert_sampling: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-2 gating (module docstring); same returns as :func:`top1gating`."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = int(gates.shape[0]), int(gates.shape[1])
    idx1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(idx1, num_classes=num_experts)
    second = logits + _gumbel(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    idx2 = torch.argmax(second.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(idx2, num_classes=num_experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (loc1 < capacity).to(mask1.dtype)
        mask2 = mask2 * (loc2 < capacity).to(mask2.dtype)
    else:
        capacity = _max_over(exp_counts.max(), ep_comm)
    loc1_s = torch.sum(loc1 * mask1, dim=1)
    loc2_s = torch.sum(loc2 * mask2, dim=1)
    g1 = (gates * mask1.float()).sum(dim=1)
    g2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    combine = (g1.unsqueeze(1) * mask1.float()).unsqueeze(2) * F.one_hot(loc1_s, capacity).float().unsqueeze(1)
    combine = combine + (g2.unsqueeze(1) * mask2.float()).unsqueeze(2) * F.one_hot(loc2_s, capacity).float().unsqueeze(
        1
    )
    return l_aux, combine, combine.bool(), exp_counts


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_comm: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k gating for ``k > 2`` (module docstring); same returns as :func:`top1gating`."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = int(gates.shape[0]), int(gates.shape[1])
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        masked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        keep_idx = torch.topk(masked, k=min(capacity, num_tokens), dim=0).indices
        mask = mask & torch.zeros_like(mask).scatter_(0, keep_idx, True)
    else:
        capacity = _max_over(exp_counts.max(), ep_comm)
    locations = torch.cumsum(mask.to(torch.int64), dim=0) - 1
    gm = gates * mask
    gm = gm / torch.clamp(gm.sum(dim=-1, keepdim=True), min=torch.finfo(gm.dtype).eps)
    loc_sc = F.one_hot(locations * mask, num_classes=capacity).float()
    combine = gm.unsqueeze(2) * loc_sc
    return l_aux, combine, combine.bool(), exp_counts


class _GateLinear(nn.Linear):
    """The gate's projection, computed in fp32 whatever the weight's dtype (DeepSpeed's
    ``F.linear(input.float(), wg.weight.float())``). Called as a module so ZeRO stage 3's hooks gather its
    weight around the call."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """``input``: ``[S, M]`` (any float dtype) -> fp32 logits ``[S, E]``."""
        return F.linear(input.float(), self.weight.float())


class TopKGate(nn.Module):
    """The router: ``wg`` (``Linear(model_dim, num_experts, bias=False)``, computed in fp32) and the gating
    of :func:`top1gating` / :func:`top2gating` / :func:`topkgating` (capacity ``capacity_factor`` in
    training, ``eval_capacity_factor`` in eval; noise only in training).

    Raises:
        ConfigError: ``k`` < 1 or > ``num_experts``; an unknown ``noisy_gate_policy``.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_comm: Any = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ConfigError(f"MoE k={k}: top-k gating needs 1 <= k <= num_experts ({num_experts})")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ConfigError(
                f"MoE noisy_gate_policy={noisy_gate_policy!r}: valid are None, 'None', 'Jitter', 'RSample'"
            )
        self.wg = _GateLinear(model_dim, num_experts, bias=False)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.ep_comm = ep_comm
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(
        self,
        input: torch.Tensor,
        used_token: torch.Tensor | None = None,  # noqa: A002
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input``: ``[S, M]``. Returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            eps = 1e-2
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        logits = self.wg(x)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return top1gating(logits, cf, self.min_capacity, used_token, policy, self.drop_tokens, self.use_rts,
                              self.ep_comm)  # fmt: skip
        if self.k == 2:
            return top2gating(logits, cf, self.min_capacity, self.drop_tokens, self.ep_comm,
                              self.top2_2nd_expert_sampling and self.training)  # fmt: skip
        return topkgating(logits, self.k, cf, self.min_capacity, self.drop_tokens, self.ep_comm)


class MOELayer(nn.Module):
    """Gate, dispatch, local experts, combine (module docstring).

    Attributes:
        l_aux / exp_counts: of the last forward.
    """

    def __init__(
        self, gate: TopKGate, experts: nn.Module, ep_group_name: str, ep_size: int, num_local_experts: int
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.ep_comm: Any = None
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def set_ep_comm(self, ep_comm: Any) -> None:
        """Use ``ep_comm`` (a :class:`dscore.comm.Comm` over the expert-parallel group) for the exchanges."""
        self.ep_comm = ep_comm
        self.gate.ep_comm = ep_comm

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden``: ``[..., M]``; returns the same shape.

        Raises:
            ConfigError: ``ep_size > 1`` but no expert-parallel group was set (the engine sets it;
                standalone, call ``MoE.set_deepspeed_parallelism(comm)``).
        """
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        self.l_aux, combine, dispatch, self.exp_counts = self.gate(tokens, used_token)
        dispatched = torch.einsum("sec,sm->ecm", dispatch.to(tokens.dtype), tokens)
        if self.ep_size > 1:
            if self.ep_comm is None:
                raise ConfigError(
                    f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: build it through "
                    "dscore.initialize or call set_deepspeed_parallelism(comm) first"
                )
            dispatched = _AllToAll.apply(self.ep_comm, dispatched)
        capacity = dispatched.shape[1]
        out = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, capacity, d_model))
        out = out.reshape(self.ep_size * self.num_local_experts, capacity, d_model)
        if self.ep_size > 1:
            out = _AllToAll.apply(self.ep_comm, out)
        combined = torch.einsum("sec,ecm->sm", combine.to(tokens.dtype), out)
        return combined.reshape(hidden.shape)
