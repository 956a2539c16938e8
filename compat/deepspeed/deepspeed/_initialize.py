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
    (``engine.checkpoint_layout = "deepspeed"``, see the ``deepspeed`` checkpoint layout of the built-in ``checkpoint`` plugin).

    Args:
        mpu: passed to :func:`dscore.initialize`: the :class:`dscore.parallel.ParallelMesh` that
            ``UlyssesSPAttentionHF.register_with_transformers`` returns (DeepSpeed returns its module of
            sequence-parallel groups there; Accelerate passes it on unchanged). Its sizes must equal the
            config's ``sequence_parallel_size`` / ``tensor_parallel.autotp_size``.
        mesh_param: DeepSpeed's ``(data_parallel_size, sequence_parallel_size)``, the shape of the
            data x sequence device mesh it builds (sequence ranks adjacent, the layout of dscore's mesh).
            Routed to the config's ``sequence_parallel_size`` (set when absent; it must agree when present);
            the data-parallel size dscore builds (``world / sp``) must equal ``data_parallel_size``.

    Raises:
        dscore.runtime.initialize.InitializeError: ``mesh_param`` is not two positive integers.
        dscore.errors.ConfigError: ``mesh_param`` disagrees with ``sequence_parallel_size`` or with the world
            size, or comes with ``tensor_parallel.autotp_size`` > 1 (DeepSpeed's mesh has no tensor dimension);
            an ``mpu`` that is not a ``ParallelMesh`` or whose sizes differ from the config's. Every error of
            :func:`dscore.initialize`.
    """
    import dscore
    from dscore.errors import ConfigError

    data = read_client_config(args, config, config_params)
    mesh_dp = None
    if mesh_param is not None:
        mesh_dp, data = _route_mesh_param(mesh_param, data)
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
    if mesh_dp is not None and result[0].runtime.mesh.dp_size != mesh_dp:
        built = result[0].runtime.mesh
        result[0].close()
        raise ConfigError(
            f"deepspeed.initialize(mesh_param={tuple(mesh_param)!r}): data_parallel_size {mesh_dp} but the "
            f"{built.shape.world} launched ranks give {built.dp_size} data-parallel ranks at sequence_parallel_size "
            f"{built.sp_size}; launch data_parallel_size x sequence_parallel_size processes",
            path="sequence_parallel_size",
        )
    if plain_args is not args and getattr(plain_args, "local_rank", None) is not None:
        args.local_rank = plain_args.local_rank
    # tools written for DeepSpeed (zero_to_fp32, Lightning's converter) read its files: save in its layout
    result[0].checkpoint_layout = "deepspeed"
    return result


def _route_mesh_param(mesh_param: Any, data: Any) -> tuple[int, Any]:
    """DeepSpeed's ``mesh_param=(data_parallel_size, sequence_parallel_size)`` as dscore config.

    Returns ``(data_parallel_size, config)`` with ``sequence_parallel_size`` set in a copy of the config.
    Raises as :func:`initialize` documents.
    """
    from dscore.errors import ConfigError
    from dscore.parallel.mesh import raw_mesh_degrees
    from dscore.runtime.initialize import InitializeError

    shape = tuple(mesh_param) if isinstance(mesh_param, (tuple, list)) else None
    if shape is None or len(shape) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                    for n in shape):
        raise InitializeError(
            f"deepspeed.initialize(mesh_param={mesh_param!r}): expected DeepSpeed's (data_parallel_size, "
            "sequence_parallel_size), two positive integers"
        )
    dp, sp = shape
    if not isinstance(data, dict):
        return dp, data  # no config: dscore.initialize raises its own error
    tp, _ = raw_mesh_degrees(data)
    if tp > 1:
        raise ConfigError(
            f"deepspeed.initialize(mesh_param={shape!r}) with tensor_parallel.autotp_size {tp}: DeepSpeed's "
            "mesh_param has only data and sequence dimensions; leave mesh_param out and dscore builds the "
            "data x sequence x tensor mesh from the config",
            path="tensor_parallel.autotp_size",
        )
    if "sequence_parallel_size" in data and data["sequence_parallel_size"] != sp:
        raise ConfigError(
            f"deepspeed.initialize(mesh_param={shape!r}) says sequence_parallel_size {sp} but the config says "
            f"{data['sequence_parallel_size']!r}; make them agree",
            path="sequence_parallel_size",
        )
    return dp, {**data, "sequence_parallel_size": sp}
