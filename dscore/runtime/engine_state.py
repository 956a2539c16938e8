"""The engine's checkpoint-facing state and checkpoint API, as a mixin of :class:`dscore.runtime.engine.DscoreEngine`.

For :mod:`dscore.persistence`: :meth:`~CheckpointState.counters_state` / :meth:`~CheckpointState.load_counters_state`,
:attr:`~CheckpointState.data_sampler_state` / :meth:`~CheckpointState.load_data_sampler_state`,
:meth:`~CheckpointState.rng_state` / :meth:`~CheckpointState.load_rng_state`, :meth:`~CheckpointState.state_for_checkpoint`
bundling them, and ``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model``, which delegate to
:mod:`dscore.persistence` in the layout :attr:`checkpoint_layout` names.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dscore.runtime.context import runtime_scoped

if TYPE_CHECKING:
    from dscore.protocols.precision import LossScaler
    from dscore.runtime.runtime import Runtime

__all__ = ["CheckpointState"]


class CheckpointState:
    """Checkpoint-facing state of the engine (module docs); mixed into :class:`~dscore.runtime.engine.DscoreEngine`,
    whose constructor sets the attributes declared here."""

    runtime: Runtime
    lr_scheduler: Any
    loss_scaler: LossScaler | None
    training_dataloader: Any
    dp_world_size: int
    micro_steps: int
    global_steps: int
    global_samples: int
    skipped_steps: int
    #: the ``checkpoint_layout`` unit ``save_checkpoint`` writes (``"dscore"`` by default).
    checkpoint_layout: str
    _gas: int
    _train_batch_size: int
    _backwards_since_step: int
    _window_samples: int
    zero_optimization_stage: Callable[[], int]
    _warn_pending_gradients: Callable[[str], None]

    # ------------------------------------------------------------------ checkpoint-facing state
    def counters_state(self) -> dict[str, int]:
        """``{"global_steps", "global_samples", "skipped_steps", "micro_steps"}`` as ints."""
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "micro_steps": self.micro_steps,
        }

    def load_counters_state(self, state: dict[str, Any]) -> None:
        """Restore counters saved by :meth:`counters_state`.

        ``global_samples`` falls back to ``global_steps * train_batch_size`` (DeepSpeed). ``micro_steps``
        becomes ``global_steps * gradient_accumulation_steps`` whatever was saved: a loaded run starts at an
        accumulation boundary even when the saved window (``gradient_accumulation_steps`` or world size)
        differs from this one (DeepSpeed does not checkpoint ``micro_steps`` at all, which also starts at a
        boundary). Pending gradients are not checkpointed, so a saved mid-window position cannot resume.
        """
        self.global_steps = int(state.get("global_steps", 0))
        self.global_samples = int(state.get("global_samples", self.global_steps * self._train_batch_size))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.micro_steps = self.global_steps * self._gas
        self._backwards_since_step = 0
        self._window_samples = self.global_samples

    @property
    def data_sampler_state(self) -> dict[str, int] | None:
        """Position of the training data loader: ``{"epoch", "batches_consumed"}`` (see
        :class:`dscore.runtime.dataloader.DscoreDataLoader`), or None without ``training_data``."""
        loader = self.training_dataloader
        return loader.state_dict() if loader is not None else None

    def load_data_sampler_state(self, state: dict[str, Any] | None) -> None:
        """Restore :attr:`data_sampler_state`; the next ``iter(engine.training_dataloader)`` resumes there."""
        if state is not None and self.training_dataloader is not None:
            self.training_dataloader.load_state_dict(state)

    def rng_state(self) -> dict[str, Any]:
        """Python, torch CPU and accelerator RNG states (``accelerator`` is None on a CPU accelerator)."""
        accel_state = None
        accel = self.runtime.accelerator
        if getattr(accel, "device_type", "cpu") != "cpu":
            accel_state = accel.get_rng_state()
        return {"python": random.getstate(), "torch": torch.get_rng_state(), "accelerator": accel_state}

    def load_rng_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`rng_state` returned (missing entries are left alone)."""
        if state.get("python") is not None:
            random.setstate(state["python"])
        if state.get("torch") is not None:
            torch.set_rng_state(state["torch"])
        if state.get("accelerator") is not None:
            self.runtime.accelerator.set_rng_state(state["accelerator"])

    def state_for_checkpoint(self) -> dict[str, Any]:
        """Everything the engine itself owns, for :mod:`dscore.persistence`.

        Returns:
            ``{"counters": counters_state(), "lr_scheduler": state dict or None, "loss_scaler": state
            dict or None, "data_sampler": data_sampler_state, "rng": rng_state(), "zero_stage":
            zero_stage_impl.stage, "dp_world_size": int}``. Module and optimizer state come from
            :attr:`zero_stage_impl` (``module_state_dict()``, ``state_dict()``), which may run collectives.
        """
        return {
            "counters": self.counters_state(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "data_sampler": self.data_sampler_state,
            "rng": self.rng_state(),
            "zero_stage": self.zero_optimization_stage(),
            "dp_world_size": self.dp_world_size,
        }

    def load_state_from_checkpoint(self, state: dict[str, Any], *, load_lr_scheduler_states: bool = True) -> None:
        """Restore what :meth:`state_for_checkpoint` returned (counters, scheduler, scaler, sampler, RNG)."""
        if state.get("counters") is not None:
            self.load_counters_state(state["counters"])
        if load_lr_scheduler_states and self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.load_data_sampler_state(state.get("data_sampler"))
        if state.get("rng") is not None:
            self.load_rng_state(state["rng"])

    # ------------------------------------------------------------------ checkpoint API (delegates)
    @runtime_scoped
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save a checkpoint on every rank (see :func:`dscore.persistence.save_checkpoint`). Returns True.

        ``exclude_frozen_parameters=True`` leaves parameters with ``requires_grad=False`` out of the module
        state (DeepSpeed's meaning; a later load into a model that already holds them restores the rest).
        Warns when gradients of an incomplete accumulation window are pending (they are not saved). The
        files follow :attr:`checkpoint_layout`.
        """
        from dscore import persistence
        from dscore.runtime.offload_states import refuse_while_offloaded

        refuse_while_offloaded(self, "engine.save_checkpoint()")  # before any file or collective
        self._warn_pending_gradients("save_checkpoint()")
        return persistence.save_checkpoint(
            self,
            save_dir,
            tag=tag,
            client_state=client_state if client_state is not None else {},
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
            layout=self.checkpoint_layout,
        )

    @runtime_scoped
    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint (see :func:`dscore.persistence.load_checkpoint`); returns ``(path, client_state)``.

        Raises:
            EngineError: the states are offloaded (``offload_states()``): call ``reload_states()`` first.
        """
        from dscore import persistence
        from dscore.runtime.offload_states import refuse_while_offloaded

        refuse_while_offloaded(self, "engine.load_checkpoint()")

        return persistence.load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the module's 16-bit (or fp32) weights (see :func:`dscore.persistence.save_16bit_model`).

        Raises:
            EngineError: the states are offloaded (``offload_states()``): call ``reload_states()`` first.
        """
        from dscore import persistence
        from dscore.runtime.offload_states import refuse_while_offloaded

        refuse_while_offloaded(self, "engine.save_16bit_model()")

        return persistence.save_16bit_model(self, save_dir, save_filename=save_filename)

    save_fp16_model = save_16bit_model
