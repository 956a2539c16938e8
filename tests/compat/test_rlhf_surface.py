"""What RLHF libraries (TRL, OpenRLHF) call on a DeepSpeed ZeRO-3 model, on dscore through ``import deepspeed``
(issue 40 item 3). 2 gloo ranks on CPU; jobs in rlhf_jobs.py."""

from __future__ import annotations

import deepspeed
import pytest
import rlhf_jobs  # tests/compat is on sys.path: pytest's prepend import mode

from dscore.testing import run_distributed

assert getattr(deepspeed, "__dscore__", False), f"`deepspeed` at {deepspeed.__file__} is not dscore's layer"

pytestmark = pytest.mark.slow


def test_trl_unwrap_model_for_generation_on_an_accelerate_zero3_llama() -> None:
    """TRL 1.16's ``unwrap_model_for_generation`` (``remove_hooks``/``add_hooks`` on
    ``engine.optimizer.parameter_offload``) works unchanged: inside it the hooks are gone and the model is
    gathered, greedy generation equals the single-process model with the same weights, and afterwards the
    hooks are back, the parameters released, and training continues with the reference's losses."""
    results = run_distributed(rlhf_jobs.trl_generation_job, 2, timeout=300, init_process_group=False)
    for r in results:
        assert r["generated"] == r["ref_generated"]
        before, inside, after = r["hooks"]
        assert before > 0 and inside == 0 and after == before
        assert r["status"] == (True, True)
        assert r["invalid_trace_after"]  # add_hooks invalidated the trace: the next forward re-records it
        assert r["valid_trace_after_training"]  # ... and the next backward adopted the re-recorded order
        assert len(r["losses"]) == 3
        for loss, ref in r["losses"]:
            assert loss == pytest.approx(ref, abs=2e-5)
    assert results[0]["losses"] == results[1]["losses"]
