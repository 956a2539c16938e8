"""The built-in model transforms (:class:`dscore.protocols.ModelTransform`): AutoTP, AutoEP, Ulysses and
activation checkpointing, run by ``dscore.initialize`` in their spec's ``order`` (100, 200, 300, 400).

This module is torch-free at import (``enabled`` reads the config only, so the core may ask a disabled
unit whether a config needs it); each step imports its machinery when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dscore.errors import ConfigError
from dscore.protocols.transform import ModelTransform, PrepareContext, StageInputs, TransformContext, VerifyContext

if TYPE_CHECKING:
    from dscore.config.model import DscoreConfig
    from dscore.protocols.zero import ZeroStage
    from dscore_plugins.parallel.config_ac import ActivationCheckpointingConfig
    from dscore_plugins.parallel.config_ep import ExpertParallelConfig
    from dscore_plugins.parallel.config_tp import TensorParallelConfig

__all__ = ["AutoEPTransform", "AutoTPTransform", "ActivationCheckpointingTransform", "UlyssesTransform"]

_PIPELINE_TP_SP = "tensor_parallel.autotp_size / sequence_parallel_size cannot be combined with a pipeline model yet"


class AutoTPTransform(ModelTransform["TensorParallelConfig"]):
    """``tensor_parallel.autotp_size > 1``: split the model's layers over the tensor-parallel group
    (:mod:`dscore_plugins.parallel.autotp`), give the ZeRO stage split parameter groups and wrap it in the
    :class:`~dscore_plugins.parallel.autotp.stage.TensorParallelStage` that makes its gradient norm, overflow
    verdict and clipping the whole model's."""

    def enabled(self, config: DscoreConfig) -> bool:
        """True when ``tensor_parallel.autotp_size`` is above 1."""
        block = config.section("tensor_parallel", None)
        return block is not None and int(block.size) > 1

    def prepare(self, ctx: PrepareContext[TensorParallelConfig]) -> None:
        """Refuse a pipeline model (ConfigError at ``tensor_parallel.autotp_size``)."""
        if ctx.pipeline_model:
            raise ConfigError(_PIPELINE_TP_SP, path="tensor_parallel.autotp_size")

    def apply(self, ctx: TransformContext[TensorParallelConfig]) -> None:
        """Check the config against the precision, split the model, remap the parameters and the client
        optimizer's groups onto the split parameters.

        The split starts with a broadcast of the unsplit model from world rank 0 over the world
        (:func:`~dscore_plugins.parallel.autotp.plan.apply_autotp`), so every tensor of the split model is
        declared in ``ctx.replicas_equal``: the ZeRO stage's data-parallel broadcast skips them (the model
        travels once). A model split before ``initialize`` (``tp_model_init``) declares nothing: user code
        may have changed it since, so the data-parallel broadcast runs as usual.

        Raises:
            ConfigError: as :func:`~dscore_plugins.parallel.autotp.plan.check_tp_config` and
                :func:`~dscore_plugins.parallel.autotp.plan.apply_autotp`.
        """
        from dscore_plugins.parallel.autotp.plan import (
            apply_autotp,
            check_tp_config,
            remap_client_optimizer,
            remap_parameters,
        )

        check_tp_config(ctx.config, precision_name=ctx.precision.name)
        split_here = getattr(ctx.model, "_dscore_autotp", None) is None
        apply_autotp(ctx.model, ctx.mesh, ctx.section)
        if split_here:  # every tensor is world rank 0's (sliced alike): equal over each data-parallel group
            ctx.replicas_equal = [*ctx.model.parameters(), *ctx.model.buffers()]
        ctx.model_parameters = remap_parameters(ctx.model, ctx.model_parameters)
        remap_client_optimizer(ctx.model, ctx.client_optimizer)

    def adjust_stage(self, ctx: TransformContext[TensorParallelConfig], inputs: StageInputs) -> StageInputs:
        """Groups split into replicated / sharded halves (the wrapper's norm counts each kind right).

        A client optimizer instance defines the stage's groups, so its own ``param_groups`` become the halves
        too (group ``i`` -> ``2i`` and ``2i + 1``, both with group ``i``'s hyper-parameters); a client LR
        scheduler built over it before ``initialize`` then has the wrong number of groups and is refused by
        the scheduler check (build it after ``initialize``, or pass it as a callable).
        """
        import torch

        from dscore.runtime.assembly import param_groups
        from dscore_plugins.parallel.autotp.stage import split_groups_for_tp

        groups = split_groups_for_tp(
            param_groups(inputs.module, inputs.model_parameters, ctx.client_optimizer), inputs.module
        )
        opt = ctx.client_optimizer
        if isinstance(opt, torch.optim.Optimizer):
            # frozen parameters stay with their group's replicated half (the stage drops them again)
            frozen = [[p for p in g["params"] if not p.requires_grad] for g in opt.param_groups]
            opt.param_groups[:] = [
                {**g, "params": list(g["params"]) + (frozen[i // 2] if i % 2 == 0 else [])}
                for i, g in enumerate(groups)
            ]
        return StageInputs(module=inputs.module, model_parameters=groups, config=inputs.config)

    def wrap_stage(self, ctx: TransformContext[TensorParallelConfig], stage: ZeroStage, inputs: StageInputs) -> ZeroStage:
        """The stage wrapped for the model-wide gradient norm (overflow verdict, clipping, reported norm)."""
        from dscore_plugins.parallel.autotp.stage import wrap_stage

        return wrap_stage(stage, inputs.module, ctx.mesh)

    def verify(self, ctx: VerifyContext[TensorParallelConfig]) -> None:
        """Refuse an engine that left the model unsplit (ConfigError naming the engine)."""
        if getattr(ctx.model, "_dscore_autotp", None) is None:
            raise ConfigError(
                f"the engine {ctx.engine_name!r} did not apply tensor_parallel.autotp_size {ctx.mesh.tp_size} (the "
                "model is unsplit); use the standard engine or call dscore.parallel.autotp.apply_autotp in the "
                "engine's factory",
                path="tensor_parallel.autotp_size",
            )


class AutoEPTransform(ModelTransform["ExpertParallelConfig"]):
    """``expert_parallel.enabled``: replace the model's MoE blocks by expert-parallel layers
    (:mod:`dscore_plugins.parallel.autoep`), expert parameters in optimizer groups of their own."""

    def enabled(self, config: DscoreConfig) -> bool:
        """``expert_parallel.enabled``."""
        block = config.section("expert_parallel", None)
        return block is not None and bool(block.enabled)

    def prepare(self, ctx: PrepareContext[ExpertParallelConfig]) -> None:
        """Refuse a pipeline model (ConfigError at ``expert_parallel.enabled``)."""
        if ctx.pipeline_model:
            raise ConfigError(
                "expert_parallel.enabled cannot be combined with a pipeline model yet", path="expert_parallel.enabled"
            )

    def apply(self, ctx: TransformContext[ExpertParallelConfig]) -> None:
        """Convert the MoE blocks; ``ctx.model_parameters`` becomes groups with the experts split out.

        Raises:
            ConfigError: with tensor / sequence parallelism or a client optimizer instance (each names
                ``expert_parallel.enabled``), or as :func:`~dscore_plugins.parallel.autoep.convert.apply_autoep`.
        """
        import torch

        from dscore.moe.utils import split_params_into_different_moe_groups_for_optimizer
        from dscore.runtime.assembly import param_groups
        from dscore_plugins.parallel.autoep.convert import apply_autoep, remap_parameters

        mesh = ctx.mesh
        if mesh.tp_size > 1 or mesh.sp_size > 1:
            raise ConfigError(
                "expert_parallel.enabled with tensor_parallel.autotp_size > 1 or sequence_parallel_size > 1 (AutoEP "
                "folding) is not implemented; AutoEP runs over the data-parallel ranks only",
                path="expert_parallel.enabled",
            )
        if isinstance(ctx.client_optimizer, torch.optim.Optimizer):
            raise ConfigError(
                "expert_parallel.enabled with an optimizer instance: AutoEP replaces the expert weights the optimizer "
                "holds; pass the optimizer through ds_config or as a callable (params -> optimizer)",
                path="expert_parallel.enabled",
            )
        replaced = apply_autoep(ctx.model, ctx.section, ctx.runtime.comm, mesh)
        groups = param_groups(ctx.model, remap_parameters(ctx.model_parameters, replaced), None)
        ctx.model_parameters = split_params_into_different_moe_groups_for_optimizer(groups) if groups else groups

    def verify(self, ctx: VerifyContext[ExpertParallelConfig]) -> None:
        """Refuse an engine that converted no MoE block (ConfigError naming the engine)."""
        from dscore_plugins.parallel.autoep.layer import AutoEPMoELayer

        if not any(isinstance(m, AutoEPMoELayer) for m in ctx.model.modules()):
            raise ConfigError(
                f"the engine {ctx.engine_name!r} did not apply expert_parallel (no MoE block was converted); use the "
                "standard engine or call dscore.moe.autoep.apply_autoep in the engine's factory",
                path="expert_parallel.enabled",
            )


class UlyssesTransform(ModelTransform[None]):
    """``sequence_parallel_size > 1`` (a core key: the mesh's sequence dimension): require that the model's
    attention is Ulysses' all-to-all attention (:mod:`dscore_plugins.parallel.ulysses`)."""

    def enabled(self, config: DscoreConfig) -> bool:
        """True when ``sequence_parallel_size`` is above 1."""
        return int(config.sequence_parallel_size) > 1

    def prepare(self, ctx: PrepareContext[None]) -> None:
        """Refuse a pipeline model (ConfigError at ``sequence_parallel_size``)."""
        if ctx.pipeline_model:
            raise ConfigError(_PIPELINE_TP_SP, path="sequence_parallel_size")

    def apply(self, ctx: TransformContext[None]) -> None:
        """Raises ConfigError when no attention of the model runs through ``UlyssesSPAttentionHF``
        (:func:`~dscore_plugins.parallel.ulysses.attention.require_ulysses_attention`)."""
        from dscore_plugins.parallel.ulysses.attention import require_ulysses_attention

        require_ulysses_attention(ctx.model, ctx.mesh.sp_size)


class ActivationCheckpointingTransform(ModelTransform["ActivationCheckpointingConfig"]):
    """An ``activation_checkpointing`` block: apply it to ``dscore.checkpointing`` (process-wide settings
    ``checkpoint`` reads inside model code) with the runtime's accelerator. A config without the block keeps
    an earlier ``dscore.checkpointing.configure()``."""

    def enabled(self, config: DscoreConfig) -> bool:
        """True when the user's config holds an ``activation_checkpointing`` block."""
        return "activation_checkpointing" in config.raw

    def prepare(self, ctx: PrepareContext[ActivationCheckpointingConfig]) -> None:
        """:func:`dscore_plugins.parallel.checkpointing.state.configure` from the block (every engine)."""
        from dscore_plugins.parallel.checkpointing.state import configure

        configure(deepspeed_config=ctx.config, accelerator=ctx.runtime.accelerator)

