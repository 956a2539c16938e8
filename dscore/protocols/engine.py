"""The engine contract: what ``dscore.initialize`` hands an engine plugin, and what it must return.

Engines are plugins like every other kind. A plugin registers an :class:`dscore.specs.EngineSpec`
(``name``, an import-string ``predicate(model, config) -> bool``, an import-string ``factory`` and a
``priority``) through the ``dscore_register_engines`` hook. ``dscore.initialize`` validates the config,
creates the :class:`~dscore.runtime.runtime.Runtime` (accelerator, process group, comm), calls the
``dscore_configure`` hook, then asks every engine's predicate about the model and calls the factory of the
one that accepts it (highest priority wins) with an :class:`EngineContext`. DeepSpeed makes the same
choice by type: ``PipelineEngine`` for a ``PipelineModule``, ``DeepSpeedEngine`` otherwise.

The factory returns an object satisfying :class:`Engine`; ``initialize`` returns
``(engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)`` and calls the
``dscore_engine_created`` hook with it. Most engines subclass :class:`dscore.runtime.engine.DscoreEngine`
(re-exported here as :class:`DscoreEngine`) and build their parts with the context's helpers, which apply
exactly the rules of the standard engine (precision selection, optimizer choice, ZeRO stage plugin,
LR scheduler, sharded data loader, monitors); a minimal complete engine is
``examples/plugins/dscore-example-engine`` in the repository.

This module imports torch only for type checking.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from dscore.protocols.precision import LossScaler, PrecisionMode
    from dscore.protocols.zero import ZeroStage

__all__ = ["Engine", "EngineContext"]


@runtime_checkable
class Engine(Protocol):
    """What an engine factory returns (the first value of ``dscore.initialize``).

    Attributes:
        module: the model the engine trains.
        optimizer: the optimizer object returned by ``initialize`` (may be None).
        training_dataloader: the loader built over ``training_data`` (None without it).
        lr_scheduler: the LR scheduler (None without one).
    """

    module: Any
    optimizer: Any
    training_dataloader: Any
    lr_scheduler: Any

    def close(self) -> None:
        """Release what the engine holds (monitors, its lease on dscore's process group). Idempotent."""


@dataclass(frozen=True)
class EngineContext:
    """Everything ``dscore.initialize`` received and built, handed to an engine factory.

    Attributes:
        config: the validated :class:`dscore.config.DscoreConfig` (batch triangle resolved).
        runtime: the :class:`dscore.runtime.runtime.Runtime` (plugin manager, registry, accelerator,
            ``comm`` over the default process group).
        model: the user's ``torch.nn.Module``, as passed (not yet moved or cast).
        client_optimizer: ``optimizer=`` of ``initialize``: an instance, a ``callable(param_groups)``, or None.
        model_parameters: ``model_parameters=`` of ``initialize`` (tensors, pairs or group dicts), or None.
        training_data: ``training_data=`` (a map-style dataset) or None.
        client_lr_scheduler: ``lr_scheduler=`` (instance or ``callable(optimizer)``) or None.
        collate_fn: ``collate_fn=`` for the training loader, or None.
    """

    config: Any
    runtime: Any
    model: torch.nn.Module
    client_optimizer: Any = None
    model_parameters: Iterable[Any] | None = None
    training_data: Any = None
    client_lr_scheduler: Any = None
    collate_fn: Callable[[list[Any]], Any] | None = None

    # ---------------------------------------------------------------- building blocks
    def select_precision(self) -> PrecisionMode:
        """The precision mode whose config block is enabled (``fp16`` / ``bf16``), else the default (fp32).

        Raises:
            ConfigError: two precision blocks are enabled.
        """
        from dscore.runtime.assembly import check_device_dtype, select_precision

        precision = select_precision(self.config, self.runtime.registry)
        check_device_dtype(precision, self.runtime.accelerator)
        return precision

    def build_zero_stage(
        self,
        module: torch.nn.Module,
        *,
        precision: PrecisionMode,
        loss_scaler: LossScaler | None,
        comm: Any = None,
        config: Any = None,
        model_parameters: Iterable[Any] | None = None,
    ) -> ZeroStage:
        """Build the ZeRO stage plugin for ``zero_optimization.stage`` over ``module``, as the standard engine does.

        Args:
            module: the (device-placed, precision-prepared) module whose parameters the stage owns.
            precision / loss_scaler: from :meth:`select_precision` and ``precision.make_loss_scaler``.
            comm: the :class:`dscore.comm.Comm` the stage reduces over (default: the gradient group of the
                runtime's mesh: the sequence x data ranks, all ranks without tensor/sequence parallelism). A
                pipeline engine passes ``runtime.comm.bound_to(data_parallel_group)``.
            config: the config the stage reads (default: :attr:`config`); an engine may pass a copy
                with a key changed (``config.model_copy(update=...)``) when it takes over that duty.
            model_parameters: overrides :attr:`model_parameters` (e.g. only this pipeline stage's).

        Raises:
            ConfigError: ZeRO stage 1/2 without an optimizer, or a client optimizer the stage cannot use.
        """
        from dscore.runtime.assembly import build_zero_stage, mesh_of

        return build_zero_stage(
            self.runtime,
            self.config if config is None else config,
            module=module,
            model_parameters=self.model_parameters if model_parameters is None else model_parameters,
            client_optimizer=self.client_optimizer,
            precision=precision,
            loss_scaler=loss_scaler,
            comm=mesh_of(self.runtime).grad_comm if comm is None else comm,
        )

    def build_lr_scheduler(self, optimizer: Any) -> Any:
        """The LR scheduler from ``scheduler.type`` or :attr:`client_lr_scheduler` (None without optimizer)."""
        from dscore.runtime.optimizer_builder import build_lr_scheduler

        return build_lr_scheduler(self.config, self.runtime.registry, optimizer, self.client_lr_scheduler)

    def build_dataloader(self, *, dp_world_size: int, dp_rank: int) -> Any:
        """A :class:`dscore.runtime.dataloader.DscoreDataLoader` over :attr:`training_data` sharded over
        ``dp_world_size`` data-parallel ranks (micro-batches of ``train_micro_batch_size_per_gpu``), or None."""
        if self.training_data is None:
            return None
        from dscore.runtime.dataloader import DscoreDataLoader

        return DscoreDataLoader(
            self.training_data,
            batch_size=int(self.config.train_micro_batch_size_per_gpu),
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            collate_fn=self.collate_fn,
            drop_last=bool(self.config.dataloader_drop_last),
            pin_memory=getattr(self.runtime.accelerator, "device_type", "cpu") != "cpu",
        )

    def create_monitors(self) -> list[Any]:
        """Every enabled monitor (global rank 0 only; [] elsewhere)."""
        from dscore.runtime.assembly import create_monitors

        return create_monitors(self.config, self.runtime.registry, int(self.runtime.comm.get_rank()))


def __getattr__(name: str) -> Any:
    # DscoreEngine is the base class most engines extend; importing it imports torch, so resolve lazily.
    if name == "DscoreEngine":
        from dscore.runtime.engine import DscoreEngine

        return DscoreEngine
    raise AttributeError(f"module 'dscore.protocols.engine' has no attribute {name!r}")
