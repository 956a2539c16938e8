"""The unchanged Hugging Face Trainer and Accelerate loop run on dscore through ``import deepspeed``.

2 gloo ranks on CPU (``TrainingArguments(use_cpu=True)``; Accelerate creates the process group itself), a
tiny GPT-2 built from a config, fp32. The jobs are in hf_jobs.py (shared with bench/compat_vs_deepspeed.py,
which runs them on DeepSpeed 0.19.8 for the per-step loss comparison).
"""

from __future__ import annotations

# compat/deepspeed (make setup) and transformers/accelerate/trl/pytorch-lightning (the test extra) are
# required, never skipped
import accelerate  # noqa: F401
import deepspeed
import hf_jobs  # tests/compat is on sys.path: pytest's prepend import mode
import pytest
import transformers  # noqa: F401

from dscore.testing import run_distributed

assert getattr(deepspeed, "__dscore__", False), f"`deepspeed` at {deepspeed.__file__} is not dscore's layer"

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("stage", "build_in_zero_init", "config_optimizer"),
    [(2, False, True), (3, True, False)],
    ids=["zero2-config-optimizer-and-scheduler", "zero3-born-partitioned-trainer-optimizer"],
)
def test_trainer_trains_saves_and_resumes_bit_for_bit(
    stage: int, build_in_zero_init: bool, config_optimizer: bool, tmp_path
) -> None:
    """10 steps with a checkpoint at step 5; a new Trainer resumed from checkpoint-5 alone reproduces the
    losses and gradient norms of steps 6-10 exactly (weights, Adam moments, LR scheduler, RNG and data
    position all restored). ZeRO-2: optimizer and WarmupDecayLR from the config ("auto" values filled by the
    Trainer; the scheduler's state travels in the checkpoint). ZeRO-3: the Trainer's own AdamW and LR
    schedule, the model built by ``from_config`` inside ``deepspeed.zero.Init``.
    The checkpoint is in DeepSpeed's layout and ``zero_to_fp32`` gives the Trainer's saved weights."""
    results = run_distributed(
        hf_jobs.trainer_resume_job, 2, stage, str(tmp_path), build_in_zero_init, config_optimizer, timeout=600,
        init_process_group=False,
    )
    full, resumed = results[0]["full"], results[0]["resumed"]
    assert full["deepspeed"].startswith("0.19.8+dscore") and full["is_engine"] and full["engine"] == "DscoreEngine"
    assert full["born_partitioned"] is build_in_zero_init
    assert full["checkpoints"] == ["checkpoint-10", "checkpoint-5"]
    assert sorted(full["losses"]) == list(range(1, 11))
    losses = [full["losses"][s] for s in range(1, 11)]
    assert all(3.5 < x < 5.0 for x in losses) and losses[-1] < losses[0]  # it trains
    for step in range(6, 11):
        assert resumed["losses"][step] == full["losses"][step], step
        assert resumed["grad_norms"][step] == full["grad_norms"][step], step
    # both ranks logged the same (the Trainer reduces the loss over ranks)
    assert results[1]["full"]["losses"] == full["losses"]
    # the engine saved DeepSpeed 0.19.8's layout (through compat), and it reads back as the Trainer's weights
    model_files = (["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
                   if stage == 3 else ["mp_rank_00_model_states.pt"])
    assert results[0]["files"] == sorted(["_COMPLETE", *model_files, "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                          "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
    check = results[0]["fp32_vs_saved_model"]
    assert check["missing"] == [] and check["max_abs_diff"] == 0.0
    assert check["extra"] == (["lm_head.weight"] if stage == 3 else [])  # the tied alias (shared_params)
    _lightning_converter_reads(tmp_path / "full" / "checkpoint-5", stage)


def test_trainer_resumes_a_llama_at_zero3(tmp_path) -> None:
    """A Llama's ``rotary_emb.inv_freq`` is a non-persistent buffer: the ZeRO-3 checkpoint (DeepSpeed's
    layout, through compat) leaves it out and ``resume_from_checkpoint`` keeps the model's own values; the
    resumed Trainer's losses and gradient norms equal the uninterrupted run's (6 steps, checkpoint at 3).
    The model is built by ``from_config`` inside ``deepspeed.zero.Init`` (born partitioned, as
    ``from_pretrained`` is under the Trainer at ZeRO-3)."""
    results = run_distributed(
        hf_jobs.trainer_resume_job, 2, 3, str(tmp_path), True, False, "llama", 6, 3, timeout=600,
        init_process_group=False,
    )
    full, resumed = results[0]["full"], results[0]["resumed"]
    assert full["is_engine"] and full["born_partitioned"]
    assert full["checkpoints"] == ["checkpoint-3", "checkpoint-6"]
    assert sorted(full["losses"]) == list(range(1, 7)) and {4, 5, 6} <= set(resumed["losses"])
    for step in (4, 5, 6):
        assert resumed["losses"][step] == full["losses"][step], step
        assert resumed["grad_norms"][step] == full["grad_norms"][step], step
    check = results[0]["fp32_vs_saved_model"]
    assert check["missing"] == [] and check["max_abs_diff"] == 0.0
    assert not any("inv_freq" in k for k in check["extra"])


def _lightning_converter_reads(checkpoint, stage: int) -> None:
    """Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` (which imports ``deepspeed.utils.zero_to_fp32``
    and ``torch.load``s the model and optimizer files itself) on the compat-written checkpoint."""
    import torch
    from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    from safetensors.torch import load_file

    out = convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(checkpoint / "lightning.pt"))
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert set(saved) <= set(out["state_dict"])
    for k, v in saved.items():
        assert torch.equal(out["state_dict"][k], v.float()), k
    assert out["global_samples"] == 5 * 8 and out["ds_version"] == "0.19.8"
    assert torch.load(checkpoint / "lightning.pt", weights_only=True)["param_shapes"]  # plain types only


def test_accelerate_loop_at_zero2_and_zero3_then_trl_sft(tmp_path) -> None:
    """Accelerate's own loop (``PartialState(cpu=True)``, ``Accelerator(deepspeed_plugin=...)``, prepare,
    ``accelerator.backward``, ``optimizer.step``): ZeRO-2 and ZeRO-3 give the same per-step losses (fp32, 1
    micro-batch per step) and ``accelerator.get_state_dict`` gathers the full ZeRO-3 model on rank 0 only.
    Then, in the same processes, TRL's ``SFTTrainer`` trains 3 steps at ZeRO-3 on the engine."""
    results = run_distributed(hf_jobs.accelerate_stages_job, 2, (2, 3), str(tmp_path), timeout=600,
                              init_process_group=False)
    by_stage = {stage: [results[0][stage], results[1][stage]] for stage in (2, 3)}
    for rank in (0, 1):
        z2, z3 = by_stage[2][rank], by_stage[3][rank]
        assert z2["engine"] == z3["engine"] == "DscoreEngine"
        assert len(z2["losses"]) == 6
        assert z2["losses"] == pytest.approx(z3["losses"], abs=1e-5)
    assert by_stage[2][0]["losses"] != by_stage[2][1]["losses"]  # each rank saw its own shard of the data
    assert by_stage[3][0]["state_keys"] == by_stage[2][0]["state_keys"] > 0 and by_stage[3][1]["state_keys"] == 0
    assert by_stage[3][0]["state_digest"] == pytest.approx(by_stage[2][0]["state_digest"], abs=1e-4)
    trl = results[0]["trl"]
    assert trl["is_engine"] and sorted(trl["losses"]) == [1, 2, 3]
    assert all(3.5 < x < 5.0 for x in trl["losses"].values())
    assert results[1]["trl"]["losses"] == trl["losses"]
