"""NVMeParamSwapper (plugins/dscore_plugins/zero/nvme_params.py) on real FlatUnits of one rank: partitions
in swap files, made resident by the units' own hook, an LRU bound (max_in_cpu), read-ahead, write-back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dscore.comm import Comm
from dscore.errors import ConfigError, DscoreError
from dscore.zero.partition import FlatUnit

pytestmark = pytest.mark.slow


def _units() -> tuple[list[FlatUnit], list[list[torch.Tensor]]]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(40, 50), torch.nn.Linear(50, 30), torch.nn.Linear(30, 7)]
    units, values = [], []
    for lin in layers:
        vals = [lin.weight.detach().clone(), lin.bias.detach().clone()]
        u = FlatUnit([lin.weight, lin.bias], Comm(None), dtype=torch.float32, device=torch.device("cpu"))
        u.load_full(vals)
        u.release()
        units.append(u)
        values.append(vals)
    return units, values


def test_partitions_live_in_swap_and_come_back_through_the_unit_hook(aio_op, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from dscore_plugins.zero.nvme_params import NVMeParamSwapper

    units, values = _units()
    sw = NVMeParamSwapper(units, folder=tmp_path, run_id="p1", buffer_count=2, buffer_size=4000, max_in_cpu=1600)
    try:
        assert all(u.partition.numel() == 0 for u in units) and sw.resident_elements() == 0
        for u, vals in zip(units, values):  # gather reads each partition back from its file
            u.gather()
            assert all(torch.equal(a, b) for a, b in zip(u.full_values(), vals))
            u.release()
        assert sw.resident_elements() <= 1600  # 2050 + 1530 + 217 elements: LRU eviction kept the bound
        assert units[0].partition.numel() == 0  # evicted
        sw.prefetch(units)
        assert sw.swap.is_prefetched("unit000000")
        # a modification under write_back survives eviction (written back because dirty)
        units[0].gather()
        units[0].full_values()[0].fill_(2.5)
        units[0].write_back()
        units[0].release()
        for u in units[1:]:
            u.gather()
            u.release()
        assert units[0].partition.numel() == 0
        units[0].gather()
        assert torch.equal(units[0].full_values()[0], torch.full((50, 40), 2.5))
        units[0].release()
        # the optimizer's new values: evicted units written straight to the file, partly covered ones patched
        offsets = [0, units[0].chunk, units[0].chunk + units[1].chunk]
        total = offsets[-1] + units[2].chunk
        new = torch.arange(total, dtype=torch.float32)
        sw.write_range(units, offsets, 0, new)
        sw.write_range(units, offsets, offsets[1] - 5, torch.full((10,), -1.0))
        got = torch.cat([sw.read(u) for u in units])
        want = new.clone()
        want[offsets[1] - 5 : offsets[1] + 5] = -1.0
        assert torch.equal(got, want)
    finally:
        folder = sw.folder
        sw.close()
    assert not folder.exists()
    evicted = next(u for u in units if u.partition.numel() == 0)
    with pytest.raises(DscoreError, match="closed NVMe swap folder"):
        evicted.gather()


def test_a_partition_larger_than_buffer_size_is_refused(aio_op, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from dscore_plugins.zero.nvme_params import NVMeParamSwapper

    units, _ = _units()
    with pytest.raises(ConfigError, match=r"offload_param.buffer_size = 1000 .* at least 2050"):
        NVMeParamSwapper(units, folder=tmp_path, buffer_size=1000)
    assert list(tmp_path.iterdir()) == []
