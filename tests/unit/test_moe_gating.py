"""MoE gating on hand-built routings (capacity, clamping, dropped tokens, aux loss), the layer against a
dense loop on one process, the optimizer-group split, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dscore.errors import ConfigError
from dscore.moe.layer import MoE
from dscore.moe.sharded_moe import top1gating, top2gating, topkgating
from dscore.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer


def _logits(choices: list[int], num_experts: int, strength: float = 4.0) -> torch.Tensor:
    """Logits whose argmax is `choices[s]` for token s (softmax gate of the chosen expert known)."""
    out = torch.zeros(len(choices), num_experts)
    for s, e in enumerate(choices):
        out[s, e] = strength + 0.1 * s  # distinct gate values per token
    return out


def test_top1_capacity_drops_later_tokens_and_aux_loss() -> None:
    choices = [0, 0, 1, 0, 0, 0, 1, 0]  # expert 0: 6 tokens, expert 1: 2
    logits = _logits(choices, 2)
    l_aux, combine, dispatch, counts = top1gating(logits, 1.0, 0, use_rts=False)
    assert counts.tolist() == [6, 2]
    capacity = combine.shape[2]
    assert capacity == 4  # ceil(8 / 2 * 1.0)
    gates = torch.softmax(logits, dim=1)
    kept0 = [s for s, e in enumerate(choices) if e == 0][:4]  # the first 4 in token order
    dropped = [s for s, e in enumerate(choices) if e == 0][4:]
    for slot, s in enumerate(kept0):
        assert combine[s, 0, slot] == gates[s, 0] and combine[s].count_nonzero() == 1
    for s in dropped:
        assert combine[s].count_nonzero() == 0 and not dispatch[s].any()
    for slot, s in enumerate([2, 6]):
        assert combine[s, 1, slot] == gates[s, 1]
    mask = torch.nn.functional.one_hot(torch.tensor(choices), 2).float()
    assert torch.allclose(l_aux, 2 * (gates.mean(0) * mask.mean(0)).sum())


def test_capacity_clamped_by_min_capacity_and_unbounded_without_dropping() -> None:
    choices = [0, 0, 0, 0, 0, 1, 2, 3]
    logits = _logits(choices, 4)
    _, combine, _, _ = top1gating(logits, 0.5, 3, use_rts=False)
    assert combine.shape[2] == 3  # ceil(8 / 4 * 0.5) = 1, clamped up to min_capacity 3
    assert int((combine[:, 0].sum(-1) > 0).sum()) == 3  # expert 0 keeps 3 of its 5
    _, combine, _, counts = top1gating(logits, 0.5, 3, drop_tokens=False, use_rts=False)
    assert combine.shape[2] == 5 == int(counts.max())  # capacity = the largest load: nothing dropped
    assert int((combine.sum((1, 2)) > 0).sum()) == 8
    # random token selection keeps 3 of expert 0's tokens too, any 3
    _, combine, _, _ = top1gating(logits, 0.5, 3, use_rts=True)
    assert int((combine[:, 0].sum(-1) > 0).sum()) == 3
    with pytest.raises(ConfigError, match="min_capacity"):
        top1gating(logits, 1.0, 9)


def test_top2_second_choices_after_first_and_renormalized() -> None:
    # first choices: 0,0,0,1 ; second choices: 1,1,1,0 (logits rank them second)
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.1, 2.1, 0.0], [3.2, 2.2, 0.0], [2.0, 3.0, 0.0]])
    l_aux, combine, _, counts = top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False)
    assert counts.tolist() == [4, 4, 0]
    capacity = combine.shape[2]
    assert capacity == 2  # ceil(4 / 3 * 0.5 * 2)
    # expert 0: first choices of tokens 0,1,2 fill slots 0,1 (token 2 dropped); token 3's second choice
    # would take slot 3 (after the 3 first choices): dropped
    assert combine[0, 0, 0] > 0 and combine[1, 0, 1] > 0 and combine[2, 0].sum() == 0 and combine[3, 0].sum() == 0
    # expert 1: token 3's first choice slot 0; second choices of tokens 0,1,2 start at slot 1: token 0 kept
    assert combine[3, 1, 0] > 0 and combine[0, 1, 1] > 0 and combine[1, 1].sum() == 0
    gates = torch.softmax(logits, 1)
    g0 = gates[0, 0] / (gates[0, 0] + gates[0, 1])
    assert torch.allclose(combine[0, 0, 0], g0) and torch.allclose(combine[0].sum(), torch.tensor(1.0))
    mask1 = torch.nn.functional.one_hot(gates.argmax(1), 3).float()
    assert torch.allclose(l_aux, (gates.mean(0) * mask1.mean(0)).mean() * 9)
    _, _, _, counts = topkgating(torch.randn(6, 4), 3, 1.0, 0)
    assert int(counts.sum()) == 18


def _dense_reference(x: torch.Tensor, gate_w: torch.Tensor, experts: list[nn.Module]):
    gates = torch.softmax(x.float() @ gate_w.float().t(), dim=1)
    idx = gates.argmax(1)
    out = torch.stack([gates[s, idx[s]] * experts[int(idx[s])](x[s]) for s in range(x.shape[0])])
    mask = torch.nn.functional.one_hot(idx, len(experts)).float()
    return out, len(experts) * (gates.mean(0) * mask.mean(0)).sum()


def test_layer_on_one_rank_equals_the_dense_loop() -> None:
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    moe = MoE(8, expert, num_experts=3, ep_size=1, k=1, drop_tokens=False, min_capacity=0)
    with torch.no_grad():
        for i, e in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            for p in e.parameters():
                p.add_(0.05 * i)
    x = torch.randn(2, 5, 8)
    out, l_aux, counts = moe(x)
    ref, ref_aux = _dense_reference(
        x.reshape(-1, 8), moe.deepspeed_moe.gate.wg.weight, list(moe.deepspeed_moe.experts.deepspeed_experts)
    )
    assert out.shape == x.shape and int(counts.sum()) == 10
    assert torch.allclose(out.reshape(-1, 8), ref, atol=1e-6) and torch.allclose(l_aux, ref_aux)
    assert all(is_moe_param(p) and p.group_name == "ep_size_1" for p in moe.deepspeed_moe.experts.parameters())
    assert not any(is_moe_param(p) for p in moe.deepspeed_moe.gate.parameters())


def test_split_params_into_moe_groups_and_refusals() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=1))
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "lr": 0.1, "name": "main"}, max_group_size=20
    )
    assert [g["name"] for g in groups] == ["main", "ep_size_1", "ep_size_1"]  # 2 experts x 20 elems, cap 20
    assert len(groups[0]["params"]) == 3 and not groups[0].get("moe")  # 2 dense + the gate
    assert all(g["moe"] and g["lr"] == 0.1 for g in groups[1:])
    assert sum(len(g["params"]) for g in groups[1:]) == 4
    for kwargs, match in (
        ({"num_experts": 3, "ep_size": 2}, "divisible"),
        ({"use_tutel": True}, "Tutel"),
        ({"enable_expert_tensor_parallelism": True}, "tensor parallelism"),
        ({"k": 3}, "k=3"),
        ({"noisy_gate_policy": "Gaussian"}, "noisy_gate_policy"),
    ):
        with pytest.raises(ConfigError, match=match):
            MoE(4, nn.Linear(4, 4), **{"num_experts": 2, **kwargs})
