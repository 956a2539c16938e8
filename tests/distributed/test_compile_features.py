"""Features under engine.compile() on 2 gloo ranks (issue 41 items 3 and 5): activation checkpointing; rank
functions in compile_ckpt_runs.py."""

from __future__ import annotations

import compile_ckpt_runs  # tests/distributed is on sys.path: pytest's prepend import mode
import pytest
import torch

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpoint_under_engine_compile_matches_plain(backend: str) -> None:
    """ZeRO 2, dropout blocks: the checkpointed compiled model trains as the plain compiled one under the same
    seeds (losses and weights after 3 steps), with 0 graph breaks and a graph really produced."""
    results = run_distributed(
        compile_ckpt_runs.checkpoint_under_engine_compile, 2, backend, 2, init_process_group=False, timeout=300
    )
    for rank, r in enumerate(results):
        plain, ckpt = r["plain"], r["ckpt"]
        assert ckpt["breaks"] == 0 and plain["breaks"] == 0, rank
        assert ckpt["graphs"] >= 1, rank
        assert ckpt["losses"] == pytest.approx(plain["losses"], abs=1e-5), rank
        for a, b in zip(plain["weights"], ckpt["weights"], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert results[0]["ckpt"]["losses"] != results[1]["ckpt"]["losses"]
