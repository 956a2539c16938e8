"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` (DeepSpeed 0.19.8's parsed-config object) over dscore's
:func:`dscore.config.load_config`, the ``get_*`` readers the suite uses, and the optimizer-name constants.

``DeepSpeedConfig(config, mpu=None, mesh_device=None)`` takes what 0.19.8 takes (a dict, a JSON/Hjson path, or
url-safe base64 text), computes the data-parallel world size the way 0.19.8 does (the default process group,
or ``mpu``'s data-parallel size, or the ``data_parallel`` dimension of ``mesh_device``, divided by
``sequence_parallel_size`` when given without an ``mpu``; 1 before ``init_distributed``), and loads the config
with dscore's validation and batch-triangle resolution, so its numbers are dscore's engine's. The attributes
of DeepSpeed's object that the suite and client code read are provided (:data:`DeepSpeedConfig.ATTRIBUTES`);
reading any other one raises ``AttributeError`` naming the loaded :class:`dscore.config.DscoreConfig`
(``.dscore_config``), which holds every section. Errors are dscore's :class:`dscore.errors.ConfigError`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from dscore.config import DscoreConfig, load_config
from dscore.errors import ConfigError

# DeepSpeed's config error is dscore's: every invalid ds_config value dscore finds raises ConfigError
DeepSpeedConfigError = ConfigError

__all__ = [
    "ADAGRAD_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "LAMB_OPTIMIZER",
    "LION_OPTIMIZER",
    "MUADAMW_OPTIMIZER",
    "MUADAM_OPTIMIZER",
    "MUON_OPTIMIZER",
    "MUSGD_OPTIMIZER",
    "get_gradient_clipping",
    "get_log_level",
]

# DeepSpeed 0.19.8's optimizer-name constants (`optimizer.type`, lower-cased)
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"

_GRADIENT_CLIPPING_DEFAULT = 1.0  # DeepSpeed 0.19.8's and dscore's default


def get_gradient_clipping(param_dict: dict[str, Any]) -> float:
    """``param_dict["gradient_clipping"]``, else the default 1.0 (DeepSpeed 0.19.8's and dscore's)."""
    return param_dict.get("gradient_clipping", _GRADIENT_CLIPPING_DEFAULT)


def get_log_level(param_dict: dict[str, Any]) -> Any:
    """``param_dict["log_level"]``, else ``None`` (DeepSpeed 0.19.8's reader; dscore applies the key to its
    Python loggers)."""
    return param_dict.get("log_level")


def _data_parallel_world_size(config: Any, mpu: Any, mesh_device: Any) -> tuple[int, int | float]:
    """``(global_rank, world_size)`` as DeepSpeed 0.19.8's ``DeepSpeedConfig`` computes them (``(0, 1)`` before
    the default process group exists)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank = dist.get_rank()
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return rank, mpu.get_data_parallel_world_size()
        return rank, dist.get_world_size() / mpu.get_sequence_parallel_world_size()  # Ulysses' mpu
    if mesh_device is not None:
        return rank, dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    if isinstance(config, dict) and "sequence_parallel_size" in config:
        return rank, dist.get_world_size() / config["sequence_parallel_size"]
    return rank, dist.get_world_size()


def _attr(path: str) -> Callable[[DscoreConfig], Any]:
    def get(cfg: DscoreConfig) -> Any:
        value: Any = cfg
        for part in path.split("."):
            value = getattr(value, part)
        return value

    return get


class DeepSpeedConfig:
    """DeepSpeed 0.19.8's ``DeepSpeedConfig`` over dscore's config loading (see the module docstring).

    Args:
        config: a ds_config dict (not modified), a path to a JSON/Hjson file, or url-safe base64 JSON text.
        mpu: a model-parallel unit (``get_data_parallel_world_size``, or Ulysses'
            ``get_sequence_parallel_world_size``) whose data-parallel size is the batch triangle's world size.
        mesh_device: a ``torch.distributed.DeviceMesh`` with a ``data_parallel`` dimension, likewise.

    Raises:
        dscore.errors.ConfigError: every problem of the config (unknown or refused keys, a batch triangle
            that does not hold for the world size, fp16 and bf16 both enabled, ...), listed in one error.
        ValueError: the world size is not a whole number (``sequence_parallel_size`` not dividing it).
    """

    #: DeepSpeed attribute -> where dscore's loaded config holds it
    ATTRIBUTES: dict[str, Callable[[DscoreConfig], Any]] = {
        "train_batch_size": _attr("train_batch_size"),
        "train_micro_batch_size_per_gpu": _attr("train_micro_batch_size_per_gpu"),
        "gradient_accumulation_steps": _attr("gradient_accumulation_steps"),
        "managed_gradient_accumulation": _attr("managed_gradient_accumulation"),
        "steps_per_print": _attr("steps_per_print"),
        "gradient_clipping": _attr("gradient_clipping"),
        "prescale_gradients": _attr("prescale_gradients"),
        "gradient_predivide_factor": _attr("gradient_predivide_factor"),
        "gradient_allreduce_op": _attr("gradient_allreduce_op"),
        "communication_data_type": _attr("communication_data_type"),
        "wall_clock_breakdown": _attr("wall_clock_breakdown"),
        "dataloader_drop_last": _attr("dataloader_drop_last"),
        "zero_allow_untested_optimizer": _attr("zero_allow_untested_optimizer"),
        "zero_force_ds_cpu_optimizer": _attr("zero_force_ds_cpu_optimizer"),
        "sequence_parallel_size": _attr("sequence_parallel_size"),
        "zero_config": _attr("zero_optimization"),
        "zero_optimization_stage": _attr("zero_optimization.stage"),
        "zero_enabled": lambda cfg: cfg.zero_optimization.stage > 0,
        "float16_config": _attr("fp16"),
        "bfloat16_config": _attr("bf16"),
        "fp16_enabled": _attr("fp16.enabled"),
        "bfloat16_enabled": _attr("bf16.enabled"),
        "activation_checkpointing_config": _attr("activation_checkpointing"),
        "pipeline": _attr("pipeline"),
        "optimizer_name": lambda cfg: cfg.optimizer.type.lower() if cfg.optimizer is not None else None,
        "optimizer_params": lambda cfg: cfg.optimizer.params if cfg.optimizer is not None else None,
        "scheduler_name": lambda cfg: cfg.scheduler.type if cfg.scheduler is not None else None,
        "scheduler_params": lambda cfg: cfg.scheduler.params if cfg.scheduler is not None else None,
    }

    def __init__(self, config: str | dict[str, Any], mpu: Any = None, mesh_device: Any = None) -> None:
        self.global_rank, world_size = _data_parallel_world_size(config, mpu, mesh_device)
        if world_size != int(world_size) or world_size < 1:
            raise ValueError(f"DeepSpeedConfig: the data-parallel world size {world_size} is not a whole number "
                             "(sequence_parallel_size must divide the number of processes)")
        self.world_size = int(world_size)
        source = copy.deepcopy(config) if isinstance(config, dict) else config  # the caller's dict stays as is
        self.dscore_config = load_config(source, world_size=self.world_size)
        self._param_dict = config if isinstance(config, dict) else dict(self.dscore_config.raw)

    def __getattr__(self, name: str) -> Any:
        getter = type(self).ATTRIBUTES.get(name)
        if getter is None or name.startswith("__"):
            raise AttributeError(
                f"DeepSpeedConfig.{name}: this attribute of DeepSpeed 0.19.8's config object is not provided by "
                f"dscore; provided: {', '.join(sorted(type(self).ATTRIBUTES))}; every section is on the loaded "
                "dscore config, .dscore_config"
            )
        return getter(self.__dict__["dscore_config"])

    def __repr__(self) -> str:
        return f"DeepSpeedConfig(world_size={self.world_size}, {self.dscore_config.source_name})"
