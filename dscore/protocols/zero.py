"""The contract between the engine and a ZeRO-stage plugin (stages 0-3).

The engine owns the training-loop bookkeeping (micro steps, boundaries, counters, LR scheduler,
logging, checkpoints); a :class:`ZeroStage` owns everything about gradients and parameters in between:
where gradients are reduced (all-reduce for stage 0, bucketed reduce-scatter for 1-3), which slice of
the optimizer state lives on this rank, unscaling, overflow checks, clipping by the global norm, the
optimizer step and the all-gather of updated parameters. Stage 0 is a ZeRO stage like the others (plain
data parallelism), so the engine has exactly one code path.

The stage receives the selected :class:`~dscore.protocols.precision.PrecisionMode` and its loss scaler
in its :class:`ZeroStageContext` and reports overflows to the scaler.

A stage implementation is registered by a :class:`dscore.specs.ZeroStageSpec` (``stage``: the ZeRO level
it implements; ``name``: what ``zero_optimization.implementation`` selects; ``default``: whether it is
the implementation of its level when none is named). Building blocks for writing one (the bucketed
gradient reducer, partition layout, optimizer over partitions, clipping) are public in :mod:`dscore.zero`.

Mirrors DeepSpeed's split between ``DeepSpeedEngine`` and its ``DeepSpeedZeroOptimizer`` /
``DeepSpeedZeroOptimizer_Stage3`` / ``FP16_Optimizer`` wrappers (``deepspeed/runtime/engine.py``).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from dscore.protocols.precision import LossScaler, PrecisionMode

if TYPE_CHECKING:
    import torch

    from dscore.accelerator import Accelerator
    from dscore.comm import Comm
    from dscore.config.base import SectionModel
    from dscore.config.model import DscoreConfig
    from dscore.runtime.runtime import Runtime

__all__ = ["ParamFragment", "StepOutcome", "ZeroStage", "ZeroStageContext"]

#: the validated ``zero_optimization`` model a stage reads (the built-in stages: ``ZeroConfig``)
SectionT = TypeVar("SectionT", bound="SectionModel")


@dataclass
class ZeroStageContext(Generic[SectionT]):
    """Everything a ZeRO stage needs from the engine, built once per engine (``cls(ctx)``).

    Generic over the section model: a stage annotates ``ctx: ZeroStageContext[ZeroConfig]`` to have
    ``ctx.section`` typed.

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
        config: the validated :class:`dscore.config.DscoreConfig` (top-level keys such as
            ``gradient_clipping``, ``gradient_allreduce_op``, ``prescale_gradients``).
        section: the validated ``zero_optimization`` model (``config.section("zero_optimization")``):
            every ZeRO key with its default already applied (``reduce_bucket_size``, ``overlap_comm``,
            ``offload_optimizer``, ...).
        runtime: the :class:`dscore.runtime.runtime.Runtime` of this engine (accelerator, registry, op
            builders).
        comm: the :class:`dscore.comm.Comm` of the group gradients are reduced over (``runtime.comm``
            for the standard engine; a data-parallel sub-group's ``Comm`` inside a pipeline stage).
        precision: the selected precision mode.
        loss_scaler: the engine's loss scaler (None unless fp16).
    """

    module: torch.nn.Module
    param_groups: list[dict[str, Any]]
    client_optimizer: torch.optim.Optimizer | None
    optimizer_factory: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None
    config: DscoreConfig
    section: SectionT
    runtime: Runtime
    comm: Comm
    precision: PrecisionMode
    loss_scaler: LossScaler | None

    @property
    def accelerator(self) -> Accelerator:
        """``runtime.accelerator`` (device placement, pinned host memory, streams)."""
        return self.runtime.accelerator


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


@dataclass(frozen=True)
class ParamFragment:
    """Where one module parameter's training state lives on this rank (:meth:`ZeroStage.param_fragment`).

    A parameter's elements, flattened in row-major order, are spread over the ranks of ``comm``; this rank
    holds ``numel`` of them starting at ``start`` (possibly ``numel == 0``: this rank holds none of them).
    The per-parameter accessors of :mod:`dscore.zero.fragments` read and write through these views.

    Attributes:
        name: the parameter's name in the module (for error messages).
        shape: the parameter's full shape (under stage 3 its ``ds_shape``).
        start: offset of this rank's first element inside the flattened full parameter.
        numel: elements of the parameter held by this rank.
        master: 1-D fp32 view (``numel`` elements) of the master weights the optimizer steps; writing it
            changes what the next ``step`` updates (the module's low-precision copy follows at that step;
            under fp32 without offload it *is* the module's storage). May live on the host (offload).
        optimizer: the optimizer the stage steps (None when the engine has none).
        optimizer_param: the tensor keyed in ``optimizer.state`` whose flattened state holds this
            fragment at ``state_offset`` (None when the engine has no optimizer).
        state_offset: start of this fragment inside the flattened ``optimizer.state[optimizer_param][key]``.
        grad: 1-D view (``numel`` elements) of the reduced gradient, or None when the stage holds no
            reduced gradient now (before ``backward`` at a boundary, or after ``step``/``zero_grad``).
            Still loss-scaled (fp16) and still to be divided by ``grad_divisor``.
        grad_divisor: what ``grad`` must be divided by to give the averaged gradient (the part of the
            data-parallel mean the stage folds into its step), 1.0 when ``grad`` is already averaged.
        comm: the :class:`dscore.comm.Comm` whose ranks together hold the whole parameter (sum over it of
            every rank's fragment placed at its ``start`` gives the full tensor), or None when this rank
            holds all of it.
        device: the device full values are assembled on (the module parameter's compute device).
        write_weights: ``fn(value)`` writes a full value of the parameter (its full shape, fp32, the same on
            every rank) into the module's compute-dtype weights held on this rank (the parameter, its
            partition, a gathered copy), with no communication; :func:`dscore.zero.fragments.set_full_fp32_param`
            calls it after writing ``master``, so the module's weights follow at once on every rank.
    """

    name: str
    shape: torch.Size
    start: int
    numel: int
    master: torch.Tensor
    optimizer: torch.optim.Optimizer | None
    optimizer_param: torch.Tensor | None
    state_offset: int
    grad: torch.Tensor | None
    grad_divisor: float
    comm: Comm | None
    device: torch.device
    write_weights: Callable[[torch.Tensor], None]


class ZeroStage(abc.ABC):
    """Owns gradient reduction, optimizer state and the optimizer step for one engine.

    The engine calls, per micro step: ``backward(loss, boundary=...)``; at each gradient accumulation
    boundary: ``step()`` then nothing else (``step`` zeroes gradients). ``optimizer`` is what
    ``engine.optimizer`` returns and what the LR scheduler drives, so its ``param_groups`` must carry the
    live ``lr``.

    Checkpoint state is world-size independent: :meth:`state_dict` returns full (gathered) tensors keyed
    by parameter name, so a checkpoint saved with N ranks loads with M.
    """

    #: the ZeRO level (0-3) this implementation provides: what the engine's checks and the checkpoint
    #: layout assume (a third-party stage-2 variant says 2).
    stage: ClassVar[int]

    #: True when the stage honours :attr:`grad_norm_sq` (the built-in stages 0-3 do). A model transform
    #: whose parameters are split beyond ``ctx.comm`` (AutoTP) refuses a stage that does not.
    supports_grad_norm_sq: ClassVar[bool] = False

    #: Set by a model transform whose layout spans more ranks than ``ctx.comm`` (AutoTP's tensor-parallel
    #: shards): ``fn(device) -> 0-dim float32 tensor on device``, the squared L2 norm of the stage's
    #: gradients (the optimizer's ``param_groups``' ``.grad``, still loss-scaled and not yet divided, as
    #: the stage would sum them) over every rank of the model, ``inf`` when any rank holds an inf/NaN;
    #: identical on every rank (one collective, which all ranks enter). A stage that supports it
    #: (:attr:`supports_grad_norm_sq`) calls it at every boundary in place of its own norm all-reduce, so
    #: its overflow verdict, clipping and reported norm are the whole model's. None: the stage's own.
    grad_norm_sq: Callable[[torch.device], torch.Tensor] | None = None

    def __init__(self, ctx: ZeroStageContext[Any]) -> None:
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

    @abc.abstractmethod
    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full parameters (``{name: full tensor}``, as :meth:`module_state_dict` returns) into the stage.

        Used by ``engine.load_checkpoint(..., load_module_only=True)`` and by weights-only loads. Besides
        ``module.load_state_dict``, every copy of the weights the stage keeps must be refreshed, or the next
        ``step`` silently continues from the old weights: stages 1/2 (and stage 0 with fp16/bf16) copy the
        loaded values into their fp32 master partitions, stage 3 re-partitions. Abstract on purpose: there
        is no default that is right for every stage (a stage with no separate copy still writes the one line).

        Args:
            state: full tensors keyed by parameter/buffer name, any device and dtype.
            strict: as ``torch.nn.Module.load_state_dict``: missing or unexpected keys raise.
        """

    @abc.abstractmethod
    def partition_bytes(self) -> dict[str, int]:
        """Bytes held by this rank: ``{"optimizer_state": ..., "parameters": ..., "gradients": ...}``."""

    def iter_module_state(self) -> Iterator[dict[str, torch.Tensor]]:
        """The full module state dict (:meth:`module_state_dict`'s keys and values) in pieces, in the
        module's state-dict order, for ``engine.iter_full_params``. Collective like
        :meth:`module_state_dict`: every rank exhausts the iterator.

        The values may be views of memory the stage frees or reuses when the iterator resumes: the caller
        copies what it keeps before asking for the next piece. Default: the whole of
        :meth:`module_state_dict` as one piece (stages holding full parameters return views of the
        module's own tensors, so nothing extra is allocated); a stage that partitions parameters streams
        them (stage 3: one unit gathered at a time).
        """
        yield self.module_state_dict()

    def empty_partition_cache(self) -> None:
        """Release gathered parameters and any memory kept to gather them again (``engine.empty_partition_cache()``).

        Default: the stage keeps full parameters resident and caches nothing, so there is nothing to release.
        """
        return None

    def compile_regions(self) -> list[tuple[str, torch.nn.Module]] | None:
        """The modules ``engine.compile()`` compiles one by one instead of the whole module, or None.

        Called once, when the engine is compiled, before anything is compiled. A stage whose module hooks
        must not run inside compiled code (stage 3 gathers and releases parameters in them) returns the
        regions, as ``(qualified name, module)`` in module order, and from then on runs its hooks at the
        regions' boundaries instead of on the modules inside them; the engine compiles each region's
        ``forward`` separately, so those hooks run eagerly between the compiled graphs and none sits inside
        one. Every module holding a parameter the stage gathers lies in exactly one region. Default: None
        (stages 0-2 keep full parameters and hook nothing in forward: the whole module is compiled).
        """
        return None

    def generation_context(self) -> AbstractContextManager[None]:
        """A context in which the module runs forward for generation (``engine.generation_mode()``).

        Inside it every parameter is whole on the device and the stage's own module hooks do nothing, so a
        ``generate`` loop runs no collective per token; on exit what the stage gathered is released. It must be
        re-entrant (an inner use is free) and entered by every rank of the stage's group (it may gather).
        Default: the stage keeps full parameters resident (stages 0-2), so there is nothing to do.
        """
        return contextlib.nullcontext()

    def offload_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors holding each kind of training state, for ``engine.offload_states`` /
        ``reload_states`` (DeepSpeed's ``OffloadStateTypeEnum`` names as keys).

        The engine moves whole storages (every view of a listed tensor follows, so flat buffers and the
        parameters viewing them move together and come back bit for bit) and skips tensors already off
        the device. Default, found from what any stage exposes: ``lp_params`` the module's parameters,
        ``hp_params`` the optimizer's parameters (the fp32 masters), ``lp_grads`` the ``.grad`` of both,
        ``optim_states`` every tensor in ``optimizer.state``. Override to add buffers only the stage holds
        (``contiguous_grad_buffer``: gradient staging buffers; partitions not viewed by a parameter).
        """
        module = self.ctx.module
        lp: list[torch.Tensor] = list(module.parameters())
        out: dict[str, list[torch.Tensor]] = {
            "lp_params": lp,
            "lp_grads": [p.grad for p in lp if p.grad is not None],
            "hp_params": [],
            "optim_states": [],
            "contiguous_grad_buffer": [],
        }
        opt = self.optimizer
        if opt is not None:
            masters = [p for g in opt.param_groups for p in g["params"]]
            out["hp_params"] = masters
            out["lp_grads"] += [p.grad for p in masters if p.grad is not None]
            out["optim_states"] = [v for st in opt.state.values() for v in st.values() if _is_tensor(v)]
        return out

    def param_fragment(self, param: torch.nn.Parameter) -> ParamFragment | None:
        """Where ``param``'s fp32 master, reduced gradient and optimizer state live on this rank
        (DeepSpeed's per-parameter "hp mapping"), for :mod:`dscore.zero.fragments`.

        Args:
            param: a parameter of ``ctx.module``.

        Returns:
            Its :class:`ParamFragment`, or None when the stage keeps no training state for it (a frozen
            parameter).

        Raises:
            dscore.errors.FragmentAccessError: the stage does not provide per-parameter access (this
                default; the built-in stages 0-3 override it), or ``param`` is not one of ``ctx.module``'s
                parameters.
        """
        from dscore.errors import FragmentAccessError

        raise FragmentAccessError(
            f"per-parameter access to ZeRO state (dscore.zero.fragments, deepspeed.utils.safe_get_*) is not "
            f"provided by {type(self).__module__}.{type(self).__qualname__}: the stage does not implement "
            "ZeroStage.param_fragment; use engine.module_state_dict() / checkpoints, or a built-in ZeRO stage"
        )

    def close(self) -> None:
        """Release what the stage created outside its tensors (NVMe swap files, I/O threads); run by
        ``engine.close()``, idempotent. Default: the stage holds nothing of the kind."""
        return None


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)
