"""Where a parameter's bytes are in DeepSpeed's files: :class:`Piece`, :class:`Shard`, :class:`ParamInfo`, and
the small readers of an optimizer-states file (its state dict, base optimizer groups, loss-scaler state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dscore.errors import CheckpointError
from dscore_plugins.checkpoint_ds._unpickle import DSLossScaler

__all__ = ["ParamInfo", "Piece", "Shard", "scaler_state"]


@dataclass(frozen=True)
class Piece:
    """A run of ``numel`` elements of parameter ``name``'s flattened value, elements ``[dst, dst+numel)``,
    stored at ``[src, src+numel)`` of flat source ``slot`` (a group or sub-group index) of one shard."""

    name: str
    slot: int
    src: int
    dst: int
    numel: int


@dataclass
class Shard:
    """One file holding flat fp32 masters and optimizer moments, and how to read them.

    ``kind``: ``"zero12"`` (``single_partition_of_fp32_groups``), ``"zero3"`` (``fp32_flat_groups``),
    ``"flat0"`` (stage-0 ``fp32_groups_flat``), ``"torch0"`` (stage-0 torch-style, one slot per param).
    """

    path: str
    rank: int
    kind: str
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class ParamInfo:
    """A trainable parameter: its (first) module name, full shape and optimizer group index."""

    name: str
    shape: tuple[int, ...]
    group: int

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))


def bad_file(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; this does not look like a DeepSpeed 0.19-style checkpoint dscore can read")


def optimizer_sd(obj: Any, path: str) -> dict[str, Any]:
    if not isinstance(obj, dict) or not isinstance(obj.get("optimizer_state_dict"), dict):
        raise bad_file(path, "no 'optimizer_state_dict' dict")
    return obj["optimizer_state_dict"]


def base_groups(osd: dict[str, Any], path: str) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]] | None]:
    """``(moment state per slot, param_groups or None)`` of ``base_optimizer_state`` (dict or elastic list)."""
    base = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    if isinstance(base, dict):
        state = base.get("state", {})
        groups = base.get("param_groups")
        if not isinstance(state, dict):
            raise bad_file(path, "base_optimizer_state['state'] is not a dict")
        return {int(k): v for k, v in state.items()}, groups if isinstance(groups, list) else None
    if isinstance(base, list):  # elastic checkpoint: one state dict per group
        return {i: s for i, s in enumerate(base)}, None
    if base is None:
        return {}, None
    raise bad_file(path, f"base_optimizer_state is a {type(base).__name__}")


def scaler_state(osd: dict[str, Any]) -> dict[str, Any] | None:
    """DeepSpeed's loss-scaler state in dscore's ``LossScaler.state_dict()`` form, or None.

    ZeRO files hold a ``LossScaler``/``DynamicLossScaler`` object under ``loss_scaler``; stage-0
    FP16_Optimizer files hold ``dynamic_loss_scale``/``cur_scale``/``cur_iter``/``last_overflow_iter``.
    """
    obj = osd.get("loss_scaler")
    if isinstance(obj, DSLossScaler):
        d = obj.as_dict()
        dynamic = bool(d.get("dynamic", False))
        out: dict[str, Any] = {"dynamic": dynamic, "cur_scale": float(d.get("cur_scale", 1.0))}
        if dynamic:
            out.update(
                cur_iter=int(d.get("cur_iter", 0)),
                last_overflow_iter=int(d.get("last_overflow_iter", -1)),
                cur_hysteresis=int(d.get("cur_hysteresis", d.get("delayed_shift", 1))),
            )
        return out
    if "cur_scale" in osd:
        dynamic = bool(osd.get("dynamic_loss_scale", False))
        out = {"dynamic": dynamic, "cur_scale": float(osd["cur_scale"])}
        if dynamic:
            last = osd.get("last_overflow_iter", -1)
            out.update(cur_iter=int(osd.get("cur_iter", 0)), last_overflow_iter=int(-1 if last is None else last))
        return out
    return None
