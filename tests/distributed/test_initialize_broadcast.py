"""Issue 38 item 2: ``dscore.initialize`` makes the data-parallel replicas equal to rank 0's model.

Every rank seeds torch with its own rank before building the model (and fills a persistent and a
non-persistent buffer from that generator), as a script that forgets to seed alike does. Right after
``initialize`` every rank's (gathered) parameters and buffers must be rank 0's initial values, at ZeRO 0,
1, 2, 3 and with ``zero.Init``; after one step both ranks equal a single-process reference trained from
rank 0's initialisation on both ranks' batches. Model-parallel layouts keep their shards: AutoTP shards
are broadcast only within their data-parallel group (4 ranks, tp 2 x dp 2), MoE expert parameters within
their expert-data-parallel group (ep 2: each rank keeps its own experts; ep 1: rank 0's experts). The
model is a tiny Hugging Face ``LlamaForCausalLM`` built from a config (its rotary ``inv_freq`` is a
non-persistent buffer).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscore.testing import run_distributed

SEQ, MICRO, LR = 8, 2, 0.1


def _llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def _add_buffers(model: Any, seed: int) -> None:
    """A persistent buffer drawn from ``seed`` and a seed-dependent non-persistent one (rotary ``inv_freq``)."""
    g = torch.Generator().manual_seed(seed)
    model.register_buffer("marker", torch.randn(5, generator=g))
    rotary = model.model.rotary_emb
    rotary.inv_freq.mul_(1.0 + 0.01 * seed)


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 32, (MICRO, SEQ), generator=torch.Generator().manual_seed(7 + rank))


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # the reference steps unclipped
    }


def _full(engine: Any) -> dict[str, torch.Tensor]:
    """Gathered parameters and every buffer (non-persistent ones too) of the engine's model."""
    out = {k: v.detach().clone() for k, v in engine.zero_stage_impl.module_state_dict().items()}
    out.update({f"buffer:{k}": b.detach().clone() for k, b in engine.module.named_buffers()})
    return out


def _own(model: Any) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out.update({f"buffer:{k}": b.detach().clone() for k, b in model.named_buffers()})
    return out


def _stages() -> dict[str, Any]:
    import torch.distributed as dist

    import dscore

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for case in ("zero0", "zero1", "zero2", "zero3", "zero_init"):
        stage = 3 if case == "zero_init" else int(case[-1])
        if case == "zero_init":
            with dscore.zero.Init():
                model = _llama(100 + rank)
        else:
            model = _llama(100 + rank)
        _add_buffers(model, 100 + rank)
        # a zero.Init model's parameters are partitions: only its buffers are whole before initialize
        initial = {f"buffer:{k}": b.detach().clone() for k, b in model.named_buffers()}
        if case != "zero_init":
            initial = _own(model)
        engine, *_ = dscore.initialize(model=model, config=_config(stage))
        after_init = _full(engine)
        loss = engine(input_ids=_ids(rank), labels=_ids(rank)).loss
        engine.backward(loss)
        engine.step()
        out[case] = {"initial": initial, "after_init": after_init, "after_step": _full(engine)}
    return out


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rank 0's model, and that model after one SGD step on both ranks' batches in one process."""
    model = _llama(100)
    _add_buffers(model, 100)
    initial = _own(model)
    ids = torch.cat([_ids(0), _ids(1)])
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return initial, _own(model)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, atol: float = 0.0) -> None:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for k in want:
        assert got[k].shape == want[k].shape, f"{what}: {k}"
        diff = float((got[k].float() - want[k].float()).abs().max()) if got[k].numel() else 0.0
        assert diff <= atol, f"{what}: {k} differs by {diff}"


@pytest.mark.slow
def test_initialize_gives_every_rank_rank0s_model_at_every_stage() -> None:
    r0, r1 = run_distributed(_stages, 2, timeout=300)
    ref_initial, ref_step = _reference()
    _assert_same(r0["zero0"]["initial"], ref_initial, "rank 0's own model is the reference's")
    for case in r0:
        for rank, res in ((0, r0), (1, r1)):
            got = res[case]
            # bitwise: a broadcast, not a computation
            _assert_same(got["after_init"], ref_initial, f"{case} rank {rank} right after initialize")
            _assert_same(got["after_step"], ref_step, f"{case} rank {rank} after one step", atol=1e-5)
    # the ranks really started apart (rank 1's own seed), so the equality above is the broadcast's
    assert not torch.equal(r1["zero0"]["initial"]["lm_head.weight"], ref_initial["lm_head.weight"])
    assert not torch.equal(r1["zero_init"]["initial"]["buffer:marker"], ref_initial["buffer:marker"])


def _autotp() -> dict[str, Any]:
    import torch.distributed as dist

    import dscore

    rank = dist.get_rank()
    model = _llama(100 + rank)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = {**_config(0), "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = dscore.initialize(model=model, config=cfg)
    mesh = engine.runtime.mesh
    local = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    return {"full": full, "local": local, "dp": mesh.dp_rank, "tp": mesh.tp_rank}


@pytest.mark.slow
def test_autotp_shards_are_broadcast_within_their_data_parallel_group_only() -> None:
    results = run_distributed(_autotp, 4, timeout=400)
    by = {(r["dp"], r["tp"]): r for r in results}
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    sharded = [k for k, v in by[0, 0]["local"].items() if v.shape != by[0, 0]["full"][k].shape]
    assert sharded, "AutoTP split nothing: the test would not see shards"
    for tp in (0, 1):
        src, dst = by[0, tp], by[1, tp]
        # the second data-parallel replica of this tensor rank holds the first one's values, bitwise
        _assert_same(dst["local"], src["local"], f"tp rank {tp}, dp rank 1 after initialize")
        assert not torch.equal(dst["full"]["lm_head.weight"], src["full"]["lm_head.weight"])  # they started apart
        for k in sharded:
            # the source keeps its own shard: slice `tp` of its own full weight along the split dimension
            v, w = src["local"][k], src["full"][k]
            dim = 0 if v.shape[0] != w.shape[0] else 1
            assert torch.equal(v, w.chunk(2, dim)[tp]), f"{k}: tp rank {tp}'s shard was overwritten"
    for k in sharded:  # shards stay shards: the two tensor ranks hold different slices
        assert not torch.equal(by[0, 0]["local"][k], by[0, 1]["local"][k]), k


D, H, NE, TOKENS = 8, 16, 2, 6


def _moe_net(ep: int, seed: int) -> Any:
    from torch import nn

    from dscore.moe.layer import MoE

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.inp = nn.Linear(D, D)
            expert = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
            self.moe = MoE(D, expert, num_experts=NE, ep_size=ep, k=1, drop_tokens=False, min_capacity=0)
            self.out = nn.Linear(D, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _, _ = self.moe(torch.tanh(self.inp(x)))
            return self.out(h)

    return Net()


def _moe() -> dict[int, Any]:
    import torch.distributed as dist

    import dscore
    from dscore.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    rank = dist.get_rank()
    out: dict[int, Any] = {}
    for ep in (2, 1):
        model = _moe_net(ep, 100 + rank)
        initial = {k: v.detach().clone() for k, v in model.named_parameters()}
        experts = sorted(k for k, v in model.named_parameters() if is_moe_param(v))
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
        cfg = {"train_micro_batch_size_per_gpu": TOKENS, "optimizer": {"type": "SGD", "params": {"lr": LR}}}
        engine, *_ = dscore.initialize(
            model=model, model_parameters=groups, config={**cfg, "zero_optimization": {"stage": 1}}
        )
        after = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
        out[ep] = {"initial": initial, "after": after, "experts": experts}
    return out


@pytest.mark.slow
def test_moe_expert_parameters_are_broadcast_within_their_expert_data_parallel_group() -> None:
    r0, r1 = run_distributed(_moe, 2, timeout=300)
    for ep in (2, 1):
        experts = r0[ep]["experts"]
        assert experts and experts == r1[ep]["experts"]
        dense = [k for k in r0[ep]["initial"] if k not in experts]
        for res in (r0, r1):  # dense parameters (the gate too): rank 0's, over the whole data-parallel group
            _assert_same({k: res[ep]["after"][k] for k in dense}, {k: r0[ep]["initial"][k] for k in dense}, f"ep {ep}")
        for k in experts:
            assert not torch.equal(r0[ep]["initial"][k], r1[ep]["initial"][k]), k  # the ranks started apart
            if ep == 2:  # each rank holds other experts (an EDP group of one): its own, untouched
                assert torch.equal(r1[ep]["after"][k], r1[ep]["initial"][k]), k
            else:  # both ranks hold every expert (one EDP group of 2): rank 0's
                assert torch.equal(r1[ep]["after"][k], r0[ep]["initial"][k]), k


def _pipeline() -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn

    import dscore
    from dscore.pipe import LayerSpec, PipelineModule

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    layers = [LayerSpec(nn.Linear, 4, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 2)]
    model = PipelineModule(layers=layers, num_stages=1, loss_fn=nn.functional.mse_loss)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
    }
    engine, *_ = dscore.initialize(model=model, config=cfg)
    return {"initial": initial, "after": {k: v.detach().clone() for k, v in engine.module.named_parameters()}}


@pytest.mark.slow
def test_pipeline_engine_broadcasts_within_its_data_parallel_group() -> None:
    r0, r1 = run_distributed(_pipeline, 2, timeout=240)
    assert not torch.equal(r0["initial"]["0.weight"], r1["initial"]["0.weight"])  # the ranks started apart
    for res in (r0, r1):
        _assert_same(res["after"], r0["initial"], "pipeline dp replica after initialize")


def _packing() -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn

    from dscore.comm import Comm
    from dscore.runtime.replicas import broadcast_replicas

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    m = nn.Module()
    m.big = nn.Parameter(torch.randn(40))  # 160 bytes > the bucket: travels alone, in place
    m.low = nn.Parameter(torch.randn(3, 5).to(torch.bfloat16))
    m.wide = nn.Parameter(torch.randn(3, dtype=torch.float64))
    m.odd = nn.Parameter(torch.randn(5, 3).t())  # not contiguous: staged through a bucket
    m.register_buffer("count", torch.randint(0, 1000, (3,)))
    m.register_buffer("mask", torch.rand(7) > 0.5, persistent=False)
    before = {k: v.detach().clone() for k, v in [*m.named_parameters(), *m.named_buffers()]}
    summary = broadcast_replicas(m, Comm(None, backend="gloo"), device=torch.device("cpu"), bucket_bytes=64)
    after = {k: v.detach().clone() for k, v in [*m.named_parameters(), *m.named_buffers()]}
    return {"before": before, "after": after, "summary": summary, "odd_stride": m.odd.stride()}


@pytest.mark.slow
def test_broadcast_packs_mixed_dtypes_into_bounded_buckets() -> None:
    r0, r1 = run_distributed(_packing, 2, timeout=120)
    for res in (r0, r1):
        _assert_same(res["after"], r0["before"], "after broadcast_replicas")
        assert res["odd_stride"] == (1, 3)  # written through the parameter's own (transposed) storage
    s = r0["summary"]
    assert s.tensors == 6 and s.skipped_partitioned == 0
    assert s.nbytes == sum(v.numel() * v.element_size() for v in r0["before"].values())
    # 64-byte buckets (aligned starts): big | low (30 B) + wide (24 B) | odd (60 B) | count (24 B) + mask (7 B)
    assert s.calls == 4
    assert not torch.equal(r1["before"]["count"], r0["before"]["count"])
