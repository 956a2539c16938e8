"""DeepSpeed 0.19.8 as a side-by-side peer row in the benchmarks (``dp_throughput.py``, ``gpt_throughput.py``).

DeepSpeed lives only in the separate bench venv (bench/README.md), never in the test venv. A DeepSpeed row
gets the dscore row's config plus ``optimizer.params.foreach: true``: with ``torch_adam`` DeepSpeed 0.19.8
passes ``foreach`` from the params to ``torch.optim.AdamW`` (default ``None``, torch's per-parameter loop on
CPU), while dscore's ``torch_adam`` always builds the for-each AdamW. It runs with ``DS_ACCELERATOR=cpu``
(without oneCCL bindings DeepSpeed's CPU accelerator names ``gloo`` as its backend) on the process group the
bench already opened, which ``deepspeed.initialize`` adopts through its ``TorchBackend``. DeepSpeed's
training collectives (all-reduce, reduce-scatter, all-gather) all go through ``torch.distributed``; its
CPU shared-memory op (``deepspeed_shm_comm``, JIT-built once by the ``TorchBackend`` and cached in
``~/.cache/torch_extensions``) serves only ``inference_all_reduce``, which training never calls.

:func:`check_engine` then proves, on every rank and before timing, that the engine measures what the dscore
row measures, and raises otherwise: a DeepSpeed row never silently becomes something else.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from typing import Any


def rows_wanted(no_deepspeed: bool, require_deepspeed: bool, rows: str, log: logging.Logger) -> bool:
    """Whether a benchmark adds its DeepSpeed rows (``rows`` names them in the log line).

    Raises:
        SystemExit: 2 when both flags are given, or ``--require-deepspeed`` and DeepSpeed is not importable
            by this interpreter (the side-by-side run must not skip it silently).
    """
    import importlib.util
    import sys

    if no_deepspeed and require_deepspeed:
        log.error("--no-deepspeed and --require-deepspeed contradict each other")
        raise SystemExit(2)
    if no_deepspeed:
        log.info("DeepSpeed: skipped (--no-deepspeed)")
        return False
    if importlib.util.find_spec("deepspeed") is None:
        if require_deepspeed:
            log.error("DeepSpeed: not importable by %s (--require-deepspeed); set up the bench venv as "
                      "bench/README.md says", sys.executable)
            raise SystemExit(2)
        log.info("DeepSpeed: not installed (pip install 'dscore[bench]' for the side-by-side run); skipping")
        return False
    from importlib.metadata import version

    from dscore.env_report import deepspeed_compat

    if deepspeed_compat()["active"]:  # `deepspeed` is dscore's own compatibility layer, not a peer
        if require_deepspeed:
            log.error("DeepSpeed: %s imports dscore's compatibility layer (compat/deepspeed), not DeepSpeed; "
                      "use the bench venv as bench/README.md says", sys.executable)
            raise SystemExit(2)
        log.info("DeepSpeed: `deepspeed` here is dscore's compatibility layer, not DeepSpeed; skipping the peer rows")
        return False
    log.info("DeepSpeed %s: rows %s (DS_ACCELERATOR=cpu, gloo)", version("deepspeed"), rows)
    return True


def train_step(engine: Any, forward: Any, timers: Any = None) -> None:
    """One DeepSpeed training step: ``loss = forward()``, ``engine.backward(loss)``, ``engine.step()``; with
    ``timers`` (the bench's phase timers: ``start(name)`` / ``stop(name)``) each phase is timed by hand, as
    DeepSpeed's own ``wall_clock_breakdown`` only logs."""
    if timers is None:
        engine.backward(forward())
        engine.step()
        return
    timers.start("forward")
    loss = forward()
    timers.stop("forward")
    timers.start("backward")
    engine.backward(loss)
    timers.stop("backward")
    timers.start("step")
    engine.step()
    timers.stop("step")


def config(dscore_config: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``dscore_config`` with ``optimizer.params.foreach = True`` (see the module doc)."""
    cfg = copy.deepcopy(dscore_config)
    cfg["optimizer"]["params"]["foreach"] = True
    return cfg


def quiet() -> None:
    """Silence DeepSpeed's info logs and torch's per-call-site deprecation warnings for the collective
    names DeepSpeed 0.19.8 calls (``all_gather_into_tensor``, ``reduce_scatter_tensor``)."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def initialize(model: Any, dscore_config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``deepspeed.initialize`` with :func:`config` of ``dscore_config``, then :func:`check_engine`.

    Returns:
        ``(engine, checked)``: the DeepSpeed engine and what :func:`check_engine` found.

    Raises:
        RuntimeError: from :func:`check_engine`.
    """
    import deepspeed

    quiet()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(dscore_config))
    return engine, check_engine(engine, dscore_config)


def check_engine(engine: Any, dscore_config: dict[str, Any]) -> dict[str, Any]:
    """Fail loudly unless the DeepSpeed engine runs what ``dscore_config`` asks of dscore.

    Checks: ``DS_ACCELERATOR=cpu`` and DeepSpeed's CPU accelerator; its comm backend is ``TorchBackend``
    (torch.distributed) and the world, the engine's data-parallel and the ZeRO optimizer's groups are gloo;
    the ZeRO stage; fp32 (no fp16/bf16); the basic optimizer is ``torch.optim.AdamW`` with ``foreach=True``;
    ``overlap_comm``, ``reduce_bucket_size``, ``allgather_bucket_size`` and ``gradient_clipping`` as in
    ``dscore_config``; one torch thread.

    Returns:
        ``{"backend": {group: name}, "optimizer": class name, "foreach": bool}`` for the report.

    Raises:
        RuntimeError: naming every mismatch.
    """
    import deepspeed.comm.comm as ds_comm
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import TorchBackend

    zero = dscore_config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    bad: list[str] = []
    if os.environ.get("DS_ACCELERATOR") != "cpu" or get_accelerator().device_name() != "cpu":
        bad.append(f"accelerator {get_accelerator().device_name()!r}, DS_ACCELERATOR="
                   f"{os.environ.get('DS_ACCELERATOR')!r} (want 'cpu' for both)")
    if not isinstance(ds_comm.cdb, TorchBackend):
        bad.append(f"DeepSpeed comm backend {type(ds_comm.cdb).__name__} (want TorchBackend over torch.distributed)")
    groups: dict[str, Any] = {"world": None, "engine data-parallel": engine.data_parallel_group}
    if stage > 0:
        groups["ZeRO optimizer"] = engine.optimizer.dp_process_group
    backends = {name: dist.get_backend(g) for name, g in groups.items()}
    bad += [f"{name} group backend {b!r} (want 'gloo')" for name, b in backends.items() if b != "gloo"]
    if engine.zero_optimization_stage() != stage:
        bad.append(f"ZeRO stage {engine.zero_optimization_stage()} (want {stage})")
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        bad.append("fp16/bf16 enabled (want fp32)")
    basic = engine.basic_optimizer
    foreach = basic.defaults.get("foreach") if basic is not None else None
    if type(basic) is not torch.optim.AdamW or foreach is not True:
        bad.append(f"basic optimizer {type(basic).__name__} foreach={foreach} (want torch.optim.AdamW foreach=True)")
    if stage > 0:
        if engine.zero_overlap_comm() != bool(zero.get("overlap_comm", stage == 3)):
            bad.append(f"overlap_comm {engine.zero_overlap_comm()} (want {zero.get('overlap_comm')})")
        for key, got in (("reduce_bucket_size", engine.zero_reduce_bucket_size()),
                         ("allgather_bucket_size", engine.zero_allgather_bucket_size())):
            if key in zero and int(got) != int(zero[key]):
                bad.append(f"{key} {got} (want {int(zero[key])})")
    clip = float(dscore_config.get("gradient_clipping", 0.0))
    if float(engine.gradient_clipping()) != clip:
        bad.append(f"gradient_clipping {engine.gradient_clipping()} (want {clip})")
    if torch.get_num_threads() != 1:
        bad.append(f"torch threads {torch.get_num_threads()} (want 1)")
    if bad:
        raise RuntimeError(f"DeepSpeed ZeRO-{stage} row would not measure what the dscore row does: " + "; ".join(bad))
    return {"backend": backends, "optimizer": type(basic).__name__, "foreach": foreach}
