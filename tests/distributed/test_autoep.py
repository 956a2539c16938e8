"""AutoEP (``expert_parallel``) on two real gloo ranks with ``autoep_size`` 2 and 4 experts (2 per rank):
tiny random Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and DeepSeek-V2 models trained through
``dscore.initialize`` equal the unmodified Hugging Face model in one process within 1e-5: logits and router
logits (vs the concatenated batch), the auxiliary loss and loss HF computes on the rank's batch (and HF's
loss function over every rank's router logits equals the concatenated batch's aux loss), gradients
(ZeRO 0) and weights after 3 SGD steps (ZeRO 0, 1, 2; one run with gradient clipping; ZeRO 3 with every
parameter partitioned, its weights seen through the logits of one more forward); a checkpoint saved at
``autoep_size`` 2 loads at 1 and keeps training equal. All scenarios share one spawn of the ranks."""

from __future__ import annotations

import autoep_runs
import pytest

from dscore.testing import run_distributed

pytest.importorskip("transformers")

TOL = 1e-5


@pytest.mark.slow
def test_autoep_equals_the_hugging_face_model(tmp_path) -> None:
    results = run_distributed(autoep_runs.two_ranks, 2, str(tmp_path), timeout=600)
    for rank, res in enumerate(results):
        for scenario, worst in res.items():
            for what, value in worst.items():
                assert value <= TOL, f"rank {rank} {scenario}: {what} differs by {value:.3g}"
