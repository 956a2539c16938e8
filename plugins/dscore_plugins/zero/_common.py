"""Helpers shared by ZeRO stages 1-3: config reading, optimizer construction over flat partitions,
the global-norm clip/unscale step, and world-size-independent (de)serialisation of partitioned state.

Partition layout used by every stage here: a *group partition* is one 1-D tensor per optimizer
parameter group holding, back to back, this rank's chunk of each *segment* (a bucket in stages 1/2, a
module unit in stage 3). A segment concatenates some parameters (in a fixed order), pads to a multiple
of the world size and is split into ``world`` equal chunks of ``chunk`` elements; rank ``r`` owns chunk
``r``. Every rank uses the same layout, so an all-gather of the group partition gives every segment.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dscore.errors import ConfigError
from dscore.zero._comm import Collectives

log = logging.getLogger("dscore.zero")

_CPU_OPTIMIZER_NAMES = {"DscoreCPUAdam", "DeepSpeedCPUAdam", "DscoreCPUAdagrad", "DscoreCPULion"}


# ---------------------------------------------------------------------- config
def zero_section(config: Any) -> Any:
    """The ``zero_optimization`` section of a config (object with DeepSpeed field names) or None."""
    if config is None:
        return None
    if hasattr(config, "section"):
        try:
            return config.section("zero_optimization")
        except Exception:  # noqa: BLE001 - fall back to the attribute
            pass
    return getattr(config, "zero_optimization", None)


def zget(zc: Any, name: str, default: Any) -> Any:
    """``zc.name`` (or ``zc[name]`` for dicts), ``default`` when missing or None."""
    if zc is None:
        return default
    value = zc.get(name, None) if isinstance(zc, dict) else getattr(zc, name, None)
    return default if value is None else value


def offload_device(zc: Any, key: str) -> str:
    """``"none"``/``"cpu"`` for ``offload_optimizer`` / ``offload_param``.

    Raises:
        ConfigError: ``device: nvme`` (not implemented by dscore's ZeRO; names the key and valid values).
    """
    block = zget(zc, key, None)
    if block is None:
        return "none"
    raw = zget(block, "device", "none")
    dev = str(getattr(raw, "value", raw)).split(".")[-1].lower()
    if dev == "nvme":
        raise ConfigError(
            f'zero_optimization.{key}.device = "nvme" is not supported by dscore\'s ZeRO stages; '
            'valid values are "none" and "cpu"'
        )
    return dev


def offload_pin(zc: Any, key: str) -> bool:
    """``pin_memory`` of an offload block (pinning needs an accelerator; False on CPU-only hosts)."""
    block = zget(zc, key, None)
    return bool(zget(block, "pin_memory", False)) and torch.cuda.is_available()


def host_tensor(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed 1-D CPU tensor of ``numel`` elements, pinned when ``pin``."""
    t = torch.zeros(numel, dtype=dtype, device="cpu")
    return t.pin_memory() if pin else t


def check_client_optimizer_for_offload(ctx: Any, offload: bool) -> None:
    """Mirror DeepSpeed: a client optimizer with CPU offload must be a dscore CPU optimizer.

    Raises:
        ConfigError: the client optimizer is not a CPU optimizer and ``zero_force_ds_cpu_optimizer`` is
            true (the default); the message names the opt-out key.
    """
    opt = ctx.client_optimizer
    if not offload or opt is None:
        return
    force = getattr(ctx.config, "zero_force_ds_cpu_optimizer", True)
    if force is None:
        force = True
    if type(opt).__name__ in _CPU_OPTIMIZER_NAMES or getattr(opt, "offload_capable", False):
        return
    if force:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.device = 'cpu' with a client optimizer of type "
            f"{type(opt).__module__}.{type(opt).__name__}: offload needs a CPU optimizer (DscoreCPUAdam, or "
            "configure the optimizer through the config's 'optimizer' block). To use this optimizer on the "
            'CPU-resident partitions anyway set "zero_force_ds_cpu_optimizer": false.'
        )
    log.warning("zero_force_ds_cpu_optimizer is false: stepping client optimizer %s on CPU partitions", type(opt))


def unique_trainable(param_groups: list[dict[str, Any]]) -> list[list[torch.nn.Parameter]]:
    """The parameters of each group, deduplicated, frozen ones dropped.

    Raises:
        ConfigError: a parameter appears in two groups.
    """
    seen: set[int] = set()
    out: list[list[torch.nn.Parameter]] = []
    for group in param_groups:
        ps: list[torch.nn.Parameter] = []
        for p in group["params"]:
            if id(p) in seen:
                raise ConfigError(
                    "a parameter appears more than once in model_parameters / the optimizer's groups; "
                    "each trainable parameter must belong to exactly one group"
                )
            seen.add(id(p))
            if p.requires_grad:
                ps.append(p)
        out.append(ps)
    return out


def build_optimizer(
    ctx: Any, master_params: list[list[torch.nn.Parameter]], group_params: list[list[torch.nn.Parameter]]
) -> torch.optim.Optimizer | None:
    """An optimizer over the flat master partitions (``master_params[g]``: group g's partition tensors).

    Group ``g`` of the optimizer is group ``g`` of ``ctx.param_groups``, always, including empty and
    all-frozen groups (``params: []``): hyper-parameters stay with exactly their parameters and a
    client LR scheduler's per-group lists stay aligned. A client optimizer keeps its object identity and
    hyper-parameters; its groups are re-pointed at the partitions (its prior state is dropped, as
    DeepSpeed's ZeRO wrappers do). Otherwise ``optimizer_factory`` builds one from the context's param
    groups with ``params`` replaced.

    Raises:
        ConfigError: the client optimizer's groups are not the trainable parameter groups (names the
            group); a self-communicating optimizer (1-bit Adam/Lamb) over partitions.
    """
    if ctx.client_optimizer is not None:
        opt = ctx.client_optimizer
        check_client_groups(opt, group_params)
        for g, masters in zip(opt.param_groups, master_params):
            g["params"] = list(masters)
        opt.state.clear()
        return _refuse_self_communicating(opt, ctx)
    if ctx.optimizer_factory is not None:
        groups = [{**ctx.param_groups[i], "params": list(master_params[i])} for i in range(len(group_params))]
        return _refuse_self_communicating(ctx.optimizer_factory(groups), ctx)
    return None


def check_client_groups(opt: torch.optim.Optimizer, group_params: list[list[torch.nn.Parameter]]) -> None:
    """Check that ``opt.param_groups[g]`` holds exactly the trainable parameters ``group_params[g]``.

    ``dscore.initialize`` derives the groups from the client optimizer, so this only fails when a
    :class:`ZeroStageContext` is built by hand with groups that differ from the optimizer's.

    Raises:
        ConfigError: naming the first group whose parameters differ, or the group counts.
    """
    if len(opt.param_groups) != len(group_params):
        raise ConfigError(
            f"the client optimizer has {len(opt.param_groups)} parameter group(s) but the engine was given "
            f"{len(group_params)}; pass the optimizer's own groups (or no model_parameters) to dscore.initialize"
        )
    for gi, (g, ps) in enumerate(zip(opt.param_groups, group_params)):
        held = [id(p) for p in g["params"] if p.requires_grad]
        if held != [id(p) for p in ps]:
            raise ConfigError(
                f"the client optimizer's param_groups[{gi}] holds {len(held)} trainable parameter(s) that differ "
                f"from the engine's group {gi} ({len(ps)}); each optimizer group must be exactly one engine group"
            )


def _refuse_self_communicating(opt: torch.optim.Optimizer, ctx: Any) -> torch.optim.Optimizer:
    """1-bit Adam/Lamb compress and all-reduce full momentum tensors themselves (they expose
    ``gradient_allreduce_needed``); over ZeRO partitions that communication would mix different slices.

    Raises:
        ConfigError: naming the optimizer and ``zero_optimization.stage``, suggesting stage 0.
    """
    if hasattr(opt, "gradient_allreduce_needed"):
        stage = getattr(ctx.config, "zero_stage", "1-3")
        raise ConfigError(
            f"optimizer {type(opt).__name__} communicates its own compressed momentum and cannot run over ZeRO "
            f"partitions (zero_optimization.stage = {stage}); use zero_optimization.stage 0 with it",
            path="zero_optimization.stage",
        )
    return opt


# ---------------------------------------------------------------------- segments
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
        return [n for s in self.segments for n in s.names]


def gather_by_name(part: torch.Tensor, layout: GroupLayout, coll: Collectives) -> dict[str, torch.Tensor]:
    """All-gather a group-partition-shaped tensor and cut it into full per-parameter CPU tensors.

    Args:
        part: 1-D, ``layout.numel`` elements, any dtype/device.
    Returns:
        ``{name: tensor of the parameter's shape}`` (CPU, ``part``'s dtype).
    """
    world = coll.world
    src = part.detach().contiguous()
    gathered = torch.empty(world * layout.numel, dtype=src.dtype, device=src.device)
    coll.all_gather(gathered, src)
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
    coll: Collectives,
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, torch.Tensor]]:
    """``(state by name, param_groups hyper-parameters, fp32 master weights by name)`` with full tensors.

    Args:
        pairs: every optimizer parameter (a flat partition tensor) with the layout of its elements.

    Runs collectives: every rank must call it.
    """
    state: dict[str, Any] = {}
    hyper_groups: list[dict[str, Any]] = []
    fp32: dict[str, torch.Tensor] = {}
    layout_of = {id(m): lay for m, lay in pairs}
    for m, lay in pairs:
        fp32.update(gather_by_name(m.detach(), lay, coll))
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
                    full[k] = gather_by_name(v, layout, coll)
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
) -> None:
    """Re-partition a :func:`optimizer_state_dict` result (saved at any world size) into ``opt``.

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
                    scatter_by_name({n: saved_state[n][k] for n in names}, layout, rank, t)
                    new[k] = t.to(m.device)
                else:
                    new[k] = v0.clone() if torch.is_tensor(v0) else v0
            opt.state[m] = new


# ---------------------------------------------------------------------- step
def unscale_clip(
    flats: list[torch.Tensor],
    coll: Collectives,
    *,
    divisor: float,
    clip: float,
    check_overflow: bool,
) -> tuple[torch.Tensor | None, bool]:
    """Global-norm unscale and clip of this rank's gradient partitions, in place.

    Args:
        flats: fp32 gradient partitions (disjoint across ranks, so squared norms add up exactly).
        divisor: what the gradients must be divided by (loss scale x world size when reductions summed).
        clip: ``gradient_clipping`` (0 disables).
        check_overflow: treat a non-finite norm as overflow.

    Returns:
        ``(global norm as a 0-dim fp32 tensor, overflow)``. The norm is that of the true (unscaled,
        averaged) gradients before clipping, identical on every rank; the clip coefficient is
        ``clip / (norm + 1e-6)`` capped at 1, as :func:`torch.nn.utils.clip_grad_norm_`. One scalar
        all-reduce and one host sync.
    """
    if flats:
        norms = torch._foreach_norm(flats, 2.0)
        sq = torch.stack([n.float() for n in norms]).pow(2).sum()
    else:
        sq = torch.zeros((), dtype=torch.float32)
    coll.all_reduce(sq)
    norm = sq.sqrt() / divisor
    if not math.isfinite(float(norm)):
        if check_overflow:
            return None, True
    coef = 1.0 / divisor
    if clip > 0.0:
        c = clip / (float(norm) + 1e-6)
        if c < 1.0:
            coef *= c
    if coef != 1.0 and flats:
        torch._foreach_mul_(flats, coef)
    return norm, False
