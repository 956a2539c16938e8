"""``deepspeed.zero`` on :mod:`dscore.zero`: ``Init``, ``GatheredParameters``, ``register_external_parameter``."""

from __future__ import annotations

from typing import Any

from dscore.zero import GatheredParameters
from dscore.zero import Init as _DscoreInit

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]


class Init(_DscoreInit):
    """``deepspeed.zero.Init``: :class:`dscore.zero.Init` with DeepSpeed's keyword arguments.

    ``config_dict_or_path`` / ``config`` (the ds_config; its fp16/bf16 choice sets the partitions' dtype when
    ``dtype`` is not given), ``dtype``, ``enabled``, ``data_parallel_group`` (a process group) and
    ``remote_device`` (``None``/``"none"``: the module's device; ``"cpu"``: partitions kept on the host) are
    honoured; ``pin_memory`` and ``mem_efficient_linear`` change no result and are accepted.

    Raises:
        dscore.errors.ConfigError: ``remote_device="nvme"``, ``mpu``, ``zero_param_parallel_group``,
            ``sequence_data_parallel_group``, quantized weights or ``param_swapper``: not supported by
            dscore's ``zero.Init`` (named in the message).
    """

    def __init__(
        self,
        module: Any = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: Any = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: Any = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        from dscore.errors import ConfigError

        unsupported = {
            "mpu": mpu,
            "zero_param_parallel_group": zero_param_parallel_group,
            "sequence_data_parallel_group": sequence_data_parallel_group,
            "param_swapper": param_swapper,
            "zero_quantized_weights": zero_quantized_weights or None,
            "zero_quantized_nontrainable_weights": zero_quantized_nontrainable_weights or None,
        }
        given = [k for k, v in unsupported.items() if v is not None]
        if given:
            raise ConfigError(
                f"deepspeed.zero.Init({', '.join(given)}=...): not supported by dscore (data parallelism only, "
                "no quantized or swapped ZeRO-3 weights in zero.Init)"
            )
        device = None if remote_device is None else str(getattr(remote_device, "value", remote_device)).lower()
        if device == "nvme":
            raise ConfigError(
                'deepspeed.zero.Init(remote_device="nvme") is not supported by dscore: use '
                'zero_optimization.offload_param.device "nvme" in the config (applied when the engine is built)'
            )
        super().__init__(
            module,
            group=data_parallel_group,
            dtype=dtype,
            device="cpu" if device == "cpu" else None,
            enabled=enabled,
            config_dict_or_path=config_dict_or_path if config_dict_or_path is not None else config,
        )


def register_external_parameter(module: Any, parameter: Any) -> None:
    """``deepspeed.zero.register_external_parameter``: dscore's stage 3 gathers only a module's own
    parameters in its forward, so a partitioned parameter used by another module is refused here (gather it
    with ``deepspeed.zero.GatheredParameters`` around that use). A parameter that is not partitioned (ZeRO
    stages 0-2, or outside ``zero.Init``) needs nothing and is accepted.

    Raises:
        dscore.errors.ConfigError: ``parameter`` is partitioned by ZeRO stage 3.
    """
    from dscore.errors import ConfigError
    from dscore.zero import is_partitioned

    if is_partitioned(parameter):
        raise ConfigError(
            f"deepspeed.zero.register_external_parameter({type(module).__name__}, <parameter of shape "
            f"{tuple(getattr(parameter, 'ds_shape', parameter.shape))}>): external parameters are not supported by "
            "dscore's ZeRO stage 3; gather the parameter with deepspeed.zero.GatheredParameters where it is used"
        )


def unregister_external_parameter(module: Any, parameter: Any) -> None:
    """Counterpart of :func:`register_external_parameter` (nothing was registered)."""
    register_external_parameter(module, parameter)
