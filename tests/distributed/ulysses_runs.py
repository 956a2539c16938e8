"""Ulysses sequence parallelism through ``dscore.initialize`` on real gloo ranks against one process on the
full sequence (rank functions and checks, run by ``test_tp_sp.py``) (outputs, losses, gradient norms and parameters after 3 AdamW steps within 1e-5).

* 2 ranks, sp 2 (ZeRO 0), 64 tokens; uneven splits and head counts refused with ConfigError.
* 4 ranks: sp 2 x dp 2 (ZeRO 3, 128 tokens) and tp 2 x sp 2 (ZeRO 2, 64 tokens: both composed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tp_sp_model import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    VOCAB,
    batches,
    ds_config,
    make_model,
    reference_dp,
    sdpa_core,
)

MICRO, STEPS = 2, 3


def _train(seq: int, stage: int, tp: int = 1) -> dict[str, Any]:
    import dscore
    from dscore.parallel.ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, all_gather_differentiable

    model = make_model()
    extra: dict[str, Any] = {"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}
    cfg = ds_config(sequence_parallel_size=2, zero_optimization={"stage": stage}, gradient_clipping=1e6, **extra)
    engine, _, _, _ = dscore.initialize(model=model, config=cfg)
    mesh = engine.runtime.mesh
    sp = mesh.sp_size
    for layer in engine.module.layers:
        layer.self_attn.core = UlyssesSPAttentionHF(
            sdpa_core,
            local_seq_length=seq // sp,
            global_seq_length=seq,
            batch_size=MICRO,
            attn_head_count=HEADS // tp,
            attn_head_size=HEAD_DIM,
            kv_head_count=HEADS // tp,
            num_hidden_layers=LAYERS,
            process_group=mesh.sp_comm,
        )
    d = mesh.dp_rank
    data = [
        {k: v[d * MICRO : (d + 1) * MICRO] for k, v in b.items()} for b in batches(STEPS, MICRO * mesh.dp_size, seq)
    ]
    # DeepSpeed passes the torch.distributed group (a dscore Comm works as well)
    loader = UlyssesSPDataLoaderAdapter(
        data, sp_rank=mesh.sp_rank, sp_group=mesh.get_sequence_parallel_group(), sp_world_size=sp, device="cpu"
    )
    losses, norms, logits0, grads0 = [], [], None, {}
    for i, b in enumerate(loader):
        logits = engine(b["input_ids"], b["position_ids"])
        labels = b["shift_labels"]
        loss_sum = F.cross_entropy(
            logits.reshape(-1, VOCAB).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        count = (labels != -100).sum().float()
        sums = all_gather_differentiable(loss_sum, mesh.sp_comm)
        counts = all_gather_differentiable(count, mesh.sp_comm)
        loss = sums.sum() / counts.sum()  # the token-weighted loss of the whole sequence, equal on every sp rank
        engine.backward(loss)
        if i == 0 and stage == 0:  # ZeRO 0 keeps full gradients: after the boundary backward they are averaged
            grads0 = {n: p.grad.detach().numpy().copy() for n, p in engine.module.named_parameters()}
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        if i == 0:
            logits0 = logits.detach().numpy().copy()
        losses.append(float(loss.detach()))
    full = {k: v.detach().float().numpy().copy() for k, v in engine.zero_stage_impl.module_state_dict().items()}
    from dscore.parallel import groups
    from dscore.runtime.context import use_runtime

    with use_runtime(engine.runtime):
        sizes = (
            groups.get_sequence_parallel_world_size(),
            groups._get_data_parallel_world_size(),
            groups.get_tensor_model_parallel_world_size(),
            groups.get_sequence_parallel_rank(),
        )
    assert sizes == (sp, mesh.dp_size, tp, mesh.sp_rank), sizes
    assert (engine.seq_parallel_world_size, engine.mp_world_size) == (sp, tp)
    return {
        "losses": losses,
        "norms": norms,
        "logits": logits0,
        "grads": grads0,
        "params": full,
        "dp": mesh.dp_size,
        "dp_rank": d,
        "sp_rank": mesh.sp_rank,
        "seq": seq,
    }


def _refusals() -> dict[str, str]:
    import dscore
    from dscore.errors import ConfigError
    from dscore.parallel.ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    out = {}
    mesh = dscore.initialize(model=make_model(), config=ds_config(sequence_parallel_size=2))[0].runtime.mesh
    adapter = UlyssesSPDataLoaderAdapter(batches(1, MICRO, 63), mesh.sp_rank, mesh.sp_comm, 2, "cpu")
    try:
        next(iter(adapter))
    except ConfigError as exc:
        out["uneven"] = str(exc)
    try:
        UlyssesSPAttentionHF(sdpa_core, 32, 64, MICRO, 3, HEAD_DIM, 3, LAYERS, mesh.sp_comm)
    except ConfigError as exc:
        out["heads"] = str(exc)
    plain, _, _, _ = dscore.initialize(model=make_model(), config=ds_config(sequence_parallel_size=2))
    try:  # no Ulysses attention installed: attention would see only the local shard
        plain(batches(1, MICRO, 32)[0]["input_ids"])
    except ConfigError as exc:
        out["no_ulysses"] = str(exc)
    return out


def two_ranks() -> dict[str, Any]:
    res = _train(64, 0)
    res["refused"] = _refusals()
    return res


def four_ranks() -> list[dict[str, Any]]:
    return [_train(128, 3), _train(64, 2, tp=2)]


def _check(res: dict[str, Any], ref: dict[str, Any], dp: int) -> None:
    assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5, abs=1e-6)
    seq, s, d = res["seq"], res["sp_rank"], res["dp_rank"]
    local = ref["logits"][d * MICRO : (d + 1) * MICRO, s * seq // 2 : (s + 1) * seq // 2]
    assert torch.allclose(torch.from_numpy(res["logits"]), local, atol=1e-5)
    for name, value in ref["params"].items():
        got = torch.from_numpy(res["params"][name])
        assert torch.allclose(got, value, atol=1e-5, rtol=0), (name, (got - value).abs().max())


def check_two_ranks(results: list[dict[str, Any]]) -> None:
    """Assertions over :func:`two_ranks`' results (one per rank)."""
    ref = reference_dp(STEPS, MICRO, 1, 64)
    for res in results:
        _check(res, ref, 1)
        assert res["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        assert "63 is not divisible by sequence_parallel_size 2" in res["refused"]["uneven"]
        assert "attn_head_count = 3 is not divisible" in res["refused"]["heads"]
        assert "ran no Ulysses attention" in res["refused"]["no_ulysses"]
        assert set(res["grads"]) == set(ref["grads"])  # first-step gradients of every parameter, sp 2 vs full
        for name, g in ref["grads"].items():
            assert torch.allclose(torch.from_numpy(res["grads"][name]), g, atol=1e-6, rtol=1e-5), name


def check_four_ranks(results: list[list[dict[str, Any]]]) -> None:
    """Assertions over :func:`four_ranks`' results (one list per rank)."""
    ref_dp = reference_dp(STEPS, MICRO, 2, 128)
    ref_tp = reference_dp(STEPS, MICRO, 1, 64)
    for res_dp, res_tp in results:
        assert res_dp["dp"] == 2 and res_tp["dp"] == 1
        _check(res_dp, ref_dp, 2)
        _check(res_tp, ref_tp, 1)
        assert res_tp["losses"] == pytest.approx(ref_tp["losses"], abs=1e-5)
    # sp 2 x dp 2: ranks 0-1 hold dp shard 0, ranks 2-3 shard 1; their mean loss is the reference's
    means = [(results[0][0]["losses"][s] + results[2][0]["losses"][s]) / 2 for s in range(STEPS)]
    assert means == pytest.approx(ref_dp["losses"], abs=1e-5)
