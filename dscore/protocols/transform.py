"""The model-transform contract: a change ``dscore.initialize`` makes to the user's model and its training
set-up (AutoTP, AutoEP, Ulysses, activation checkpointing, a third party's adapter), run in ``order``.

A plugin registers a :class:`dscore.specs.ModelTransformSpec` (``name``, the import string of a
:class:`ModelTransform` object, the ``config_key`` section it owns — registered by the same plugin as a
:class:`~dscore.specs.ConfigSectionSpec` — and an ``order``) through ``dscore_register_model_transforms``.
The core names no transform: it runs every registered one whose :meth:`ModelTransform.enabled` says yes,
in ascending ``order`` (ties by name), at these points:

1. :meth:`ModelTransform.prepare` — in ``dscore.initialize``, once the runtime exists and before the device
   mesh and the engine, for every model (pipeline models included, :attr:`PrepareContext.pipeline_model`):
   refuse what the transform cannot combine with, set process-wide settings;
2. :meth:`ModelTransform.apply` — in the standard engine's assembly, after the precision mode is chosen and
   before the model is moved and cast: rewrite ``ctx.model`` in place and set ``ctx.model_parameters`` to
   the parameters to optimize (:class:`TransformContext`);
3. :meth:`ModelTransform.adjust_stage` — after the module is cast and before the ZeRO stage is built: change
   the parameter groups and the config the stage is built with (:class:`StageInputs`);
4. :meth:`ModelTransform.wrap_stage` — after the ZeRO stage is built: return the stage the engine uses;
5. :meth:`ModelTransform.verify` — in ``dscore.initialize`` after any engine plugin built itself: refuse an
   engine that did not apply the transform (a model left unconverted must not train as if it were).

Only :meth:`~ModelTransform.enabled` must be written; every step defaults to changing nothing. A transform disabled as ``model_transform:<name>`` is never run; a config for
which its :meth:`~ModelTransform.enabled` says yes is refused naming the unit (so the object's module must
import cheaply: no torch at module level, heavy imports inside the methods).

This module imports torch only for type checking.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

    from dscore.config.model import DscoreConfig
    from dscore.parallel.mesh import ParallelMesh
    from dscore.protocols.precision import PrecisionMode
    from dscore.protocols.zero import ZeroStage
    from dscore.runtime.runtime import Runtime

__all__ = ["ModelTransform", "PrepareContext", "StageInputs", "TransformContext", "VerifyContext"]

SectionT = TypeVar("SectionT")


@dataclass(frozen=True, kw_only=True)
class PrepareContext(Generic[SectionT]):
    """What :meth:`ModelTransform.prepare` receives.

    Attributes:
        runtime: the :class:`~dscore.runtime.runtime.Runtime` (accelerator, comm, registry); no mesh yet.
        config: the validated :class:`~dscore.config.model.DscoreConfig`.
        section: the transform's validated ``config_key`` section, None when the spec names none.
        path: the ``config_key`` (``""`` without one), for error paths.
        model: the user's module as passed to ``initialize``.
        pipeline_model: True when the model brings its own pipeline topology (a ``PipelineModule``): the
            pipeline engine builds it and runs no :meth:`ModelTransform.apply`.
    """

    runtime: Runtime
    config: DscoreConfig
    section: SectionT
    path: str
    model: torch.nn.Module
    pipeline_model: bool


@dataclass(kw_only=True)
class TransformContext(Generic[SectionT]):
    """What :meth:`ModelTransform.apply` (and the later steps) receive; ``model_parameters`` is mutable.

    One context per transform: ``model`` is the same module object for all of them, ``model_parameters``
    is handed on from one transform to the next in ``order``.

    Attributes:
        runtime: the :class:`~dscore.runtime.runtime.Runtime`.
        config: the validated :class:`~dscore.config.model.DscoreConfig`.
        section: the transform's validated ``config_key`` section, None when the spec names none.
        path: the ``config_key`` (``""`` without one), for error paths.
        mesh: the run's :class:`~dscore.parallel.mesh.ParallelMesh` (``tp_size``, ``sp_size``, ``dp_size``,
            their comms).
        model: the user's module, on its original device and dtype; rewrite it in place.
        model_parameters: what the optimizer will train: ``model_parameters=`` of ``initialize`` (tensors,
            ``(name, tensor)`` pairs or group dicts; None = the module's parameters) as left by the
            transforms before this one. Set it when the parameters change (a replaced layer's new ones).
        client_optimizer: ``optimizer=`` of ``initialize`` (an instance, a callable, or None).
        precision: the selected :class:`~dscore.protocols.precision.PrecisionMode` (``name``: fp32 / fp16 /
            bf16); the module is cast by it after every :meth:`~ModelTransform.apply`.
        replicas_equal: tensors of ``model`` that :meth:`~ModelTransform.apply` made equal on every rank of
            each group a ZeRO stage reduces over (e.g. AutoTP broadcasts the unsplit model from world rank 0
            before slicing it): the stage's replica broadcast
            (:func:`dscore.runtime.replicas.broadcast_replicas`, ``already_equal``) skips them, so they do not
            travel twice. Matched by object identity (a tensor replaced afterwards, such as a buffer moved by
            ``Module.to``, is broadcast as usual); the same tensors on every rank; empty by default. A later
            transform that changes one of them differently per rank must remove it.
    """

    runtime: Runtime
    config: DscoreConfig
    section: SectionT
    path: str
    mesh: ParallelMesh
    model: torch.nn.Module
    model_parameters: Iterable[Any] | None
    client_optimizer: Any
    precision: PrecisionMode
    replicas_equal: list[torch.Tensor] = field(default_factory=list)


@dataclass(kw_only=True)
class StageInputs:
    """What the ZeRO stage is about to be built from (:meth:`ModelTransform.adjust_stage` may replace fields).

    Attributes:
        module: the model as the engine trains it (moved to the device, cast by the precision mode).
        model_parameters: the parameters / group dicts the stage partitions and the optimizer steps
            (normalised by :func:`dscore.runtime.assembly.param_groups` when the stage is built).
        config: the :class:`~dscore.config.model.DscoreConfig` the stage is built with (a transform that
            clips gradients itself gives the stage a copy with ``gradient_clipping: 0``); the engine keeps
            the user's config.
    """

    module: torch.nn.Module
    model_parameters: Iterable[Any] | None
    config: DscoreConfig


@dataclass(frozen=True, kw_only=True)
class VerifyContext(Generic[SectionT]):
    """What :meth:`ModelTransform.verify` receives once an engine plugin built itself.

    Attributes:
        engine_name: the engine spec's name (``"standard"``, ``"pipeline"``, a third party's).
        engine: the built engine.
        model: the user's module (after the engine's factory ran).
        config: the validated config; ``section`` / ``path`` as in :class:`PrepareContext`.
        mesh: the run's mesh.
    """

    engine_name: str
    engine: Any
    model: torch.nn.Module
    config: DscoreConfig
    section: SectionT
    path: str
    mesh: ParallelMesh


class ModelTransform(ABC, Generic[SectionT]):
    """A model transform (see the module docstring for when each method runs).

    Objects are stateless between runs: the registry may hand one object to several ``initialize`` calls.
    Errors that reject a config are :class:`~dscore.errors.ConfigError` with ``path`` set to the key.
    """

    @abstractmethod
    def enabled(self, config: DscoreConfig) -> bool:
        """Whether this run uses the transform. Cheap and side-effect free: reads ``config`` only (its own
        section through ``config.section(key)``), no collectives, no torch import."""

    def prepare(self, ctx: PrepareContext[SectionT]) -> None:
        """Before the mesh and the engine (every model, pipeline ones included). The default changes
        nothing; raise :class:`~dscore.errors.ConfigError` for a combination the transform cannot honour."""
        return None

    def apply(self, ctx: TransformContext[SectionT]) -> None:
        """Rewrite ``ctx.model`` in place; set ``ctx.model_parameters`` when the trained parameters change.
        The default changes nothing (a transform acting only in :meth:`prepare`, such as process-wide settings).

        Raises:
            ConfigError: the model or config cannot be transformed (names the key).
        """
        return None

    def adjust_stage(self, ctx: TransformContext[SectionT], inputs: StageInputs) -> StageInputs:
        """The inputs the ZeRO stage is built from; the default returns ``inputs`` unchanged."""
        return inputs

    def wrap_stage(self, ctx: TransformContext[SectionT], stage: ZeroStage, inputs: StageInputs) -> ZeroStage:
        """The stage the engine uses in place of ``stage`` (built from ``inputs``); the default is ``stage``.
        A wrapper keeps ``type(wrapper).stage`` equal to the inner stage's (the engine and checkpoints read it)."""
        return stage

    def verify(self, ctx: VerifyContext[SectionT]) -> None:
        """After an engine plugin built itself: raise :class:`~dscore.errors.ConfigError` naming the engine
        when it did not apply the transform. The default checks nothing."""
        return None
