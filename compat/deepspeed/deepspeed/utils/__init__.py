"""``deepspeed.utils``: ``logger``, the ZeRO-3 leaf-module helpers (``set_z3_leaf_modules``, ...) and ``groups``.

``logger`` is dscore's logger (``logging.getLogger("dscore")``): integrations set its level (Trainer does
``deepspeed.utils.logger.setLevel(...)``) and that governs dscore's messages. The leaf-module helpers are
dscore's (``dscore.zero``), imported when first used; ``groups`` maps DeepSpeed's group accessors onto
:mod:`dscore.parallel.groups`.
"""

from __future__ import annotations

from typing import Any

from deepspeed._not_provided import not_provided
from deepspeed.utils.logging import log_dist, logger, set_log_level_from_string

__all__ = [
    "RepeatingLoader",
    "get_numactl_cmd",
    "get_z3_leaf_modules",
    "groups",
    "log_dist",
    "logger",
    "set_log_level_from_string",
    "set_z3_leaf_modules",
    "torch",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]

# DeepSpeed's per-parameter accessors into ZeRO's partitioned fp32 weights, gradients and optimizer state
# (deepspeed/utils/tensor_fragment.py): dscore's engine has no per-parameter accessor yet.
_FRAGMENT_WHY = ("dscore's engine has no per-parameter accessor into ZeRO's partitioned state; read the whole fp32 "
                 "state with engine.consolidated_16bit_state_dict() or dscore.checkpoint.get_fp32_state_dict_from_checkpoint")
for _name in ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
              "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
              "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
              "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
              "safe_update_full_grad_vectorized", "get_full_hp_param", "get_full_hp_grad", "set_full_hp_param",
              "set_full_hp_grad", "tensor_fragment", "fragment_address", "get_hp_fragment_mapping",
              "map_to_flat_opt_states", "link_hp_params", "lazy_init_hp_params_optimizer_state"):
    globals()[_name] = not_provided(f"deepspeed.utils.{_name}", _FRAGMENT_WHY)
    __all__.append(_name)
del _name

_LEAF_NAMES = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module")


def __getattr__(name: str) -> Any:
    if name in _LEAF_NAMES:
        import dscore.zero

        value = getattr(dscore.zero, name, None)
        if value is None:
            from dscore.errors import ConfigError

            raise ConfigError(
                f"deepspeed.utils.{name}: this dscore installation has no ZeRO-3 leaf modules "
                f"(dscore.zero.{name} is missing); upgrade dscore"
            )
        return value
    if name == "RepeatingLoader":
        from dscore.runtime.dataloader import RepeatingLoader

        return RepeatingLoader
    if name == "get_numactl_cmd":
        from deepspeed.utils.numa import get_numactl_cmd

        return get_numactl_cmd
    if name in ("zero_to_fp32", "logging", "groups", "torch", "numa", "pin_memory", "pin_memory_tracker"):
        from importlib import import_module

        return import_module(f"deepspeed.utils.{name}")
    raise AttributeError(f"deepspeed.utils.{name} is not provided by dscore's compatibility layer")
