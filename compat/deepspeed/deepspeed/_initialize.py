"""``deepspeed.initialize``: :func:`dscore.initialize` after the edge conversion of client-written values."""

from __future__ import annotations

import argparse
import logging
from typing import Any

log = logging.getLogger("dscore.compat")

__all__ = ["initialize", "read_client_config"]


def read_client_config(args: Any, config: Any, config_params: Any) -> Any:
    """The config as DeepSpeed would read it, with client-written values converted.

    Picks the source as ``deepspeed.initialize`` does (``config``, else ``config_params``, else
    ``args.deepspeed_config``), reads it with :func:`dscore.config.loader.read_source` and applies
    :func:`dscore.config.client_values.convert_client_values`, logging each of its warnings. Returns the
    converted dict, or None when no config was given (``dscore.initialize`` then raises its own error).
    """
    from dscore.config.client_values import convert_client_values
    from dscore.config.loader import read_source

    source = config if config is not None else config_params
    if source is None and args is not None:
        source = args  # an argparse.Namespace with deepspeed_config (read_source knows the forms)
        if getattr(args, "deepspeed_config", None) is None and getattr(args, "deepscale_config", None) is None:
            return None
    if source is None:
        return None
    data, _name, warnings = read_source(source)
    for message in warnings:
        log.warning("%s", message)
    converted, notes = convert_client_values(data)
    for message in notes:
        log.warning("%s", message)
    return converted


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """DeepSpeed 0.19.8's ``deepspeed.initialize`` on dscore.

    Same arguments and return value as :func:`dscore.initialize` (``(engine, optimizer, dataloader,
    lr_scheduler)``, the engine a :class:`dscore.runtime.engine.DscoreEngine`, which is
    ``deepspeed.DeepSpeedEngine`` here). The config (``config``, ``config_params`` or
    ``args.deepspeed_config``) first goes through :func:`read_client_config`: ``steps_per_print: inf`` and
    top-level dotted keys get DeepSpeed's meaning with a warning; everything else is validated as strictly
    as ``dscore.initialize`` does. The engine saves checkpoints in DeepSpeed 0.19.8's layout
    (``engine.checkpoint_layout = "deepspeed"``, see :mod:`dscore.checkpoint.deepspeed.writer`).

    Raises:
        dscore.runtime.initialize.InitializeError: ``mesh_param`` (a tensor/sequence-parallel device mesh) or ``mpu``
            are given: dscore is data parallel only. Every error of :func:`dscore.initialize`.
    """
    import dscore
    from dscore.runtime.initialize import InitializeError

    if mesh_param is not None:
        raise InitializeError(
            f"deepspeed.initialize(mesh_param={mesh_param!r}): tensor/sequence-parallel meshes are not supported "
            "by dscore yet; only data parallelism is available"
        )
    data = read_client_config(args, config, config_params)
    plain_args = args
    if data is not None and args is not None:
        # the config was read here; dscore sees the rest of args (local_rank) without a second config source
        plain_args = argparse.Namespace(
            **{k: v for k, v in vars(args).items() if k not in ("deepspeed_config", "deepscale_config")}
        )
    result = dscore.initialize(
        args=plain_args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        distributed_port=distributed_port,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=data,
    )
    if plain_args is not args and getattr(plain_args, "local_rank", None) is not None:
        args.local_rank = plain_args.local_rank
    # tools written for DeepSpeed (zero_to_fp32, Lightning's converter) read its files: save in its layout
    result[0].checkpoint_layout = "deepspeed"
    return result
