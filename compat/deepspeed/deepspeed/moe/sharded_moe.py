"""``deepspeed.moe.sharded_moe``: DeepSpeed 0.19.8's gating functions on :mod:`dscore.moe.sharded_moe`.

``top1gating``, ``top2gating`` and ``topkgating`` take DeepSpeed's arguments and return DeepSpeed's
``(l_aux, combine_weights [S, E, C], dispatch_mask [S, E, C], exp_counts [E])``: ``ep_group`` (a
``torch.distributed`` group, None for the world) is what the capacity of ``drop_tokens=False`` is maximised over.
DeepSpeed's sparse-route and Tutel paths (``sparse_routes=True``, ``use_tutel=True``) and ``topkgating``'s
``drop_policy="position"`` are not provided: they raise :class:`NotProvidedError`. The module's other names
(``MOELayer``, ``TopKGate``, the private sparse encode / decode helpers) import and raise the same error when used;
the MoE layer is ``deepspeed.moe.layer.MoE``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepspeed._not_provided import NotProvidedError, not_provided
from dscore.moe import sharded_moe as _impl
from dscore.parallel.ulysses import as_comm

__all__ = ["top1gating", "top2gating", "topkgating"]

if TYPE_CHECKING:
    import torch

    _Gating = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _refuse(fn: str, what: str) -> None:
    raise NotProvidedError(f"deepspeed.moe.sharded_moe.{fn}({what}) (DeepSpeed 0.19.8) is not provided by dscore: "
                           "dscore routes with dense [S, E, C] combine weights only")


def _comm(ep_group: Any) -> Any:
    import torch.distributed as dist

    return as_comm(ep_group) if dist.is_available() and dist.is_initialized() else None


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Any = None, sparse_routes: bool = False, use_tutel: bool = False) -> _Gating:
    """Top-1 gating of ``logits`` (``[S, E]`` fp32), DeepSpeed's semantics (:func:`dscore.moe.sharded_moe.top1gating`).

    Raises:
        NotProvidedError: ``sparse_routes`` or ``use_tutel``.
        ConfigError: fewer tokens than ``min_capacity``.
    """
    if sparse_routes or use_tutel:
        _refuse("top1gating", "sparse_routes=True" if sparse_routes else "use_tutel=True")
    return _impl.top1gating(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens,
                            use_rts, ep_comm=_comm(ep_group))


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False) -> _Gating:
    """Top-2 gating of ``logits`` (``[S, E]`` fp32), DeepSpeed's semantics (capacity from ``2 x capacity_factor``).

    Raises:
        NotProvidedError: ``sparse_routes``.
    """
    if sparse_routes:
        _refuse("top2gating", "sparse_routes=True")
    return _impl.top2gating(logits, capacity_factor, min_capacity, drop_tokens, ep_comm=_comm(ep_group),
                            top2_2nd_expert_sampling=top2_2nd_expert_sampling)


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs", sparse_routes: bool = False) -> _Gating:
    """Top-k gating of ``logits`` (``[S, E]`` fp32), DeepSpeed's semantics (capacity from ``k x capacity_factor``;
    over capacity the lowest-probability assignments are dropped, DeepSpeed's default ``drop_policy="probs"``).

    Raises:
        NotProvidedError: ``sparse_routes`` or ``drop_policy="position"``.
        ValueError: another ``drop_policy``.
    """
    if sparse_routes:
        _refuse("topkgating", "sparse_routes=True")
    if drop_policy == "position":
        _refuse("topkgating", "drop_policy='position'")
    if drop_policy != "probs":
        raise ValueError(f"topkgating drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    return _impl.topkgating(logits, k, capacity_factor, min_capacity, drop_tokens, ep_comm=_comm(ep_group))


_REASON = "use deepspeed.moe.layer.MoE (dscore.moe.layer.MoE), which builds its gate and dispatch itself"
globals().update({name: not_provided(f"{__name__}.{name}", _REASON) for name in (
    "MOELayer", "TopKGate", "_route_slots", "_sparse_encode", "_sparse_decode", "gumbel_rsample", "multiplicative_jitter",
    "einsum", "_AllToAll", "_capacity", "_top_idx", "_one_hot_to_float")})
