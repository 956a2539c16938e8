"""Issue 15 conformance matrix: every way a DeepSpeed user builds the optimizer trains like plain PyTorch.

Factors (see ``conformance_matrix.FACTORS``): ZeRO stage 0-3 x optimizer offload (none/cpu) x precision
(fp32/bf16) x optimizer source (config / client from ``model.parameters()`` / client with per-group
dicts, with and without ``model_parameters``, a callable) x group shape (single, per-group lr/wd/betas,
empty group, frozen group, one-element group, zero-size parameter, tied weights) x scheduler (none /
config / client). The full product is 2352 combinations (2058 valid: offload needs stage 1-3). A
pairwise covering array (every pair of factor values in some case) plus the issue's failing inputs is
run instead, all cases in ONE 2-rank gloo job (one process pair runs the whole list), and each case is
compared with a single-process PyTorch reference after 3 optimizer steps of 2 micro-batches each, with
gradient clipping: parameters (fp32 1e-6, bf16 1e-2), Adam step counts, the lr of every group after
every step, bit-exact ranks, and parameters that must not move (lr 0, frozen) bit-exactly unmoved.
"""

from __future__ import annotations

from typing import Any

import conformance_matrix as cm
import pytest

from dscore.testing import run_distributed

CASES = cm.all_cases()
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
BF16_TOL = dict(rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def matrix_results() -> list[list[Any]]:
    """Every case run once, on 2 ranks, in one job: ``results[rank][case_index]``."""
    return run_distributed(cm.run_cases, cm.WORLD, CASES, timeout=600)


def test_matrix_covers_every_pair_and_the_issue_inputs() -> None:
    import itertools

    names = list(cm.FACTORS)
    for a, b in itertools.combinations(names, 2):
        for va in cm.FACTORS[a]:
            for vb in cm.FACTORS[b]:
                if cm.allowed({a: va, b: vb}):
                    assert any(c[a] == va and c[b] == vb for c in CASES), (a, va, b, vb)
    for c in cm.ISSUE_CASES:
        assert c in CASES
    assert all(cm.allowed(c) for c in CASES)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[cm.case_id(c) for c in CASES])
def test_case_matches_pytorch(matrix_results: list[list[Any]], index: int) -> None:
    import torch

    case = CASES[index]
    ref = cm.reference(case)
    tol = BF16_TOL if case["precision"] == "bf16" else FP32_TOL
    results = [matrix_results[r][index] for r in range(cm.WORLD)]
    for rank, res in enumerate(results):
        assert not isinstance(res, str), f"rank {rank} failed on {case}:\n{res}"
    results = [{**res, "params": {k: torch.from_numpy(v) for k, v in res["params"].items()}} for res in results]
    first = results[0]
    for rank, res in enumerate(results):
        # ranks agree exactly
        for name, value in res["params"].items():
            assert torch.equal(value, first["params"][name]), f"rank {rank} disagrees on {name}"
        assert res["global_steps"] == cm.STEPS
        assert res["steps"] == ref["steps"] == [cm.STEPS], (res["steps"], ref["steps"])
        assert res["n_groups"] == ref["n_groups"]
        assert len(res["lrs"]) == cm.STEPS
        for got, want in zip(res["lrs"], ref["lrs"]):
            assert got == pytest.approx(want, rel=1e-12, abs=0.0)
    assert set(first["params"]) == set(ref["params"])
    initial = {k: v.detach().float() for k, v in cm.make_model(case["shape"]).state_dict().items()}
    for name, want in ref["params"].items():
        got = first["params"][name]
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{n}: {m}")
        if torch.equal(want, initial[name].to(want.dtype)):
            # an lr=0 group or a frozen parameter must not move at all, whatever the precision
            assert torch.equal(got, want), f"{name} moved but must not"
