"""ZeRO stage 3 on the host re-gathers into the memory its released units gave back (2 gloo ranks), trains
exactly as the single-process reference, and ``engine.empty_partition_cache()`` frees what it kept."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_zero_stages import MICRO, STEPS, WORLD, batches, engine_config, make_model, param_groups, reference

from dscore.testing import run_distributed


def _train() -> dict[str, Any]:
    import torch.distributed as dist

    import dscore

    # release every unit after its forward, so backward re-gathers it: the cache serves both
    config = engine_config(3, overlap_comm=True, stage3_max_reuse_distance=0)
    model = make_model()
    engine, *_ = dscore.initialize(model=model, model_parameters=param_groups(model), config=config)
    stage = engine.zero_stage_impl
    rank = dist.get_rank()
    for window in batches():
        for x, y in window:
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
    cache = stage.buffer_cache
    out: dict[str, Any] = {
        "hits": cache.hits,
        "misses": cache.misses,
        "within_mark": cache.live_bytes + cache.cached_bytes <= cache.high_water_bytes,
        "cached_before": cache.cached_bytes,
    }
    names = [n for n, _ in engine.module.named_parameters()]
    with dscore.zero.GatheredParameters(list(engine.module.parameters())):
        out["params"] = {n: p.detach().clone().numpy() for n, p in zip(names, engine.module.parameters())}
    engine.empty_partition_cache()
    out["cached_after"] = cache.cached_bytes
    out["gathered_after"] = sum(1 for s in stage.units if s.unit.gathered and not s.unit.persistent)
    misses = cache.misses
    with torch.no_grad():
        engine(batches()[0][0][0][:MICRO])  # gathers again, into fresh memory
    out["misses_after_forward"] = cache.misses - misses
    engine.close()
    return out


@pytest.mark.slow
def test_stage3_regathers_into_kept_memory_and_empty_partition_cache_frees_it() -> None:
    results = run_distributed(_train, WORLD, timeout=300)
    ref = reference(STEPS)[0]
    for r in results:
        assert r["hits"] > r["misses"] > 0, r  # after the first gathers, re-gathers reuse memory
        assert r["within_mark"] and r["cached_before"] > 0
        assert r["cached_after"] == 0 and r["gathered_after"] == 0
        assert r["misses_after_forward"] > 0
        for name, got in r["params"].items():
            assert torch.allclose(torch.from_numpy(got), ref[name], atol=2e-5, rtol=1e-4), name
