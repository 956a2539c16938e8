"""DeepSpeed 0.19.8 checkpoints resume in dscore at world size 1 and 2 and every ZeRO stage.

Each fixture is loaded at both world sizes, each time at another ZeRO stage than saved where possible
(:data:`PLAN`: every stage 0-3 for each dtype), and steps 4 and 5 of the fixture's data rule must
reproduce DeepSpeed's own ``at_end`` parameters (fp32 ~1e-6; bf16 within bf16 rounding). Loads are
batched: one process group per world size runs every job.
"""

from __future__ import annotations

import math
import os

import ds_fixture_helpers as H
import pytest

from dscore.testing import run_distributed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not H.FIXTURES.is_dir(), reason=f"DeepSpeed fixtures not found at {H.FIXTURES}"),
]

NAMES = H.fixture_names()


#: ZeRO stage to load each shared fixture at, per world size: each fixture meets two stages (never only its
#: own), and per dtype every stage 0-3 is met at each world size. Unknown (new) fixtures get stages 3 then 1.
PLAN = {
    "z0_fp32_ws1": {1: 3, 2: 1},
    "z1_fp32_ws2": {1: 2, 2: 0},
    "z2_fp32_ws2": {1: 1, 2: 3},
    "z3_fp32_ws2": {1: 0, 2: 2},
    "z2_bf16_ws2": {1: 0, 2: 3},
    "z3_bf16_ws1": {1: 1, 2: 2},
}
#: The committed extra layouts (``data/``): tied weights at ZeRO 2, stage-0 bf16, ZeRO 3 with groups/frozen/BN,
#: ZeRO 3 with a non-persistent buffer, ZeRO 2 saved by 3 ranks (uneven partitions; its global batch of 12 does not split over 2 ranks: None).
EXTRA_PLAN: dict[str, dict[int, int | None]] = {
    "tied_z2_ws2": {1: 3, 2: 0},
    "z0_bf16_ws1": {1: 2, 2: 3},
    "z3_groups_frozen_bn_ws2": {1: 1, 2: 0},
    "z2_fp32_ws3": {1: 1, 2: None},  # stage 3 at ws 1 and stage 2 at ws 3: test_ds_uneven_partitions.py
    "rotary_z3_ws2": {1: 1, 2: 0},  # stage 3 at ws 2 and 1: test_ds_nonpersistent_buffers.py
}


def _jobs(ws: int) -> list[tuple[str, int]]:
    jobs = [(str(H.FIXTURES / name), PLAN.get(name, {1: 3, 2: 1})[ws]) for name in NAMES]
    for path in H.extra_paths():
        stage = EXTRA_PLAN.get(os.path.basename(path), {1: 3, 2: 1})[ws]
        if stage is not None:
            jobs.append((path, stage))
    return jobs


def _check(results: list[dict], jobs: list[tuple], ws: int) -> None:
    assert len(results) == len(jobs)
    failures = []
    for r, job in zip(results, jobs):
        exp = H.expected(job[0])
        restored = r["restored"]
        assert restored["client"] == exp["client_state"], r["fixture"]
        assert restored["global_steps"] == exp["at_save"]["global_steps"], r["fixture"]
        assert restored["global_samples"] == exp["at_save"]["global_steps"] * H.MICRO * exp["world_size"]
        assert restored["skipped_steps"] == 0
        assert restored["lr_after_load"] == pytest.approx(exp["at_save"]["lr"]), r["fixture"]
        assert r["global_steps_end"] == exp["at_end"]["global_steps"]
        assert r["lr_end"] == pytest.approx(exp["at_end"]["lr"])
        tol = 1e-6 if r["dtype"] == "fp32" else 1e-2  # bf16: ~2 units in the last place at |w| ~ 1
        worst = max(r["errors"].values())
        if not math.isfinite(worst) or worst > tol:
            failures.append(f"{job} stage {r['stage']} ws {ws}: max |diff| {worst:.3g} > {tol} ({r['errors']})")
    assert not failures, "\n".join(failures)


def test_fixture_coverage_plan() -> None:
    """Every fixture at both world sizes and two stages; fp32 meets every stage at each world size, bf16
    every stage over the two."""
    assert len(NAMES) >= 6 and set(PLAN) <= set(NAMES)
    for plan in PLAN.values():
        assert plan[1] != plan[2]
    for dtype in ("fp32", "bf16"):
        for ws in (1, 2):
            stages = {
                s for n, plan in PLAN.items() if H.expected(str(H.FIXTURES / n))["dtype"] == dtype for s in [plan[ws]]
            }
            if dtype == "fp32":
                assert stages == {0, 1, 2, 3}, (dtype, ws, stages)
        both = {
            plan[w] for n, plan in PLAN.items() if H.expected(str(H.FIXTURES / n))["dtype"] == dtype for w in (1, 2)
        }
        assert both == {0, 1, 2, 3}, (dtype, both)


@pytest.mark.parametrize("ws", [1, 2])
def test_resume_matches_deepspeed(ws: int, tmp_path) -> None:
    """Load, train steps 4-5, match DeepSpeed. At ws 1 the run also loads three checkpoints converted by
    `dscore checkpoint import` (dscore's own pickle-free format) at yet other stages."""
    jobs: list[tuple] = list(_jobs(ws))
    if ws == 1:
        from dscore.checkpoint.deepspeed import import_checkpoint

        for name, stage in (("z3_fp32_ws2", 1), ("z2_bf16_ws2", 3), ("z0_fp32_ws1", 2)):
            out = tmp_path / name
            import_checkpoint(str(H.FIXTURES / name), str(out))
            files = os.listdir(out / "global_step3")
            assert "_COMPLETE" in files and not any(f.endswith(".pt") for f in files), files
            jobs.append((str(H.FIXTURES / name), str(out), stage))
    results = run_distributed(H.resume_worker, ws, jobs, timeout=600)
    _check(results[0], jobs, ws)

