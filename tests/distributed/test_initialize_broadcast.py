"""Issue 38 item 2: ``dscore.initialize`` makes the data-parallel replicas equal to rank 0's model.

Every rank seeds torch with its own rank before building the model (and fills a persistent and a
non-persistent buffer from that generator), as a script that forgets to seed alike does. Right after
``initialize`` every rank's (gathered) parameters and buffers must be rank 0's initial values, at ZeRO 0,
1, 2, 3 and with ``zero.Init``; after one step both ranks equal a single-process reference trained from
rank 0's initialisation on both ranks' batches. Model-parallel layouts keep their shards: AutoTP shards
are broadcast only within their data-parallel group (4 ranks, tp 2 x dp 2), MoE expert parameters within
their expert-data-parallel group (ep 2: each rank keeps its own experts; ep 1: rank 0's experts). The
model is a tiny Hugging Face ``LlamaForCausalLM`` built from a config (its rotary ``inv_freq`` is a
non-persistent buffer).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscore.testing import run_distributed

SEQ, MICRO, LR = 8, 2, 0.1


def _llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def _add_buffers(model: Any, seed: int) -> None:
    """A persistent buffer drawn from ``seed`` and a seed-dependent non-persistent one (rotary ``inv_freq``)."""
    g = torch.Generator().manual_seed(seed)
    model.register_buffer("marker", torch.randn(5, generator=g))
    rotary = model.model.rotary_emb
    rotary.inv_freq.mul_(1.0 + 0.01 * seed)


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 32, (MICRO, SEQ), generator=torch.Generator().manual_seed(7 + rank))


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # the reference steps unclipped
    }


def _full(engine: Any) -> dict[str, torch.Tensor]:
    """Gathered parameters and every buffer (non-persistent ones too) of the engine's model."""
    out = {k: v.detach().clone() for k, v in engine.zero_stage_impl.module_state_dict().items()}
    out.update({f"buffer:{k}": b.detach().clone() for k, b in engine.module.named_buffers()})
    return out


def _own(model: Any) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out.update({f"buffer:{k}": b.detach().clone() for k, b in model.named_buffers()})
    return out


def _stages() -> dict[str, Any]:
    import torch.distributed as dist

    import dscore

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for case in ("zero0", "zero1", "zero2", "zero3", "zero_init"):
        stage = 3 if case == "zero_init" else int(case[-1])
        if case == "zero_init":
            with dscore.zero.Init():
                model = _llama(100 + rank)
        else:
            model = _llama(100 + rank)
        _add_buffers(model, 100 + rank)
        # a zero.Init model's parameters are partitions: only its buffers are whole before initialize
        initial = {f"buffer:{k}": b.detach().clone() for k, b in model.named_buffers()}
        if case != "zero_init":
            initial = _own(model)
        engine, *_ = dscore.initialize(model=model, config=_config(stage))
        after_init = _full(engine)
        loss = engine(input_ids=_ids(rank), labels=_ids(rank)).loss
        engine.backward(loss)
        engine.step()
        out[case] = {"initial": initial, "after_init": after_init, "after_step": _full(engine)}
    return out


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rank 0's model, and that model after one SGD step on both ranks' batches in one process."""
    model = _llama(100)
    _add_buffers(model, 100)
    initial = _own(model)
    ids = torch.cat([_ids(0), _ids(1)])
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return initial, _own(model)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, atol: float = 0.0) -> None:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for k in want:
        assert got[k].shape == want[k].shape, f"{what}: {k}"
        diff = float((got[k].float() - want[k].float()).abs().max()) if got[k].numel() else 0.0
        assert diff <= atol, f"{what}: {k} differs by {diff}"


@pytest.mark.slow
def test_initialize_gives_every_rank_rank0s_model_at_every_stage() -> None:
    r0, r1 = run_distributed(_stages, 2, timeout=300)
    ref_initial, ref_step = _reference()
    _assert_same(r0["zero0"]["initial"], ref_initial, "rank 0's own model is the reference's")
    for case in r0:
        for rank, res in ((0, r0), (1, r1)):
            got = res[case]
            # bitwise: a broadcast, not a computation
            _assert_same(got["after_init"], ref_initial, f"{case} rank {rank} right after initialize")
            _assert_same(got["after_step"], ref_step, f"{case} rank {rank} after one step", atol=1e-5)
    # the ranks really started apart (rank 1's own seed), so the equality above is the broadcast's
    assert not torch.equal(r1["zero0"]["initial"]["lm_head.weight"], ref_initial["lm_head.weight"])
    assert not torch.equal(r1["zero_init"]["initial"]["buffer:marker"], ref_initial["buffer:marker"])
