"""The Ulysses data-loader adapter's two inputs on 2 gloo ranks (issue 38 item 6, last gap).

* Different batches per rank (DeepSpeed's semantics, what Accelerate's loader gives): each rank yields, in
  rank order, its shard of every rank's batch; ``len`` is ``len(dl) * sp``; a second pass repeats the first;
  ranks may differ in sequence length; bool tensors and non-tensor values travel; a Hugging Face Llama
  trained through it takes the same losses as one process over rank 0's batch, then rank 1's.
* The same batch on every rank (dscore's loaders): one shard per batch, ``len(dl)``.
* Refused on every rank alike: a later divergence after an identical first batch, different batch sizes,
  loaders that run out at different batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

SEQ = {0: 8, 1: 12}  # rank r's sequence length: the ranks' batches may differ in length
VOCAB = 64


def _batch(rank: int, j: int, seq: int, b: int = 2) -> dict[str, Any]:
    ids = torch.arange(b * seq, device="cpu").reshape(b, seq) + 1000 * rank + 100 * j
    return {
        "input_ids": ids,
        "labels": ids + 1,
        "attention_mask": torch.ones(b, seq, dtype=torch.long, device="cpu"),
        "loss_mask": (ids % 3 == 0),
        "tag": f"r{rank}b{j}",
    }


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _ids(rank: int, j: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(10 * rank + j)
    return torch.randint(0, VOCAB, (2, 16), generator=g, device="cpu")


def _record(adapter: Any) -> list[dict[str, Any]]:
    return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in adapter]


def _refused(make: Any) -> str:
    from dscore.errors import DscoreError

    try:
        adapter = make()
        list(adapter)
    except DscoreError as e:
        return str(e)
    return "accepted"


def _job() -> dict[str, Any]:
    import dscore
    from dscore.parallel.ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, all_gather_differentiable

    rank = torch.distributed.get_rank()
    out: dict[str, Any] = {}

    def adapter(batches: list[dict[str, Any]]) -> Any:
        return UlyssesSPDataLoaderAdapter(batches, sp_rank=rank, sp_group=None, sp_world_size=2, device="cpu")

    differing = adapter([_batch(rank, j, SEQ[rank]) for j in range(2)])
    out["gather_len"], out["gather_mode"] = len(differing), getattr(differing, "mode", None)
    out["gather"] = [_record(differing), _record(differing)]  # two passes (epochs)
    same = adapter([_batch(0, j, 8) for j in range(2)])
    out["same_len"], out["same_mode"] = len(same), getattr(same, "mode", None)
    out["same"] = _record(same)

    out["diverged"] = _refused(lambda: adapter([_batch(0, 0, 8), _batch(rank, 1, 8)]))
    out["sizes"] = _refused(lambda: adapter([_batch(rank, 0, 8, b=2 + rank)]))
    out["ran_out"] = _refused(lambda: adapter([_batch(rank, j, 8) for j in range(2 - rank)]))

    # a Hugging Face Llama through dscore.initialize, each rank's loader holding its own one batch
    from dscore.errors import ConfigError

    eager = _llama()
    eager.set_attn_implementation("eager")
    try:  # the model passed in is switched to "ulysses" only when it runs the named core attention
        UlyssesSPAttentionHF.register_with_transformers(eager, "sdpa", 2, 2, seq_length=16)
        out["mismatch"] = "accepted"
    except ConfigError as e:
        out["mismatch"] = str(e)
    model = _llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 2, seq_length=16)  # switches to ulysses
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "gradient_clipping": 1e6}
    engine, _, _, _ = dscore.initialize(model=model, config=config, mpu=mpu)
    loader = UlyssesSPDataLoaderAdapter([{"input_ids": _ids(rank, 0), "labels": _ids(rank, 0)}], mpu.sp_rank,
                                        mpu.get_sequence_parallel_group(), 2, "cpu")
    losses = []
    for batch in loader:
        res = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        labels = batch["shift_labels"]
        loss_sum = torch.nn.functional.cross_entropy(res.logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                     reduction="sum")
        sums = all_gather_differentiable(loss_sum, mpu.sp_comm)
        counts = all_gather_differentiable((labels != -100).sum().float(), mpu.sp_comm)
        loss = sums.sum() / counts.sum()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out["losses"] = losses
    engine.close()
    return out


def _shard(batch: dict[str, Any], rank: int) -> dict[str, Any]:
    """What rank ``rank`` must yield for a full ``batch`` (computed here independently of the adapter)."""
    ids = batch["input_ids"]
    seq = ids.shape[1]
    lo, hi = rank * seq // 2, (rank + 1) * seq // 2
    shifted = torch.cat([batch["labels"][:, 1:], torch.full((ids.shape[0], 1), -100, device="cpu")], dim=1)
    return {
        "input_ids": ids[:, lo:hi].tolist(),
        "loss_mask": batch["loss_mask"][:, lo:hi].tolist(),
        "tag": batch["tag"],
        "position_ids": torch.arange(seq, device="cpu").expand(ids.shape[0], seq)[:, lo:hi].tolist(),
        "shift_labels": shifted[:, lo:hi].tolist(),
    }


@pytest.mark.slow
def test_ulysses_adapter_gathers_different_batches_and_keeps_one_shared_batch() -> None:
    from dscore.testing import run_distributed

    results = run_distributed(_job, 2, timeout=300)
    for rank, r in enumerate(results):
        assert (r["gather_len"], r["gather_mode"]) == (4, "gather")
        # rank order within each pull: rank 0's batch j, then rank 1's batch j
        expected = [_shard(_batch(src, j, SEQ[src]), rank) for j in range(2) for src in range(2)]
        assert r["gather"][0] == expected and r["gather"][1] == expected
        assert (r["same_len"], r["same_mode"]) == (2, "same")
        assert r["same"] == [_shard(_batch(0, j, 8), rank) for j in range(2)]
        assert "batch 1 differs between the ranks" in r["diverged"]
        assert "different sizes" in r["sizes"] and "rank 0: 2, rank 1: 3" in r["sizes"]
        assert "ran out at different batches" in r["ran_out"] and "rank(s) [1] have no batch 1" in r["ran_out"]
        assert "core_attn_implementation 'sdpa' but the model runs attn_implementation 'eager'" in r["mismatch"]

    # one process over the same samples, in DeepSpeed's order: rank 0's batch, then rank 1's
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = []
    for src in range(2):
        ids = _ids(src, 0)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference.append(float(loss.detach()))
    assert reference[0] != pytest.approx(reference[1], abs=1e-3)
    for r in results:
        assert r["losses"] == pytest.approx(reference, abs=1e-5)
