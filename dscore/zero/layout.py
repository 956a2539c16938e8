"""Partition layout of ZeRO stages 1-3 and world-size-independent (de)serialisation of partitioned state.

A *group partition* is one 1-D tensor per optimizer parameter group holding, back to back, this rank's
chunk of each *segment* (a reduce bucket in stages 1/2, a module unit in stage 3). A segment concatenates
some parameters (in a fixed order), pads to a multiple of the world size and is split into ``world``
equal chunks of ``chunk`` elements; rank ``r`` owns chunk ``r``. Every rank uses the same layout, so an
all-gather of the group partition gives every segment.

Checkpoints hold full tensors keyed by parameter name (:func:`optimizer_state_dict`), so a state saved
at N ranks loads at M (:func:`load_optimizer_state`, :func:`scatter_by_name`). Public: third-party ZeRO
stages use these helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError

if TYPE_CHECKING:
    from dscore.comm import Comm
    from dscore.protocols.precision import LossScaler

__all__ = [
    "GroupLayout",
    "Segment",
    "chunk_fragment",
    "gather_by_name",
    "load_optimizer_state",
    "load_partitioned_state",
    "optimizer_state_dict",
    "packed_offsets",
    "partitioned_state_dict",
    "scatter_by_name",
]


def packed_offsets(numels: Sequence[int]) -> tuple[list[int], int]:
    """``(start of each of ``numels`` when laid out back to back, total)`` in elements."""
    offsets: list[int] = []
    total = 0
    for n in numels:
        offsets.append(total)
        total += int(n)
    return offsets, total


def chunk_fragment(offset: int, numel: int, chunk: int, rank: int) -> tuple[int, int, int]:
    """Which elements of one parameter rank ``rank``'s chunk of a segment holds.

    Args:
        offset: start of the parameter inside the padded segment (elements).
        numel: the parameter's elements.
        chunk: elements per rank (the segment is ``world * chunk`` long; rank ``r`` owns
            ``[r * chunk, (r + 1) * chunk)``).
        rank: the rank inside the group the segment is partitioned over.

    Returns:
        ``(start in the flattened parameter, start in the rank's chunk, length)``; ``(0, 0, 0)`` when the
        chunk holds none of the parameter.
    """
    lo = max(offset, rank * chunk)
    hi = min(offset + numel, (rank + 1) * chunk)
    if hi <= lo:
        return 0, 0, 0
    return lo - offset, lo - rank * chunk, hi - lo


@dataclass
class Segment:
    """One bucket / unit inside a group partition.

    Attributes:
        part_offset: start of this rank's chunk inside the group partition (elements).
        chunk: elements per rank.
        names: parameter names, in layout order.
        offsets: start of each parameter inside the padded segment (elements).
        numels: elements of each parameter.
        shapes: shape of each parameter.
    """

    part_offset: int
    chunk: int
    names: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)


@dataclass
class GroupLayout:
    """Segments of one optimizer parameter group and the partition length (elements)."""

    segments: list[Segment] = field(default_factory=list)
    numel: int = 0

    @property
    def names(self) -> list[str]:
        """Parameter names of every segment, in layout order."""
        return [n for s in self.segments for n in s.names]


def gather_by_name(part: torch.Tensor, layout: GroupLayout, comm: Comm) -> dict[str, torch.Tensor]:
    """All-gather a group-partition-shaped tensor and cut it into full per-parameter CPU tensors.

    Args:
        part: 1-D, ``layout.numel`` elements, any dtype/device. A host ``part`` (masters and optimizer
            state under optimizer offload) is copied to the collective device first
            (:func:`dscore.zero.optimizer.collective_device`): NCCL cannot gather host tensors.
    Returns:
        ``{name: tensor of the parameter's shape}`` (CPU, ``part``'s dtype).
    """
    from dscore.zero.optimizer import collective_device

    world = comm.world_size
    src = part.detach().to(collective_device([part])).contiguous()
    gathered = torch.empty(world * layout.numel, dtype=src.dtype, device=src.device)
    comm.all_gather_into_tensor(gathered, src)
    rows = gathered.view(world, layout.numel).cpu()
    out: dict[str, torch.Tensor] = {}
    for seg in layout.segments:
        flat = rows[:, seg.part_offset : seg.part_offset + seg.chunk].reshape(-1)
        for name, off, n, shape in zip(seg.names, seg.offsets, seg.numels, seg.shapes):
            out[name] = flat[off : off + n].view(shape).clone()
    return out


def scatter_by_name(
    values: dict[str, torch.Tensor], layout: GroupLayout, rank: int, out: torch.Tensor
) -> None:
    """Write this rank's chunks of full per-parameter ``values`` into ``out`` (a group partition).

    Raises:
        KeyError: a parameter of the layout is missing from ``values`` (names it).
    """
    with torch.no_grad():
        for seg in layout.segments:
            own = torch.zeros(seg.chunk, dtype=out.dtype)
            lo = rank * seg.chunk
            for name, off, n in zip(seg.names, seg.offsets, seg.numels):
                if name not in values:
                    raise KeyError(f"checkpoint has no entry for parameter {name!r}")
                a, b = max(off, lo), min(off + n, lo + seg.chunk)
                if a < b:
                    own[a - lo : b - lo] = values[name].reshape(-1)[a - off : b - off].to(out.dtype)
            out[seg.part_offset : seg.part_offset + seg.chunk].copy_(own)


def optimizer_state_dict(
    opt: torch.optim.Optimizer | None,
    pairs: list[tuple[torch.Tensor, GroupLayout]],
    comm: Comm,
    *,
    comms: dict[int, Comm] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, torch.Tensor]]:
    """``(state by name, param_groups hyper-parameters, fp32 master weights by name)`` with full tensors.

    Args:
        pairs: every optimizer parameter (a flat partition tensor) with the layout of its elements.
        comms: ``id(partition) -> Comm`` for partitions spread over another group than ``comm`` (MoE
            expert groups over their expert-data-parallel group).

    Runs collectives: every rank must call it.
    """
    state: dict[str, Any] = {}
    hyper_groups: list[dict[str, Any]] = []
    fp32: dict[str, torch.Tensor] = {}
    layout_of = {id(m): lay for m, lay in pairs}
    def comm_of(m: torch.Tensor) -> Comm:
        return comms.get(id(m), comm) if comms else comm

    for m, lay in pairs:
        fp32.update(gather_by_name(m.detach(), lay, comm_of(m)))
    if opt is None:
        return state, hyper_groups, fp32
    for group in opt.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["param_names"] = [n for m in group["params"] for n in layout_of[id(m)].names]
        hyper_groups.append(hyper)
        for m in group["params"]:
            layout = layout_of[id(m)]
            pstate = opt.state.get(m, {})
            full: dict[str, dict[str, torch.Tensor]] = {}
            scalars: dict[str, Any] = {}
            for k, v in pstate.items():
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == layout.numel:
                    full[k] = gather_by_name(v, layout, comm_of(m))
                else:
                    scalars[k] = v.detach().clone() if torch.is_tensor(v) else v
            for name in layout.names:
                entry = {k: full[k][name] for k in full}
                entry.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
                if entry:
                    state[name] = entry
    return state, hyper_groups, fp32


def load_optimizer_state(
    opt: torch.optim.Optimizer,
    pairs: list[tuple[torch.Tensor, GroupLayout]],
    saved: dict[str, Any],
    rank: int,
    *,
    ranks: dict[int, int] | None = None,
) -> None:
    """Re-partition a :func:`optimizer_state_dict` result (saved at any world size) into ``opt``
    (``ranks``: ``id(partition) -> rank`` where a partition's group is not the data-parallel one).

    Raises:
        ConfigError: the number of parameter groups differs.
    """
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(opt.param_groups):
        raise ConfigError(
            f"checkpoint has {len(saved_groups)} optimizer parameter group(s), the engine has "
            f"{len(opt.param_groups)}"
        )
    layout_of = {id(m): lay for m, lay in pairs}
    saved_state = saved.get("state", {})
    opt.state.clear()
    for group, sg in zip(opt.param_groups, saved_groups):
        for k, v in sg.items():
            if k not in ("params", "param_names"):
                group[k] = v
        for m in group["params"]:
            layout = layout_of[id(m)]
            names = layout.names
            if not names or names[0] not in saved_state:
                continue
            new: dict[str, Any] = {}
            for k, v0 in saved_state[names[0]].items():
                if torch.is_tensor(v0) and v0.dim() > 0:
                    t = torch.zeros(layout.numel, dtype=v0.dtype)
                    own_rank = ranks.get(id(m), rank) if ranks else rank
                    scatter_by_name({n: saved_state[n][k] for n in names}, layout, own_rank, t)
                    new[k] = t.to(m.device)
                else:
                    new[k] = v0.clone() if torch.is_tensor(v0) else v0
            opt.state[m] = new


def partitioned_state_dict(
    opt: torch.optim.Optimizer | None,
    pairs: list[tuple[torch.Tensor, GroupLayout]],
    comm: Comm,
    loss_scaler: LossScaler | None,
    *,
    comms: dict[int, Comm] | None = None,
) -> dict[str, Any]:
    """:meth:`dscore.protocols.ZeroStage.state_dict` of a stage with partitioned optimizer state
    (``comms``: as :func:`optimizer_state_dict`).

    Returns ``{"param_names", "state", "param_groups", "fp32_params"[, "loss_scaler"]}`` with full
    tensors keyed by parameter name (see :func:`optimizer_state_dict`). Collective: every rank calls it.
    """
    state, groups, fp32 = optimizer_state_dict(opt, pairs, comm, comms=comms)
    out: dict[str, Any] = {
        "param_names": [n for _, lay in pairs for n in lay.names],
        "state": state,
        "param_groups": groups,
        "fp32_params": fp32,
    }
    if loss_scaler is not None:
        out["loss_scaler"] = loss_scaler.state_dict()
    return out


def load_partitioned_state(
    state: dict[str, Any],
    *,
    opt: torch.optim.Optimizer | None,
    pairs: list[tuple[torch.Tensor, GroupLayout]],
    rank: int,
    loss_scaler: LossScaler | None,
    load_optimizer_states: bool,
    masters_loaded: Callable[[bool], None],
    ranks: dict[int, int] | None = None,
    load_fp32_masters: bool = True,
) -> None:
    """Restore :func:`partitioned_state_dict` output saved at any world size (``ranks``: as
    :func:`load_optimizer_state`).

    ``load_fp32_masters=False`` (``zero_optimization.load_from_fp32_weights: false``, as DeepSpeed) leaves
    the saved fp32 master weights unread: the masters are rebuilt from the (already loaded) 16-bit module
    weights, the optimizer state is still restored.

    With ``load_optimizer_states`` and saved ``fp32_params``, this rank's chunks are scattered into the
    master partitions (``pairs``) and ``masters_loaded(True)`` runs (the stage copies masters into its
    parameters); otherwise ``masters_loaded(False)`` runs (the stage refreshes masters from the module).
    Then the loss scaler and the optimizer state are restored when ``load_optimizer_states``.

    Raises:
        KeyError: a parameter of the layout is missing from ``fp32_params``.
        ConfigError: the number of optimizer parameter groups differs.
    """
    fp32 = state.get("fp32_params") if load_optimizer_states and load_fp32_masters else None
    with torch.no_grad():
        if fp32:
            for m, lay in pairs:
                scatter_by_name(fp32, lay, ranks.get(id(m), rank) if ranks else rank, m.data)
        masters_loaded(bool(fp32))
    if not load_optimizer_states:
        return
    if loss_scaler is not None and "loss_scaler" in state:
        loss_scaler.load_state_dict(state["loss_scaler"])
    if opt is not None:
        load_optimizer_state(opt, pairs, state, rank, ranks=ranks)

