"""The contract between the engine and a ZeRO-stage plugin (stages 0-3).

The engine owns the training-loop bookkeeping (micro steps, boundaries, counters, LR scheduler,
logging, checkpoints); a :class:`ZeroStage` owns everything about gradients and parameters in between:
where gradients are reduced (all-reduce for stage 0, bucketed reduce-scatter for 1-3), which slice of
the optimizer state lives on this rank, unscaling, overflow checks, clipping by the global norm, the
optimizer step and the all-gather of updated parameters. Stage 0 is a ZeRO stage like the others (plain
data parallelism), so the engine has exactly one code path.

The stage receives the selected :class:`~dscore.protocols.precision.PrecisionMode` and its loss scaler
in its :class:`ZeroStageContext` and reports overflows to the scaler.

Mirrors DeepSpeed's split between ``DeepSpeedEngine`` and its ``DeepSpeedZeroOptimizer`` /
``DeepSpeedZeroOptimizer_Stage3`` / ``FP16_Optimizer`` wrappers (``deepspeed/runtime/engine.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from dscore.protocols.precision import LossScaler, PrecisionMode

if TYPE_CHECKING:
    import torch

__all__ = ["StepOutcome", "ZeroStage", "ZeroStageContext"]


@dataclass
class ZeroStageContext:
    """Everything a ZeRO stage needs from the engine, built once per engine.

    Attributes:
        module: the user's model, already on the accelerator device and cast by the precision mode.
        param_groups: trainable parameters as torch-style groups ``[{"params": [...], **overrides}]``
            (frozen parameters are excluded; empty groups are kept). With a client optimizer instance,
            group ``i`` is ``client_optimizer.param_groups[i]`` (DeepSpeed's rule: the client's groups,
            not ``model_parameters``); else from ``model_parameters`` / the module. A stage must give the
            optimizer exactly these groups, in this order, so every group's hyper-parameters apply to
            exactly its parameters and per-group scheduler lists stay aligned.
        client_optimizer: an optimizer instance the user passed, built over the module's parameters,
            or None. The stage steps this very object (re-pointing its groups at partitions).
        optimizer_factory: ``factory(param_groups) -> torch.optim.Optimizer`` built from the config's
            ``optimizer`` block (or the user's optimizer callable), or None when there is no optimizer.
        config: the validated :class:`dscore.config.DscoreConfig`.
        comm: the runtime's collective facade (:class:`dscore.comm.Comm`).
        accelerator: the runtime's accelerator.
        precision: the selected precision mode.
        loss_scaler: the engine's loss scaler (None unless fp16).
    """

    module: torch.nn.Module
    param_groups: list[dict[str, Any]]
    client_optimizer: torch.optim.Optimizer | None
    optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None
    config: Any
    comm: Any
    accelerator: Any
    precision: PrecisionMode
    loss_scaler: LossScaler | None


@dataclass(frozen=True)
class StepOutcome:
    """What happened at one gradient accumulation boundary.

    Attributes:
        applied: False when the step was skipped (fp16/bf16 overflow).
        overflow: True when an inf/NaN gradient was found on any rank.
        global_grad_norm: the unscaled global L2 norm over all ranks' gradients before clipping, as a
            Python float or a 0-dim tensor (so a stage need not synchronize the device just to report
            it; the engine converts it with ``float()`` only when asked), or None when it was not
            computed (overflow, or neither clipping nor an overflow check needed it).
    """

    applied: bool
    overflow: bool
    global_grad_norm: float | torch.Tensor | None


class ZeroStage(abc.ABC):
    """Owns gradient reduction, optimizer state and the optimizer step for one engine.

    The engine calls, per micro step: ``backward(loss, boundary=...)``; at each gradient accumulation
    boundary: ``step()`` then nothing else (``step`` zeroes gradients). ``optimizer`` is what
    ``engine.optimizer`` returns and what the LR scheduler drives, so its ``param_groups`` must carry the
    live ``lr``.

    Checkpoint state is world-size independent: :meth:`state_dict` returns full (gathered) tensors keyed
    by parameter name, so a checkpoint saved with N ranks loads with M.
    """

    stage: ClassVar[int]

    def __init__(self, ctx: ZeroStageContext) -> None:
        self.ctx = ctx

    @property
    @abc.abstractmethod
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer object exposed as ``engine.optimizer`` (None when training without one)."""

    @property
    def public_optimizer(self) -> Any:
        """What ``engine.optimizer`` and ``dscore.initialize`` return: :attr:`optimizer` by default.

        A stage may return another object when there is no optimizer (stage 3 returns a parameter
        manager that can still gather, save and load, as DeepSpeed returns ``DeepSpeedZeRoOffload``).
        The engine decides whether it can train from :attr:`optimizer` alone.
        """
        return self.optimizer

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, *, boundary: bool, sync: bool = True, retain_graph: bool = False) -> None:
        """Run backward for one micro step.

        The engine passes ``retain_graph`` only when the user asked for it (``engine.backward(loss,
        retain_graph=True)``), so implementations written before it existed keep working unless used.

        Args:
            loss: scalar, already divided by ``gradient_accumulation_steps`` and multiplied by the loss scale.
            boundary: True on the micro step that ends a gradient accumulation window; reduction must be
                complete when this returns (or when :meth:`step` starts).
            sync: False inside ``engine.no_sync()``: gradients accumulate locally, no communication.
            retain_graph: forwarded to ``torch.Tensor.backward``.
        """

    @abc.abstractmethod
    def step(self) -> StepOutcome:
        """At a boundary: unscale, check overflow, clip to ``gradient_clipping`` by the global norm,
        step the optimizer, all-gather updated parameters as the stage requires, and zero gradients.

        If the gradients were not reduced yet (the last ``backward`` had ``boundary=False`` because the
        user manages boundaries with ``managed_gradient_accumulation: false``, or set the boundary
        late), ``step`` must reduce them first. The loss scaler's ``update`` is called here (once per
        boundary) with the overflow result; the LR scheduler and counters are the engine's."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop all accumulated gradients (and partitions) without stepping."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """World-size independent optimizer state: ``{"param_names": [...], "state": {name: {key: full
        tensor}}, "param_groups": [...hyper-parameters without params...], "fp32_params": {name: full fp32
        tensor} (when master weights differ from the module's)}``."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Restore :meth:`state_dict` output saved at any data-parallel world size (re-partitioning it)."""

    @abc.abstractmethod
    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The full module state dict (stage 3 gathers partitioned parameters; other stages return the
        module's own). Called on every rank (it may run collectives)."""

    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full parameters into the module (stage 3 re-partitions). Default: ``module.load_state_dict``."""
        self.ctx.module.load_state_dict(state, strict=strict)

    @abc.abstractmethod
    def partition_bytes(self) -> dict[str, int]:
        """Bytes held by this rank: ``{"optimizer_state": ..., "parameters": ..., "gradients": ...}``."""
