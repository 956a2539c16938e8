"""DeepSpeed 0.19.8's tensor/sequence-parallel import paths through the compat layer (in-process, one rank).

The 2- and 4-rank numerics of AutoTP and Ulysses are dscore's own (tests/distributed/test_tp_sp.py); here:
each DeepSpeed name resolves to dscore's object, ``initialize(mpu=, mesh_param=)`` routes to what
``dscore.initialize`` supports, and what dscore lacks is refused naming it.
"""

from __future__ import annotations

import inspect
import types

import deepspeed
import pytest
import torch

import dscore
from dscore.errors import ConfigError, DscoreError
from dscore.runtime.initialize import InitializeError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _config(**extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}


def test_deepspeed_parallel_names_are_dscores_objects() -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledMLP,
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
        sequence_tiled_compute,
    )
    from deepspeed.utils import groups

    import dscore.parallel.groups as dgroups
    import dscore.parallel.ulysses as dulysses
    from dscore.parallel.autotp import tp_model_init

    assert deepspeed.tp_model_init is tp_model_init
    assert (UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, TiledMLP, sequence_tiled_compute) == (
        dulysses.UlyssesSPAttentionHF, dulysses.UlyssesSPDataLoaderAdapter, dulysses.TiledMLP,
        dulysses.sequence_tiled_compute)
    # what accelerate 1.15 / transformers 5.x call (underscored in DeepSpeed), and the public spellings
    for name in ("_get_sequence_parallel_group", "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank",
                 "_get_sequence_data_parallel_group", "_get_sequence_data_parallel_world_size",
                 "_get_sequence_data_parallel_rank", "_get_data_parallel_group", "_get_data_parallel_world_size",
                 "_get_data_parallel_rank", "_get_zero_param_intra_parallel_group",
                 "_get_zero_param_intra_parallel_group_world_size", "_get_zero_param_intra_parallel_rank_in_mygroup",
                 "_get_zero_param_intra_parallel_group_ranks"):
        assert getattr(groups, name) is getattr(dgroups, name.lstrip("_")), name
    for name in dgroups.__all__:
        if name not in ("current_mesh", "note_engine", "note_mesh"):
            assert getattr(groups, name) is getattr(dgroups, name), name
    assert deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP is TiledMLP


def test_what_dscore_lacks_is_refused_by_name() -> None:
    from deepspeed.runtime.sequence_parallel import ulysses_sp
    from deepspeed.utils import groups

    for name in ("_get_broadcast_src_rank", "_get_expert_parallel_group_dict", "initialize",
                 "_create_zero_param_parallel_group"):
        stand_in = getattr(groups, name)  # importable (issue 39): refused when used
        with pytest.raises(DscoreError, match=f"deepspeed.utils.groups.{name} .DeepSpeed 0.19.8. is not provided"):
            stand_in()
    for name in ("SequenceTiledCompute", "TiledFusedLogitsLoss", "AutogradComputeMLP"):
        stand_in = getattr(ulysses_sp, name)
        with pytest.raises(DscoreError, match=f"ulysses_sp.{name} .DeepSpeed 0.19.8. is not provided"):
            stand_in()
    assert not hasattr(groups, "no_such_accessor") and not hasattr(ulysses_sp, "NoSuchName")
    with pytest.raises(AttributeError, match="sequence_parallel.nope"):
        deepspeed.runtime.sequence_parallel.nope  # noqa: B018


def test_register_with_transformers_takes_deepspeeds_arguments() -> None:
    """Accelerate 1.15 binds these keywords (and passes ``disable_in_eval`` only where the signature has it)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    sig = inspect.signature(UlyssesSPAttentionHF.register_with_transformers)
    sig.bind(model_name_or_path="m", sequence_parallel_size=2, seq_length=64, seq_length_is_variable=False,
             core_attn_implementation="sdpa", micro_batch_size=1)
    assert list(sig.parameters)[:4] == ["model_name_or_path", "core_attn_implementation", "sequence_parallel_size",
                                        "micro_batch_size"]  # DeepSpeed's positional order
    assert "disable_in_eval" not in sig.parameters
    with pytest.raises(ConfigError, match="seq_length_is_variable=False needs seq_length"):
        UlyssesSPAttentionHF.register_with_transformers("m", "sdpa", 2, 1, seq_length_is_variable=False)
    with pytest.raises(ConfigError, match="seq_length 64 != max_length 32"):
        UlyssesSPAttentionHF.register_with_transformers("m", "sdpa", 2, 1, seq_length=64, max_length=32)


def test_initialize_routes_mesh_param_and_mpu() -> None:
    from deepspeed.utils import groups

    from dscore.runtime.context import use_runtime

    engine, _, _, _ = deepspeed.initialize(model=_model(), config=_config(), mesh_param=(1, 1))
    try:
        with use_runtime(engine.runtime):
            assert groups._get_sequence_parallel_world_size() == 1 and groups.get_data_parallel_world_size() == 1
            assert groups._get_sequence_data_parallel_world_size() == 1 and groups._get_data_parallel_rank() == 0
    finally:
        engine.close()
    # Accelerate's call, keyword for keyword: the returned mpu answers its calls and becomes the engine's mesh
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import LlamaConfig

    deepspeed.init_distributed()
    hf_model = types.SimpleNamespace(config=LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                                        num_hidden_layers=1, intermediate_size=32))
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=hf_model, sequence_parallel_size=1, seq_length=8, seq_length_is_variable=False,
        core_attn_implementation="sdpa", micro_batch_size=2)
    assert (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()) == (1, 0)
    again, _, _, _ = deepspeed.initialize(model=_model(), config=_config(), mpu=mpu)
    assert again.runtime.mesh is mpu
    again.close()
    with pytest.raises(ConfigError, match=r"mpu= must be a dscore.parallel.ParallelMesh .*got SimpleNamespace"):
        deepspeed.initialize(model=_model(), config=_config(), mpu=types.SimpleNamespace())
    with pytest.raises(ConfigError, match=r"data_parallel_size 2 but the 1 launched ranks give 1"):
        deepspeed.initialize(model=_model(), config=_config(), mesh_param=(2, 1))
    with pytest.raises(ConfigError, match=r"mesh_param=\(1, 2\)\) says sequence_parallel_size 2 but the config"):
        deepspeed.initialize(model=_model(), config=_config(sequence_parallel_size=1), mesh_param=(1, 2))
    with pytest.raises(ConfigError, match="sequence_parallel_size .2. = 2 does not divide the world size 1"):
        deepspeed.initialize(model=_model(), config=_config(), mesh_param=(1, 2))
    with pytest.raises(ConfigError, match="mesh_param has only data and sequence dimensions"):
        deepspeed.initialize(model=_model(), config=_config(tensor_parallel={"autotp_size": 2}), mesh_param=(1, 1))
    for bad in ((1,), (1, 0), "1x2", (1.0, 2)):
        with pytest.raises(InitializeError, match="expected DeepSpeed's .data_parallel_size, sequence_parallel_size."):
            deepspeed.initialize(model=_model(), config=_config(), mesh_param=bad)
    assert dscore.initialize is not deepspeed.initialize
