"""The feature matrix run on the test device (``testdev`` + ``testnccl``) and on the CPU (gloo).

:func:`run_matrix` runs on each rank of one 2-rank job: for each platform it creates the default process
group (``testnccl`` for the test device, ``gloo`` for the CPU; dscore adopts it), runs every cell, and
destroys the group. A cell is a dict of factors; its result is the final module parameters (numpy), the
loss of every micro step, the loss scale after every step (fp16), whether every step was applied, and the
dtypes and devices of the optimizer's master tensors. The test compares platform against platform.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

IN, HID, OUT = 6, 8, 3
MICRO, GAS, STEPS = 2, 2, 3
CLIP = 0.1
LR = 0.02
SGD_LR = 0.05

#: platform -> (torch.distributed backend, dscore accelerator); "cuda" is used by tests/gpu/run.sh
PLATFORMS = {"testdev": ("testnccl", "testdev"), "cpu": ("gloo", "cpu"), "cuda": ("nccl", "cuda")}


def make_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, OUT))


def engine_config(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """The ds_config of ``cell`` (keys: stage, precision, offload, param_offload, gas, clip, hpz)."""
    gas = cell.get("gas", GAS)
    cfg: dict[str, Any] = {
        "accelerator": accelerator,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": (
            {"type": "SGD", "params": {"lr": SGD_LR}} if cell.get("optimizer") == "SGD"
            else {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}}
        ),
        "zero_optimization": {
            "stage": cell["stage"],
            "reduce_bucket_size": 50,
            "allgather_bucket_size": 50,
            "stage3_param_persistence_threshold": 0,
        },
        "steps_per_print": 10**9,
    }
    # DeepSpeed 0.19's default clips at 1.0: "no clipping" must be said with 0
    cfg["gradient_clipping"] = CLIP if cell.get("clip", True) else 0.0
    if cell["precision"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif cell["precision"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": cell.get("scale_power", 8), "loss_scale_window": 2,
                       "hysteresis": 1, "min_loss_scale": 1}
    off = cell.get("offload", "none")
    if off == "cpu":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_force_ds_cpu_optimizer"] = False
    elif off == "nvme":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": cell["_swap"], "pin_memory": True}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if cell.get("param_offload"):
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if cell.get("hpz"):  # ZeRO++ hpZ; units re-gathered in backward (from the secondary partitions)
        cfg["zero_optimization"].update(zero_hpz_partition_size=cell["hpz"], stage3_max_reuse_distance=0)
    return cfg


def data(n: int, seed: int = 7) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def run_cell(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """Train ``cell`` on this rank with dscore on ``accelerator``; return the measurements."""
    import torch
    import torch.distributed as dist

    import dscore

    world, rank = dist.get_world_size(), dist.get_rank()
    gas = cell.get("gas", GAS)
    steps = cell.get("steps", STEPS)
    with tempfile.TemporaryDirectory() as swap:
        cell = {**cell, "_swap": swap}
        model = make_model()
        engine, optimizer, _, _ = dscore.initialize(model=model, config=engine_config(cell, accelerator))
        try:
            device = engine.device
            x, y = data(MICRO * world * gas * steps)
            if cell.get("spike"):  # inputs fp16 cannot hold at the second step: an overflow, the step is skipped
                x[MICRO * world * gas:MICRO * world * (gas + 1)] *= 1e6
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cell["precision"]]
            losses, scales, applied = [], [], []
            span = MICRO * world
            for k in range(gas * steps):
                rows = slice(k * span + rank * MICRO, k * span + (rank + 1) * MICRO)
                xb = x[rows].to(device=device, dtype=dtype)
                yb = y[rows].to(device=device)
                out = engine(xb)
                assert out.device == device, f"engine output on {out.device}, expected {device}"
                loss = ((out.float() - yb) ** 2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach().cpu()))
                if (k + 1) % gas == 0:
                    applied.append(bool(engine.was_step_applied()))
                    scales.append(float(engine.get_loss_scale()) if cell["precision"] == "fp16" else 1.0)
            state = engine.zero_stage_impl.module_state_dict()
            masters = sorted({(str(p.dtype), p.device.type) for g in optimizer.param_groups for p in g["params"]})
            return {
                "params": {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()},
                "losses": losses,
                "scales": scales,
                "applied": applied,
                "masters": masters,
                "module_devices": sorted({p.device.type for p in engine.module.parameters()}),
            }
        finally:
            engine.close()


def _dtype(cell: dict[str, Any]) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cell["precision"]]


def run_checkpoint(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """Train 2 steps, save into ``cell["dir"]/<accelerator>``; returns the weights saved (after the save)."""
    import torch.distributed as dist

    import dscore

    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    with tempfile.TemporaryDirectory() as swap:
        engine, _, _, _ = dscore.initialize(model=model, config=engine_config({**cell, "_swap": swap}, accelerator))
        try:
            x, y = data(MICRO * world * GAS * 2)
            span = MICRO * world
            for k in range(GAS * cell.get("train_steps", 2)):
                rows = slice(k * span + rank * MICRO, k * span + (rank + 1) * MICRO)
                xb = x[rows].to(device=engine.device, dtype=_dtype(cell))
                loss = ((engine(xb).float() - y[rows].to(engine.device)) ** 2).mean()
                engine.backward(loss)
                engine.step()
            where = os.path.join(cell["dir"], accelerator)
            if cell.get("layout"):  # "deepspeed": DeepSpeed 0.19.8's file layout (what compat/deepspeed writes)
                engine.checkpoint_layout = cell["layout"]
            engine.save_checkpoint(where, tag="t2")
            state = engine.zero_stage_impl.module_state_dict()
            from dscore.checkpoint.export import get_fp32_state_dict_from_checkpoint

            fp32 = get_fp32_state_dict_from_checkpoint(where, "t2")  # the fp32 masters where there are any
            return {
                "params": {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()},
                "masters": {k: v.detach().cpu().numpy().copy() for k, v in fp32.items()},
                "master_dtypes": sorted({str(v.dtype) for v in fp32.values()}),
            }
        finally:
            engine.close()


def run_resume(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """Load ``cell["dir"]/<accelerator>`` at this world size and stage, train one more step."""
    import torch.distributed as dist

    import dscore

    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    engine, optimizer, _, _ = dscore.initialize(model=model, config=engine_config(cell, accelerator))
    try:
        engine.load_checkpoint(os.path.join(cell["dir"], accelerator), tag="t2")
        loaded = {k: v.detach().float().cpu().numpy().copy() for k, v in engine.zero_stage_impl.module_state_dict().items()}
        per_rank = MICRO * 2 // world  # the saving run's global batch (2 ranks x MICRO) per micro step
        x, y = data(MICRO * 2 * GAS * 3)
        for k in range(GAS * 2, GAS * 3):
            rows = slice(k * MICRO * 2 + rank * per_rank, k * MICRO * 2 + (rank + 1) * per_rank)
            for m in range(max(1, per_rank // MICRO)):
                sub = slice(rows.start + m * MICRO, rows.start + (m + 1) * MICRO) if per_rank > MICRO else rows
                loss = ((engine(x[sub].to(engine.device)).float() - y[sub].to(engine.device)) ** 2).mean()
                engine.backward(loss)
                engine.step()
        state = engine.zero_stage_impl.module_state_dict()
        masters = sorted({(str(p.dtype), p.device.type) for g in optimizer.param_groups for p in g["params"]})
        return {
            "loaded": loaded,
            "params": {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()},
            "masters": masters,
            "global_steps": engine.global_steps,
        }
    finally:
        engine.close()


def run_gathered(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """ZeRO-3: ``GatheredParameters`` reads full weights on every rank and writes one from rank 0; then
    activation checkpointing (``dscore.checkpointing.checkpoint``) inside the model's forward for 2 steps."""
    import torch
    import torch.distributed as dist

    import dscore
    from dscore import checkpointing

    class Ckpt(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpointing.checkpoint(self.body, x)

    world, rank = dist.get_world_size(), dist.get_rank()
    model = Ckpt()
    engine, _, _, _ = dscore.initialize(model=model, config=engine_config(cell, accelerator))
    try:
        first = model.body[0].weight
        with dscore.zero.GatheredParameters([first], modifier_rank=0):
            seen = first.detach().float().cpu().numpy().copy()
            shape = tuple(first.shape)
            if rank == 0:
                with torch.no_grad():
                    first.mul_(0.5)
        x, y = data(MICRO * world * GAS * 2)
        span = MICRO * world
        for k in range(GAS * 2):
            rows = slice(k * span + rank * MICRO, k * span + (rank + 1) * MICRO)
            loss = ((engine(x[rows].to(engine.device)).float() - y[rows].to(engine.device)) ** 2).mean()
            engine.backward(loss)
            engine.step()
        state = engine.zero_stage_impl.module_state_dict()
        return {
            "seen": seen,
            "shape": shape,
            "params": {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()},
        }
    finally:
        engine.close()


def run_pipeline(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """A 2-stage pipeline (tests/pipeline/pipe_models.py) with activation checkpointing, 2 steps."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
    from pipe_models import train_pipeline

    out = train_pipeline(2, 2, cell.get("gas", 2), checkpoint_interval=1, clip=cell.get("clip_value", 0.0))
    return {"losses": out["losses"], "layers": out["layers"], "stage": out["stage"]}


def run_gpt(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """The GPT example's model and config (examples/gpt) for a few steps on random tokens."""
    import json
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    import dscore

    root = Path(__file__).resolve().parents[2] / "examples" / "gpt"
    sys.path.insert(0, str(root))
    try:
        import model as gpt_model  # examples/gpt/model.py
    finally:
        sys.path.remove(str(root))
    cfg = json.loads((root / "ds_config.json").read_text())
    cfg.pop("train_batch_size", None)
    cfg.update({"accelerator": accelerator, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                "steps_per_print": 10**9})
    cfg.pop("tensorboard", None)
    cfg.pop("csv_monitor", None)
    cfg.pop("wall_clock_breakdown", None)
    torch.manual_seed(0)
    net = gpt_model.GPT(gpt_model.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))
    engine, _, _, _ = dscore.initialize(model=net, config=cfg)
    try:
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(11)
        steps = cell.get("steps", 3)
        tokens = torch.randint(0, 64, (steps, dist.get_world_size(), 2, 17), generator=g)
        losses = []
        # the same attention algorithm on both platforms: torch picks its fused CPU kernel on the host but
        # the math one on an out-of-tree device (they differ in the last bits)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        math_attention = sdpa_kernel(SDPBackend.MATH)
        math_attention.__enter__()
        for step in range(steps):
            t = tokens[step, rank].to(engine.device)
            loss = engine(t[:, :-1], t[:, 1:])
            loss = loss[1] if isinstance(loss, tuple) else loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().cpu()))
        math_attention.__exit__(None, None, None)
        state = engine.zero_stage_impl.module_state_dict()
        return {"losses": losses, "params": {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()}}
    finally:
        engine.close()


def run_ds_resume(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """Load a DeepSpeed 0.19.8 checkpoint (tests/checkpoint_deepspeed/data/<fixture>) into a ZeRO ``stage``
    engine at this world size, train its remaining steps; the errors against DeepSpeed's final weights."""
    import sys

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint_deepspeed"))
    import ds_fixture_helpers as H

    path = str(Path(__file__).resolve().parents[1] / "checkpoint_deepspeed" / "data" / cell["fixture"])
    exp = H.expected(path)
    exp = {**exp, "config": {**exp["config"], "accelerator": accelerator}}
    rank, ws = dist.get_rank(), dist.get_world_size()
    engine = H.engine_for(exp, cell["stage"], ws)
    try:
        engine.load_checkpoint(path)
        kind = exp.get("model", "mlp")
        for step in range(exp["save_at"] + 1, exp["total_steps"] + 1):
            for x, y in H.my_micro_batches(kind, step, int(exp["world_size"]), rank, ws):
                out = engine(x.to(engine.device))
                loss = torch.nn.functional.cross_entropy(out.float(), y.to(engine.device))
                engine.backward(loss)
                engine.step()
        final = engine.zero_stage_impl.module_state_dict()
        return {
            "errors": H.max_errors(final, exp["at_end"]["params"], rank_local_buffers=ws != int(exp["world_size"])),
            "params": {k: v.detach().float().cpu().numpy().copy() for k, v in final.items()},
        }
    finally:
        engine.close()


def _tp_sp_model() -> Any:
    """tests/distributed/tp_sp_model.py (the TinyLlama of the AutoTP / Ulysses tests)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    import tp_sp_model

    return tp_sp_model


def _tp_sp_result(engine: Any, losses: list[float], norms: list[float], logits0: Any) -> dict[str, Any]:
    state = engine.zero_stage_impl.module_state_dict()
    return {
        "params": {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()},
        "losses": losses,
        "norms": norms,
        "logits0": logits0,
        "local_shapes": {n: tuple(p.shape) for n, p in engine.module.named_parameters()},
        "module_devices": sorted({p.device.type for p in engine.module.parameters()}),
    }


def _norm(engine: Any) -> float:
    import torch

    n = engine.get_global_grad_norm()
    return float(n.detach().cpu()) if isinstance(n, torch.Tensor) else float(n)


def run_autotp(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """AutoTP, tp 2 (dp 1 on 2 ranks), ZeRO ``stage``: 3 AdamW steps of the TinyLlama with clipping active
    (the norm across tensor-parallel shards decides the update); the same-batch check runs on every forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import dscore

    m = _tp_sp_model()
    cfg = m.ds_config(tensor_parallel={"autotp_size": 2}, zero_optimization={"stage": cell["stage"]},
                      gradient_clipping=cell["clip"], accelerator=accelerator, steps_per_print=10**9)
    engine, _, _, _ = dscore.initialize(model=m.make_model(), config=cfg)
    try:
        losses, norms, logits0 = [], [], None
        with sdpa_kernel(SDPBackend.MATH):  # the same attention kernel on the host and the device
            for b in m.batches(cell["steps"], cell["micro"], cell["seq"]):
                ids, labels = b["input_ids"].to(engine.device), b["labels"].to(engine.device)
                logits = engine(ids)
                assert logits.device == engine.device, f"logits on {logits.device}, expected {engine.device}"
                loss = m.causal_lm_loss(logits, labels)
                engine.backward(loss)
                engine.step()
                norms.append(_norm(engine))
                losses.append(float(loss.detach().cpu()))
                if logits0 is None:
                    logits0 = logits.detach().float().cpu().numpy().copy()
        return _tp_sp_result(engine, losses, norms, logits0)
    finally:
        engine.close()


def run_ulysses(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """Ulysses, sp 2 on 2 ranks, ZeRO ``stage``: 3 AdamW steps of the TinyLlama over ``seq`` tokens split in
    two, the sequence's token-weighted loss gathered across the sp ranks (as ulysses_runs.py)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import dscore
    from dscore.parallel.ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, all_gather_differentiable

    m = _tp_sp_model()
    seq, micro = cell["seq"], cell["micro"]
    cfg = m.ds_config(sequence_parallel_size=2, zero_optimization={"stage": cell["stage"]}, gradient_clipping=1e6,
                      accelerator=accelerator, steps_per_print=10**9)
    engine, _, _, _ = dscore.initialize(model=m.make_model(), config=cfg)
    try:
        mesh = engine.runtime.mesh
        for layer in engine.module.layers:
            layer.self_attn.core = UlyssesSPAttentionHF(
                m.sdpa_core, local_seq_length=seq // 2, global_seq_length=seq, batch_size=micro,
                attn_head_count=m.HEADS, attn_head_size=m.HEAD_DIM, kv_head_count=m.HEADS,
                num_hidden_layers=m.LAYERS, process_group=mesh.sp_comm,
            )
        loader = UlyssesSPDataLoaderAdapter(
            m.batches(cell["steps"], micro, seq), sp_rank=mesh.sp_rank, sp_group=mesh.get_sequence_parallel_group(),
            sp_world_size=2, device=engine.device,
        )
        losses, norms, logits0 = [], [], None
        with sdpa_kernel(SDPBackend.MATH):
            for b in loader:
                assert b["input_ids"].device == engine.device, b["input_ids"].device
                logits = engine(b["input_ids"], b["position_ids"])
                labels = b["shift_labels"]
                loss_sum = F.cross_entropy(logits.reshape(-1, m.VOCAB).float(), labels.reshape(-1), ignore_index=-100,
                                           reduction="sum")
                count = (labels != -100).sum().to(torch.float32)
                loss = (all_gather_differentiable(loss_sum, mesh.sp_comm).sum()
                        / all_gather_differentiable(count, mesh.sp_comm).sum())
                engine.backward(loss)
                engine.step()
                norms.append(_norm(engine))
                losses.append(float(loss.detach().cpu()))
                if logits0 is None:
                    logits0 = logits.detach().float().cpu().numpy().copy()
        return _tp_sp_result(engine, losses, norms, logits0)
    finally:
        engine.close()


def run_offload_states(cell: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """``offload_states`` / ``reload_states`` at ZeRO ``stage``: two engines train the same 2 steps; one then
    offloads each state kind alone and reloads it, then all kinds together and reloads, reading the device
    allocator's byte counter (``memory_allocated``) before, after the offload and after the reload; both
    train 2 more steps and their weights are returned (equal bit for bit when offload -> reload is exact).

    ``kinds[k]`` holds, per kind (and ``"all"``): the bytes the counter dropped, the bytes it came back, the
    offloader's own count (:meth:`~dscore.runtime.offload_states.StateOffloader.bytes_by_kind`) and the
    bytes of the distinct device storages behind the stage's tensors of that kind (the states' sizes).
    On the CPU the counter does not exist: only the weights are compared there.
    """
    import torch
    import torch.distributed as dist

    import dscore
    from dscore.runtime.offload_states import OFFLOAD_STATE_TYPES

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = engine_config({**cell, "gas": 1}, accelerator)
    plain, _, _, _ = dscore.initialize(model=make_model(), config=cfg)
    moved, _, _, _ = dscore.initialize(model=make_model(), config=cfg)
    device = moved.device
    counter = torch.get_device_module(device.type).memory_allocated if device.type != "cpu" else None

    def train(engine: Any, first: int, steps: int) -> None:
        x, y = data(MICRO * world * (first + steps))
        for k in range(first, first + steps):
            rows = slice(k * MICRO * world + rank * MICRO, k * MICRO * world + (rank + 1) * MICRO)
            out = engine(x[rows].to(device=device, dtype=_dtype(cell)))
            engine.backward(((out.float() - y[rows].to(device)) ** 2).mean())
            engine.step()

    def sizes(kinds: list[str]) -> int:
        tensors = moved.zero_stage_impl.offload_state_tensors()  # (stage 3 frees its gather cache here)
        seen: dict[int, int] = {}
        for kind in kinds:
            for t in tensors.get(kind, []):
                if t is not None and t.device.type == device.type:
                    st = t.untyped_storage()
                    seen[st.data_ptr()] = int(st.nbytes())
        return sum(seen.values())

    try:
        train(plain, 0, 2)
        train(moved, 0, 2)
        kinds: dict[str, dict[str, int]] = {}
        if counter is not None:
            for kind in [*OFFLOAD_STATE_TYPES, "all"]:
                include = list(OFFLOAD_STATE_TYPES) if kind == "all" else [kind]
                size = sizes(include)
                before = counter(device)
                moved.offload_states(include=include)
                offloaded = counter(device)
                counted = moved.__dict__["_state_offloader"].bytes_by_kind()
                moved.reload_states()
                after = counter(device)
                kinds[kind] = {
                    "freed": before - offloaded,
                    "returned": after - offloaded,
                    "offloader": counted.get(kind, 0) if kind != "all" else sum(counted.values()),
                    "size": size,
                    "before": before,
                }
        else:
            moved.offload_states()
            moved.reload_states()
        train(plain, 2, 2)
        train(moved, 2, 2)
        weights = [e.zero_stage_impl.module_state_dict() for e in (plain, moved)]
        return {
            "params": {k: v.detach().float().cpu().numpy().copy() for k, v in weights[1].items()},
            "same_as_never_offloaded": all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]),
            "kinds": kinds,
        }
    finally:
        plain.close()
        moved.close()


KINDS = {
    "ds_resume": run_ds_resume,
    "train": run_cell,
    "save": run_checkpoint,
    "resume": run_resume,
    "gathered": run_gathered,
    "pipeline": run_pipeline,
    "gpt": run_gpt,
    "autotp": run_autotp,
    "ulysses": run_ulysses,
    "offload_states": run_offload_states,
}


def run_matrix(cells: list[dict[str, Any]], platforms: tuple[str, ...] = ("testdev", "cpu")) -> dict[str, list[Any]]:
    """On this rank: every cell on every platform; an exception becomes ``"ERROR: ..."`` for that cell.

    ``DS_ACCELERATOR`` is set to the platform's accelerator while its cells run, so helpers that build
    their own config (the pipeline's) select it too.
    """
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # one rendezvous store for every platform's group: a second TCPStore on the same port could be reached
    # by a fast rank while the slow one still serves the first
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=300))
    out: dict[str, list[Any]] = {}
    for platform in platforms:
        backend, accelerator = PLATFORMS[platform]
        os.environ["DS_ACCELERATOR"] = accelerator
        if platform == "testdev":
            from dscore_testdevice.comm import register
            from dscore_testdevice.device import activate

            activate()
            register()
            torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", rank)))
        elif platform == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend, store=dist.PrefixStore(platform, store), rank=rank, world_size=world)
        results = []
        for cell in cells:
            try:
                results.append(KINDS[cell.get("kind", "train")](cell, accelerator))
            except Exception:  # noqa: BLE001 - reported per cell by the test
                results.append("ERROR: " + traceback.format_exc(limit=12))
        dist.barrier()
        dist.destroy_process_group()
        out[platform] = results
    os.environ.pop("DS_ACCELERATOR", None)
    return out
