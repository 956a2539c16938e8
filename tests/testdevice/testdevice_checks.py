"""Per-rank functions of tests/testdevice/test_testdevice.py (module level so run_distributed can pickle them).

Every function runs in a spawned process: activating the test device renames torch's PrivateUse1 backend
for the whole process, which the pytest process itself must not see.
"""

from __future__ import annotations

import os
from typing import Any


def _activate() -> Any:
    import torch
    from dscore_testdevice.device import activate

    module = activate()
    torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    return module


def _raises(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return ""


def device_semantics() -> dict[str, Any]:
    """One process: what the device does (the test asserts every entry)."""
    import torch

    from dscore_plugins.zero.offload import host_tensor

    mod = _activate()
    out: dict[str, Any] = {}
    d = torch.device("testdev", 0)
    a = torch.arange(12, dtype=torch.float32).view(3, 4)
    t = a.to(d)
    out["device"] = str(t.device)
    out["is_cpu"] = t.is_cpu
    out["roundtrip_equal"] = bool(torch.equal(t.cpu(), a))
    out["strided_copy_equal"] = bool(torch.equal(t.t().contiguous().cpu(), a.t().contiguous()))
    v = t[1:, ::2]
    v.add_(100)  # an in-place op on a strided view through the CPU fallback writes the device memory
    b = a.clone()
    b[1:, ::2] += 100
    out["view_inplace_equal"] = bool(torch.equal(t.cpu(), b))
    out["mix_host_error"] = _raises(lambda: t + torch.ones(3, 4))
    out["mix_host_scalar_ok"] = _raises(lambda: t + torch.tensor(2.0)) == ""
    out["mix_index_error"] = _raises(lambda: t + torch.ones(3, 4, device="testdev:1"))
    out["numpy_error"] = _raises(lambda: t.numpy())
    before = mod.host_scalar_reads()
    float(t.sum())
    out["scalar_reads_counted"] = mod.host_scalar_reads() - before
    base = mod.memory_allocated(0)
    big = torch.empty(1 << 20, dtype=torch.uint8, device=d)
    out["memory_allocated_delta"] = mod.memory_allocated(0) - base
    del big
    out["memory_after_free_delta"] = mod.memory_allocated(0) - base
    p = torch.empty(16).pin_memory()
    out["pinned"] = bool(p.is_pinned()) and not bool(torch.empty(16).is_pinned())
    s1 = torch.Stream(device="testdev")
    out["new_stream_differs"] = s1.stream_id != torch.accelerator.current_stream(d).stream_id
    e1 = torch.Event(device="testdev", enable_timing=True)
    e2 = torch.Event(device="testdev", enable_timing=True)
    e1.record()
    _ = t @ t.t()
    e2.record()
    e2.synchronize()
    out["event_elapsed_ms"] = float(e1.elapsed_time(e2))
    lin = torch.nn.Linear(4, 2).to(d)
    lin(t).sum().backward()
    out["grad_device"] = str(lin.weight.grad.device)
    # the accelerator plugin, selected as a vendor's would be
    os.environ["DS_ACCELERATOR"] = "testdev"
    from dscore.accelerator import select_accelerator
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    acc, reason = select_accelerator(Registry(create_plugin_manager()))
    out["accelerator"] = (acc.name, acc.device_type, acc.communication_backend_name(), str(acc.device(0)))
    out["accelerator_reason"] = reason
    # defect 7: host_tensor allocates pinned in one step (never a plain buffer plus its pinned copy)
    copies = []
    original = type(acc).pin_memory

    def spy(self: Any, tensor: Any) -> Any:
        copies.append(tensor.numel())
        return original(self, tensor)

    # tied weights survive the move to the device (dscore.runtime.placement.to_module); torch's own
    # Module.to builds new Parameters on an out-of-tree device and unties them
    from dscore.runtime.placement import to_module

    def tied() -> Any:
        m = torch.nn.Module()
        m.emb = torch.nn.Embedding(5, 3)
        m.head = torch.nn.Linear(3, 5, bias=False)
        m.head.weight = m.emb.weight
        return m

    plain, kept = tied(), tied()
    first = kept.emb.weight
    plain.to(d)
    to_module(kept, device=d)
    to_module(kept, dtype=torch.bfloat16)
    out["ties"] = {"torch_to": plain.head.weight is plain.emb.weight, "to_module": kept.head.weight is kept.emb.weight,
                   "same_parameter": kept.emb.weight is first, "where": f"{kept.emb.weight.device}/{kept.emb.weight.dtype}"}
    type(acc).pin_memory = spy  # type: ignore[method-assign]
    try:
        h = host_tensor(1000, torch.float32, True, acc)
    finally:
        type(acc).pin_memory = original  # type: ignore[method-assign]
    out["host_tensor"] = {"pinned": bool(h.is_pinned()), "zero": bool((h == 0).all()), "copies": copies,
                          "device": str(h.device)}
    return out


def nccl_rules() -> dict[str, Any]:
    """Two ranks on ``testnccl``: what NCCL's rules refuse and how point-to-point and results behave."""
    import torch
    import torch.distributed as dist
    from dscore_testdevice.comm import register

    _activate()
    register()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("testnccl", rank=rank, world_size=world)
    d = torch.device("testdev", rank)
    out: dict[str, Any] = {"backend": dist.get_backend()}
    out["host_all_reduce"] = _raises(lambda: dist.all_reduce(torch.ones(3)))
    out["host_broadcast"] = _raises(lambda: dist.broadcast(torch.ones(3), 0))
    out["host_all_gather"] = _raises(lambda: dist.all_gather_into_tensor(torch.empty(6, device=d), torch.ones(3)))
    out["host_send"] = _raises(lambda: dist.send(torch.ones(3), 1 - rank))
    other = torch.device("testdev", 1 - rank)
    out["other_device"] = _raises(lambda: dist.all_reduce(torch.ones(3, device=other)))
    t = torch.full((4,), float(rank + 1), device=d)
    work = dist.all_reduce(t, async_op=True)
    out["before_wait"] = t.cpu().tolist()
    work.wait()
    out["after_wait"] = t.cpu().tolist()
    avg = torch.full((2,), float(rank + 1), device=d)
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    out["avg"] = avg.cpu().tolist()
    g = torch.empty(8, device=d)
    dist.all_gather_into_tensor(g, t)
    out["all_gather"] = g.cpu().tolist()
    rs = torch.empty(2, device=d)
    dist.reduce_scatter_tensor(rs, torch.arange(4, dtype=torch.float32, device=d))
    out["reduce_scatter"] = rs.cpu().tolist()
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    out["objects"] = objs
    # tags are ignored: messages are matched in the order they were posted
    if rank == 0:
        dist.send(torch.full((2,), 1.0, device=d), 1, tag=5)
        dist.send(torch.full((2,), 2.0, device=d), 1, tag=3)
    else:
        first, second = torch.empty(2, device=d), torch.empty(2, device=d)
        dist.recv(first, 0, tag=3)  # tag 3 was posted second: NCCL ignores it, so this gets the first message
        dist.recv(second, 0, tag=5)
        out["p2p_order"] = [first.cpu().tolist(), second.cpu().tolist()]
    dist.barrier()
    dist.destroy_process_group()
    return out


def _engine(stage: int, extra: dict[str, Any] | None = None) -> Any:
    import torch

    import dscore

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    cfg: dict[str, Any] = {
        "accelerator": "testdev",
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        **(extra or {}),
    }
    engine, *_ = dscore.initialize(model=model, config=cfg)
    return engine


def syncs_and_timers() -> dict[str, Any]:
    """Two ranks, dscore's own init (testnccl chosen by the accelerator): host syncs and timer syncs.

    * ``unscale_clip`` without overflow checking reads no device scalar on the host (defect 7: the
      ``float(norm)`` of every step);
    * with ``wall_clock_breakdown`` every sub-phase clock read of ``step`` synchronizes the device (defect 7:
      sub-phase timers measured launch time only).
    """
    import torch

    from dscore.runtime.timers import active_timers
    from dscore.zero import unscale_clip

    mod = _activate()
    out: dict[str, Any] = {}
    engine = _engine(2, {"wall_clock_breakdown": True})
    try:
        comm = engine.runtime.comm
        out["backend"] = comm.backend
        flats = [torch.randn(5, device=engine.device), torch.randn(7, device=engine.device)]
        before = mod.host_scalar_reads()
        from dscore.runtime.context import use_runtime

        with use_runtime(engine.runtime):
            norm, overflow = unscale_clip(flats, comm, divisor=2.0, clip=0.5, check_overflow=False)
        out["unscale_clip_scalar_reads"] = mod.host_scalar_reads() - before
        out["norm_device"] = str(norm.device) if norm is not None else ""
        host = [torch.randn(9), torch.randn(4)]  # host partitions, as under offload_optimizer
        with use_runtime(engine.runtime):
            hnorm, _ = unscale_clip(host, comm, divisor=1.0, clip=0.5, check_overflow=True)
        out["host_norm_device"] = str(hnorm.device) if hnorm is not None else ""
        # timers: count synchronizations inside one step against the sub-phases it records
        calls = [0]
        real = mod.synchronize

        def counting(device: Any = None) -> None:
            calls[0] += 1
            real(device)

        mod.synchronize = counting
        try:
            x = torch.randn(2, 6, device=engine.device)
            reads = mod.host_scalar_reads()
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
            out["scalar_reads_per_step"] = mod.host_scalar_reads() - reads
            engine.backward(engine(x).float().pow(2).mean())
            timers = active_timers()
            assert timers is not None
            timers.reset()
            calls[0] = 0
            engine.step()
            out["step_syncs"] = calls[0]
            out["step_subphases"] = sorted(k for k in timers.totals() if k.startswith("step."))
        finally:
            mod.synchronize = real
    finally:
        engine.close()
    return out
