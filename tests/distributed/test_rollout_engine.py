"""The rollout API through the engine (issue 40 item 2) on 2 gloo ranks: ``HybridEngineRollout`` over a ZeRO
engine generates what the single-process model's ``generate`` gives, before and after a training step, with
``n_samples_per_prompt`` and ``continuous_batch_size``. Rank functions: hybrid_runs.py."""

from __future__ import annotations

import hybrid_runs  # tests/distributed is on sys.path: pytest's prepend import mode
import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 3, "stage3_param_persistence_threshold": 0}])
def test_rollout_through_the_engine_equals_single_process_generate(zero: dict) -> None:
    for rank, res in enumerate(run_distributed(hybrid_runs.rollout_generate, 2, zero, timeout=300)):
        for phase in ("before", "after"):
            r = res[phase]
            assert r["got"] == r["want"], (rank, phase)
            assert r["start"] == [6] * 4
            for cont, alone, m in zip(r["cont"], r["alone"], r["cont_mask"]):
                if 36 in alone:
                    alone = alone[: alone.index(36) + 1]
                assert cont[: len(alone)] == alone and sum(m) == len(alone), (rank, phase)
