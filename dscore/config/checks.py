"""Cross-section checks run on the validated config (each names the key path at fault).

Mirrors DeepSpeed's ``_do_error_check`` / ``_initialize_params``:

* fp16 and bf16 both enabled (path ``bf16.enabled``),
* ``zero_optimization.offload_optimizer.device`` cpu/nvme needs ZeRO stage >= 1,
* ``zero_optimization.offload_param.device`` cpu/nvme needs stage 3,
* ``fp16.fp16_master_weights_and_grads``, ``bf16.bf16_master_weights_and_grads`` and
  ``bf16.bf16_optimizer_states`` need stage >= 1; ``bf16_optimizer_states`` also needs
  ``bf16_master_weights_and_grads``,
* ``gradient_allreduce_op: "sum"`` is refused with stage 3,
* ``data_types.param_dtype`` must match the enabled precision, ``data_types.grad_accum_dtype`` the dtype
  the stage accumulates gradients in (the model's dtype at stages 0-1, fp32 at stages 2-3),
* ``zero_optimization.compute_grad_norm: false`` needs ``gradient_clipping: 0`` and no optimizer offload,
* an enabled monitor section (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``) needs a registered
  monitor with that ``config_key``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dscore.config.errors import Problem
from dscore.config.keys import MONITOR_KEYS
from dscore.specs import MonitorSpec

if TYPE_CHECKING:
    from dscore.config.model import DscoreConfig
    from dscore.registry import Registry

__all__ = ["cross_check"]


def _problem(path: str, text: str) -> Problem:
    return (path, f"{path}: {text}", tuple(path.split(".")))


def _check_zero_implementation(implementation: str | None, stage: int, registry: Registry) -> list[Problem]:
    """``zero_optimization.implementation`` must name a registered ZeRO stage of ``stage`` (as
    ``optimizer.type`` must name a registered optimizer): checked here so ``dscore config check`` sees it."""
    if implementation is None:
        return []
    from dscore.errors import DscoreError

    try:
        registry.zero_stage(stage, implementation=implementation)
    except DscoreError as exc:  # not installed / disabled / broken / other stage / two providers
        text = str(exc)
        prefix = "zero_optimization.implementation: "
        return [_problem("zero_optimization.implementation", text[len(prefix) :] if text.startswith(prefix) else text)]
    return []


def _offload_device_of(zero: object, name: str) -> str:
    return str(getattr(getattr(zero, name, None), "device", "none"))


def cross_check(cfg: DscoreConfig, registry: Registry) -> list[Problem]:
    """Return the cross-section problems of the validated config ``cfg``.

    The plugin-owned sections (``fp16``, ``bf16``, ``zero_optimization``) are read through
    :meth:`DscoreConfig.section` (None when no plugin registers them); their keys with ``getattr``
    defaults, since another plugin's model of the same section may not define them.
    """
    problems: list[Problem] = []
    stage = cfg.zero_stage
    fp16 = cfg.section("fp16", None)
    bf16 = cfg.section("bf16", None)
    if cfg.fp16_enabled and cfg.bf16_enabled:
        problems.append(_problem("bf16.enabled", "fp16 and bf16 cannot both be enabled (fp16.enabled is also true)"))
    zero = cfg.section("zero_optimization", None)
    problems += _check_zero_implementation(getattr(zero, "implementation", None), stage, registry)
    for name, need in (("offload_optimizer", 1), ("offload_param", 3)):
        block = getattr(zero, name, None)
        device = getattr(block, "device", "none")
        if device in ("cpu", "nvme") and (stage < need if need == 1 else stage != 3):
            required = "ZeRO stage 1, 2 or 3" if need == 1 else "ZeRO stage 3"
            problems.append(
                _problem(
                    f"zero_optimization.{name}.device",
                    f"offloading to {device!r} requires {required}, but zero_optimization.stage is {stage}",
                )
            )
    for section, flag in (
        (fp16, "fp16_master_weights_and_grads"),
        (bf16, "bf16_master_weights_and_grads"),
        (bf16, "bf16_optimizer_states"),
    ):
        if section is not None and getattr(section, flag, False) and stage == 0:
            key = "fp16" if section is fp16 else "bf16"
            problems.append(
                _problem(f"{key}.{flag}", f"requires ZeRO stage 1, 2 or 3, but zero_optimization.stage is {stage}")
            )
    if (
        bf16 is not None
        and getattr(bf16, "bf16_optimizer_states", False)
        and not getattr(bf16, "bf16_master_weights_and_grads", False)
    ):
        problems.append(_problem("bf16.bf16_optimizer_states", "requires bf16.bf16_master_weights_and_grads: true"))
    if cfg.gradient_allreduce_op == "sum" and stage == 3:
        problems.append(_problem("gradient_allreduce_op", "'sum' is not supported with ZeRO stage 3; use 'mean'"))
    mode = "fp16" if cfg.fp16_enabled else "bf16" if cfg.bf16_enabled else "fp32"
    acc = cfg.data_types.grad_accum_dtype
    if acc is not None:
        # stage 0 and 1 accumulate in the model's dtype; stages 2-3 reduce every micro step into fp32 partitions
        actual = "fp32" if stage >= 2 else mode
        if acc != actual:
            problems.append(
                _problem(
                    "data_types.grad_accum_dtype",
                    f"{acc!r}: dscore accumulates gradients in {actual} at ZeRO stage {stage} with {mode} "
                    f"training; remove the key, set it to {actual!r}, or use "
                    + ("stage 2 or 3 for fp32 accumulation" if acc == "fp32" else "another stage"),
                )
            )
    if zero is not None and getattr(zero, "compute_grad_norm", True) is False:
        if cfg.gradient_clipping > 0:
            problems.append(
                _problem("zero_optimization.compute_grad_norm", "false requires gradient_clipping: 0 (as DeepSpeed)")
            )
        if _offload_device_of(zero, "offload_optimizer") in ("cpu", "nvme"):
            problems.append(
                _problem("zero_optimization.compute_grad_norm", "false does not support offload_optimizer (as DeepSpeed)")
            )
    param_dtype = cfg.data_types.param_dtype
    if param_dtype is not None:
        if param_dtype != mode:
            problems.append(
                _problem("data_types.param_dtype", f"{param_dtype!r} does not match the enabled precision {mode!r}")
            )
    handled = {spec.config_key for spec in registry.specs("monitor") if isinstance(spec, MonitorSpec)}
    for key in sorted(MONITOR_KEYS | handled):
        section = cfg.section(key, None)
        if section is not None and getattr(section, "enabled", False) and key not in handled:
            installed = ", ".join(sorted(k for k in handled if k)) or "(none)"
            problems.append(
                _problem(
                    f"{key}.enabled",
                    f"no installed monitor plugin handles {key!r}, so dscore cannot enable it "
                    f"(monitors installed for: {installed}). Set {key}.enabled to false or install a plugin.",
                )
            )
    return problems
