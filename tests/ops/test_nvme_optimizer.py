"""NVMeOptimizerSwapper (plugins/dscore_plugins/zero/nvme_optimizer.py) on its own: optimizer state and
fp32 masters in swap files, stepped sub-group by sub-group, against the same optimizer in memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dscore.errors import ConfigError, DscoreError

pytestmark = pytest.mark.slow

SIZES = [50_000, 16_384, 7, 40_001]  # several sub-groups of 16384, an exact one, a tiny one


def _pair(kind: str, cpu_ops):  # type: ignore[no-untyped-def]
    """Two identical optimizers over identical masters (two groups with different lr)."""
    g = torch.Generator().manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]
    dut = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    for p in ref + dut:
        p.grad = torch.zeros(p.numel())

    def make(ps):  # type: ignore[no-untyped-def]
        groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.01}]
        if kind == "cpu_adam":
            from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

            return DscoreCPUAdam(groups, lr=1e-3, weight_decay=0.01)
        return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, foreach=False)

    return ref, make(ref), dut, make(dut)


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g) for n in SIZES]


def _step_both(ref, o_ref, dut, sw, step: int) -> None:  # type: ignore[no-untyped-def]
    for a, b, gr in zip(ref, dut, _grads(step)):
        a.grad.copy_(gr)
        b.grad.copy_(gr)
    o_ref.step()
    sw.step()


@pytest.mark.parametrize(
    ("kind", "pipeline", "buffers"),
    [("cpu_adam", True, 3), ("cpu_adam", False, 1), ("torch_adamw", True, 8)],
)
def test_chunked_swapped_steps_equal_in_memory_steps(cpu_ops, aio_op, tmp_path: Path, kind: str, pipeline: bool,
                                                     buffers: int) -> None:  # type: ignore[no-untyped-def]
    from dscore_plugins.zero.nvme_optimizer import NVMeOptimizerSwapper

    ref, o_ref, dut, o_dut = _pair(kind, cpu_ops)
    targets = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
    sw = NVMeOptimizerSwapper(o_dut, dut, folder=tmp_path, targets=targets, sub_group_size=10_000,
                              buffer_count=buffers, pipeline_read=pipeline, pipeline_write=pipeline, run_id="u1")
    try:
        assert sw.sub_group_size == 16_384  # rounded up to the alignment
        assert len(sw.chunks) == 4 + 1 + 1 + 3
        for step in range(4):
            _step_both(ref, o_ref, dut, sw, step)
            # between steps nothing of the state is in memory
            assert all(p.numel() == 0 for p in dut) and len(o_dut.state) == 0
        for a, t in zip(ref, targets):
            assert torch.equal(a.detach().to(torch.bfloat16), t)
        assert sw.bytes_on_disk() == 3 * 4 * sum(SIZES)  # master + exp_avg + exp_avg_sq, fp32
        with sw.materialized():
            for a, b in zip(ref, dut):
                assert torch.equal(a.data, b.data)
                assert set(o_ref.state[a]) == set(o_dut.state[b])
                for k, v in o_ref.state[a].items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(o_dut.state[b][k])), k
        assert all(p.numel() == 0 for p in dut) and len(o_dut.state) == 0
    finally:
        folder = sw.folder
        sw.close()
    assert not folder.exists() and not folder.parent.exists()


def test_load_through_materialized_writes_back_and_training_continues(cpu_ops, aio_op, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from dscore_plugins.zero.nvme_optimizer import NVMeOptimizerSwapper, swapper_for

    ref, o_ref, dut, o_dut = _pair("cpu_adam", cpu_ops)
    for step in range(2):  # the reference moves ahead; the swapped optimizer is fresh
        for a, gr in zip(ref, _grads(step)):
            a.grad.copy_(gr)
        o_ref.step()
    with NVMeOptimizerSwapper(o_dut, dut, folder=tmp_path, sub_group_size=16_384, pipeline_read=True,
                              run_id="u2") as sw:
        assert swapper_for(o_dut) is sw
        saved = o_ref.state_dict()
        with sw.materialized(write_back=True):
            for a, b in zip(ref, dut):
                b.data.copy_(a.data)
            o_dut.load_state_dict(saved)
        for step in range(2, 4):
            _step_both(ref, o_ref, dut, sw, step)
        with sw.materialized():
            for a, b in zip(ref, dut):
                assert torch.equal(a.data, b.data)
                assert torch.equal(o_ref.state[a]["exp_avg_sq"], o_dut.state[b]["exp_avg_sq"])
                assert float(o_dut.state[b]["step"]) == 4.0
        # the optimizer's own state_dict / load_state_dict see the full state (read from / written to swap)
        sd_ref, sd_dut = o_ref.state_dict(), o_dut.state_dict()
        assert len(o_dut.state) == 0 and all(p.numel() == 0 for p in dut)
        assert sd_ref["state"].keys() == sd_dut["state"].keys()
        for i, entry in sd_ref["state"].items():
            assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(sd_dut["state"][i][k])) for k, v in entry.items())
        zeroed = {**sd_ref, "state": {i: {k: (torch.zeros_like(v) if k == "exp_avg" else v) for k, v in e.items()}
                                      for i, e in sd_ref["state"].items()}}
        o_dut.load_state_dict(zeroed)
        with sw.materialized():
            assert all(torch.equal(o_dut.state[b]["exp_avg"], torch.zeros_like(b.data)) for b in dut)
        o_dut.load_state_dict(sd_ref)
        # weights changed outside the optimizer land in swap
        sw.update_slice(0, 16_000, torch.full((1000,), 3.0))
        with sw.materialized():
            assert torch.equal(dut[0].data[16_000:17_000], torch.full((1000,), 3.0))
            assert torch.equal(dut[0].data[:16_000], ref[0].data[:16_000])
        # a block that raises writes nothing back
        with pytest.raises(RuntimeError, match="boom"), sw.materialized(write_back=True):
            dut[1].data.zero_()
            raise RuntimeError("boom")
        with sw.materialized():
            assert torch.equal(dut[1].data, ref[1].data)
    assert swapper_for(o_dut) is None
    with pytest.raises(DscoreError, match="closed"):
        sw.step()


def test_bad_masters_and_paths_are_refused(aio_op, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from dscore_plugins.zero.nvme_optimizer import NVMeOptimizerSwapper, check_nvme_path

    p = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(DscoreError, match="1-D contiguous fp32 CPU"):
        NVMeOptimizerSwapper(opt, [p], folder=tmp_path)
    q = torch.nn.Parameter(torch.zeros(10))
    with pytest.raises(DscoreError, match="not a parameter of the optimizer"):
        NVMeOptimizerSwapper(opt, [q], folder=tmp_path)
    assert list(tmp_path.iterdir()) == []
    key = "zero_optimization.offload_optimizer.nvme_path"
    with pytest.raises(ConfigError, match=f"{key} is required"):
        check_nvme_path(None, key)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=f"{key} = .*a_file/swap.* cannot hold swap files"):
        check_nvme_path(blocker / "swap", key)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(ConfigError, match="Permission denied"):
                check_nvme_path(ro, key)
        finally:
            ro.chmod(0o700)
    assert check_nvme_path(tmp_path / "new" / "deep", key).is_dir()
