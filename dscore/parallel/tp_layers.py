"""Tensor-parallel layers of AutoTP training: column- and row-split ``Linear``, split ``Embedding``.

Megatron-LM's split (Shoeybi et al. 2019, "Megatron-LM", §3), which DeepSpeed's AutoTP training uses:

* **column**: ``W`` (``[out, in]``) keeps rows ``out/tp`` per rank; the input is replicated, so its gradient
  is the sum over the group of each rank's partial gradient (identity forward, all-reduce backward); the
  output stays split along the last dim, or is all-gathered (``gather_output``).
* **row**: ``W`` keeps columns ``in/tp`` per rank; the input arrives split (from a column layer); the
  partial outputs are all-reduced and the (replicated) bias is added after the sum, once.
* **embedding**: the embedding dim is split like a column layer and the output gathered.

A fused weight (``shape: [3, -1]``, e.g. qkv) is split per sub-parameter so every rank keeps its slice of
each part. Each layer records how its parameters were split (:attr:`TPParam`) so that full tensors can be
gathered for checkpoints and sliced again on load (:func:`shard_of`, :func:`gather_full`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "ColumnParallelLinear",
    "EmbeddingDimSplit",
    "GatherReplacedLayerParams",
    "RowParallelLinear",
    "TPParam",
    "gather_full",
    "shard_of",
]


@dataclass(frozen=True)
class TPParam:
    """How one parameter is split: along ``dim`` into ``tp`` parts, per each of ``parts`` fused sub-parameters."""

    dim: int
    tp: int
    rank: int
    parts: int = 1


def shard_of(full: torch.Tensor, spec: TPParam) -> torch.Tensor:
    """This rank's slice of ``full`` (a contiguous copy).

    Raises:
        ValueError: the split dim does not divide by ``parts x tp``.
    """
    n = full.shape[spec.dim]
    if n % (spec.parts * spec.tp) != 0:
        raise ValueError(f"dim {spec.dim} of size {n} does not divide into {spec.parts} part(s) x tp {spec.tp}")
    pieces = full.chunk(spec.parts, dim=spec.dim)
    return torch.cat([p.chunk(spec.tp, dim=spec.dim)[spec.rank] for p in pieces], dim=spec.dim).contiguous()


def gather_full(shard: torch.Tensor, spec: TPParam, comm: Any) -> torch.Tensor:
    """The full tensor from every rank's ``shard`` (collective over the tensor-parallel ``comm``)."""
    shard = shard.detach().contiguous()
    outs = [torch.empty_like(shard) for _ in range(spec.tp)]
    comm.all_gather(outs, shard)
    per_rank = [o.chunk(spec.parts, dim=spec.dim) for o in outs]
    return torch.cat([per_rank[r][k] for k in range(spec.parts) for r in range(spec.tp)], dim=spec.dim)


def _keep_requires_grad(layer: torch.nn.Module, linear: torch.nn.Linear) -> Any:
    """Give the split ``layer``'s weight and bias the ``requires_grad`` of ``linear``'s (frozen stays frozen)."""
    layer.weight.requires_grad_(linear.weight.requires_grad)
    if layer.bias is not None and linear.bias is not None:
        layer.bias.requires_grad_(linear.bias.requires_grad)
    return layer


class _CopyToTP(torch.autograd.Function):
    """Identity forward; gradient summed over the tensor-parallel group (the input was replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Sum over the tensor-parallel group forward; identity backward (the output is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim forward (ranks in order); backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, tp: int, rank: int) -> torch.Tensor:
        ctx.tp, ctx.rank = tp, rank
        x = x.contiguous()
        outs = [torch.empty_like(x) for _ in range(tp)]
        comm.all_gather(outs, x)
        return torch.cat(outs, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.chunk(ctx.tp, dim=-1)[ctx.rank].contiguous(), None, None, None


class ColumnParallelLinear(torch.nn.Module):
    """A ``Linear`` whose output features are split over the tensor-parallel group.

    Shapes: input ``[..., in]`` (replicated), output ``[..., out/tp]`` (or ``[..., out]`` with
    ``gather_output``). Built from a full ``torch.nn.Linear`` by :meth:`from_linear`.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        comm: Any,
        tp: int,
        rank: int,
        parts: int = 1,
        gather_output: bool = False,
        in_features: int = 0,
        out_features: int = 0,
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=True)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=True)
        self.comm, self.tp, self.rank, self.gather_output = comm, tp, rank, gather_output
        self.in_features, self.out_features = in_features, out_features
        self.tp_params = {"weight": TPParam(0, tp, rank, parts)}
        if bias is not None:
            self.tp_params["bias"] = TPParam(0, tp, rank, parts)

    @classmethod
    def from_linear(
        cls, linear: torch.nn.Linear, *, comm: Any, tp: int, rank: int, parts: int = 1, gather_output: bool = False
    ) -> ColumnParallelLinear:
        """Split ``linear`` (its weights copied, its ``requires_grad`` kept)."""
        spec = TPParam(0, tp, rank, parts)
        with torch.no_grad():
            w = shard_of(linear.weight.detach(), spec)
            b = None if linear.bias is None else shard_of(linear.bias.detach(), spec)
        layer = cls(
            w,
            b,
            comm=comm,
            tp=tp,
            rank=rank,
            parts=parts,
            gather_output=gather_output,
            in_features=linear.in_features,
            out_features=linear.out_features,
        )
        return _keep_requires_grad(layer, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(_CopyToTP.apply(x, self.comm), self.weight, self.bias)
        if self.gather_output:
            y = _GatherLastDim.apply(y, self.comm, self.tp, self.rank)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} split over tp {self.tp}, gather={self.gather_output}"


class RowParallelLinear(torch.nn.Module):
    """A ``Linear`` whose input features are split; the output is all-reduced, then the bias is added.

    Shapes: input ``[..., in/tp]`` (split, as a column layer leaves it), output ``[..., out]`` (replicated).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        comm: Any,
        tp: int,
        rank: int,
        parts: int = 1,
        in_features: int = 0,
        out_features: int = 0,
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=True)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=True)
        self.comm, self.tp, self.rank = comm, tp, rank
        self.in_features, self.out_features = in_features, out_features
        self.tp_params = {"weight": TPParam(1, tp, rank, parts)}

    @classmethod
    def from_linear(
        cls, linear: torch.nn.Linear, *, comm: Any, tp: int, rank: int, parts: int = 1
    ) -> RowParallelLinear:
        """Split ``linear`` (the bias stays whole and is added after the all-reduce)."""
        with torch.no_grad():
            w = shard_of(linear.weight.detach(), TPParam(1, tp, rank, parts))
            b = None if linear.bias is None else linear.bias.detach().clone()
        layer = cls(
            w,
            b,
            comm=comm,
            tp=tp,
            rank=rank,
            parts=parts,
            in_features=linear.in_features,
            out_features=linear.out_features,
        )
        return _keep_requires_grad(layer, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} split over tp {self.tp}, out={self.out_features}"


class EmbeddingDimSplit(torch.nn.Module):
    """An ``Embedding`` whose embedding dim is split; the looked-up vectors are all-gathered to full width."""

    def __init__(self, emb: torch.nn.Embedding, *, comm: Any, tp: int, rank: int) -> None:
        super().__init__()
        spec = TPParam(1, tp, rank)
        with torch.no_grad():
            self.weight = torch.nn.Parameter(
                shard_of(emb.weight.detach(), spec), requires_grad=emb.weight.requires_grad
            )
        self.padding_idx, self.num_embeddings, self.embedding_dim = (
            emb.padding_idx,
            emb.num_embeddings,
            emb.embedding_dim,
        )
        self.comm, self.tp, self.rank = comm, tp, rank
        self.tp_params = {"weight": spec}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        part = F.embedding(ids, self.weight, self.padding_idx)
        return _GatherLastDim.apply(part, self.comm, self.tp, self.rank)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} split over tp {self.tp}"


_FULL_ATTR = "_dscore_tp_full"  # set on a split parameter while a GatherReplacedLayerParams holds it full


class GatherReplacedLayerParams:
    """DeepSpeed 0.19.8's ``deepspeed.module_inject.layers.GatherReplacedLayerParams``: inside the context the
    tensor-parallel split parameters among ``params`` hold their full tensors; on exit each rank keeps its
    slice of the (possibly modified) full tensor again.

    A parameter is "replaced" when an AutoTP layer of ``module`` (itself or a submodule with ``tp_params``:
    :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`EmbeddingDimSplit`) lists it as split.
    Other parameters (a row layer's replicated bias, norms, a model without tensor parallelism) are left as
    they are; when none of ``params`` is split the context does nothing (DeepSpeed's rule), as with
    ``enabled=False``. A parameter already held full by an enclosing context is not gathered again (the
    outer one re-slices it). Entering is collective over each layer's tensor-parallel group: every rank of it
    enters with the same parameters. An edit made inside the context is kept when every rank makes it (each
    slices its part of its own full copy), as in DeepSpeed.

    Under ZeRO-3 the split parameters are also partitioned over the data-parallel group: enter
    ``dscore.zero.GatheredParameters`` first (as DeepSpeed's engine does around this context).

    Args:
        params: one parameter or an iterable of them (e.g. ``module.parameters(recurse=False)``).
        module: the module they belong to (its submodules are searched too).
        enabled: False makes the context do nothing.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``, or ``params`` holds something not a tensor.
        RuntimeError (on enter): a split parameter is ZeRO-3 partitioned and not gathered.
    """

    def __init__(self, params: Iterable[torch.Tensor] | torch.Tensor, module: torch.nn.Module,
                 enabled: bool = True) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"GatherReplacedLayerParams: module must be a torch.nn.Module, got {type(module).__name__}")
        plist = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in plist:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"GatherReplacedLayerParams: params must be tensors, got a {type(p).__name__}")
        self.module, self.params = module, plist
        owners: dict[int, tuple[torch.nn.Module, TPParam]] = {}
        for layer in module.modules():
            specs = getattr(layer, "tp_params", None)
            if isinstance(specs, dict):
                for name, spec in specs.items():
                    t = getattr(layer, name, None)
                    if isinstance(t, torch.Tensor):
                        owners[id(t)] = (layer, spec)
        self._split = [(p, *owners[id(p)]) for p in plist if id(p) in owners]
        self.enabled = bool(enabled) and bool(self._split)
        self._held: list[tuple[torch.Tensor, TPParam, torch.Tensor]] = []

    def __enter__(self) -> None:
        if not self.enabled:
            return
        from dscore.zero.partition import unit_of

        for p, _layer, _spec in self._split:
            unit = unit_of(p)
            if unit is not None and not unit.gathered:
                raise RuntimeError(
                    "GatherReplacedLayerParams: a tensor-parallel parameter is ZeRO-3 partitioned and not gathered "
                    f"(shape {tuple(getattr(p, 'ds_shape', p.shape))}); enter dscore.zero.GatheredParameters("
                    "params) first"
                )
        for p, layer, spec in self._split:
            if getattr(p, _FULL_ATTR, False) or spec.tp == 1:
                continue
            shard = p.data  # kept: under ZeRO-3 it is a view of the unit's buffer, written back on exit
            with torch.no_grad():
                p.data = gather_full(shard, spec, layer.comm).contiguous()
            setattr(p, _FULL_ATTR, True)
            self._held.append((p, spec, shard))

    def __exit__(self, *exc: Any) -> None:
        for p, spec, shard in self._held:
            with torch.no_grad():
                shard.copy_(shard_of(p.data, spec))
                p.data = shard
            delattr(p, _FULL_ATTR)
        self._held = []
