"""The ``ema`` engine: :class:`dscore.protocols.DscoreEngine` plus an EMA of the trainable weights.

Only public dscore names are used: the factory receives a :class:`dscore.protocols.EngineContext` and
builds every part with its helpers, which apply the standard engine's rules (precision, ZeRO stage
plugin, LR scheduler, sharded data loader, monitors).
"""

from __future__ import annotations

from typing import Any

import torch

from dscore.protocols import DscoreEngine, EngineContext

__all__ = ["EmaEngine", "build", "handles"]


def handles(model: Any, config: Any) -> bool:
    """True when the config's ``ema`` block is enabled (any ``torch.nn.Module``)."""
    section = config.section("ema")
    return bool(section is not None and section.enabled and isinstance(model, torch.nn.Module))


def build(ctx: EngineContext) -> EmaEngine:
    """The factory ``dscore.initialize`` calls with the validated config and the runtime."""
    cfg, runtime = ctx.config, ctx.runtime
    precision = ctx.select_precision()
    ctx.model.to(runtime.accelerator.device())
    module = precision.prepare_module(ctx.model) or ctx.model
    scaler = precision.make_loss_scaler(zero_stage=int(cfg.zero_stage))
    stage = ctx.build_zero_stage(module, precision=precision, loss_scaler=scaler)
    rank, world = int(runtime.comm.get_rank()), int(runtime.comm.get_world_size())
    return EmaEngine(
        decay=float(cfg.section("ema").decay),
        module=module,
        config=cfg,
        runtime=runtime,
        zero_stage=stage,
        precision=precision,
        loss_scaler=scaler,
        lr_scheduler=ctx.build_lr_scheduler(stage.optimizer),
        training_dataloader=ctx.build_dataloader(dp_world_size=world, dp_rank=rank),
        monitors=ctx.create_monitors(),
        rank=rank,
        dp_world_size=world,
    )


class EmaEngine(DscoreEngine):
    """The standard engine; after every applied optimizer step ``ema = decay * ema + (1 - decay) * w``."""

    def __init__(self, *, decay: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.decay = decay
        self._ema = {n: p.detach().float().clone() for n, p in self.module.named_parameters() if p.requires_grad}

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """``DscoreEngine.step``, then the EMA update when the optimizer step was applied."""
        super().step(lr_kwargs)
        if self.was_step_applied():
            with torch.no_grad():
                for name, p in self.module.named_parameters():
                    if name in self._ema:
                        self._ema[name].mul_(self.decay).add_(p.detach().float(), alpha=1.0 - self.decay)

    def ema_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights (fp32 copies), keyed like ``module.state_dict()``."""
        return {n: t.clone() for n, t in self._ema.items()}
