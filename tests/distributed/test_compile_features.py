"""Features under engine.compile() on 2 gloo ranks (issue 41 items 3 and 5): activation checkpointing; rank
functions in compile_feature_runs.py."""

from __future__ import annotations

import compile_feature_runs  # tests/distributed is on sys.path: pytest's prepend import mode
import pytest
import torch

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("backend", "stage"), [("eager", 2), ("aot_eager", 2), ("aot_eager", 3)])
def test_checkpoint_under_engine_compile_matches_plain(backend: str, stage: int) -> None:
    """Dropout blocks: the checkpointed compiled model trains as the plain compiled one under the same seeds
    (losses and weights after 3 steps), with 0 graph breaks and a graph really produced. At ZeRO-3 the blocks
    are compiled regions: the checkpoint's recompute runs the compiled region again, with its gather."""
    results = run_distributed(
        compile_feature_runs.checkpoint_under_engine_compile, 2, backend, stage, init_process_group=False, timeout=300
    )
    for rank, r in enumerate(results):
        plain, ckpt = r["plain"], r["ckpt"]
        assert ckpt["breaks"] == 0 and plain["breaks"] == 0, rank
        assert ckpt["graphs"] >= 1, rank
        assert ckpt["losses"] == pytest.approx(plain["losses"], abs=1e-5), rank
        for a, b in zip(plain["weights"], ckpt["weights"], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert results[0]["ckpt"]["losses"] != results[1]["ckpt"]["losses"]


def test_autotp_ulysses_moe_under_engine_compile() -> None:
    """2 ranks, 3 steps each: AutoTP (tp 2) and Ulysses (sp 2) on a tiny LlamaForCausalLM, a dscore.moe MoE with
    one expert per rank. Compiled losses equal eager within 1e-5 with a graph produced; graph breaks: Ulysses 0
    (its first-forward check keeps its hooks under compile), AutoTP only its one-time same-batch check (run
    eagerly) and the comm facade's data-pointer tests inside the tensor-parallel autograd functions (13 over the
    3 steps' compiles), MoE one per gating call (the capacity without token dropping is a host value agreed over
    the expert group: 1 MoE layer x 2 compiles per step shape, measured 6)."""
    results = run_distributed(compile_feature_runs.features_compiled, 2, "eager", timeout=400)
    for rank, r in enumerate(results):
        for name in ("autotp", "ulysses", "moe"):
            f = r[name]
            assert f["compiled"] == pytest.approx(f["eager"], abs=1e-5), (rank, name)
            assert f["compiled_graphs"] >= 1, (rank, name)
        assert r["ulysses"]["compiled_breaks"] == 0, (rank, r["ulysses"]["compiled_reasons"])
        tp = r["autotp"]
        assert tp["compiled_breaks"] <= 14, (rank, tp["compiled_reasons"])  # 31 while the check was traced
        assert "Data pointer comparison" in tp["compiled_reasons"]
        moe = r["moe"]
        assert moe["compiled_breaks"] == 2 * compile_feature_runs.STEPS, (rank, moe["compiled_reasons"])
        assert all("disable" in reason for reason in moe["compiled_reasons"]), (rank, moe["compiled_reasons"])
