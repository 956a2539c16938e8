"""The training engine returned by :func:`dscore.initialize`.

:class:`DscoreEngine` owns the training-loop bookkeeping and mirrors ``deepspeed.DeepSpeedEngine``
(``deepspeed/runtime/engine.py``): it wraps the user's module, counts micro steps and optimizer steps,
knows the gradient accumulation boundary, drives the LR scheduler, logs progress and feeds monitors.
Everything about gradients and parameters between ``backward`` and the optimizer step is delegated to a
ZeRO-stage plugin (:class:`dscore.protocols.ZeroStage`; stage 0 is plain data parallelism), so
there is one code path for every stage.

Semantics (DeepSpeed 0.19.8):

* ``engine(*args, **kwargs)`` calls the module.
* ``backward(loss)`` divides the loss by ``gradient_accumulation_steps`` (``scale_wrt_gas``), multiplies
  it by the loss scale (fp16) and hands it to the stage, which accumulates gradients and, at the
  boundary, averages them over the data-parallel group. Returns ``loss / gradient_accumulation_steps``.
* ``backward`` twice without ``step()`` in between is refused under managed accumulation unless the caller
  set the boundary (docs/engine-api.md, issue 33); skipped steps are logged at WARNING.
* ``step()`` is a no-op off the boundary (only ``micro_steps`` advances). At the boundary the stage
  unscales, checks overflow, clips to ``gradient_clipping`` by the global norm, steps the optimizer and
  zeroes gradients; the engine steps the LR scheduler **only when the step was applied**, and counts
  ``global_steps`` (skipped steps included), ``global_samples`` (+= ``train_batch_size``) and
  ``skipped_steps``. ``micro_steps`` advances on every ``step()`` call.
* The boundary is ``(micro_steps + 1) % gradient_accumulation_steps == 0`` unless set with
  :meth:`set_gradient_accumulation_boundary` (the value then sticks). With
  ``managed_gradient_accumulation: false`` the caller owns boundaries: every ``step()`` is a boundary,
  :meth:`is_gradient_accumulation_boundary` is true only while ``step()`` runs (or when set explicitly),
  and ``global_samples`` grows by ``train_batch_size // gradient_accumulation_steps`` per ``backward``.

Logging: every ``steps_per_print`` optimizer steps rank 0 logs step, skipped steps, mean loss over the
window, learning rates, loss scale and samples/s (logger ``dscore.runtime.engine``); with
``wall_clock_breakdown`` the mean forward/backward/step times (ms, device-synchronized) are logged on
the same steps, with the ZeRO stage's sub-phases (gradient bucketing, reduce launch/wait, clip,
optimizer, parameter all-gather and its waits; see :mod:`dscore.runtime.timers`). Monitors (rank 0) receive ``Train/Samples/train_loss``, ``Train/Samples/lr`` and (fp16)
``Train/Samples/loss_scale`` at every optimizer step, with ``global_samples`` as the x value.

Modules: this one holds the loop and the composition; DeepSpeed's accessors are the mixin
:class:`dscore.runtime.engine_accessors.DeepSpeedAccessors`, the checkpoint-facing state and the checkpoint
API the mixin :class:`dscore.runtime.engine_state.CheckpointState`, the errors :mod:`dscore.runtime.engine_errors`.

Checkpoint-facing state (for :mod:`dscore.persistence`): :meth:`counters_state` /
:meth:`load_counters_state`, :attr:`lr_scheduler`, :attr:`zero_stage_impl` (``state_dict``,
``load_state_dict``, ``module_state_dict``, ``load_module_state_dict``), :attr:`loss_scaler`,
:attr:`data_sampler_state` / :meth:`load_data_sampler_state`, :meth:`rng_state` /
:meth:`load_rng_state`, and :meth:`state_for_checkpoint` bundling them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from dscore.protocols.precision import LossScaler, PrecisionMode
from dscore.protocols.zero import ZeroStage
from dscore.runtime.compile import CompileState
from dscore.runtime.context import runtime_scoped
from dscore.runtime.engine_accessors import DeepSpeedAccessors
from dscore.runtime.engine_errors import EngineAPIMissing, EngineError
from dscore.runtime.engine_state import CheckpointState
from dscore.runtime.logging_utils import log_rank0
from dscore.runtime.offload_states import bind_optimizer_state_methods, refuse_while_offloaded
from dscore.runtime.timers import PhaseTimers

if TYPE_CHECKING:
    from dscore.config.model import DscoreConfig
    from dscore.runtime.runtime import Runtime

__all__ = ["DscoreEngine", "EngineAPIMissing", "EngineError", "LEFT_OUT_APIS"]

log = logging.getLogger("dscore.runtime.engine")

FORWARD, BACKWARD, STEP = "forward", "backward", "step"


# DeepSpeed engine APIs dscore leaves out on purpose: the reason is in docs/engine-api.md ("Left out")
LEFT_OUT_APIS = frozenset(
    {
        "set_train_batch_size",
        "set_train_micro_batch_size",
        "deepspeed_io",
        "load_universal_checkpoint",
        "flops_profiler_enabled",
        "autotuning_enabled",
        "curriculum_learning_enabled",
        "data_efficiency_enabled",
        "random_ltd_enabled",
        "eigenvalue_enabled",
        "pld_enabled",
        "quantize_training",
        "sparse_gradients_enabled",
    }
)


class DscoreEngine(DeepSpeedAccessors, CheckpointState, torch.nn.Module):
    """The object ``dscore.initialize`` returns first; use it like the model plus an optimizer.

    Built by :func:`dscore.runtime.initialize.initialize`; the constructor only wires already-built parts.

    Args:
        module: the user's model (on the device, cast by the precision mode).
        config: the validated :class:`dscore.config.DscoreConfig`.
        runtime: the :class:`dscore.runtime.runtime.Runtime` of this engine (plugin manager, registry,
            accelerator, comm).
        zero_stage: the ZeRO stage object owning gradients and the optimizer step.
        precision: the precision mode.
        loss_scaler: the loss scaler (fp16) or None.
        lr_scheduler: the LR scheduler or None.
        training_dataloader: the :class:`dscore.runtime.dataloader.DscoreDataLoader` or None.
        monitors: monitor objects (``write_events``, ``close``) created on rank 0.
        rank / dp_world_size: this process's global rank and the data-parallel world size.

    Attributes:
        micro_steps, global_steps, global_samples, skipped_steps: the DeepSpeed counters (ints, start 0).
    """

    def __init__(
        self,
        *,
        module: torch.nn.Module,
        config: DscoreConfig,
        runtime: Runtime,
        zero_stage: ZeroStage,
        precision: PrecisionMode,
        loss_scaler: LossScaler | None,
        lr_scheduler: Any,
        training_dataloader: Any,
        monitors: list[Any],
        rank: int,
        dp_world_size: int,
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.runtime = runtime
        self.zero_stage_impl = zero_stage
        self.precision = precision
        self.loss_scaler = loss_scaler
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.monitors = list(monitors)
        self.global_rank = rank
        self.dp_world_size = dp_world_size

        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0

        self._gas = int(config.gradient_accumulation_steps)
        self._train_batch_size = int(config.train_batch_size)
        self._micro_batch_size = int(config.train_micro_batch_size_per_gpu)
        self._managed = bool(config.managed_gradient_accumulation)
        self._boundary_override: bool | None = None
        self._inside_step = False
        self._in_no_sync = False
        self._step_applied = False
        self._global_grad_norm: float | torch.Tensor | None = None
        self._backwards_since_step = 0
        #: ``"dscore"`` (default: pickle-free, world-size independent) or ``"deepspeed"`` (DeepSpeed 0.19.8's
        #: files, for tools that read them; set by the ``deepspeed`` compatibility distribution). See
        #: :func:`dscore.persistence.save_checkpoint`; loads read either.
        self.checkpoint_layout = "dscore"
        self._backwards_in_micro_step = 0  # backward() calls since the last step() call (issue 33 item 1)
        self._warned_unmanaged_window = False
        self._states_offloaded = False  # offload_states() moved training state off the device
        self._compile_state = CompileState()  # engine.compile() / an adopted torch.compile(model)

        self._steps_per_print = config.steps_per_print or 0
        fp16 = config.section("fp16", None)
        self._auto_cast_dtype = precision.compute_dtype if getattr(fp16, "auto_cast", False) else None
        # DeepSpeed forces wall_clock_breakdown on with the flops profiler (its report reads these timers)
        profiler = config.section("flops_profiler", None)
        self._wall_clock = bool(config.wall_clock_breakdown) or (profiler is not None and bool(profiler.enabled))
        self._timers = PhaseTimers(self._synchronize) if self._wall_clock else None
        if self._timers is not None:
            self._timers.activate()  # ZeRO stages add their sub-phases (dscore.runtime.timers.active_timers)
        # Losses are accumulated (as tensors, no device sync) only when someone reads them.
        self._track_loss = rank == 0 and (bool(self._steps_per_print) or bool(self.monitors))
        self._step_loss: torch.Tensor | None = None
        self._window_loss_sum = 0.0
        self._window_steps = 0
        self._window_start = time.perf_counter()
        self._window_samples = 0
        pm = getattr(runtime, "plugin_manager", None)
        self._pm = pm
        self._after_step_hook = bool(pm is not None and pm.has_implementations("dscore_after_optimizer_step"))
        # one lease on the process group dscore owns; close() returns it (see dscore.comm.init)
        self._closed = False
        self._holds_group = _lease_process_group(runtime)
        # DeepSpeed's ZeRO optimizers have offload_states / reload_states / empty_partition_cache (OpenRLHF
        # and verl call them on engine.optimizer): the engine's own calls
        bind_optimizer_state_methods(self, self.optimizer)

    # ------------------------------------------------------------------ attribute fall-through
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and name != "module":
                try:
                    return getattr(module, name)
                except AttributeError:
                    if name in LEFT_OUT_APIS:
                        raise EngineAPIMissing(name) from None
                    raise
            raise

    # ------------------------------------------------------------------ properties / config accessors
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the ZeRO stage steps; without one None, except under ZeRO stage 3, which returns
        its parameter manager (gather / save / load still work; DeepSpeed returns ``DeepSpeedZeRoOffload``)."""
        stage = self.zero_stage_impl
        return getattr(stage, "public_optimizer", stage.optimizer)

    @property
    def accelerator(self) -> Any:
        """The runtime's accelerator."""
        return self.runtime.accelerator

    @property
    def device(self) -> torch.device:
        """The device the module lives on."""
        return self.runtime.accelerator.device()

    def _synchronize(self) -> None:
        self.runtime.accelerator.synchronize()

    # ------------------------------------------------------------------ forward
    @runtime_scoped
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the module. With ``fp16.auto_cast`` floating-point tensor inputs are cast to fp16 first."""
        refuse_while_offloaded(self, "engine.forward()")
        if self._auto_cast_dtype is not None:
            args, kwargs = _cast_inputs(args, kwargs, self._auto_cast_dtype)
        if self._timers is None:
            return self.module(*args, **kwargs)
        self._timers.start(FORWARD)
        out = self.module(*args, **kwargs)
        self._timers.stop(FORWARD)
        return out

    # ------------------------------------------------------------------ torch.compile
    def compile(  # type: ignore[override]  # DeepSpeed's signature, not nn.Module.compile(*args, **kwargs)
        self,
        backend: Any = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile the wrapped module in place with ``torch.compile`` (DeepSpeed 0.19.8's ``engine.compile``).

        Args:
            backend: a dynamo backend name or callable; default the accelerator's
                :meth:`~dscore.accelerator.Accelerator.get_compile_backend` (``"inductor"`` on CPU and CUDA).
            compile_kwargs: further ``torch.compile`` arguments (``fullgraph``, ``dynamic``, ``mode``,
                ``options``); a ``backend`` key is overridden by ``backend`` with a warning.
            schedule: DeepCompile's pass schedule; only None is accepted (DeepCompile is not implemented).
            compiled_autograd_enabled: also compile the backward pass with compiled autograd (its backend is
                the accelerator's default, as in DeepSpeed).

        A second call does nothing. ``engine(...)`` and ``engine.module(...)`` then run compiled; parameters,
        hooks and checkpoint keys stay the plain module's. See :mod:`dscore.runtime.compile`.

        Raises:
            ConfigError: a non-None ``schedule``; an unknown backend name; ``compile_kwargs`` not a dict.
        """
        self._compile_state.compile(
            self.module,
            backend=self.runtime.accelerator.get_compile_backend() if backend is None else backend,
            compile_kwargs=compile_kwargs,
            schedule=schedule,
            compiled_autograd_enabled=compiled_autograd_enabled,
            deepcompile=False,
            regions=self.zero_stage_impl.compile_regions,
        )

    @property
    def is_compiled(self) -> bool:
        """True once :meth:`compile` ran, or when ``initialize`` got a ``torch.compile(model)``."""
        return self._compile_state.compiled

    # ------------------------------------------------------------------ generation
    @contextlib.contextmanager
    def generation_mode(self) -> Iterator[DscoreEngine]:
        """A context for generating with ``engine.module`` inside the training engine (RLHF rollouts).

        On entry the ZeRO stage makes every parameter whole on the device (stage 3: one gather of each
        unit, all in flight together; stages 0-2 hold them already) and its module hooks stop firing, so a
        ``generate`` loop runs no collective per token and ranks may stop at different lengths; gradients
        are off inside. On exit what was gathered for it is released. Re-entrant: a nested use gathers
        nothing. Every rank of the data-parallel group must enter it (the gather is collective).

        Yields:
            the engine.

        Raises:
            EngineError: the training states are offloaded (``engine.offload_states()``; reload first).
        """
        refuse_while_offloaded(self, "engine.generation_mode()")
        with self.zero_stage_impl.generation_context(), torch.no_grad():
            yield self

    # ------------------------------------------------------------------ boundaries
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro step ends a gradient accumulation window (see module docstring)."""
        if self._boundary_override is not None:
            return self._boundary_override
        if not self._managed:
            return self._inside_step
        return (self.micro_steps + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the boundary decision; the value sticks until set again (DeepSpeed behaviour).

        Needed with ``managed_gradient_accumulation: false`` when gradients must be reduced in the last
        ``backward`` of a window rather than in ``step()``. ``None`` returns to the counter's decision
        (DeepSpeed stores the value as given and tests it against None the same way).
        """
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, ``backward`` accumulates gradients locally without communication; ``step`` is refused.

        Raises:
            EngineError: with ZeRO stage 2 or 3 (gradients are partitioned) or when re-entered.
        """
        if self.zero_optimization_stage() >= 2:
            raise EngineError(
                f"no_sync() cannot be used with ZeRO stage {self.zero_optimization_stage()}: "
                "gradient partitioning needs the reduction at every backward"
            )
        if self._in_no_sync:
            raise EngineError("no_sync() is already active; re-entering it is not supported")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # ------------------------------------------------------------------ backward / step
    @runtime_scoped
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward for one micro step.

        Args:
            loss: a scalar tensor (any float dtype) from the forward pass.
            retain_graph: keep the autograd graph (as ``torch.Tensor.backward``).
            scale_wrt_gas: divide by ``gradient_accumulation_steps`` first (DeepSpeed default).

        Returns:
            ``loss / gradient_accumulation_steps`` (not multiplied by the loss scale).

        Raises:
            EngineError: there is no optimizer, ``loss`` is not a scalar, or (managed accumulation, no
                boundary set by the caller, outside ``no_sync``) ``backward`` already ran since the last
                ``step()``: the micro-batches would be summed into one (issue 33; DeepSpeed sums silently);
                or the states are offloaded (``offload_states()``).
        """
        refuse_while_offloaded(self, "engine.backward()")
        if self.zero_stage_impl.optimizer is None:
            raise EngineError(
                "engine.backward() needs an optimizer: pass optimizer= or set optimizer.type in ds_config"
            )
        if loss.dim() != 0:
            raise EngineError(f"engine.backward() needs a scalar loss, got a tensor of shape {tuple(loss.shape)}")
        self._check_one_backward_per_micro_step()
        timers = self._timers
        if timers is not None:
            timers.start(BACKWARD)
        scaled = loss / self._gas if scale_wrt_gas and self._gas != 1 else loss
        if self._track_loss:
            detached = scaled.detach().float()
            self._step_loss = detached if self._step_loss is None else self._step_loss + detached
        to_backward = scaled
        if self.loss_scaler is not None:
            to_backward = scaled * self.loss_scaler.loss_scale
        boundary = self.is_gradient_accumulation_boundary()
        with self._compile_state.backward_context(self.runtime.accelerator.get_compile_backend()):
            if retain_graph:
                self.zero_stage_impl.backward(
                    to_backward, boundary=boundary, sync=not self._in_no_sync, retain_graph=True
                )
            else:
                self.zero_stage_impl.backward(to_backward, boundary=boundary, sync=not self._in_no_sync)
        self._backwards_since_step += 1
        if not self._in_no_sync:
            self._backwards_in_micro_step += 1
        if timers is not None:
            timers.stop(BACKWARD)
        return scaled

    def _check_one_backward_per_micro_step(self) -> None:
        # DeepSpeed counts micro steps in step(), not in backward(): a loop that calls backward() k times
        # per step() (accumulation owned by a wrapper, Lightning #19350) silently sums k micro-batches into
        # one micro step (gradient_accumulation_steps: 1 -> k times the mean gradient; G > 1 -> the window
        # never reaches its boundary on time). Under managed accumulation that is refused; a caller that
        # owns boundaries says so with set_gradient_accumulation_boundary() or
        # managed_gradient_accumulation: false.
        if self._in_no_sync:  # DeepSpeed: no_sync() disables the tracking of accumulation steps
            return
        if not self._managed or self._boundary_override is not None or self._backwards_in_micro_step == 0:
            return
        raise EngineError(
            f"engine.backward() called {self._backwards_in_micro_step + 1} times without engine.step() in "
            f"between, with gradient_accumulation_steps={self._gas}: the engine counts one micro-batch per "
            "engine.step() call, so these gradients would be summed into one micro-batch. Call engine.step() "
            "after every engine.backward() (it steps the optimizer only at the accumulation boundary) and set "
            "gradient_accumulation_steps to the number of micro-batches per optimizer step; or, when a "
            "training loop owns the accumulation, call engine.set_gradient_accumulation_boundary(is_boundary) "
            "before each backward (or set managed_gradient_accumulation: false). Sum several losses of one "
            "micro-batch before one engine.backward()"
        )

    @runtime_scoped
    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Advance one micro step; at the boundary run the optimizer step (see module docstring).

        Args:
            lr_kwargs: keyword arguments for ``lr_scheduler.step`` (DeepSpeed passes them through).

        Raises:
            EngineError: inside ``no_sync()`` or without an optimizer.
        """
        if self._in_no_sync:
            raise EngineError("engine.step() is not allowed inside no_sync(); leave the context first")
        refuse_while_offloaded(self, "engine.step()")
        if self.zero_stage_impl.optimizer is None:
            raise EngineError("engine.step() needs an optimizer: pass optimizer= or set optimizer.type in ds_config")
        self._step_applied = False
        self._backwards_in_micro_step = 0
        boundary = True if not self._managed and self._boundary_override is None else None
        self._inside_step = True
        try:
            if boundary is None:
                boundary = self.is_gradient_accumulation_boundary()
            if boundary:
                self._take_step(lr_kwargs)
        finally:
            self._inside_step = False
        self.micro_steps += 1

    def _take_step(self, lr_kwargs: dict[str, Any] | None, samples: int | None = None) -> None:
        timers = self._timers
        if timers is not None:
            timers.start(STEP)
        if not self._managed and samples is None:
            self._warn_unmanaged_window()
        outcome = self.zero_stage_impl.step()
        self._global_grad_norm = outcome.global_grad_norm
        if outcome.applied:
            self._step_applied = True
            if self.lr_scheduler is not None:
                if lr_kwargs:
                    self.lr_scheduler.step(**lr_kwargs)
                else:
                    self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
            self._log_skipped_step(outcome)
        self.global_steps += 1
        if samples is not None:  # a partial window (flush_gradient_accumulation)
            self.global_samples += samples
        elif self._managed:
            self.global_samples += self._train_batch_size
        else:
            self.global_samples += (self._train_batch_size // self._gas) * self._backwards_since_step
        self._backwards_since_step = 0
        if timers is not None:
            timers.stop(STEP)
        if self._track_loss:
            self._report()
        if self._after_step_hook and self._pm is not None:
            self._pm.call("dscore_after_optimizer_step", engine=self, step_applied=outcome.applied)

    def _warn_unmanaged_window(self) -> None:
        k = self._backwards_since_step
        if k == self._gas or k == 0 or self._warned_unmanaged_window:
            return
        self._warned_unmanaged_window = True  # once per engine: the caller chose its windows
        log.warning(
            "optimizer step %d applies %d engine.backward() call(s) with gradient_accumulation_steps=%d "
            "(managed_gradient_accumulation: false): each loss was divided by %d, so the step uses %d/%d "
            "times the mean gradient. Set gradient_accumulation_steps to the micro-batches per step, or pass "
            "scale_wrt_gas=False and scale the loss yourself (warned once)",
            self.global_steps + 1,
            k,
            self._gas,
            self._gas,
            k,
            self._gas,
        )

    def _log_skipped_step(self, outcome: Any) -> None:
        # every skip is a WARNING (DeepSpeed #8415); after the first 10, one line per 100 skips
        n = self.skipped_steps
        if n > 10 and n % 100 != 0:
            return
        if self.loss_scaler is not None:
            reason = f"fp16 gradient overflow (loss scale now {self.loss_scaler.loss_scale:g})"
        elif outcome.overflow:
            reason = "non-finite (inf/NaN) gradients"
        else:
            reason = "the ZeRO stage did not apply it"
        log_rank0(
            log,
            self.global_rank,
            "step %d skipped: %s; %d step(s) skipped so far%s",
            self.global_steps + 1,
            reason,
            n,
            " (further skips logged every 100)" if n == 10 else "",
            level=logging.WARNING,
        )

    def zero_grad(self) -> None:  # type: ignore[override]  # DeepSpeed's engine.zero_grad() takes no argument
        """Drop accumulated gradients without stepping; every module parameter's ``.grad`` is None after it
        (DeepSpeed's ``engine.zero_grad()``).

        Raises:
            EngineError: the states are offloaded (``offload_states()``; the gradients' storage is freed).
        """
        refuse_while_offloaded(self, "engine.zero_grad()")
        self.zero_stage_impl.zero_grad()
        self._backwards_in_micro_step = 0  # the dropped micro-batch no longer counts (item 1's check)

    @property
    def pending_micro_batches(self) -> int:
        """``backward`` calls whose gradients wait for an optimizer step (0 at an accumulation boundary)."""
        return self._backwards_since_step

    def flush_gradient_accumulation(self, apply: bool) -> bool:
        """End a partial accumulation window: apply its gradients in one optimizer step, or drop them.

        With ``gradient_accumulation_steps: G`` and a data loader whose length is not a multiple of G, the
        last ``k < G`` micro-batches of an epoch leave gradients pending. Call this once after the epoch's
        loop. ``apply=True`` runs the optimizer step now (reduction, unscale/overflow check, clipping, LR
        scheduler, ``global_steps += 1``, ``global_samples += k * micro_batch * dp_world``). Each micro
        batch's loss was divided by G, so the update uses ``sum / G`` of the ``k`` gradients - exactly
        what DeepSpeed applies for the same window when ``set_gradient_accumulation_boundary(True)`` is
        called before its last ``backward``. ``apply=False`` drops the gradients (DeepSpeed's behaviour
        when nothing is done: the next window's ``zero_grad`` discards them). Either way the next
        micro-batch starts a fresh window (``micro_steps`` moves to the next multiple of G).

        Collective when ``apply`` and gradients are pending: call on every rank.

        Args:
            apply: step with the pending gradients (True) or discard them (False).

        Returns:
            True when an optimizer step was applied (False: nothing pending, dropped, or fp16 overflow).

        Raises:
            EngineError: inside ``no_sync()``, without an optimizer, or with
                ``managed_gradient_accumulation: false`` (every ``step()`` is a boundary there).
        """
        if not self._managed:
            raise EngineError(
                "flush_gradient_accumulation() is for managed gradient accumulation; with "
                "managed_gradient_accumulation: false every engine.step() already applies the gradients"
            )
        if self._in_no_sync:
            raise EngineError("flush_gradient_accumulation() is not allowed inside no_sync(); leave the context first")
        if self.zero_stage_impl.optimizer is None:
            raise EngineError("flush_gradient_accumulation() needs an optimizer")
        pending = self._backwards_since_step
        self._step_applied = False
        if pending and apply:
            self._take_step(None, samples=(self._train_batch_size // self._gas) * pending)
        elif pending:
            self.zero_stage_impl.zero_grad()
            self._backwards_since_step = 0
            self._step_loss = None
            log_rank0(log, self.global_rank, "dropped the gradients of %d pending micro-batch(es)", pending)
        self.micro_steps = -(-self.micro_steps // self._gas) * self._gas
        return self._step_applied

    def _warn_pending_gradients(self, where: str) -> None:
        pending = self._backwards_since_step
        if pending and self._managed:
            log.warning(
                "%s with gradients of %d micro-batch(es) pending (gradient_accumulation_steps=%d, the window is "
                "incomplete): they are not saved and will not be applied. Call "
                "engine.flush_gradient_accumulation(apply=True) to step with them or apply=False to drop them",
                where,
                pending,
                self._gas,
            )

    # ------------------------------------------------------------------ queries
    def was_step_applied(self) -> bool:
        """True iff the last ``step()`` updated the parameters (false off the boundary and on overflow)."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        """The ``lr`` of every optimizer parameter group (0.0 for a group without one); [] without optimizer."""
        opt = self.optimizer
        if opt is None:
            return []
        return [float(g.get("lr", 0.0)) for g in opt.param_groups]

    def get_mom(self) -> list[Any]:
        """``momentum`` (SGD/RMSprop style) or ``betas`` of every parameter group."""
        opt = self.optimizer
        if opt is None:
            return []
        return [g.get("momentum", g.get("betas")) for g in opt.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The unscaled global gradient L2 norm of the last applied step, **before** clipping, or None.

        Global: over every rank's gradients of one model replica (data-parallel partitions summed,
        tensor-parallel shards summed and replicated parameters counted once, experts per their groups,
        pipeline stages summed) and equal on every rank, whatever ``gradient_clipping`` is. None after a
        skipped (overflow) step, or when nothing needed the norm (fp32 at ZeRO 0 without clipping).
        DeepSpeed's ``get_global_grad_norm``; :meth:`get_global_grad_norm_post_clip` is the norm as applied.
        """
        norm = self._global_grad_norm
        if isinstance(norm, torch.Tensor):
            norm = float(norm)
            self._global_grad_norm = norm
        return norm

    def get_global_grad_norm_post_clip(self) -> float | None:
        """The global L2 norm of the gradients the last applied step used, after clipping, or None.

        ``norm * min(1, gradient_clipping / (norm + 1e-6))`` with ``norm`` =
        :meth:`get_global_grad_norm` (the coefficient of :func:`torch.nn.utils.clip_grad_norm_`, which every
        stage applies), computed in float32 as the stages compute the coefficient; scaling gradients by a
        coefficient scales their norm by it, so this is the norm of what the optimizer got. Equal to
        :meth:`get_global_grad_norm` when ``gradient_clipping`` is 0 or the norm is below it (or not finite).
        None when :meth:`get_global_grad_norm` is. dscore's own (DeepSpeed 0.19.8 has no such accessor).
        """
        norm = self.get_global_grad_norm()
        clip = self._clip_for_post_norm()
        if norm is None or clip <= 0.0 or not (norm == norm and abs(norm) != float("inf")):
            return norm
        value = torch.tensor(norm, dtype=torch.float32, device="cpu")
        coef = torch.clamp(clip / (value + 1e-6), max=1.0)
        return float(value * coef)

    def _clip_for_post_norm(self) -> float:
        # the bound the stage clipped with (the pipeline engine clips itself with its own)
        return float(self.config.gradient_clipping or 0.0)

    def get_loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    # ------------------------------------------------------------------ logging and monitors
    def _report(self) -> None:
        step_loss = self._step_loss
        self._step_loss = None
        if step_loss is None:
            return
        if self.monitors:
            loss_value = float(step_loss)
            self._window_loss_sum += loss_value
            events = [
                ("Train/Samples/train_loss", loss_value, self.global_samples),
                ("Train/Samples/lr", (self.get_lr() or [0.0])[0], self.global_samples),
            ]
            if self.loss_scaler is not None:
                events.append(("Train/Samples/loss_scale", self.get_loss_scale(), self.global_samples))
            for monitor in self.monitors:
                monitor.write_events(events)
        elif self._steps_per_print:
            # keep the window sum on the device; read it only at a print step
            self._window_loss_sum = self._window_loss_sum + step_loss  # type: ignore[assignment]
        self._window_steps += 1
        if self._steps_per_print and self.global_steps % self._steps_per_print == 0:
            self._print_progress()

    def _print_progress(self) -> None:
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        samples = self.global_samples - self._window_samples
        mean_loss = float(self._window_loss_sum) / max(1, self._window_steps)
        log_rank0(
            log,
            self.global_rank,
            "step=%d skipped=%d loss=%.6f lr=%s loss_scale=%g samples/s=%.1f",
            self.global_steps,
            self.skipped_steps,
            mean_loss,
            [f"{lr:.3e}" for lr in self.get_lr()],
            self.get_loss_scale(),
            samples / elapsed,
        )
        if self._timers is not None:
            times = self._timers.mean_ms()
            log_rank0(
                log,
                self.global_rank,
                "time (ms/call): " + " | ".join(f"{k}: {v:.2f}" for k, v in times.items()),
            )
        self._window_start = now
        self._window_samples = self.global_samples
        self._window_loss_sum = 0.0
        self._window_steps = 0

    def close_monitors(self) -> None:
        """Flush and close every monitor (called by ``destroy``)."""
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []
        self._track_loss = self.global_rank == 0 and bool(self._steps_per_print)

    def close(self) -> None:
        """Release what the engine holds: the ZeRO stage's resources (NVMe swap files), monitors, then
        its lease on the process group. Idempotent; the engine must not be used for training afterwards.

        The process group is destroyed here only when dscore created it for an engine
        (``dscore.initialize`` made the group) and this was the last open engine using it; a group
        created by the user, or by an explicit ``dscore.init_distributed()``, stays alive (dscore's own
        group is in any case destroyed at interpreter exit). Collective when it destroys the group:
        every rank should close its engine. Also what ``with engine:`` does on leaving the block.
        """
        if self._closed:
            return
        self._closed = True
        self._warn_pending_gradients("engine.close()")
        try:
            self.zero_stage_impl.close()  # e.g. removes NVMe swap files
            self.close_monitors()
        finally:
            if self._holds_group:
                self._holds_group = False
                from dscore.comm.init import PROCESS_GROUP_OWNER

                PROCESS_GROUP_OWNER.release()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a closed engine no longer gives the group accessors their mesh)."""
        return self._closed

    def destroy(self) -> None:
        """DeepSpeed's name for :meth:`close`."""
        self.close()

    def __enter__(self) -> DscoreEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

def _lease_process_group(runtime: Any) -> bool:
    """Take one lease on dscore's process group for a new engine (False when there is no facade)."""
    comm = getattr(runtime, "comm", None)  # unit tests build engines on a bare runtime stand-in
    from dscore.comm.facade import Comm

    if not isinstance(comm, Comm):
        return False
    from dscore.comm.init import PROCESS_GROUP_OWNER

    PROCESS_GROUP_OWNER.acquire(comm)
    return True


def _cast_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        return value

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
