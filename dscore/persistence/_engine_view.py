"""Every engine attribute the checkpoint code reads, in one place (see :class:`dscore.persistence.CheckpointEngine`)."""

from __future__ import annotations

import json
import logging
from typing import Any

from dscore.comm import Comm
from dscore.errors import CheckpointError

__all__ = ["EngineView", "frozen_parameter_names"]

logger = logging.getLogger("dscore.checkpoint")

TAG_VALIDATION_MODES = ("IGNORE", "WARN", "FAIL")


class EngineView:
    """Every engine attribute the checkpoint code touches, read in one place (see ``CheckpointEngine``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        runtime = getattr(engine, "runtime", None)
        comm = getattr(runtime, "comm", None) or getattr(engine, "comm", None)
        self.coll: Comm = comm if isinstance(comm, Comm) else Comm(None)
        zero = getattr(engine, "zero_stage_impl", None)
        if zero is None:
            raise CheckpointError(
                f"{type(engine).__name__} has no zero_stage_impl (the ZeroStage that owns the optimizer state); "
                "checkpoints need an engine built by dscore.initialize"
            )
        self.zero = zero

    @property
    def config(self) -> Any:
        return getattr(self.engine, "config", None)

    @property
    def tag_validation(self) -> str:
        mode = getattr(getattr(self.config, "checkpoint", None), "tag_validation", "WARN")
        mode = str(mode).upper()
        if mode not in TAG_VALIDATION_MODES:
            raise CheckpointError(
                f"checkpoint.tag_validation is {mode!r}; expected one of {list(TAG_VALIDATION_MODES)}"
            )
        return mode

    @property
    def zero_stage(self) -> int:
        stage = getattr(self.zero, "stage", None)
        if stage is None:
            stage = getattr(self.config, "zero_stage", 0)
        return int(stage or 0)

    @property
    def gather_16bit_on_save(self) -> bool:
        zcfg = getattr(self.config, "zero_optimization", None)
        for name in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"):
            if zcfg is not None and hasattr(zcfg, name):
                return bool(getattr(zcfg, name))
        return False

    @property
    def accelerator(self) -> Any:
        runtime = getattr(self.engine, "runtime", None)
        return getattr(runtime, "accelerator", None) or getattr(self.engine, "accelerator", None)

    @property
    def registry(self) -> Any:
        """The engine's runtime registry (its ``plugins.disable`` holds), else one over the installed plugins."""
        registry = getattr(getattr(self.engine, "runtime", None), "registry", None)
        if registry is not None:
            return registry
        from dscore.exports import active_registry

        return active_registry()[0]

    def call_hook(self, name: str, **kwargs: Any) -> None:
        pm = getattr(getattr(self.engine, "runtime", None), "plugin_manager", None)
        if pm is None:
            return
        if callable(getattr(pm, "call", None)):  # DscorePluginManager: skips hooks nobody implements
            pm.call(name, engine=self.engine, **kwargs)
            return
        hook = getattr(getattr(pm, "hook", None), name, None)
        if hook is not None:
            hook(engine=self.engine, **kwargs)

    def config_json(self) -> str:
        cfg = self.config
        try:
            if hasattr(cfg, "model_dump"):
                return json.dumps(cfg.model_dump(mode="json"), default=str)
        except Exception:  # informational only; never block a save on it
            logger.debug("could not serialise the config into the checkpoint", exc_info=True)
        return "null"

    def data_sampler_state(self) -> Any:
        state = getattr(self.engine, "data_sampler_state", None)
        return state() if callable(state) else state

    def load_data_sampler_state(self, state: Any) -> None:
        loader = getattr(self.engine, "load_data_sampler_state", None)
        if callable(loader):
            loader(state)
            return
        dl = getattr(self.engine, "training_dataloader", None)
        if dl is not None and hasattr(dl, "load_state_dict"):
            dl.load_state_dict(state)
            return
        logger.warning(
            "the checkpoint holds a data loader position %s but the engine has no training data loader to "
            "restore it into; it is ignored",
            state,
        )


def frozen_parameter_names(engine: Any) -> list[str]:
    """State-dict names of the module's parameters with ``requires_grad=False`` (tied names included)."""
    module = getattr(engine, "module", None)
    if module is None:
        return []
    return [n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]
