"""Rank function of test_tp_gather_replaced.py: ``GatherReplacedLayerParams`` (dscore's and the compat
``deepspeed.module_inject.layers`` one) on a tp-2 model at ZeRO 0 and ZeRO 3."""

from __future__ import annotations

from typing import Any

import torch
from tp_sp_model import batches, causal_lm_loss, ds_config, make_model

Q = "layers.0.self_attn.q_proj"  # column-split weight
ROW = "layers.0.self_attn.o_proj"  # row-split weight, replicated bias


def _loss(engine: Any) -> float:
    b = batches(1, 2, 16)[0]
    with torch.no_grad():
        return float(causal_lm_loss(engine(b["input_ids"]), b["labels"]))


def gather_checks() -> dict[str, Any]:
    import deepspeed.module_inject.layers as ds_layers

    import dscore
    from dscore.parallel.tp_layers import GatherReplacedLayerParams, shard_of

    out: dict[str, Any] = {"compat_is_dscore": ds_layers.GatherReplacedLayerParams is GatherReplacedLayerParams}
    full = {k: v.detach().clone() for k, v in make_model().state_dict().items()}
    for stage in (0, 3):
        cfg = ds_config(tensor_parallel={"autotp_size": 2},
                        zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0})
        engine, *_ = dscore.initialize(model=make_model(), config=cfg)
        mod = engine.module
        r: dict[str, Any] = {}
        names = dict(mod.named_parameters())
        shard_shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in names.items()}
        r["split_before"] = shard_shapes[f"{Q}.weight"] != tuple(full[f"{Q}.weight"].shape)
        loss0 = _loss(engine)
        gathered = dscore.zero.GatheredParameters(list(mod.parameters()), modifier_rank=0) if stage == 3 else None
        if stage == 3:
            q = mod.get_submodule(Q)
            try:
                with GatherReplacedLayerParams(list(q.parameters(recurse=False)), q):
                    r["unguarded"] = "entered"
            except RuntimeError as exc:
                r["unguarded"] = str(exc)
        if gathered is not None:
            gathered.__enter__()
        try:
            # every split layer, one at a time (DeepSpeed's consolidated state dict walk)
            per_layer = {}
            for lname, layer in mod.named_modules():
                if not hasattr(layer, "tp_params"):
                    continue
                with GatherReplacedLayerParams(list(layer.parameters(recurse=False)), layer, enabled=True):
                    for pname, p in layer.named_parameters(recurse=False):
                        key = f"{lname}.{pname}"
                        per_layer[key] = bool(torch.equal(p.detach(), full[key]))
            r["per_layer_full"] = per_layer
            r["shapes_restored"] = all(tuple(p.shape) == shard_shapes[n] or stage == 3 for n, p in names.items())
            # the whole model at once, a nested context inside it, a single tensor, enabled=False, no split param
            with GatherReplacedLayerParams(mod.parameters(), mod):
                r["whole_full"] = all(torch.equal(p.detach(), full[n]) for n, p in names.items())
                q = mod.get_submodule(Q)
                with GatherReplacedLayerParams(q.weight, q):
                    r["nested_shape"] = tuple(q.weight.shape)
                r["after_nested_shape"] = tuple(q.weight.shape)
            q = mod.get_submodule(Q)
            with GatherReplacedLayerParams(q.weight, q, enabled=False) as _:
                r["disabled_shape"] = tuple(q.weight.shape)
            norm = mod.get_submodule("norm")
            ctx = GatherReplacedLayerParams(list(norm.parameters()), norm)
            r["norm_enabled"] = ctx.enabled
            o = mod.get_submodule(ROW)
            with GatherReplacedLayerParams(list(o.parameters(recurse=False)), o):
                r["row_shapes"] = (tuple(o.weight.shape), tuple(o.bias.shape))
            # an edit made on every rank inside the context is kept (re-sliced from the edited full tensor)
            with GatherReplacedLayerParams([q.weight], q):
                with torch.no_grad():
                    q.weight.mul_(2.0)
            spec = q.tp_params["weight"]
            r["edit_kept_shard"] = bool(torch.equal(q.weight.detach(), shard_of(full[f"{Q}.weight"] * 2.0, spec)))
        finally:
            if gathered is not None:
                gathered.__exit__(None, None, None)
        sd = engine.zero_stage_impl.module_state_dict()
        r["edit_in_state_dict"] = bool(torch.equal(sd[f"{Q}.weight"].float(), full[f"{Q}.weight"] * 2.0))
        r["others_in_state_dict"] = all(torch.equal(sd[k].float(), v) for k, v in full.items() if k != f"{Q}.weight")
        r["loss_changed"] = _loss(engine) != loss0  # the edited weight is what the forward uses
        try:
            GatherReplacedLayerParams([1.0], mod)  # type: ignore[list-item]
        except TypeError as exc:
            r["bad_param"] = str(exc)
        out[stage] = r
        engine.close()
    return out
