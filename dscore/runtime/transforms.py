"""Running the registered model transforms (:mod:`dscore.protocols.transform`) without naming any of them.

``dscore.initialize`` calls :func:`refuse_missing_transforms` right after the config is validated (no
process-group work yet), :func:`prepare_transforms` once the runtime exists, and :func:`verify_transforms`
after the engine plugin built itself; the standard engine's assembly (:func:`dscore.runtime.assembly.assemble`)
runs :meth:`~dscore.protocols.transform.ModelTransform.apply`, ``adjust_stage`` and ``wrap_stage`` through
:class:`ActiveTransforms`. Order: ascending ``ModelTransformSpec.order``, ties by name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dscore.errors import ComponentNotFoundError, ConfigError, DscoreError
from dscore.protocols.transform import ModelTransform, PrepareContext, StageInputs, TransformContext, VerifyContext
from dscore.specs import ModelTransformSpec, resolve

if TYPE_CHECKING:
    import torch

    from dscore.config.model import DscoreConfig
    from dscore.parallel.mesh import ParallelMesh
    from dscore.protocols.precision import PrecisionMode
    from dscore.protocols.zero import ZeroStage
    from dscore.registry import Registry
    from dscore.runtime.runtime import Runtime

__all__ = [
    "ActiveTransforms",
    "enabled_transforms",
    "prepare_transforms",
    "refuse_missing_transforms",
    "verify_transforms",
]

log = logging.getLogger("dscore.runtime.transforms")

#: mesh dimension -> the ds_config key holding its degree (the core mesh reads both before any transform runs)
_MESH_KEYS = {"tp": "tensor_parallel.autotp_size", "sp": "sequence_parallel_size"}


def _object(obj: Any) -> ModelTransform[Any]:
    """The transform object behind an import string's target (a class is instantiated with no arguments)."""
    return obj() if isinstance(obj, type) else obj


def _ordered(specs: Iterable[Any]) -> list[ModelTransformSpec]:
    found = [s for s in specs if isinstance(s, ModelTransformSpec)]
    return sorted(found, key=lambda s: (s.order, s.name.lower()))


def enabled_transforms(registry: Registry, cfg: DscoreConfig) -> list[tuple[ModelTransformSpec, ModelTransform[Any]]]:
    """``(spec, object)`` of every registered model transform whose ``enabled(cfg)`` is true, in order.

    Raises:
        PluginLoadError: a transform's import string cannot be imported (names the plugin).
    """
    out = []
    for spec in _ordered(registry.specs("model_transform")):
        obj = _object(registry.load(spec, "transform"))
        if obj.enabled(cfg):
            out.append((spec, obj))
    return out


def _section(cfg: DscoreConfig, spec: ModelTransformSpec) -> Any:
    return cfg.section(spec.config_key) if spec.config_key else None


def refuse_missing_transforms(registry: Registry, cfg: DscoreConfig, mesh_degrees: tuple[int, int]) -> None:
    """Refuse a config that needs a model transform this run does not have.

    * a unit disabled as ``model_transform:<name>`` whose ``enabled(cfg)`` says yes (its object is imported
      to ask; a unit whose module cannot be imported counts as needed when its ``config_key`` is in the
      config);
    * a mesh dimension (``tp``, ``sp``) with a degree above 1 and no active, enabled transform declaring it in
      ``mesh_dims`` (a whole plugin disabled, or none installed): the mesh would be built for a parallelism
      nothing implements.

    Args:
        mesh_degrees: ``(tp, sp)`` as the mesh will be built (:func:`dscore.parallel.mesh.raw_mesh_degrees`).

    Raises:
        ComponentNotFoundError: a needed unit is disabled (the registry's message: which plugin provides
            it and how to re-enable it).
        ConfigError: a mesh degree above 1 that no active transform implements (names the key).
    """
    manager = registry.manager
    for record in manager.active_records():
        for spec in _ordered(record.unit_specs_disabled):
            try:
                needed = _object(resolve(spec.transform)).enabled(cfg)
            except Exception:  # noqa: BLE001 - a broken disabled unit: judge by its section alone
                needed = bool(spec.config_key) and spec.config_key in cfg.raw
            if needed:
                what = f"its section {spec.config_key!r}" if spec.config_key else "its settings"
                try:
                    registry.get("model_transform", spec.name)
                except ComponentNotFoundError as exc:
                    raise ComponentNotFoundError(
                        f"this ds_config needs the model transform {spec.name!r} ({what} enable it): {exc}",
                        kind=exc.kind,
                        name=exc.name,
                        available=exc.available,
                        suggestions=exc.suggestions,
                    ) from None
    provided = {dim for spec, _ in enabled_transforms(registry, cfg) for dim in spec.mesh_dims}
    for dim, degree in zip(("tp", "sp"), mesh_degrees):
        if degree > 1 and dim not in provided:
            key = _MESH_KEYS[dim]
            raise ConfigError(
                f"{key} = {degree} needs a model transform for the {dim!r} mesh dimension, and no active plugin "
                "provides one (a ModelTransformSpec with mesh_dims containing it); re-enable the plugin that "
                f"provides it (see `dscore plugins list`) or set {key} to 1",
                path=key,
            )


def prepare_transforms(runtime: Runtime, cfg: DscoreConfig, model: torch.nn.Module, *, pipeline_model: bool) -> None:
    """:meth:`~dscore.protocols.transform.ModelTransform.prepare` of every enabled transform, in order.

    Raises:
        ConfigError: as a transform's ``prepare`` (a combination it cannot honour).
    """
    for spec, obj in enabled_transforms(runtime.registry, cfg):
        ctx: PrepareContext[Any] = PrepareContext(
            runtime=runtime,
            config=cfg,
            section=_section(cfg, spec),
            path=spec.config_key or "",
            model=model,
            pipeline_model=pipeline_model,
        )
        obj.prepare(ctx)


def verify_transforms(runtime: Runtime, cfg: DscoreConfig, *, engine_name: str, engine: Any, model: Any) -> None:
    """:meth:`~dscore.protocols.transform.ModelTransform.verify` of every enabled transform, in order.

    Raises:
        ConfigError: the engine did not apply a transform (as the transform's ``verify``).
    """
    mesh = runtime.mesh
    if mesh is None:
        raise DscoreError("verify_transforms runs after dscore.initialize built the mesh (runtime.mesh is None)")
    for spec, obj in enabled_transforms(runtime.registry, cfg):
        ctx: VerifyContext[Any] = VerifyContext(
            engine_name=engine_name,
            engine=engine,
            model=model,
            config=cfg,
            section=_section(cfg, spec),
            path=spec.config_key or "",
            mesh=mesh,
        )
        obj.verify(ctx)


@dataclass
class ActiveTransforms:
    """The enabled transforms of one engine assembly with their contexts, applied step by step.

    Build it with :meth:`apply` (after the precision mode is chosen, before the model is moved and cast);
    then :meth:`adjust_stage` and :meth:`wrap_stage` around the ZeRO stage's construction.
    """

    steps: list[tuple[ModelTransformSpec, ModelTransform[Any], TransformContext[Any]]]
    model_parameters: Iterable[Any] | None

    @classmethod
    def apply(
        cls,
        runtime: Runtime,
        cfg: DscoreConfig,
        *,
        mesh: ParallelMesh,
        model: torch.nn.Module,
        model_parameters: Iterable[Any] | None,
        client_optimizer: Any,
        precision: PrecisionMode,
    ) -> ActiveTransforms:
        """Run ``apply`` of every enabled transform in order, handing ``model_parameters`` on.

        Raises:
            ConfigError: as a transform's ``apply``.
        """
        steps = []
        for spec, obj in enabled_transforms(runtime.registry, cfg):
            ctx: TransformContext[Any] = TransformContext(
                runtime=runtime,
                config=cfg,
                section=_section(cfg, spec),
                path=spec.config_key or "",
                mesh=mesh,
                model=model,
                model_parameters=model_parameters,
                client_optimizer=client_optimizer,
                precision=precision,
            )
            obj.apply(ctx)
            model_parameters = ctx.model_parameters
            steps.append((spec, obj, ctx))
            log.debug("model transform %s applied (order %d)", spec.name, spec.order)
        return cls(steps=steps, model_parameters=model_parameters)

    @property
    def names(self) -> list[str]:
        """The applied transforms' names, in order."""
        return [spec.name for spec, _, _ in self.steps]

    @property
    def replicas_equal(self) -> list[torch.Tensor]:
        """Every transform's :attr:`~dscore.protocols.transform.TransformContext.replicas_equal`, in order, each
        tensor once: what the ZeRO stage's replica broadcast may skip."""
        seen: set[int] = set()
        out: list[torch.Tensor] = []
        for _, _, ctx in self.steps:
            for t in ctx.replicas_equal:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def adjust_stage(self, inputs: StageInputs) -> StageInputs:
        """``inputs`` passed through every transform's ``adjust_stage``, in order."""
        for _, obj, ctx in self.steps:
            inputs = obj.adjust_stage(ctx, inputs)
        return inputs

    def wrap_stage(self, stage: ZeroStage, inputs: StageInputs) -> ZeroStage:
        """``stage`` passed through every transform's ``wrap_stage``, in order."""
        for _, obj, ctx in self.steps:
            stage = obj.wrap_stage(ctx, stage, inputs)
        return stage
