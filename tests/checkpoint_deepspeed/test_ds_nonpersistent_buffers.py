"""Issue 38 item 1 (c): a DeepSpeed 0.19.8 ZeRO-3 fp32 checkpoint saved by 2 ranks of a model with a
non-persistent buffer (``data/rotary_z3_ws2``: a rotary block whose ``rope.inv_freq`` is registered with
``persistent=False`` and used in forward, as a Llama's ``rotary_emb.inv_freq``, beside a persistent
``rope.running_amp``) loads in dscore at ZeRO-3 on 2 ranks and on 1, and steps 4 and 5 of the fixture's data
rule reproduce DeepSpeed's own parameters (``at_end``, fp32 ~1e-6). DeepSpeed saves no ``inv_freq`` (its
``buffer_names`` lists only ``rope.running_amp``): the module's own values must be kept. Needs only the
committed data (not ``../shared``)."""

from __future__ import annotations

import ds_fixture_helpers as H
import pytest
from test_ds_resume import _check

from dscore.testing import run_distributed

PATH = str(H.DATA / "rotary_z3_ws2")


@pytest.mark.slow
@pytest.mark.parametrize(("ws", "stage"), [(2, 3), (1, 3)])
def test_zero3_checkpoint_with_nonpersistent_buffer(ws: int, stage: int) -> None:
    exp = H.expected(PATH)
    assert exp["world_size"] == 2 and exp["zero_stage"] == 3 and exp["model"] == "rotary"
    assert "rope.inv_freq" not in exp["at_save"]["params"] and "rope.running_amp" in exp["at_save"]["params"]
    jobs = [(PATH, stage)]
    results = run_distributed(H.resume_worker, ws, jobs, timeout=600)
    _check(results[0], jobs, ws)
