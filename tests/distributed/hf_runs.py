"""AutoTP and Ulysses on a real Hugging Face Llama (``transformers``, a test dependency): the model's own
``tp_plan`` drives the split at tp 2 and ``UlyssesSPAttentionHF.register_with_transformers`` serves
``attn_implementation="ulysses"`` at sp 2; loss, logits and gradient norm equal one process within 1e-5. Run by ``test_tp_sp.py``'s 2-rank spawn."""

from __future__ import annotations

from typing import Any

import pytest
import torch

SEQ, MICRO = 32, 2


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 1e6,
        **extra,
    }


def two_ranks() -> dict[str, Any]:
    import dscore
    from dscore.parallel.ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, all_gather_differentiable

    out: dict[str, Any] = {}
    model = _model()
    engine, _, _, _ = dscore.initialize(model=model, config=_config(tensor_parallel={"autotp_size": 2}))
    res = engine(input_ids=_ids(), labels=_ids())
    engine.backward(res.loss)
    engine.step()
    out["tp_loss"], out["tp_logits"] = float(res.loss.detach()), res.logits.detach().numpy().copy()
    out["tp_norm"] = float(engine.get_global_grad_norm())
    out["tp_sources"] = sorted({rule.source.split("'")[0] for rule in model._dscore_autotp["plan"].values()})

    model = _model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, MICRO, seq_length=SEQ)
    model.set_attn_implementation("ulysses")
    engine, _, _, _ = dscore.initialize(model=model, config=_config(sequence_parallel_size=2), mpu=mpu)
    batch = next(
        iter(UlyssesSPDataLoaderAdapter([{"input_ids": _ids(), "labels": _ids()}], mpu.sp_rank, mpu.sp_comm, 2, "cpu"))
    )
    res = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    labels = batch["shift_labels"]
    loss_sum = torch.nn.functional.cross_entropy(
        res.logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    # the last shard has one target fewer (shifted labels end in -100): weight by valid tokens
    sums = all_gather_differentiable(loss_sum, mpu.sp_comm)
    counts = all_gather_differentiable((labels != -100).sum().float(), mpu.sp_comm)
    engine.backward(sums.sum() / counts.sum())
    engine.step()
    out["sp_logits"], out["sp_rank"] = res.logits.detach().numpy().copy(), mpu.sp_rank
    out["sp_norm"] = float(engine.get_global_grad_norm())
    return out


def check_two_ranks(results: list[dict[str, Any]]) -> None:
    """Assertions over :func:`two_ranks`' results (one per rank), against one process."""
    model = _model()
    ids = _ids()
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    for res in results:
        assert res["tp_loss"] == pytest.approx(float(ref.loss), abs=1e-5)
        assert torch.allclose(torch.from_numpy(res["tp_logits"]), ref.logits.detach(), atol=1e-5)
        assert res["tp_norm"] == pytest.approx(norm, rel=1e-5)
        assert res["tp_sources"] == ["the model"]  # every split came from the model's own tp_plan
        s = res["sp_rank"]
        assert torch.allclose(
            torch.from_numpy(res["sp_logits"]), ref.logits.detach()[:, s * SEQ // 2 : (s + 1) * SEQ // 2], atol=1e-5
        )
        assert res["sp_norm"] == pytest.approx(norm, rel=1e-5)
