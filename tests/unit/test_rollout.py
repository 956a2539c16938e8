"""The rollout API (issue 40 item 2): DeepSpeed 0.19.8's ``deepspeed.runtime.rollout`` semantics in
:mod:`dscore.rollout`. The reference numbers below were measured once with DeepSpeed 0.19.8 itself (the bench
venv /work/bench-venv, torch 2.13.0+cpu, transformers 5.24.0) on exactly these inputs."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from dscore.errors import RolloutError
from dscore.rollout import (
    HybridEngineRollout,
    ResponseTokenBatch,
    RolloutBatch,
    RolloutConfig,
    RolloutRequest,
    SamplingConfig,
    build_rollout,
    generalized_jsd_loss,
)
from dscore.rollout.continuous_batching import ContinuousBatchRequest, ContinuousBatchScheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import hybrid_runs  # noqa: E402

# deepspeed.runtime.rollout.generalized_jsd_loss(S, T, MASK, **kw) -> (loss, loss_sum, valid_token_count)
DS_JSD = {
    "b0.5": ({}, 0.07789871096611023, 0.3115948438644409, 4),
    "b0": ({"beta": 0.0}, 0.3980861008167267, 1.5923444032669067, 4),
    "b1": ({"beta": 1.0}, 0.29306793212890625, 1.172271728515625, 4),
    "b0.3_T2": ({"beta": 0.3, "temperature": 2.0}, 0.022851916030049324, 0.0914076641201973, 4),
    "topk3": ({"teacher_top_k": 3}, 0.07462647557258606, 0.29850590229034424, 4),
    "clip": ({"beta": 0.7, "pointwise_clip": 0.05}, 0.06006364896893501, 0.24025459587574005, 4),
}

# HybridEngineRollout(engine with .module = hybrid_runs.tiny_model("llama").eval(), tokenizer pad 0 / eos 36)
# .generate(RolloutRequest(PROMPTS, PROMPTS != 0), SamplingConfig(max_new_tokens=8, temperature=0.0,
# n_samples_per_prompt=2)) in DeepSpeed 0.19.8: input_ids, attention_mask (each row twice), response_start_idx 6
DS_IDS = [
    [0, 0, 3, 4, 7, 9, 36, 0, 0, 0, 0, 0, 0, 0],
    [11, 12, 13, 14, 15, 16, 26, 36, 0, 0, 0, 0, 0, 0],
    [0, 8, 6, 21, 22, 23, 31, 3, 20, 18, 17, 11, 42, 30],
]
DS_MASK = [
    [0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
    [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
]
DS_RESPONSE_MASK = [
    [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
]
PROMPTS = torch.tensor([[0, 0, 3, 4, 7, 9], [11, 12, 13, 14, 15, 16], [0, 8, 6, 21, 22, 23]])
TOKENIZER = types.SimpleNamespace(pad_token_id=0, eos_token_id=36)


def _logits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = (torch.sin(torch.arange(30, dtype=torch.float32)) * 2).reshape(2, 3, 5)
    t = (torch.cos(torch.arange(30, dtype=torch.float32) * 0.7) * 1.5).reshape(2, 3, 5)
    return s, t, torch.tensor([[1, 1, 0], [0, 1, 1]])


@pytest.mark.parametrize("key", sorted(DS_JSD))
def test_generalized_jsd_loss_equals_deepspeed(key: str) -> None:
    kw, loss, loss_sum, count = DS_JSD[key]
    out = generalized_jsd_loss(*_logits(), **kw)
    assert out.loss.item() == pytest.approx(loss, rel=1e-6, abs=1e-9)
    assert out.loss_sum.item() == pytest.approx(loss_sum, rel=1e-6, abs=1e-9)
    assert out.valid_token_count.item() == count and out.valid_token_count.dtype == torch.int64


@pytest.mark.parametrize(
    "kw", [{"beta": 1.5}, {"temperature": 0.0}, {"teacher_top_k": 0}, {"teacher_top_k": 6}, {"pointwise_clip": -1.0}]
)
def test_generalized_jsd_loss_refuses_bad_arguments(kw: dict) -> None:
    with pytest.raises(RolloutError, match=next(iter(kw))):
        generalized_jsd_loss(*_logits(), **kw)


def test_hybrid_engine_rollout_equals_deepspeed_greedy() -> None:
    engine = types.SimpleNamespace(module=hybrid_runs.tiny_model("llama").eval())
    rollout = HybridEngineRollout(engine, TOKENIZER)
    batch = rollout.generate(RolloutRequest(PROMPTS, (PROMPTS != 0).long()),
                             SamplingConfig(max_new_tokens=8, temperature=0.0, n_samples_per_prompt=2))
    assert batch.input_ids.tolist() == [row for row in DS_IDS for _ in range(2)]
    assert batch.attention_mask.tolist() == [row for row in DS_MASK for _ in range(2)]
    assert batch.response_start_idx.tolist() == [6] * 6
    assert ResponseTokenBatch.from_rollout(batch).response_mask.int().tolist() == [r for r in DS_RESPONSE_MASK for _ in range(2)]


def test_continuous_batching_equals_each_request_alone() -> None:
    """DeepSpeed 0.19.8's continuous path fails with transformers 5.24 (its static cache lacks
    get_query_offset), so the reference is its documented rule: each request greedily until its first EOS."""
    model = hybrid_runs.tiny_model("llama").eval()
    rollout = HybridEngineRollout(types.SimpleNamespace(module=model), TOKENIZER)
    batch = rollout.generate(RolloutRequest(PROMPTS, (PROMPTS != 0).long()),
                             SamplingConfig(max_new_tokens=8, temperature=0.0, continuous_batch_size=2))
    responses = [r[6:] for r in DS_IDS]
    responses = [r[: r.index(36) + 1] if 36 in r else r for r in responses]
    width = max(len(r) for r in responses)
    assert batch.input_ids.tolist() == [p + r + [0] * (width - len(r)) for p, r in zip(PROMPTS.tolist(), responses)]
    assert batch.attention_mask[:, 6:].tolist() == [[1] * len(r) + [0] * (width - len(r)) for r in responses]
    with pytest.raises(RolloutError, match="greedy"):
        rollout.generate(RolloutRequest(PROMPTS, (PROMPTS != 0).long()),
                         SamplingConfig(max_new_tokens=4, temperature=1.0, continuous_batch_size=2))
    with pytest.raises(RolloutError, match="one sample"):
        rollout.generate(RolloutRequest(PROMPTS, (PROMPTS != 0).long()),
                         SamplingConfig(max_new_tokens=4, temperature=0.0, n_samples_per_prompt=2, continuous_batch_size=2))
    rollout.sync_weights(3)
    rollout.shutdown()
    with pytest.raises(RolloutError, match="shutdown"):
        rollout.generate(RolloutRequest(PROMPTS, (PROMPTS != 0).long()), SamplingConfig(max_new_tokens=2, temperature=0.0))


def test_request_must_be_left_padded_and_shapes_checked() -> None:
    ids = torch.tensor([[3, 4, 0], [0, 5, 6]])
    with pytest.raises(RolloutError, match="prompt row 0 is not left-padded"):
        RolloutRequest(ids, (ids != 0).long())
    with pytest.raises(ValueError, match="2-D"):  # a ValueError too, as DeepSpeed raises
        RolloutRequest(torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long))
    with pytest.raises(RolloutError, match="response_start_idx"):
        RolloutBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    bad = RolloutBatch(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), torch.tensor([0]))
    with pytest.raises(RolloutError, match=r"\[1, 4\]"):
        ResponseTokenBatch.from_rollout(bad)


def test_build_rollout_and_scheduler() -> None:
    with pytest.raises(RolloutError, match="unknown rollout engine 'vllm'"):
        build_rollout(RolloutConfig(engine="vllm"), object(), TOKENIZER)
    with pytest.raises(RolloutError, match="student_engine and tokenizer"):
        build_rollout(RolloutConfig())
    with pytest.raises(RolloutError, match="use_graph_capture"):
        build_rollout(RolloutConfig(use_graph_capture=True), object(), TOKENIZER)
    assert isinstance(build_rollout(RolloutConfig(), object(), TOKENIZER), HybridEngineRollout)

    sched = ContinuousBatchScheduler(max_batch_size=2, max_new_tokens=2)
    for i in range(3):
        sched.submit(ContinuousBatchRequest(i))
    first = sched.schedule()
    assert first.active_ids == (0, 1) and first.admitted_slots == (0, 1)
    step = sched.advance(finished_ids=[0])  # 0 hit EOS; 2 takes its slot after the survivor
    assert step.retired == (0,) and step.keep_slots == (1,) and step.active_ids == (1, 2) and step.admitted_slots == (1,)
    step = sched.advance()  # 1 used its budget of 2 tokens
    assert step.retired == (1,) and step.active_ids == (2,)
    with pytest.raises(RolloutError, match="duplicate"):
        sched.submit(ContinuousBatchRequest(2))
