"""Tiled compute along the sequence: :class:`TiledMLP` and :func:`sequence_tiled_compute` run a token-wise
function over sequence tiles and recompute it tile by tile in backward, so one tile's activations live at a time."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dscore.errors import ConfigError

__all__ = ["TiledMLP", "sequence_tiled_compute"]

log = logging.getLogger("dscore.parallel.ulysses")


@dataclass(frozen=True)
class _TileSpec:
    fn: Callable[..., torch.Tensor]
    module: Any
    shards: int
    dim: int
    params: tuple[torch.nn.Parameter, ...]


class _Tiled(torch.autograd.Function):
    """Forward ``fn`` tile by tile without keeping graphs; backward recomputes each tile with grad."""

    @staticmethod
    def forward(ctx: Any, spec: _TileSpec, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.spec = spec
        ctx.save_for_backward(x)
        with torch.no_grad():
            if spec.shards == 1:  # one tile: the output may be anything (a scalar loss)
                return spec.fn(spec.module, x)
            outs = [spec.fn(spec.module, piece) for piece in x.chunk(spec.shards, dim=spec.dim)]
        return torch.cat(outs, dim=spec.dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        spec: _TileSpec = ctx.spec
        (x,) = ctx.saved_tensors
        need_x = bool(ctx.needs_input_grad[1])
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
        param_grads: list[torch.Tensor | None] = [None] * len(spec.params)
        x_grads: list[torch.Tensor] = []
        if spec.shards == 1:
            tiles = [(x.detach(), grad)]
        else:
            tiles = list(zip(x.detach().chunk(spec.shards, dim=spec.dim), grad.chunk(spec.shards, dim=spec.dim)))
        for piece, g in tiles:
            piece = piece.detach().requires_grad_(need_x)
            with torch.enable_grad():
                out = spec.fn(spec.module, piece)
            inputs = ([piece] if need_x else []) + [spec.params[i] for i in wanted]
            if not inputs:
                continue
            got = torch.autograd.grad(out, inputs, g, allow_unused=True)
            if need_x:
                x_grads.append(got[0] if got[0] is not None else torch.zeros_like(piece))
                got = got[1:]
            for i, gi in zip(wanted, got):
                if gi is not None:
                    acc = param_grads[i]
                    param_grads[i] = gi if acc is None else acc + gi
        x_grad = torch.cat(x_grads, dim=spec.dim) if need_x else None
        return (None, x_grad, *param_grads)


class TiledMLP:
    """DeepSpeed's ``TiledMLP``: ``TiledMLP.apply(fn, module, x, shards, compute_params)``.

    Computes ``fn(module, x)`` (a token-wise function, usually an MLP's forward) over ``shards`` tiles of the
    sequence dim (dim -2 of ``[b, S, h]``): the forward keeps no intermediate activations, the backward
    recomputes each tile and accumulates the gradients of ``compute_params`` (the module's parameters) and
    of ``x``. Outputs equal the untiled function's; parameter gradients are sums over tiles.
    """

    @staticmethod
    def apply(
        fn: Callable[..., torch.Tensor],
        module: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Iterable[torch.nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """Run ``fn(module, x)`` tiled (see the class docstring).

        Raises:
            ConfigError: ``shards`` below 1.
        """
        if int(shards) < 1:
            raise ConfigError(f"TiledMLP: shards must be at least 1, got {shards}")
        params = [p for p in (compute_params if compute_params is not None else module.parameters()) if p.requires_grad]
        return _tiled(fn, module, x, int(shards), x.dim() - 2, params)


def _tiled(
    fn: Callable[..., torch.Tensor],
    module: Any,
    x: torch.Tensor,
    shards: int,
    dim: int,
    params: list[torch.nn.Parameter],
) -> torch.Tensor:
    spec = _TileSpec(fn, module, shards, dim, tuple(params))
    result: torch.Tensor = _Tiled.apply(spec, x, *params)
    return result


def sequence_tiled_compute(
    fn: Callable[..., Any],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, torch.Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Iterable[torch.nn.Parameter] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """DeepSpeed's ``SequenceTiledCompute``: ``fn(**tile_kwargs, **kwargs_to_pass)`` over sequence tiles.

    Each tensor of ``kwargs_to_shard`` is cut along dim 1 (its sequence dim, length ``seqlen``) into
    ``shards`` tiles; ``fn`` runs per tile without keeping its graph and is recomputed per tile in the
    backward. The per-tile outputs are concatenated along ``output_unshard_dimension``
    (``output_reduction=None``), or combined as their ``"sum"`` or ``"mean"`` (mean weights every tile by
    its length, so it equals ``fn`` over the whole sequence for a per-token mean such as a loss).

    Raises:
        ConfigError: a sharded tensor's dim 1 is not ``seqlen``; ``output_reduction`` unknown.
    """
    if output_reduction not in (None, "sum", "mean"):
        raise ConfigError(
            f"sequence_tiled_compute: output_reduction must be None, 'sum' or 'mean', got {output_reduction!r}"
        )
    for key, t in kwargs_to_shard.items():
        if t.shape[1] != seqlen:
            raise ConfigError(
                f"sequence_tiled_compute: {key} has {t.shape[1]} positions on dim 1, expected seqlen {seqlen}"
            )
    x = kwargs_to_shard[grad_requiring_tensor_key]
    others = {k: v for k, v in kwargs_to_shard.items() if k != grad_requiring_tensor_key}
    step = math.ceil(seqlen / shards)
    params = [p for p in (compute_params or []) if p.requires_grad]
    outs = []
    weights = []
    for lo in range(0, seqlen, step):
        hi = min(seqlen, lo + step)

        def tile_fn(_module: Any, piece: torch.Tensor, lo: int = lo, hi: int = hi) -> torch.Tensor:
            tile = {k: v[:, lo:hi] for k, v in others.items()}
            out: torch.Tensor = fn(**{grad_requiring_tensor_key: piece}, **tile, **kwargs_to_pass)
            return out

        piece = x[:, lo:hi]
        outs.append(_tiled(tile_fn, None, piece, 1, 1, params))
        weights.append(hi - lo)
    if output_reduction is None:
        return torch.cat(outs, dim=output_unshard_dimension)
    total = (
        torch.stack(outs).sum(0) if output_reduction == "sum" else sum(o * (w / seqlen) for o, w in zip(outs, weights))
    )
    assert isinstance(total, torch.Tensor)
    return total
