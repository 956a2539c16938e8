"""AutoTP training through ``dscore.initialize`` on real gloo ranks against one process on the full model:
the rank functions and their checks, run by ``test_tp_sp.py`` (one spawn per world size for AutoTP and
Ulysses together: process start-up dominates on 2 cores).

* 2 ranks, tp 2: 3 AdamW steps with exact clipping (the norm across shards is active: clip below the
  norm), losses, logits and parameters equal the reference within 1e-5; the same-batch check; a
  checkpoint saved at tp 2 loads into a tp-1 engine (full tensors, optimizer state included).
* 4 ranks, tp 2 x dp 2 at ZeRO 1 and ZeRO 3: 3 steps equal the reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tp_sp_model import batches, causal_lm_loss, ds_config, make_model, reference_dp

SEQ, MICRO, STEPS, CLIP = 16, 2, 3, 0.5


def _train(stage: int, clip: float) -> dict[str, Any]:
    import dscore

    model = make_model()
    cfg = ds_config(tensor_parallel={"autotp_size": 2}, zero_optimization={"stage": stage}, gradient_clipping=clip)
    # a parameter list built before the split (a common DeepSpeed call) is remapped to the split parameters
    engine, _, _, _ = dscore.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    mesh = engine.runtime.mesh
    d = mesh.dp_rank
    losses, norms, logits0, grads0 = [], [], None, {}
    for i, b in enumerate(batches(STEPS, MICRO * mesh.dp_size, SEQ)):
        ids, labels = b["input_ids"][d * MICRO : (d + 1) * MICRO], b["labels"][d * MICRO : (d + 1) * MICRO]
        logits = engine(ids)
        loss = causal_lm_loss(logits, labels)
        engine.backward(loss)
        if i == 0 and stage == 0:  # ZeRO 0: this rank's (split) gradients, averaged, before the step clips them
            from dscore.parallel.autotp import tp_params_of

            specs = tp_params_of(engine.module)
            grads0 = {n: (p.grad.detach().numpy().copy(), specs.get(n)) for n, p in engine.module.named_parameters()}
        engine.step()
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        if i == 0:
            logits0 = logits.detach().numpy().copy()
        losses.append(float(loss.detach()))
    full = {k: v.detach().float().numpy().copy() for k, v in engine.zero_stage_impl.module_state_dict().items()}
    local = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    assert engine.zero_optimization_stage() == stage
    return {
        "losses": losses,
        "norms": norms,
        "logits": logits0,
        "grads": grads0,
        "params": full,
        "local_shapes": local,
        "engine": engine,
        "dp": mesh.dp_size,
        "dp_rank": d,
    }


def two_ranks(tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    import dscore
    from dscore.parallel.autotp import TPBatchMismatchError

    out = _train(0, CLIP)
    engine = out.pop("engine")
    engine.save_checkpoint(tmp, tag="tp2")
    saved_state = engine.zero_stage_impl.state_dict()
    exp_avg = {n: st["exp_avg"].clone() for n, st in saved_state["state"].items()}

    # a tp-1 engine (dp 2) over a fresh model loads the tp-2 checkpoint: full tensors, optimizer state too
    plain, _, _, _ = dscore.initialize(model=make_model(seed=5), config=ds_config())
    plain.load_checkpoint(tmp, tag="tp2")
    loaded = {k: v.detach().float().clone() for k, v in plain.zero_stage_impl.module_state_dict().items()}
    plain_state = plain.zero_stage_impl.state_dict()
    out["ckpt_weights_equal"] = all(torch.equal(loaded[k], torch.from_numpy(out["params"][k])) for k in out["params"])
    out["ckpt_exp_avg_equal"] = all(torch.allclose(plain_state["state"][n]["exp_avg"], v) for n, v in exp_avg.items())
    out["ckpt_param_groups"] = len(saved_state["param_groups"])
    # and back: the tp-1 checkpoint loads into the tp-2 engine (full tensors sliced per rank)
    plain.save_checkpoint(tmp, tag="tp1")
    engine.load_checkpoint(tmp, tag="tp1")
    back = engine.zero_stage_impl.module_state_dict()
    out["ckpt_back_equal"] = all(torch.equal(back[k].float(), loaded[k]) for k in loaded)

    # dscore.tp_model_init splits before initialize (DeepSpeed's flow); initialize keeps that split
    pre = dscore.tp_model_init(make_model(), tp_size=2, dtype=None)
    split_rows = tuple(pre.layers[0].self_attn.q_proj.weight.shape)
    early, _, _, _ = dscore.initialize(model=pre, config=ds_config(tensor_parallel={"autotp_size": 2}))
    first = batches(1, MICRO, SEQ)[0]["input_ids"]
    out["tp_model_init_logits"] = early(first).detach().numpy().copy()
    out["tp_model_init_rows"] = split_rows

    # ranks of one tensor-parallel group fed different batches: refused on the first forward
    other, _, _, _ = dscore.initialize(model=make_model(), config=ds_config(tensor_parallel={"autotp_size": 2}))
    ids = torch.full((MICRO, SEQ), dist.get_rank(), dtype=torch.long)
    try:
        other(ids)
        out["mismatch"] = None
    except TPBatchMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


def four_ranks() -> list[dict[str, Any]]:
    results = []
    for stage in (1, 3):
        r = _train(stage, 0.0)
        r.pop("engine")
        results.append(r)
    return results


def _check(res: dict[str, Any], ref: dict[str, Any], dp: int) -> None:
    # each rank reports its dp shard's loss; the mean over dp ranks is the reference's step loss
    for name, value in ref["params"].items():
        got = torch.from_numpy(res["params"][name])
        assert got.shape == value.shape, name
        assert torch.allclose(got, value, atol=1e-5, rtol=0), (name, (got - value).abs().max())


def check_two_ranks(results: list[dict[str, Any]]) -> None:
    """Assertions over :func:`two_ranks`' results (one per rank)."""
    ref = reference_dp(STEPS, MICRO, 1, SEQ, CLIP)
    assert ref["norms"][0] > CLIP  # clipping is active, so the norm across shards decides the update
    for res in results:
        _check(res, ref, 1)
        assert res["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        assert [float(n) for n in res["norms"]] == pytest.approx(ref["norms"], rel=1e-5)
        assert torch.allclose(torch.from_numpy(res["logits"]), ref["logits"][:MICRO], atol=1e-5)
        # the layers really are split: half the rows of q_proj, half the columns of down_proj
        assert res["local_shapes"]["layers.0.self_attn.q_proj.weight"] == (16, 32)
        assert res["local_shapes"]["layers.0.mlp.down_proj.weight"] == (32, 32)
        assert res["local_shapes"]["lm_head.weight"] == (32, 32)
        assert res["ckpt_weights_equal"] and res["ckpt_exp_avg_equal"] and res["ckpt_back_equal"]
        assert res["ckpt_param_groups"] == 1  # the user's one group, not the internal replicated/split pair
        assert res["mismatch"] is not None and "different inputs" in res["mismatch"]
        # first-step gradients: each rank's shard of every split parameter, the replicated ones whole
        from dscore.parallel.tp_layers import shard_of

        assert set(res["grads"]) == set(ref["grads"])
        for name, (grad, spec) in res["grads"].items():
            want = ref["grads"][name] if spec is None else shard_of(ref["grads"][name], spec)
            assert torch.allclose(torch.from_numpy(grad), want, atol=1e-6, rtol=1e-5), name
        assert res["tp_model_init_rows"] == (16, 32)
        assert torch.allclose(torch.from_numpy(res["tp_model_init_logits"]), ref["logits"][:MICRO], atol=1e-5)


def check_four_ranks(results: list[list[dict[str, Any]]]) -> None:
    """Assertions over :func:`four_ranks`' results (one list per rank)."""
    ref = reference_dp(STEPS, MICRO, 2, SEQ)
    for rank_results in results:
        for res in rank_results:
            assert res["dp"] == 2
            _check(res, ref, 2)
    for i in range(2):  # per stage: the mean of the two dp shards' losses is the reference loss
        means = [(results[0][i]["losses"][s] + results[2][i]["losses"][s]) / 2 for s in range(STEPS)]
        assert means == pytest.approx(ref["losses"], abs=1e-5)
