"""ZeRO++ quantized gradients (``zero_quantized_gradients``, qgZ) on real gloo ranks.

Nodes are simulated on one host by ``LOCAL_WORLD_SIZE`` (qgZ's node grouping, :mod:`dscore_plugins.zeropp.qgz`):
2 ranks as 2 nodes of 1 (one level), 4 ranks as 2 nodes of 2 (intra- then inter-node) and as one node
(exact, as DeepSpeed). Checked: the reduce-scatter against the exact one within the composed per-element
bound; a 20-step ZeRO-3 training curve (bf16, gradient accumulation, clipping) against unquantized ZeRO-3;
the bytes each rank sends in the gradient exchange; fp16 (loss scaling, overflow skip); checkpoints; the
refusal with MoE expert parameters.
"""

from __future__ import annotations

import os
from typing import Any

from dscore.testing import run_distributed

STEPS = 20


def _as_nodes(local: int) -> None:
    """Make this rank believe it shares a node with ``local`` ranks (consecutive global ranks)."""
    rank = int(os.environ["RANK"])
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    os.environ["LOCAL_RANK"] = str(rank % local)


def _rank_input(rank: int, numel: int) -> Any:
    """Rank ``rank``'s bucket: random blocks at scales 1e-3..1e3, a zero stretch and an outlier."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, 7)[torch.arange(numel) // 300 % 7]
    x[1000:1400] = 0.0
    x[2001] = 5e4 * (1 if rank % 2 else -1)
    return x


def _collective(local: int) -> dict:
    import torch

    from dscore.comm import Comm
    from dscore_plugins.zeropp.qgz import block_geometry, build

    _as_nodes(local)
    comm = Comm(backend="gloo")
    qgz = build(comm, local_world_size=local)
    world, rank = comm.world_size, comm.rank
    out: dict[str, Any] = {"active": qgz is not None}
    if qgz is None:
        return out
    # the same ranks as one node (LOCAL_WORLD_SIZE = world): DeepSpeed does not quantize, neither does dscore
    out["one_node"] = build(comm, local_world_size=comm.world_size)
    for c in (1537, 4096):  # a chunk with padded blocks, one of whole blocks
        inputs = [_rank_input(r, world * c) for r in range(world)]  # every rank's input, known everywhere
        got = torch.empty(c)
        qgz(got, inputs[rank].clone()).wait()
        exact = torch.stack(inputs).sum(0).view(world, c)[rank]
        block, cp = block_geometry(c)
        # per element: m_i = max |x_i| over the element's block of rank i's copy of this chunk
        m = torch.zeros(world, cp)
        for r, x in enumerate(inputs):
            part = torch.zeros(cp)
            part[:c] = x.view(world, c)[rank]
            m[r] = part.view(-1, block).abs().amax(dim=1).repeat_interleave(block)
        m = m[:, :c]
        # one level: sum_i m_i / 14; two levels: + sum_n p_n / 14 with p_n <= sum_{i in n} m_i
        factor = 1 / 14 if qgz.layout.local_size == 1 else 1 / 7
        bound = factor * m.sum(0) + 1e-5 * m.sum(0)  # + fp32 summation rounding
        err = (got - exact).abs()
        out[c] = {"within": bool((err <= bound).all()), "max_err": float(err.max()), "factor": factor,
                  "max_ratio": float((err / bound.clamp_min(1e-30)).max()), "quantized": float(err.max()) > 0}
    # every exchange is launched when the call returns: waiting in another order on some ranks is safe
    c = 1100
    a_in, b_in = _rank_input(rank, world * c), _rank_input(rank + 50, world * c)
    a_out, b_out, a_ref, b_ref = torch.empty(c), torch.empty(c), torch.empty(c), torch.empty(c)
    qgz(a_ref, a_in.clone()).wait()
    qgz(b_ref, b_in.clone()).wait()
    works = [qgz(a_out, a_in.clone()), qgz(b_out, b_in.clone())]
    for w in works[::-1] if rank % 2 else works:
        w.wait()
    out["any_wait_order"] = torch.equal(a_out, a_ref) and torch.equal(b_out, b_ref)
    # a non-finite gradient (fp16 overflow) stays non-finite where it lands
    c = 1024
    x = torch.zeros(world * c)
    if rank == 0:
        x[c * (world - 1) + 3] = float("inf")  # in the last rank's chunk
    got = torch.empty(c)
    qgz(got, x).wait()
    out["inf_seen"] = not bool(torch.isfinite(got).all())
    return out


def test_reduce_scatter_within_bound_on_2_and_4_ranks() -> None:
    for local, world in ((1, 2), (2, 4)):
        results = run_distributed(_collective, world, local, timeout=300)
        for rank, res in enumerate(results):
            assert res["active"]
            for c in (1537, 4096):
                assert res[c]["within"] and res[c]["quantized"], (world, local, rank, res[c])
            assert res["inf_seen"] == (rank == world - 1)
            assert res["any_wait_order"]
            assert res["one_node"] is None


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
    )


def _train(quantized: bool, precision: str, ckpt: str | None = None, steps: int = STEPS) -> dict:
    import torch
    import torch.nn.functional as F

    import dscore
    from dscore.comm import Comm

    sent = {"bytes": 0}

    def counting(name: str) -> Any:
        original = getattr(Comm, name)

        def wrapper(self: Comm, output: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            n = self.get_world_size(kwargs.get("group"))
            # what this rank sends to the others: all of the input but its own chunk
            sent["bytes"] += tensor.numel() * tensor.element_size() * (n - 1) // n
            return original(self, output, tensor, *args, **kwargs)

        return wrapper

    patched = {name: getattr(Comm, name) for name in ("reduce_scatter_tensor", "all_to_all_single")}
    for name in patched:
        setattr(Comm, name, counting(name))
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        **({} if precision == "fp32" else {precision: {"enabled": True}}),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "zero_quantized_gradients": quantized},
    }  # fmt: skip
    try:
        engine, *_ = dscore.initialize(model=_model(), config=cfg)
        rank = engine.global_rank
        g = torch.Generator().manual_seed(rank)  # fixed batches per rank: the loss curve is a fitting curve
        batches = [(torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)) for _ in range(2)]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
        losses = []
        for step in range(steps):
            total = 0.0
            for x, y in batches:
                if precision == "fp16" and step == 3 and rank == 0 and x is batches[0][0]:
                    x = x * float("inf")  # an overflow on one rank: every rank must skip this step
                loss = F.mse_loss(engine(x.to(dtype)).float(), y)
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())
            losses.append(total / 2)
        out = {"losses": losses, "bytes": sent["bytes"], "skipped": int(engine.skipped_steps)}
        if ckpt is not None:  # checkpoints are unaffected: save with qgZ, load without, same weights
            engine.save_checkpoint(ckpt, tag="t")
            before = {k: v.float().clone() for k, v in engine.zero_stage_impl.module_state_dict().items()}
            engine.close()
            cfg["zero_optimization"]["zero_quantized_gradients"] = False
            other, *_ = dscore.initialize(model=_model(), config=cfg)
            other.load_checkpoint(ckpt, tag="t")
            after = other.zero_stage_impl.module_state_dict()
            out["ckpt_equal"] = all(torch.equal(before[k], after[k].float()) for k in before)
            other.close()
        else:
            engine.close()
        return out
    finally:
        for name, fn in patched.items():
            setattr(Comm, name, fn)


def _curves(ckpt: str) -> dict:
    _as_nodes(1)  # 2 ranks = 2 nodes of 1 rank
    return {"plain": _train(False, "bf16"), "qgz": _train(True, "bf16", ckpt), "fp16": _train(True, "fp16", steps=8)}


def test_training_curve_bytes_fp16_and_checkpoint_on_two_nodes(tmp_path: Any) -> None:
    for res in run_distributed(_curves, 2, str(tmp_path), timeout=400):
        plain, qgz = res["plain"], res["qgz"]
        q, p = qgz["losses"], plain["losses"]
        # stated tolerance: every step within 6% of the unquantized loss (measured 5.0%), within 2% of the
        # initial loss in absolute terms (measured 1.4%), and never a whole step behind
        gap = max(abs(a - b) / abs(b) for a, b in zip(q, p))
        assert gap < 0.06, (gap, q, p)
        assert max(abs(a - b) for a, b in zip(q, p)) < 0.02 * p[0], (q, p)
        assert all(a < b for a, b in zip(q[1:], p[:-1])), (q, p)
        assert q[0] == p[0] and q[-1] < 0.35 * q[0]
        # bytes each rank sends in the gradient exchange: int4 + fp32 scales (4 per 256 elements) against
        # ZeRO-3's bf16 reduce-scatter (measured 0.2589)
        ratio = qgz["bytes"] / plain["bytes"]
        assert 0.25 <= ratio < 0.265, ratio
        assert qgz["ckpt_equal"]
        fp16 = res["fp16"]
        assert fp16["skipped"] >= 1 and all(map(lambda v: v == v, fp16["losses"][5:]))
        assert fp16["losses"][-1] < fp16["losses"][0]


def _two_level() -> dict:
    _as_nodes(2)  # 4 ranks = 2 nodes of 2 ranks: intra- then inter-node exchange
    return {"plain": _train(False, "bf16", steps=6), "qgz": _train(True, "bf16", steps=6)}


def test_two_level_training_and_bytes_on_four_ranks() -> None:
    for res in run_distributed(_two_level, 4, timeout=400):
        q, p = res["qgz"]["losses"], res["plain"]["losses"]
        gap = max(abs(a - b) / abs(b) for a, b in zip(q, p))
        assert gap < 0.06, (gap, q, p)  # measured 0.6% over 6 steps (3.8% over 20 in a scratch run)
        assert all(a < b for a, b in zip(q[1:], p[:-1])), (q, p)
        # intra (L-1)/L + inter (N-1)/N of int4 rows: 1/4 of ZeRO-3's bf16 reduce-scatter, +3.1% scales
        ratio = res["qgz"]["bytes"] / res["plain"]["bytes"]
        assert 0.25 <= ratio < 0.265, ratio  # measured 0.2591


def _moe_refused() -> str:
    from test_moe_expert_parallel import _models

    import dscore
    from dscore.errors import ConfigError
    from dscore.moe.utils import split_params_into_different_moe_groups_for_optimizer

    _as_nodes(1)
    model = _models()(2)  # 2 experts over 2 ranks: expert units reduce over their expert-data-parallel group
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}  # fmt: skip
    try:
        dscore.initialize(model=model, model_parameters=groups, config=cfg)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_moe_expert_parameters_with_qgz_are_refused() -> None:
    for text in run_distributed(_moe_refused, 2, timeout=300):
        assert "zero_optimization.zero_quantized_gradients" in text and "MoE expert parameters" in text, text
