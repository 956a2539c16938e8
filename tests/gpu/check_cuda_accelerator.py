"""Standalone check of ``CudaAccelerator`` (and a 1-rank nccl ``init_distributed``) on a real CUDA machine.

Run from the repository root with the project's environment::

    python tests/gpu/check_cuda_accelerator.py

Prints one ``PASS name`` / ``FAIL name: reason`` line per check and exits 1 when any check failed
(2 when no CUDA device is present). It is not collected by pytest (the file name does not start with
``test_``).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register and run ``fn`` as a named check, recording PASS/FAIL."""

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        try:
            fn()
        except Exception as exc:  # report every failure and keep going
            detail = f"{type(exc).__name__}: {exc}"
            RESULTS.append((name, False, detail))
            sys.stdout.write(f"FAIL {name}: {detail}\n{traceback.format_exc()}")
        else:
            RESULTS.append((name, True, ""))
            sys.stdout.write(f"PASS {name}\n")
        sys.stdout.flush()
        return fn

    return wrap


def main() -> int:
    """Run every check; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="[check] %(levelname)s %(name)s: %(message)s")
    import torch

    from dscore.accelerator import select_accelerator
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore_accelerators.cuda.accelerator import CudaAccelerator
    from dscore_accelerators.cuda.plugin import probe

    result = probe()
    sys.stdout.write(f"INFO probe: available={result.available} devices={result.device_count} ({result.reason})\n")
    if not result.available:
        sys.stdout.write("FAIL probe: no CUDA device here\n")
        return 2
    acc = CudaAccelerator()

    @check("probe creates no CUDA context")
    def _() -> None:
        assert not torch.cuda.is_initialized(), "torch.cuda was initialised by the probe"

    @check("auto selection picks cuda")
    def _() -> None:
        chosen, reason = select_accelerator(Registry(create_plugin_manager()), environ={})
        assert chosen.device_type == "cuda", (chosen, reason)
        assert "torch.cuda sees" in reason

    @check("device control")
    def _() -> None:
        assert acc.is_available() and acc.device_count() == result.device_count
        acc.set_device(0)
        assert acc.current_device() == 0
        assert acc.device() == torch.device("cuda", 0) and acc.device_name(0) == "cuda:0"
        assert acc.current_device_name() == "cuda:0"
        try:
            acc.set_device(acc.device_count())
        except Exception as exc:
            assert "out of range" in str(exc), exc
        else:
            raise AssertionError("set_device(device_count) must fail")

    @check("memory statistics in bytes")
    def _() -> None:
        acc.empty_cache()
        acc.reset_peak_memory_stats()
        before = acc.memory_allocated()
        x = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=acc.device())  # 256 MiB
        acc.synchronize()
        assert acc.memory_allocated() - before >= 256 * 1024 * 1024
        assert acc.max_memory_allocated() >= acc.memory_allocated()
        assert acc.memory_reserved() >= acc.memory_allocated()
        total, free = acc.total_memory(), acc.available_memory()
        assert total > free > 0 and total > 1024**3, (total, free)
        del x
        acc.empty_cache()

    @check("streams and events")
    def _() -> None:
        stream = acc.Stream()
        start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
        with acc.stream(stream):
            start.record()
            y = torch.randn(1024, 1024, device=acc.device()) @ torch.randn(1024, 1024, device=acc.device())
            end.record()
        end.synchronize()
        assert start.elapsed_time(end) >= 0.0 and y.shape == (1024, 1024)
        assert acc.current_stream() is not None
        acc.synchronize(0)

    @check("rng state round trip")
    def _() -> None:
        acc.manual_seed(123)
        state = acc.get_rng_state()
        assert state.dtype == torch.uint8 and state.device.type == "cpu"
        a = torch.rand(8, device=acc.device())
        acc.set_rng_state(state)
        b = torch.rand(8, device=acc.device())
        assert torch.equal(a, b)
        acc.manual_seed_all(5)
        assert acc.initial_seed() == 5

    @check("dtype capabilities")
    def _() -> None:
        major, _ = torch.cuda.get_device_capability()
        assert acc.is_fp16_supported() is (major >= 7 or os.environ.get("DS_ALLOW_DEPRECATED_FP16") == "1")
        assert acc.is_bf16_supported() is (major >= 8)
        dtypes = acc.supported_dtypes()
        assert dtypes[0] == torch.float32
        for dtype in dtypes:
            z = torch.ones(4, dtype=dtype, device=acc.device()) * 2
            assert z.sum().item() == 8

    @check("pinned memory")
    def _() -> None:
        host = torch.arange(1024, dtype=torch.float32)
        pinned = acc.pin_memory(host)
        assert acc.is_pinned(pinned) and not acc.is_pinned(host)
        assert torch.equal(pinned, host)
        on_dev = pinned.to(acc.device(), non_blocking=True)
        acc.synchronize()
        assert acc.on_accelerator(on_dev) and not acc.on_accelerator(host)

    @check("profiler ranges")
    def _() -> None:
        acc.range_push("dscore-check")
        acc.range_pop()

    @check("launch environment")
    def _() -> None:
        assert acc.communication_backend_name() == "nccl"
        assert acc.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
        assert acc.export_envs() == ["NCCL"]

    @check("init_distributed with nccl (1 rank) and the facade")
    def _() -> None:
        import torch.distributed as dist

        import dscore

        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)
        comm = dscore.init_distributed()
        try:
            assert dist.get_backend() == "nccl", dist.get_backend()
            t = torch.full((4,), 3.0, device=acc.device())
            comm.all_reduce(t, op="avg")
            assert torch.equal(t, torch.full((4,), 3.0, device=acc.device()))
            out = torch.empty(4, device=acc.device())
            comm.reduce_scatter_tensor(out, t)
            gathered = torch.empty(4, device=acc.device())
            comm.all_gather_into_tensor(gathered, out)
            assert torch.equal(gathered, t)
            comm.broadcast(t, src=0)
            comm.barrier()
        finally:
            dist.destroy_process_group()

    failed = [name for name, ok, _ in RESULTS if not ok]
    sys.stdout.write(f"SUMMARY {len(RESULTS) - len(failed)} passed, {len(failed)} failed\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
