"""Issue 39 (second part): DeepSpeed 0.19.8's ``deepspeed.pipe`` / ``runtime.pipe`` /
``runtime.activation_checkpointing.checkpointing`` / ``module_inject`` / ``sequence`` / ``moe.sharded_moe`` /
``runtime.sequence_parallel.parallel_state_sp`` names on dscore: importable, DeepSpeed's numbers where dscore has
the feature, NotProvidedError on use where it does not. Expected values were measured with DeepSpeed 0.19.8."""

from __future__ import annotations

import ds39p_jobs  # tests/compat is on sys.path: pytest's prepend import mode
import pytest
import torch

from dscore.errors import ConfigError, DscoreError
from dscore.testing import run_distributed


def test_topology_reads_as_deepspeeds() -> None:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    coord = topo.get_coord(5)  # DeepSpeed 0.19.8: ProcessCoord(pipe=1, data=0, model=1)
    assert (coord.pipe, coord.data, coord.model) == (1, 0, 1) and coord["data"] == 0 and tuple(coord) == (1, 0, 1)
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.filter_match(pipe=1, model=0) == [4, 6]
    assert topo.get_rank_repr(5) == "model_01" and topo.get_rank_repr(5, omit_axes=[]) == "pipe_01-data_00-model_01"
    assert topo.get_dim("tensor") == 0 and topo.get_dim("model") == 2
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="filter_match"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="rank 8 not found"):
        topo.get_coord(8)
    with pytest.raises(ConfigError, match="unknown axes"):
        ProcessTopology(["a"], [2]).filter_match(b=0)


def test_pipeline_module_one_stage_and_refusals() -> None:
    import deepspeed.pipe
    from deepspeed.runtime.pipe import PipelineModule as RuntimePipelineModule
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    import dscore.pipe

    assert deepspeed.pipe.PipelineModule is RuntimePipelineModule
    torch.manual_seed(0)
    module = deepspeed.pipe.PipelineModule([deepspeed.pipe.LayerSpec(torch.nn.Linear, 3, 3), torch.nn.ReLU()],
                                           num_stages=1)
    assert isinstance(module, dscore.pipe.PipelineModule) and module.dynamic_shape is False
    x = torch.randn(2, 3, device="cpu")
    assert torch.equal(module(x), torch.relu(module.layer_module(0)(x)))
    with pytest.raises(DscoreError, match=r"dynamic_shape=True\) \(DeepSpeed 0.19.8\) is not provided"):
        deepspeed.pipe.PipelineModule([torch.nn.ReLU()], num_stages=1, dynamic_shape=True)
    assert not isinstance(module, PipelineEngine)
    with pytest.raises(DscoreError, match="deepspeed.initialize"):
        PipelineEngine()
    with pytest.raises(DscoreError, match="TrainSchedule .DeepSpeed 0.19.8. is not provided"):
        TrainSchedule(micro_batches=4, stages=2, stage_id=0)
    with pytest.raises(DscoreError, match="DualPipeVModule"):
        deepspeed.pipe.DualPipeVModule([])


def test_activation_checkpointing_module_is_dscores() -> None:
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    assert ds_ckpt.checkpoint is deepspeed.checkpointing.checkpoint
    assert ds_ckpt.configure is deepspeed.checkpointing.configure
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(4, 3, device="cpu", requires_grad=True)
    ds_ckpt.non_reentrant_checkpoint(lambda a: lin(a).tanh(), x).sum().backward()
    want_x = x.grad.clone()
    x.grad = None
    lin(x).tanh().sum().backward()
    assert torch.allclose(want_x, x.grad)
    with pytest.raises(DscoreError, match="get_cuda_rng_tracker .DeepSpeed 0.19.8. is not provided"):
        ds_ckpt.get_cuda_rng_tracker()


def test_gating_gives_deepspeeds_numbers() -> None:
    from deepspeed.moe.sharded_moe import top1gating, top2gating, topkgating

    torch.manual_seed(0)
    logits = torch.randn(8, 4, device="cpu")
    l_aux, combine, dispatch, counts = top1gating(logits, 1.0, 1, use_rts=False)
    # DeepSpeed 0.19.8 on the same logits: l_aux 1.0000, combine sum 3.6162
    assert combine.shape == dispatch.shape == (8, 4, 2) and counts.shape == (4,)
    assert abs(float(l_aux) - 1.0) < 1e-4 and abs(float(combine.sum()) - 3.6162) < 1e-4
    assert abs(float(topkgating(logits, 3, 1.0, 1)[0]) - 1.0270) < 1e-4
    with pytest.raises(DscoreError, match="sparse_routes=True"):
        top2gating(logits, 1.0, 1, sparse_routes=True)
    with pytest.raises(DscoreError, match="drop_policy='position'"):
        topkgating(logits, 2, 1.0, 1, drop_policy="position")


def test_missing_features_import_and_refuse_on_use() -> None:
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.layers import LinearLayer
    from deepspeed.module_inject.tp_shard import get_shard_size_list
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter
    from deepspeed.moe.sharded_moe import _route_slots
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    from deepspeed.sequence.fpdt_layer import FPDT_InputConstruct
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    for name in (AutoEPMoELayer, AutoTP, LinearLayer, get_shard_size_list, TokenChoiceTopKRouter, _route_slots, PipelineParallelGrid,
                 TiledFusedLogitsLoss, FPDT_InputConstruct, DistributedAttention, _get_expert_parallel_ranks):
        with pytest.raises(DscoreError, match=r"\(DeepSpeed 0.19.8\) is not provided by dscore: \S"):
            name()


def test_parallel_state_sp_before_initialize_is_refused() -> None:
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    with pytest.raises(DscoreError, match="initialize_sequence_parallel"):
        parallel_state_sp.get_sequence_parallel_rank()


@pytest.mark.slow
def test_two_stage_pipeline_module_and_sequence_groups_on_two_ranks() -> None:
    results = run_distributed(ds39p_jobs.pipeline_module_on_ds_topology_job, 2, timeout=120)
    assert [r["layers"] for r in results] == [[0], [1]]
    assert [r["stage"] for r in results] == [0, 1]
    assert [r["sp_rank"] for r in results] == [0, 1] and {r["sp_world"] for r in results} == {2}
    assert {r["sp_sum"] for r in results} == {3.0}
