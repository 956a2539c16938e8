"""Expert-parallel-size independent checkpoints of MoE models.

On each rank an MoE layer holds ``num_experts / ep_size`` local experts, named
``<layer>.deepspeed_moe.experts.deepspeed_experts.<l>.…``. In a checkpoint every expert appears once under
its *global* index ``ep_rank · num_local_experts + l`` (the same names a one-rank model with every expert
uses), so a checkpoint saved at one ``ep_size`` loads at any other. :meth:`ExpertNaming.globalize`
renames this rank's experts and gathers the other ranks' over the expert-parallel group (collective);
:meth:`ExpertNaming.localize` keeps the experts this rank holds, renamed to their local indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ExpertNaming"]

_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


@dataclass
class _Layer:
    prefix: str  # "<layer>.deepspeed_moe.experts.deepspeed_experts."
    local: int
    ep_rank: int
    ep_comm: Any


class ExpertNaming:
    """Maps expert entry names between this rank's local indices and global indices.

    Args:
        module: the model (its :class:`dscore.moe.layer.MoE` layers must have their groups set when
            ``ep_size > 1``: ``dscore.initialize`` does it).
    """

    def __init__(self, module: nn.Module) -> None:
        from dscore.moe.layer import MoE

        self.layers = [
            _Layer(
                f"{name}{_EXPERTS}" if name else _EXPERTS.lstrip("."),
                m.num_local_experts,
                m.ep_rank,
                m.deepspeed_moe.ep_comm if m.ep_size > 1 else None,
            )  # fmt: skip
            for name, m in module.named_modules()
            if isinstance(m, MoE)
        ]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _split(self, name: str) -> tuple[_Layer, int, str] | None:
        for layer in self.layers:
            if name.startswith(layer.prefix):
                index, _, rest = name[len(layer.prefix) :].partition(".")
                return layer, int(index), rest
        return None

    def to_global(self, name: str) -> str:
        """This rank's name of an entry -> its checkpoint name (non-expert names unchanged)."""
        hit = self._split(name)
        if hit is None:
            return name
        layer, local, rest = hit
        return f"{layer.prefix}{layer.ep_rank * layer.local + local}.{rest}"

    def to_local(self, name: str) -> str | None:
        """A checkpoint name -> this rank's name, or None for an expert another rank holds."""
        hit = self._split(name)
        if hit is None:
            return name
        layer, global_id, rest = hit
        if global_id // layer.local != layer.ep_rank:
            return None
        return f"{layer.prefix}{global_id % layer.local}.{rest}"

    def globalize(self, entries: dict[str, Any]) -> dict[str, Any]:
        """``entries`` (name -> value) under checkpoint names, with every expert of every rank of the
        expert-parallel group (collective over each layer's EP group; values are pickled)."""
        out = {self.to_global(k): v for k, v in entries.items()}
        by_comm: dict[int, tuple[Any, list[_Layer]]] = {}
        for layer in self.layers:
            if layer.ep_comm is not None and layer.ep_comm.get_world_size() > 1:
                by_comm.setdefault(id(layer.ep_comm), (layer.ep_comm, []))[1].append(layer)
        for comm, layers in by_comm.values():
            mine = {k: v for k, v in out.items() if any(k.startswith(layer.prefix) for layer in layers)}
            for theirs in comm.all_gather_object(mine):
                for k, v in theirs.items():
                    out.setdefault(k, v)
        return out

    def globalize_names(self, names: list[str]) -> list[str]:
        """A list of names under checkpoint names, with every rank's experts (collective, order kept)."""
        merged = self.globalize({n: i for i, n in enumerate(names)})
        return list(merged)

    def localize(self, entries: dict[str, Any]) -> dict[str, Any]:
        """The entries this rank holds, under this rank's names (other ranks' experts dropped)."""
        out = {}
        for k, v in entries.items():
            local = self.to_local(k)
            if local is not None:
                out[local] = v
        return out
