"""An OpenRLHF-style weight sync (issue 40): two ZeRO-3 trainers gather each parameter with
``GatheredParameters([p])`` and rank 0 broadcasts it over a gloo group shared with a third "receiver"
process outside the training world (as a generation engine is); after a training step the receiver's
model equals the trainers' weights bit for bit; a second round streams ``engine.iter_full_params`` buckets."""

from __future__ import annotations

import os
from datetime import timedelta
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


def _sync_group(rank: int) -> Any:
    """A 2-member gloo group {trainer 0, receiver} over its own store (the receiver is not in the training
    world, as vLLM/OpenRLHF's weight-update group)."""
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"]) + 17
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    return dist.ProcessGroupGloo(store, 0 if rank == 0 else 1, 2)


def _job() -> dict[str, Any]:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if rank == 2:  # the receiver: its own model, weights only from the broadcasts
        pg = _sync_group(rank)
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
            for _, p in model.named_parameters():
                buf = torch.empty(p.shape, dtype=p.dtype, device="cpu")
                pg.broadcast([buf], dist.BroadcastOptions()).wait()  # root 0 of the group: trainer 0
                p.copy_(buf)
        first = {k: v.clone() for k, v in model.state_dict().items()}
        # second round, streamed: bucket sizes first, then each tensor, in the order announced
        sizes = [torch.zeros(1, dtype=torch.int64)]
        pg.broadcast(sizes, dist.BroadcastOptions()).wait()
        params = dict(model.named_parameters())
        with torch.no_grad():
            for _ in range(int(sizes[0])):
                n = [torch.zeros(1, dtype=torch.int64)]
                pg.broadcast(n, dist.BroadcastOptions()).wait()
                names = [torch.zeros(64, dtype=torch.uint8) for _ in range(int(n[0]))]
                for t in names:
                    pg.broadcast([t], dist.BroadcastOptions()).wait()
                for t in names:
                    name = bytes(t[t != 0].tolist()).decode()
                    buf = torch.empty(params[name].shape, dtype=params[name].dtype, device="cpu")
                    pg.broadcast([buf], dist.BroadcastOptions()).wait()
                    params[name].copy_(buf)
        return {"first": first, "second": {k: v.clone() for k, v in model.state_dict().items()}}

    import dscore
    from dscore.zero import GatheredParameters

    os.environ["WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", rank=rank, world_size=2)  # the training world: ranks 0 and 1
    engine, *_ = dscore.initialize(model=_model(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1 + rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    pg = _sync_group(rank) if rank == 0 else None
    for _, p in engine.module.named_parameters():
        with GatheredParameters([p]):  # collective over the trainers
            if pg is not None:
                pg.broadcast([p.data.detach().clone()], dist.BroadcastOptions()).wait()
    first = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    buckets = list(engine.iter_full_params(bucket_bytes=6000))  # collective over the trainers
    if pg is not None:
        def send(t: torch.Tensor) -> None:
            pg.broadcast([t], dist.BroadcastOptions()).wait()

        send(torch.tensor([len(buckets)], dtype=torch.int64))
        for b in buckets:
            send(torch.tensor([len(b)], dtype=torch.int64))
            for name, _ in b:
                raw = torch.zeros(64, dtype=torch.uint8)
                raw[: len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
                send(raw)
            for _, t in b:
                send(t)
    return {"first": first, "second": {k: v.clone() for k, v in engine.module_state_dict().items()}}


@pytest.mark.slow
def test_openrlhf_style_sync_delivers_the_trained_weights_exactly() -> None:
    pytest.importorskip("transformers")
    trainer0, trainer1, receiver = run_distributed(_job, 3, timeout=300, init_process_group=False)
    initial = _model().state_dict()
    for phase in ("first", "second"):  # per-parameter GatheredParameters, then engine.iter_full_params buckets
        assert list(receiver[phase]) == list(trainer0[phase]), phase
        for k, v in trainer0[phase].items():
            assert torch.equal(v, trainer1[phase][k]), (phase, k)
            assert torch.equal(v, receiver[phase][k]) and v.dtype == receiver[phase][k].dtype, (phase, k)
        # each step moved the weights: the receiver got the trained ones, not stale ones
        assert any(not torch.equal(v, initial[k]) for k, v in trainer0[phase].items()), phase
    assert any(not torch.equal(v, receiver["first"][k]) for k, v in receiver["second"].items())
