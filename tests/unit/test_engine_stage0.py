"""Stage 0 in isolation: flat gradient buffers, bucketed reduction and averaging, master weights.

A fake two-rank comm stands in for torch.distributed: its all-reduce adds a second rank's copy of the
gradient (here: the same values, as if both ranks saw the same data), so averaging must give back the
single-rank gradient exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dscore.comm import Comm
from dscore.config.load import load_config
from dscore.protocols.zero import ZeroStageContext
from dscore.runtime.dataloader import DscoreDataLoader
from dscore_plugins.precision.config import Bf16Config
from dscore_plugins.precision.precision import Bf16Mode, Fp32Mode
from dscore_plugins.zero.stage0 import Stage0


class FakeComm:
    """World of ``world`` identical ranks: all_reduce(sum) multiplies by ``world``."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.calls: list[int] = []

    def get_world_size(self) -> int:
        return self.world

    def get_rank(self) -> int:
        return 0

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self.world

    def gloo_fast(self) -> bool:
        return False

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        assert op == "sum"
        self.calls.append(tensor.numel())
        tensor.mul_(self.world)
        return SimpleNamespace(wait=lambda: True) if async_op else None


def _config(**kw):
    """A validated config (the real models, so defaults are the models' own)."""
    base = {
        "train_batch_size": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": kw.pop("bucket", 500_000_000)},
    }
    base.update(kw)
    return load_config(base)


def _stage(model, *, comm=None, precision=None, **cfg):
    config = _config(**cfg)
    ctx = ZeroStageContext(
        module=model,
        param_groups=[{"params": [p for p in model.parameters() if p.requires_grad]}],
        client_optimizer=None,
        optimizer_factory=lambda groups: torch.optim.SGD(groups, lr=1.0),
        config=config,
        section=config.section("zero_optimization"),
        runtime=SimpleNamespace(accelerator=None),
        comm=comm if comm is not None else Comm(None),
        precision=precision or Fp32Mode(),
        loss_scaler=None,
    )
    return Stage0(ctx)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))


def test_grads_are_views_of_one_flat_buffer_and_survive_zero_grad() -> None:
    model = _model()
    stage = _stage(model)
    assert len(stage.groups) == 1
    flat = stage.groups[0].grad
    for p in model.parameters():
        assert p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    model(torch.randn(3, 5)).sum().backward()
    assert flat.abs().sum() > 0
    stage.optimizer.zero_grad()  # the optimizer's zero_grad keeps the views
    assert flat.abs().sum() == 0
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    ("op", "prescale", "factor", "bucket", "expected_calls"),
    [("mean", False, 1.0, 10**9, 1), ("mean", True, 2.0, 20, 3), ("sum", False, 1.0, 50, 2)],
)
def test_reduction_buckets_and_averaging(op, prescale, factor, bucket, expected_calls) -> None:
    x = torch.randn(4, 5)
    single = _model()
    single(x).pow(2).mean().backward()
    expected = [p.grad.clone() for p in single.parameters()]

    model = _model()
    comm = FakeComm(world=2)
    stage = _stage(
        model,
        comm=comm,
        gradient_allreduce_op=op,
        prescale_gradients=prescale,
        gradient_predivide_factor=factor,
        bucket=bucket,
    )
    stage.backward(model(x).pow(2).mean(), boundary=True)
    numel = sum(p.numel() for p in model.parameters())
    assert len(comm.calls) == expected_calls and sum(comm.calls) == numel
    scale = 2.0 if op == "sum" else 1.0
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e * scale)


def test_no_reduction_off_boundary_or_without_sync_then_step_reduces() -> None:
    model = _model()
    comm = FakeComm(world=2)
    stage = _stage(model, comm=comm)
    stage.backward(model(torch.randn(2, 5)).sum(), boundary=False)
    stage.backward(model(torch.randn(2, 5)).sum(), boundary=True, sync=False)
    assert comm.calls == []
    outcome = stage.step()
    assert outcome.applied and len(comm.calls) == 1


def test_bf16_master_weights_are_fp32_and_copied_back() -> None:
    model = _model().to(torch.bfloat16)
    stage = _stage(model, precision=Bf16Mode(Bf16Config(enabled=True)), gradient_clipping=0.0)
    masters = [p for g in stage.optimizer.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    before = [m.detach().clone() for m in masters]
    stage.backward(model(torch.randn(3, 5, dtype=torch.bfloat16)).float().sum(), boundary=True)
    assert stage.step().applied
    for p, m, b in zip(model.parameters(), masters, before):
        assert not torch.equal(m, b)
        torch.testing.assert_close(p.detach(), m.detach().to(torch.bfloat16))


def test_bf16_nonfinite_gradient_skips_the_step() -> None:
    model = _model().to(torch.bfloat16)
    stage = _stage(model, precision=Bf16Mode(Bf16Config(enabled=True, check_grad_overflow=True)))
    before = [p.detach().clone() for p in model.parameters()]
    stage.backward(model(torch.randn(3, 5, dtype=torch.bfloat16)).float().sum() * float("inf"), boundary=True)
    outcome = stage.step()
    assert not outcome.applied and outcome.overflow
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    assert all(p.grad.abs().sum() == 0 for p in model.parameters())


def test_dataloader_shards_for_two_ranks_in_process() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(9))
    loaders = [DscoreDataLoader(data, batch_size=2, dp_world_size=2, dp_rank=r) for r in range(2)]
    seen = [[int(v) for (b,) in loader for v in b] for loader in loaders]
    # 9 samples: the sampler pads to 10 by repeating one, so each rank gets 5 and one index appears twice
    assert len(seen[0]) == len(seen[1]) == 5
    assert len(set(seen[0]) & set(seen[1])) <= 1
    assert set(seen[0]) | set(seen[1]) == set(range(9))
    assert [len(loader) for loader in loaders] == [3, 3]
