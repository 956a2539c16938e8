"""The engine on two gloo ranks: stage 0 numerics against a single-process PyTorch loop, data sharding,
and overflow agreement across ranks."""

from __future__ import annotations

import pytest

from dscore.testing import run_distributed

IN, OUT, MICRO, GAS, STEPS, CLIP = 6, 3, 4, 2, 3, 0.3


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUT))


def _data(world: int):
    import torch

    g = torch.Generator().manual_seed(1)
    n = MICRO * world * GAS * STEPS
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def _mse(out, y):
    return ((out.float() - y) ** 2).mean()


def _train_rank(clip: float):
    """Each rank feeds its own MICRO rows of every (MICRO * world)-row slice; returns its weights and the
    weights of a plain single-process loop over the full slices."""
    import torch
    import torch.distributed as dist

    import dscore

    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
    }
    engine, *_ = dscore.initialize(model=model, config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert engine.train_batch_size() == MICRO * GAS * world
    x, y = _data(world)
    span = MICRO * world
    for k in range(GAS * STEPS):
        rows = slice(k * span + rank * MICRO, k * span + (rank + 1) * MICRO)
        engine.backward(_mse(engine(x[rows]), y[rows]))
        engine.step()
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    for s in range(STEPS):
        for m in range(GAS):
            k = s * GAS + m
            (_mse(ref(x[k * span : (k + 1) * span]), y[k * span : (k + 1) * span]) / GAS).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
    # plain lists: tensors would travel through shared memory that dies with the rank
    return (
        [p.detach().tolist() for p in model.parameters()],
        [p.detach().tolist() for p in ref.parameters()],
        engine.global_steps,
        engine.global_samples,
    )


@pytest.mark.parametrize("clip", [pytest.param(0.0, marks=pytest.mark.slow), CLIP])
def test_two_ranks_match_single_process_loop(clip: float) -> None:
    import torch

    results = run_distributed(_train_rank, 2, clip, init_process_group=False)
    (w0, ref0, steps0, samples0), (w1, _, _, _) = results
    assert steps0 == STEPS and samples0 == STEPS * MICRO * GAS * 2
    w0, w1, ref0 = ([torch.tensor(t) for t in ws] for ws in (w0, w1, ref0))
    for a, b, r in zip(w0, w1, ref0):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # ranks hold identical replicas
        torch.testing.assert_close(a, r, rtol=2e-6, atol=2e-6)
    assert any(not torch.equal(r, p) for r, p in zip(ref0, [p.detach() for p in _model().parameters()]))


def _shard_indices():
    import torch
    import torch.distributed as dist

    import dscore

    data = torch.utils.data.TensorDataset(torch.arange(22).float().unsqueeze(1))
    engine, _, loader, _ = dscore.initialize(
        model=torch.nn.Linear(1, 1),
        training_data=data,
        config={"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    epochs = []
    for _ in range(2):
        epochs.append([int(v) for (batch,) in loader for v in batch.flatten().tolist()])
    return dist.get_rank(), epochs, len(loader)


def test_training_data_is_sharded_disjointly_and_reshuffled_per_epoch() -> None:
    (_, e0, n0), (_, e1, n1) = run_distributed(_shard_indices, 2, init_process_group=False)
    assert n0 == n1 == 4  # 11 samples per rank in batches of 3
    for epoch in range(2):
        assert set(e0[epoch]).isdisjoint(e1[epoch])
        assert set(e0[epoch]) | set(e1[epoch]) == set(range(22))
    assert e0[0] != e0[1]  # set_epoch reshuffled


def _overflow_on_rank1():
    import torch.distributed as dist

    import dscore

    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "fp16": {"enabled": True},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = dscore.initialize(model=model, config=cfg)
    x, y = _data(2)
    applied = []
    for step in range(3):
        loss = _mse(engine(x[:MICRO].half()), y[:MICRO])
        if step == 0 and dist.get_rank() == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
    return (
        applied,
        engine.skipped_steps,
        engine.get_loss_scale(),
        [p.detach().float().tolist() for p in model.parameters()],
    )


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_all() -> None:
    import torch

    (a0, s0, ls0, w0), (a1, s1, ls1, w1) = run_distributed(_overflow_on_rank1, 2, init_process_group=False)
    assert a0 == a1 == [False, True, True]
    assert s0 == s1 == 1 and ls0 == ls1 == 2.0**15
    for p, q in zip(w0, w1):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=0, atol=0)
