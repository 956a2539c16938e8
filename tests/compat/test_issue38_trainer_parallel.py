"""Issue 38 item 6: the unchanged Hugging Face Trainer with AutoTP (ZeRO 1 and 2) and with Accelerate's
Ulysses mpu (``deepspeed.initialize(mpu=...)`` as Accelerate calls it) on dscore, 2 gloo ranks (jobs in
parallel_jobs.py).

Both used to be refused by the batch triangle: the Trainer fills ``train_batch_size`` as processes x micro x
accumulation, which DeepSpeed 0.19.8 checks against ``dist.get_world_size()`` under AutoTP (tensor-parallel
ranks count) and against ``mpu.get_data_parallel_world_size()`` when Accelerate passes an mpu (Ulysses).
"""

from __future__ import annotations

import deepspeed
import parallel_jobs  # tests/compat is on sys.path: pytest's prepend import mode
import pytest

from dscore.testing import run_distributed

assert getattr(deepspeed, "__dscore__", False), f"`deepspeed` at {deepspeed.__file__} is not dscore's layer"

pytestmark = pytest.mark.slow


def test_trainer_with_autotp_trains_at_zero1_and_zero2(tmp_path) -> None:
    results = run_distributed(parallel_jobs.trainer_autotp_job, 2, str(tmp_path), timeout=600,
                              init_process_group=False)
    for stage in (1, 2):
        r0, r1 = results[0][stage], results[1][stage]
        assert r0["engine"] == "DscoreEngine" and r0["mesh"] == (1, 1, 2)
        # DeepSpeed's numbers: train_batch_size counts both tensor-parallel ranks (2 processes x 2 x 1)
        assert r0["batch"] == (4, 2, 1)
        assert sorted(r0["losses"]) == [1, 2, 3] and all(3.0 < x < 5.0 for x in r0["losses"].values())
        assert r1["losses"] == r0["losses"]  # one data-parallel rank: both tensor-parallel ranks saw the same
    assert results[0][1]["losses"] == pytest.approx(results[0][2]["losses"], abs=1e-5)


def test_initialize_takes_the_batch_world_size_and_sp_degree_from_the_mpu() -> None:
    """The call Accelerate's Ulysses ``ParallelismConfig`` makes; the whole Trainer run is the next test."""
    results = run_distributed(parallel_jobs.initialize_with_ulysses_mpu_job, 2, timeout=300)
    for r in results:
        assert r == {"batch": (2, 2, 1), "mesh_is_mpu": True, "sequence_parallel_size": 2, "dp_world_size": 1}


def test_trainer_with_accelerate_ulysses_trains_as_one_process(tmp_path) -> None:
    """The unchanged Trainer with ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)`` on 2 processes
    (sp 2, one data-parallel rank): Accelerate's loader gives the two ranks different batches, the adapter
    gathers them and both ranks train rank 0's, then rank 1's (``len`` doubled, as the Trainer assumes), so
    the losses equal one process's over the same shuffled samples (it used to refuse: "different batches")."""
    reference = run_distributed(parallel_jobs.trainer_ulysses_job, 1, str(tmp_path / "ref"), 1,
                                timeout=300, init_process_group=False)[0]
    results = run_distributed(parallel_jobs.trainer_ulysses_job, 2, str(tmp_path), 2, timeout=600,
                              init_process_group=False)
    assert reference["mesh"] == (1, 1, 1) and sorted(reference["losses"]) == [1, 2, 3]
    assert reference["losses"][3] != pytest.approx(reference["losses"][1], abs=1e-3)  # it trained
    for r in results:
        assert r["mesh"] == (1, 2, 1) and r["batch"] == (2, 2, 1)
        assert (r["adapter"], r["adapter_len"]) == ("gather", 2 * 4)  # 16 samples / 2 processes / micro 2, x sp
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-5)


def test_trainer_own_optimizer_trains_under_autotp_as_one_process(tmp_path) -> None:
    """No ``optimizer`` block: the Trainer builds torch AdamW over the unsplit model (decay / no-decay groups,
    weight decay 5) and passes it to ``initialize``; its groups are remapped onto the split parameters
    (DeepSpeed 0.19.8 remaps a client optimizer after module replacement), keeping each group's weight decay
    and the Trainer's LR schedule, so the losses equal one process's without tensor parallelism (one data-
    parallel rank in both: the same two samples per step)."""
    reference = run_distributed(parallel_jobs.trainer_own_optimizer_job, 1, str(tmp_path / "ref"), 1,
                                timeout=300, init_process_group=False)[0]
    results = run_distributed(parallel_jobs.trainer_own_optimizer_job, 2, str(tmp_path), 2, timeout=600,
                              init_process_group=False)
    for stage in (1, 2):
        assert reference[stage]["mesh"] == (1, 1, 1)
        for r in results:
            assert r[stage]["mesh"] == (1, 1, 2) and r[stage]["batch"] == (4, 2, 1)
            assert sorted(r[stage]["losses"]) == [1, 2, 3]
            assert r[stage]["losses"] == pytest.approx(reference[stage]["losses"], abs=1e-5)
    assert reference[1]["losses"][3] != pytest.approx(reference[1]["losses"][1], abs=1e-3)  # it trained
    # an optimizer that already stepped holds state of the unsplit shapes: refused, naming the group
    for r in results:
        assert "param_groups[0] position 0" in r[0]["refused"] and "exp_avg" in r[0]["refused"]
        assert "tensor_parallel.autotp_size" in r[0]["refused"]


def test_deepspeed_groups_work_outside_engine_calls() -> None:
    """``deepspeed.utils.groups`` after ``initialize`` outside any engine call reads the live engine's mesh
    (what Accelerate's Ulysses data-loader adapter and the Trainer's sequence-parallel loss call); before it,
    the mesh ``register_with_transformers`` built; two live engines with different meshes are refused naming
    both; nothing live: refused."""
    results = run_distributed(parallel_jobs.groups_outside_engine_calls_job, 2, timeout=300)
    for rank, r in enumerate(results):
        assert "no parallel mesh is current" in r["nothing"]
        # (sp, sp rank, dp, dp rank, tp, model parallel, sp x dp): rank r is sequence-parallel rank r
        assert r["before"] == r["after"] == r["one_closed"] == (2, rank, 1, 0, 1, 1, 2)
        assert r["before_group"] and r["after_group"]
        assert "two live engines have different parallel meshes" in r["two"]
        assert "dp 1 x sp 2 x tp 1" in r["two"] and "dp 2 x sp 1 x tp 1" in r["two"]
        assert "no parallel mesh is current" in r["all_closed"]
