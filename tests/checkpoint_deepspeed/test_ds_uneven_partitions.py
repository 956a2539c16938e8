"""Issue 29 item 6: a DeepSpeed 0.19.8 ZeRO-2 fp32 checkpoint saved by 3 ranks (``data/z2_fp32_ws3``: the
fixture MLP with a LayerNorm, 244 parameters, so partition boundaries fall inside parameters and the ranks'
shares differ) loads in dscore at world size 3 stage 2 and at world size 1 stage 3, and steps 4 and 5 of
the fixture's data rule reproduce DeepSpeed's own parameters (``at_end``, fp32 ~1e-6). Needs only the
committed data (not ``../shared``)."""

from __future__ import annotations

import ds_fixture_helpers as H
import pytest
from test_ds_resume import _check

from dscore.testing import run_distributed

PATH = str(H.DATA / "z2_fp32_ws3")


@pytest.mark.slow
@pytest.mark.parametrize(("ws", "stage"), [(3, 2), (1, 3)])
def test_uneven_zero2_checkpoint_of_3_ranks(ws: int, stage: int) -> None:
    assert H.expected(PATH)["world_size"] == 3 and H.expected(PATH)["zero_stage"] == 2
    jobs = [(PATH, stage)]
    results = run_distributed(H.resume_worker, ws, jobs, timeout=600)
    _check(results[0], jobs, ws)
