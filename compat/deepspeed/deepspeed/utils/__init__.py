"""``deepspeed.utils``: ``logger``, the ZeRO-3 leaf-module helpers (``set_z3_leaf_modules``, ...) and ``groups``.

``logger`` is dscore's logger (``logging.getLogger("dscore")``): integrations set its level (Trainer does
``deepspeed.utils.logger.setLevel(...)``) and that governs dscore's messages. The leaf-module helpers are
dscore's (``dscore.zero``), imported when first used; ``groups`` maps DeepSpeed's group accessors onto
:mod:`dscore.parallel.groups`; the ``safe_get_full_fp32_param`` family (:mod:`deepspeed.utils.tensor_fragment`)
reads and writes ZeRO's partitioned state through :mod:`dscore.zero.fragments`.
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
# (deepspeed/utils/tensor_fragment.py), onto dscore.zero.fragments
from deepspeed.utils.tensor_fragment import (  # noqa: E402
    fragment_address,
    get_full_hp_grad,
    get_full_hp_param,
    get_hp_fragment_mapping,
    map_to_flat_opt_states,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
    set_full_hp_grad,
    set_full_hp_param,
    tensor_fragment,
)

__all__ += [
    "fragment_address", "get_full_hp_grad", "get_full_hp_param", "get_hp_fragment_mapping", "map_to_flat_opt_states",
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param",
    "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
    "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "set_full_hp_grad", "set_full_hp_param",
    "tensor_fragment",
]

# deepspeed/utils/mixed_precision_linkage.py builds DeepSpeed's lp->hp links inside its optimizers
_LINK_WHY = ("DeepSpeed's lp/hp parameter linking is internal to its ZeRO optimizers; dscore's stages map parameters "
             "themselves (use deepspeed.utils.safe_get_full_fp32_param & co. or dscore.zero.fragments)")
for _name in ("link_hp_params", "lazy_init_hp_params_optimizer_state"):
    globals()[_name] = not_provided(f"deepspeed.utils.{_name}", _LINK_WHY)
    __all__.append(_name)
del _name

_LEAF_NAMES = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
               "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")
__all__ += ["set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"]


def __getattr__(name: str) -> Any:
    if name in _LEAF_NAMES:
        import dscore.zero.leaf

        value = getattr(dscore.zero.leaf, name, None)
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
