"""Rank functions for tests/compat/test_compat_ds_pipe_names.py (one rank of a 2-process gloo job each)."""

from __future__ import annotations

from typing import Any


def pipeline_module_on_ds_topology_job() -> dict[str, Any]:
    """A 2-stage ``deepspeed.pipe.PipelineModule`` on a DeepSpeed-style topology object: each rank builds its
    own stage's layer; ``parallel_state_sp`` builds a 2-rank sequence group over the same world."""
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp

    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 2)],
                            topology=PipeDataParallelTopology(num_pp=2, num_dp=1), partition_method="uniform")
    sp.initialize_sequence_parallel(2)
    t = torch.tensor([float(dist.get_rank() + 1)], device="cpu")
    dist.all_reduce(t, group=sp.get_sequence_parallel_group())
    return {"layers": list(module.layer_range()), "stage": module.mpu().get_stage_id(),
            "sp_rank": sp.get_model_parallel_rank(), "sp_world": sp.get_sequence_parallel_world_size(),
            "sp_sum": float(t.item())}
