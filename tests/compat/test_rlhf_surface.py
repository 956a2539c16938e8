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


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_openrlhf_offloads_states_through_engine_optimizer(stage: int) -> None:
    """``engine.optimizer.offload_states`` / ``reload_states`` (DeepSpeed's ZeRO optimizers' methods, with
    ``OffloadStateTypeEnum`` members) are the engine's: the kinds asked for leave the device (no byte of
    their storages left), the engine refuses forward and step until a reload (the engine's or the
    optimizer's), bad devices and kinds are refused by name, and training afterwards equals an engine that
    never offloaded, bit for bit."""
    results = run_distributed(rlhf_jobs.openrlhf_offload_job, 2, stage, timeout=300)
    for r in results:
        assert r["optimizer_is_engines"]
        first = r["first"]
        assert {"optim_states", "hp_params"} <= set(first["offloaded"]) and "lp_params" not in first["offloaded"]
        assert first["bytes"]["optim_states"] > 0 and first["bytes"]["hp_params"] > 0
        assert first["left"] == 0
        assert "engine.forward()" in first["forward"] and "reload_states() first" in first["forward"]
        assert "engine.step()" in first["step"]
        second = r["second"]
        assert {"optim_states", "hp_params", "lp_params"} <= set(second["offloaded"]) and second["left"] == 0
        assert "NVMe" in second["nvme"]
        assert "unknown state type(s) ['optim_state']" in second["unknown"]
        assert r["reloaded"] == []
        assert r["same"] and r["trained"]
