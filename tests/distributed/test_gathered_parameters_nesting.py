"""``GatheredParameters`` nested, overlapping and repeated on a live ZeRO-3 engine, and the DeepSpeed parameter
attributes RLHF libraries read (issue 40 item 3). 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_zero_stages import WORLD, engine_config, make_model, param_groups

from dscore.testing import run_distributed

CYCLES = 1000


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _job() -> dict[str, Any]:
    import torch.distributed as dist

    import dscore
    from dscore.zero import GatheredParameters, ZeroParamStatus

    engine, *_ = dscore.initialize(model=(model := make_model()), model_parameters=param_groups(model),
                                   config=engine_config(3, stage3_param_persistence_threshold=0))
    m = engine.module
    params = dict(m.named_parameters())
    out: dict[str, Any] = {}
    # attributes
    out["released"] = all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params.values())
    out["ids_unique"] = len({p.ds_id for p in params.values()}) == len(params)
    out["ds_tensor_sizes"] = all(p.ds_tensor.numel() == p.partition_numel() for p in params.values())
    out["external"] = [list(mod.ds_external_parameters()) for mod in m.modules()]
    pieces = {n: [torch.zeros(0)] * WORLD for n in params}
    for n, p in params.items():
        dist.all_gather_object(pieces[n], p.ds_tensor.clone())
    seen: list[set[int]] = []
    m.a.register_forward_pre_hook(lambda mod, args: seen.append(set(mod.weight.ds_active_sub_modules)))
    with torch.no_grad():
        engine(torch.ones(2, 7))
    out["active_in_forward"] = seen == [{id(m.a)}]
    out["active_after"] = len(m.a.weight.ds_active_sub_modules) == 0
    with GatheredParameters(list(params.values())):
        out["ds_tensor_is_share"] = all(
            torch.equal(torch.cat(pieces[n]), p.detach().reshape(-1)) and tuple(p.ds_shape) == tuple(p.shape)
            and p.ds_numel == p.numel() for n, p in params.items())
        # the training hooks and empty_partition_cache leave held units gathered
        with torch.no_grad():
            engine(torch.ones(2, 7))
        engine.empty_partition_cache()
        out["held_through_forward"] = all(p.ds_status is ZeroParamStatus.AVAILABLE for p in params.values())
    # overlapping nesting: the inner exit keeps what the outer holds
    with GatheredParameters([m.a.weight, m.b.weight]):
        with GatheredParameters([m.b.weight, m.frozen.weight]):
            pass
        out["inner_kept_outer"] = (m.b.weight.ds_status is ZeroParamStatus.AVAILABLE
                                   and m.frozen.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
                                   and bool(torch.isfinite(m.b.weight.sum())))
    out["outer_released"] = all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params.values())
    # a read-only inner context does not discard the outer modifier_rank=0 context's writes
    with GatheredParameters(m.a.weight, modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                m.a.weight.fill_(0.25)
        with GatheredParameters([m.a.weight, m.a.bias]):
            pass
    with GatheredParameters(m.a.weight):
        out["rank0_write_landed"] = bool((m.a.weight == 0.25).all())
    # repeated: nested modifier_rank / fwd_module cycles, no error and flat RSS
    rss: list[int] = []
    for i in range(CYCLES):
        with GatheredParameters(list(params.values()), modifier_rank=0, fwd_module=m):
            if dist.get_rank() == 0:
                with torch.no_grad():
                    m.b.bias.add_(1.0)
            with GatheredParameters([m.b.bias, m.a.bias]):
                pass
        if i in (99, CYCLES - 1):
            rss.append(_rss_bytes())
    with GatheredParameters(m.b.bias):
        out["bias_after_cycles"] = m.b.bias.detach().clone()
    out["rss_growth"] = rss[1] - rss[0]
    out["released_at_end"] = all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params.values())
    out["bias_before"] = None
    engine.close()
    return out


@pytest.mark.slow
def test_gathered_parameters_nest_repeat_and_carry_deepspeed_attributes() -> None:
    results = run_distributed(_job, WORLD, timeout=300)
    model = make_model()
    want_bias = model.b.bias.detach() + CYCLES
    for r in results:
        assert r["released"] and r["ids_unique"] and r["ds_tensor_sizes"] and r["ds_tensor_is_share"]
        assert all(ext == [] for ext in r["external"])
        assert r["active_in_forward"] and r["active_after"]
        assert r["held_through_forward"]
        assert r["inner_kept_outer"] and r["outer_released"]
        assert r["rank0_write_landed"]
        torch.testing.assert_close(r["bias_after_cycles"], want_bias)
        assert r["rss_growth"] < 4 * 2**20, r["rss_growth"]  # flat: under 4 MiB over 900 cycles
        assert r["released_at_end"]
