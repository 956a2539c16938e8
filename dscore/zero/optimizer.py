"""Optimizer plumbing shared by ZeRO stages: trainable groups, the optimizer over flat partitions, and the
global-norm unscale/clip of gradient partitions. Public: third-party ZeRO stages use these helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError, DscoreError

if TYPE_CHECKING:
    from dscore.comm import Comm
    from dscore.protocols.precision import LossScaler, PrecisionMode
    from dscore.protocols.zero import ZeroStageContext

__all__ = [
    "collective_device",
    "build_optimizer",
    "check_client_groups",
    "optimizer_state_bytes",
    "refuse_self_communicating",
    "unique_trainable",
    "unscale_clip",
    "unscale_clip_for_step",
]


def unique_trainable(
    param_groups: list[dict[str, Any]], *, keep_frozen: bool = False
) -> list[list[torch.nn.Parameter]]:
    """The parameters of each group, deduplicated, frozen ones dropped (kept with ``keep_frozen``).

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
            if p.requires_grad or keep_frozen:
                ps.append(p)
        out.append(ps)
    return out


def build_optimizer(
    ctx: ZeroStageContext, master_params: list[list[torch.nn.Parameter]], group_params: list[list[torch.nn.Parameter]]
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
        return refuse_self_communicating(opt, ctx)
    if ctx.optimizer_factory is not None:
        groups = [{**ctx.param_groups[i], "params": list(master_params[i])} for i in range(len(group_params))]
        return refuse_self_communicating(ctx.optimizer_factory(groups), ctx)
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


def refuse_self_communicating(opt: torch.optim.Optimizer, ctx: ZeroStageContext) -> torch.optim.Optimizer:
    """1-bit Adam/Lamb compress and all-reduce full momentum tensors themselves (they expose
    ``gradient_allreduce_needed``); over ZeRO partitions that communication would mix different slices.

    Raises:
        ConfigError: naming the optimizer and ``zero_optimization.stage``, suggesting stage 0.
    """
    if hasattr(opt, "gradient_allreduce_needed"):
        stage = ctx.section.stage
        raise ConfigError(
            f"optimizer {type(opt).__name__} communicates its own compressed momentum and cannot run over ZeRO "
            f"partitions (zero_optimization.stage = {stage}); use zero_optimization.stage 0 with it",
            path="zero_optimization.stage",
        )
    return opt


def collective_device(tensors: Sequence[torch.Tensor] = (), device: torch.device | str | None = None) -> torch.device:
    """The device a collective about ``tensors`` must run on: ``device`` when given, else the current
    runtime's accelerator device (NCCL and other device backends refuse host tensors), else the device
    of ``tensors[0]`` (outside a runtime: unit tests), else the CPU.
    """
    if device is not None:
        return torch.device(device)
    try:
        from dscore.runtime.context import current_runtime

        return torch.device(current_runtime().accelerator.current_device_name())
    except DscoreError:
        return tensors[0].device if tensors else torch.device("cpu")


def unscale_clip(
    flats: list[torch.Tensor],
    comm: Comm,
    *,
    divisor: float,
    clip: float,
    check_overflow: bool,
    device: torch.device | str | None = None,
    norm_sq: Callable[[torch.device], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, bool]:
    """Global-norm unscale and clip of this rank's gradient partitions, in place.

    Args:
        flats: fp32 gradient partitions (disjoint across ranks, so squared norms add up exactly); on the
            device, or on the host under optimizer offload.
        divisor: what the gradients must be divided by (loss scale x world size when reductions summed).
        clip: ``gradient_clipping`` (0 disables).
        check_overflow: treat a non-finite norm as overflow (this needs the norm on the host: one sync).
        device: where the squared norm is all-reduced (default :func:`collective_device`): a host norm is
            moved there first, as DeepSpeed does, because NCCL cannot reduce host tensors.
        norm_sq: replaces the local sum and its all-reduce over ``comm``: ``fn(device)`` returns the squared
            norm of these gradients over the whole model-parallel layout (:attr:`dscore.protocols.zero.
            ZeroStage.grad_norm_sq`); the overflow verdict is then that of every rank of the model.

    Returns:
        ``(global norm as a 0-dim fp32 tensor on the collective device, overflow)``. The norm is that of
        the true (unscaled, averaged) gradients before clipping, identical on every rank; the clip
        coefficient is ``clip / (norm + 1e-6)`` clamped to at most 1, computed in fp32 on the device as
        :func:`torch.nn.utils.clip_grad_norm_` does. Without ``check_overflow`` nothing waits for the
        device (no host sync); a non-finite norm then propagates into the gradients as in torch.
    """
    dev = collective_device(flats, device)
    if norm_sq is not None:
        sq = norm_sq(dev).to(dev, torch.float32)
    elif flats:
        norms = torch._foreach_norm(flats, 2.0)
        sq = torch.stack([n.float() for n in norms]).pow(2).sum().to(dev)
    else:
        sq = torch.zeros((), dtype=torch.float32, device=dev)
    if norm_sq is None:
        comm.all_reduce(sq)
    norm = sq.sqrt() / divisor
    if check_overflow and not bool(torch.isfinite(norm)):
        return None, True
    if not flats:
        return norm, False
    if clip > 0.0:
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0) * (1.0 / divisor)
        coef = coef.to(flats[0].device)  # host partitions under offload: one device-to-host copy
        torch._foreach_mul_(flats, coef)
    elif divisor != 1.0:
        torch._foreach_mul_(flats, 1.0 / divisor)
    return norm, False


def unscale_clip_for_step(
    flats: list[torch.Tensor],
    comm: Comm,
    *,
    precision: PrecisionMode,
    loss_scaler: LossScaler | None,
    clip: float,
    world: int,
    device: torch.device | str | None = None,
    post_divisor: float | None = None,
    norm_sq: Callable[[torch.device], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, bool, bool]:
    """The start of a partitioned stage's ``step``: :func:`unscale_clip` then the loss scaler's verdict.

    The divisor is the loss scale times the world size (gradients were summed), except under fp16 where
    the reducer already divided by the world size before summing. ``post_divisor`` replaces that
    world-size factor when the stage reduced with other divisors
    (:func:`dscore.zero.reducer.gradient_divisors`). ``norm_sq`` is passed to :func:`unscale_clip`.

    Returns:
        ``(norm, skip, overflow)``: ``skip`` is True when the step must not be applied (overflow, or the
        loss scaler says so); the scaler's ``update`` has been called once.
    """
    scale = float(loss_scaler.loss_scale) if loss_scaler is not None else 1.0
    if post_divisor is None:
        post_divisor = 1.0 if precision.compute_dtype == torch.float16 else float(world)
    divisor = scale * post_divisor
    norm, overflow = unscale_clip(
        flats, comm, divisor=divisor, clip=clip, check_overflow=bool(precision.check_overflow), device=device,
        norm_sq=norm_sq,
    )
    skip = loss_scaler.update(overflow) if loss_scaler is not None else overflow
    return norm, bool(skip or overflow), overflow


def optimizer_state_bytes(opt: torch.optim.Optimizer | None) -> int:
    """Bytes held by the tensors of ``opt``'s state (0 without an optimizer)."""
    if opt is None:
        return 0
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))

