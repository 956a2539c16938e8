"""The supported weight sync (dscore.rollout.weight_sync, issue 40 item 4): two training ranks (ZeRO 0 and ZeRO 3,
a tiny Llama) and one receiver process outside the training world. After training steps the receiver's model
equals the trainers' full weights bit for bit, over two consecutive syncs (steps checked); a receiver that cannot
load a parameter (dtype mismatch, unknown name, a name missing from a ``trainable_only`` sync) rejects the sync
naming it, every training rank raises, and the next sync goes through (``allow_missing`` takes the trainable-only
one). Stage 0 packs every tensor into one buffer per bucket, stage 3 sends the matrices as direct tensors (a
lowered threshold), one of them into a non-contiguous target. One spawn per stage."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dscore.testing import run_distributed


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _group(rank: int) -> Any:
    from dscore.rollout import WeightSyncGroup

    # sync rank 0 is training rank 0, the receiver sync rank 1
    return WeightSyncGroup("127.0.0.1", int(os.environ["MASTER_PORT"]) + 23, 2, 0 if rank == 0 else 1, timeout=120)


def _receiver() -> dict[str, Any]:
    from dscore.errors import WeightSyncError
    from dscore.rollout import WeightSyncReceiver

    g = _group(2)
    rx = WeightSyncReceiver(g)
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # only the syncs can make it equal the trainers
        emb = model.model.embed_tokens.weight
        emb.data = emb.data.t().contiguous().t()  # a non-contiguous target: a direct tensor lands through a buffer
        assert not emb.is_contiguous()
    out: dict[str, Any] = {"steps": [], "states": [], "rejects": []}
    for _ in range(2):
        out["steps"].append(rx.receive(model))
        out["states"].append({k: v.clone() for k, v in model.state_dict().items()})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    wrong_dtype = dict(state, **{"model.norm.weight": state["model.norm.weight"].double()})
    unknown = {k: v for k, v in state.items() if k != "lm_head.weight"}
    # the sender's trainable_only leaves the frozen lm_head out: missing for a strict receiver, fine with allow_missing
    lenient = WeightSyncReceiver(g, allow_missing=True)
    for target, receiver in ((wrong_dtype, rx), (unknown, rx), (model, rx), (model, lenient)):
        try:
            out["steps"].append(receiver.receive(target))
            out["states"].append({k: v.clone() for k, v in model.state_dict().items()})
        except WeightSyncError as exc:
            out["rejects"].append((exc.name, str(exc)))
    out["steps"].append(rx.receive(model))  # the group is usable after a rejected sync
    out["states"].append({k: v.clone() for k, v in model.state_dict().items()})
    g.close()
    return out


def _job(stage: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dscore.rollout import weight_sync

    if stage == 3:  # the tiny model's matrices (4-8 KiB) travel as direct tensors, the norms packed
        weight_sync._DIRECT_MIN = 1024
    rank = int(os.environ["RANK"])
    if rank == 2:
        return _receiver()

    import dscore
    from dscore.errors import WeightSyncError
    from dscore.rollout import WeightSyncSender

    os.environ["WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", rank=rank, world_size=2)  # the training world: ranks 0 and 1
    model = _model()
    model.lm_head.weight.requires_grad_(False)  # frozen: left out by trainable_only
    engine, *_ = dscore.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    sender = WeightSyncSender(engine, _group(rank) if rank == 0 else None, bucket_bytes=6000)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1 + rank))

    def train(n: int) -> None:
        for _ in range(n):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

    out: dict[str, Any] = {"states": [], "stats": [], "rejects": []}
    for step in (2, 4):
        train(2)
        out["stats"].append(sender.send(step))
        out["states"].append({k: v.clone() for k, v in engine.module_state_dict().items()})
    trainable = WeightSyncSender(engine, sender.group, bucket_bytes=6000, trainable_only=True)
    for step, tx in ((5, sender), (6, sender), (7, trainable), (8, trainable)):  # the receiver rejects 5, 6, 7
        try:
            out["stats"].append(tx.send(step))
            out["states"].append({k: v.clone() for k, v in engine.module_state_dict().items()})
        except WeightSyncError as exc:
            out["rejects"].append(str(exc))
    train(1)
    out["stats"].append(sender.send(9))
    out["states"].append({k: v.clone() for k, v in engine.module_state_dict().items()})
    if sender.group is not None:
        sender.group.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_receiver_gets_the_trained_weights_bit_for_bit(stage: int) -> None:
    pytest.importorskip("transformers")
    trainer0, trainer1, receiver = run_distributed(_job, 3, stage, timeout=300, init_process_group=False)
    initial = _model().state_dict()
    assert receiver["steps"] == [2, 4, 8, 9]
    assert [s["step"] for s in trainer0["stats"]] == [2, 4, 8, 9]
    assert trainer0["stats"][0]["count"] == len(initial) and trainer0["stats"][0]["buckets"] > 1
    assert trainer0["stats"][2]["count"] == len(initial) - 1  # trainable_only: not the frozen lm_head
    for i, (t0, t1, rx) in enumerate(zip(trainer0["states"], trainer1["states"], receiver["states"])):
        assert list(rx) == list(t0), i
        for k, v in t0.items():
            assert torch.equal(v, t1[k]), (i, k)
            assert v.dtype == rx[k].dtype and torch.equal(v, rx[k]), (i, k)
        assert any(not torch.equal(v, initial[k]) for k, v in t0.items()), i  # trained, not the initial weights
    # consecutive syncs carried different (newer) weights
    assert any(not torch.equal(v, receiver["states"][0][k]) for k, v in receiver["states"][1].items())
    (dtype_name, dtype_msg), (unknown_name, unknown_msg), (missing_name, missing_msg) = receiver["rejects"]
    assert dtype_name == "model.norm.weight" and "torch.float64" in dtype_msg, dtype_msg
    assert unknown_name == "lm_head.weight" and "not in the receiver's target" in unknown_msg, unknown_msg
    assert missing_name == "lm_head.weight" and "not sent" in missing_msg and "allow_missing" in missing_msg, missing_msg
    assert len(trainer0["rejects"]) == len(trainer1["rejects"]) == 3
    for msg, name in zip(trainer0["rejects"], ("model.norm.weight", "lm_head.weight", "lm_head.weight")):
        assert "rejected by receiver (sync rank 1" in msg and name in msg, msg
    assert all("the sending training rank 0 failed" in m for m in trainer1["rejects"]), trainer1["rejects"]
