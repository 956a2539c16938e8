"""Pipeline pieces without extra processes: partitioning, the 1F1B schedule, topology, engine selection,
the ``pipeline`` config block, and a one-stage pipeline engine in this process against plain PyTorch."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from typing import Any

import pipe_models as pm
import pytest
import torch

from dscore import hookimpl
from dscore.errors import ComponentNotFoundError, ConfigError, DistributedError, PluginConflictError, PluginLoadError
from dscore.pipe import LayerSpec, PipeDataParallelTopology, PipelineError, PipelineModule, TiedLayerSpec
from dscore.pipe.module import partition_layers
from dscore.pipe.partition import partition_balanced, partition_uniform
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry
from dscore.specs import EngineSpec
from dscore_plugins.engine.pipe.schedule import BACKWARD, FORWARD, bubble_bound, inference_schedule, train_schedule

# ----------------------------------------------------------------------------------------- partitioning


def test_partition_uniform_gives_earlier_stages_the_remainder() -> None:
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    assert partition_uniform(6, 3) == [0, 2, 4, 6]
    assert partition_uniform(2, 3) == [0, 1, 2, 2]


def _bottleneck(weights: list[float], parts: list[int]) -> float:
    return max(sum(weights[parts[s] : parts[s + 1]]) for s in range(len(parts) - 1))


def test_partition_balanced_is_optimal_against_brute_force() -> None:
    rng = random.Random(3)
    for _ in range(60):
        n, p = rng.randint(1, 8), rng.randint(1, 4)
        weights = [float(rng.randint(0, 9)) for _ in range(n)]
        parts = partition_balanced(weights, p)
        assert parts[0] == 0 and parts[-1] == n and len(parts) == p + 1
        assert all(a <= b for a, b in zip(parts, parts[1:]))
        best = min(
            _bottleneck(weights, [0, *cuts, n])
            for cuts in itertools.combinations_with_replacement(range(n + 1), p - 1)
        )
        assert _bottleneck(weights, parts) == best


def test_partition_layers_methods() -> None:
    specs = [LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 64), pm.scale_half, LayerSpec(torch.nn.ReLU)]
    # parameters: the big Linear (4*64+64) gets a stage of its own
    assert partition_layers(specs, 2, "parameters") == [0, 1, 4]
    # type: balance the Linear layers only
    assert partition_layers(specs, 2, "type:linear") == [0, 1, 4]
    assert partition_layers(specs, 2, "uniform") == [0, 2, 4]
    with pytest.raises(ConfigError, match="matches no layer class"):
        partition_layers(specs, 2, "type:conv")
    with pytest.raises(ConfigError, match="'parameters', 'uniform', 'type:<regex>'"):
        partition_layers(specs, 2, "profile")
    with pytest.raises(ConfigError, match="bad regular expression"):
        partition_layers(specs, 2, "type:(")


# ----------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("m,p", [(1, 1), (4, 2), (8, 4), (2, 4), (5, 3)])
def test_train_schedule_is_1f1b(m: int, p: int) -> None:
    for s in range(p):
        steps = train_schedule(m, p, s)
        assert sorted(i for a, i in steps if a == FORWARD) == list(range(m))
        assert [i for a, i in steps if a == BACKWARD] == list(range(m))
        alive, peak = 0, 0
        for a, i in steps:
            if a == FORWARD:
                alive += 1
                peak = max(peak, alive)
            else:
                assert (FORWARD, i) in steps[: steps.index((a, i))]
                alive -= 1
        assert peak == min(p - s, m)  # activations alive: at most p - s (the 1F1B memory bound)
        warmup = min(p - s - 1, m)
        assert all(a == FORWARD for a, _ in steps[:warmup])
    assert inference_schedule(3) == [(FORWARD, 0), (FORWARD, 1), (FORWARD, 2)]
    assert bubble_bound(8, 4) == pytest.approx(8 / 11)
    with pytest.raises(ValueError):
        train_schedule(0, 2, 0)


def test_pipe_data_topology_layout() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert topo.world_size() == 6
    assert topo.get_coord(4) == {"pipe": 1, "data": 1}
    assert topo.get_rank(pipe=1, data=2) == 5
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]  # data-parallel groups
    assert topo.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]  # pipe groups
    with pytest.raises(ConfigError):
        topo.get_rank(pipe=0)


# ----------------------------------------------------------------------------------------- module


def test_pipeline_module_one_stage_builds_every_layer_with_global_names() -> None:
    pipe = PipelineModule(layers=pm.layer_specs(), num_stages=1, loss_fn=pm.loss_fn, seed_layers=True, base_seed=pm.BASE_SEED)
    names = sorted(n for n, _ in pipe.named_parameters())
    assert names == ["1.fc.bias", "1.fc.weight", "2.fc.bias", "2.fc.weight", "tied_modules.embed.weight"]
    assert pipe.layer_module(0) is pipe.layer_module(4) is pipe.tied_modules["embed"]
    plain = pm.PlainNet()
    tokens, _ = pm.micro_batch(0, 0, 0)
    torch.testing.assert_close(pipe(tokens), plain(tokens), rtol=0, atol=0)


def test_pipeline_module_errors() -> None:
    with pytest.raises(ConfigError, match="at least one layer"):
        PipelineModule(layers=[], num_stages=1)
    with pytest.raises(ConfigError, match="exactly one of num_stages= and topology="):
        PipelineModule(layers=[pm.scale_half])
    with pytest.raises(ConfigError, match="nn.Module subclass"):
        LayerSpec(int)
    with pytest.raises(ConfigError, match="must build the same class"):
        PipelineModule(
            layers=[TiedLayerSpec("t", torch.nn.Embedding, 3, 2), TiedLayerSpec("t", torch.nn.Linear, 2, 3)], num_stages=1
        )
    with pytest.raises(DistributedError, match="does not divide the world size|needs a process group"):
        PipelineModule(layers=pm.layer_specs(), num_stages=2)
    with pytest.raises(ConfigError, match="layer 0 is 3"):
        PipelineModule(layers=[3], num_stages=1)


# ----------------------------------------------------------------------------------------- engine selection


class _GreedyEngines:
    """A plugin whose engine accepts every model at the standard engine's priority."""

    @hookimpl
    def dscore_register_engines(self) -> list[EngineSpec]:
        return [EngineSpec(name="greedy", predicate="pipe_models:always", factory="pipe_models:never_built")]


class _BadPredicate:
    @hookimpl
    def dscore_register_engines(self) -> list[EngineSpec]:
        return [EngineSpec(name="odd", predicate="pipe_models:not_a_bool", factory="pipe_models:never_built", priority=5)]


def test_engine_selection_by_predicate_and_priority() -> None:
    registry = Registry(create_plugin_manager())
    assert [s.name for s in registry.specs("engine")][:2] == ["standard", "pipeline"]
    assert registry.select_engine(torch.nn.Linear(2, 2), None).name == "standard"
    pipe = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 2, 2)], num_stages=1)
    assert registry.select_engine(pipe, None).name == "pipeline"


def test_engine_selection_errors() -> None:
    conflict = Registry(create_plugin_manager(extra_plugins=[("greedy", _GreedyEngines())]))
    with pytest.raises(PluginConflictError, match="standard.*greedy|greedy.*standard"):
        conflict.select_engine(torch.nn.Linear(2, 2), None)
    # the pipeline engine still wins a pipeline model (higher priority)
    pipe = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 2, 2)], num_stages=1)
    assert conflict.select_engine(pipe, None).name == "pipeline"
    bad = Registry(create_plugin_manager(extra_plugins=[("odd", _BadPredicate())]))
    with pytest.raises(PluginLoadError, match="returned str, expected a bool"):
        bad.select_engine(torch.nn.Linear(2, 2), None)
    none = Registry(create_plugin_manager(load_entry_points=False))
    with pytest.raises(ComponentNotFoundError, match="no engine handles a model of type Linear"):
        none.select_engine(torch.nn.Linear(2, 2), None)


def test_plugins_list_kind_engine(python_exe: str) -> None:
    out = subprocess.run(
        [python_exe, "-m", "dscore", "plugins", "list", "--kind", "engine", "--json"],
        capture_output=True, text=True, check=True, timeout=120,
    )
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["engines"]["provides"]["engine"] == ["hybrid", "pipeline", "standard"]


# ----------------------------------------------------------------------------------------- config block


def test_pipeline_section_is_validated() -> None:
    from dscore.config import load_config

    registry = Registry(create_plugin_manager())
    base = pm.config(4)
    cfg = load_config({**base, "pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}, world_size=1, registry=registry)
    assert cfg.pipeline.stages == 2 and cfg.pipeline.partition == "best" and cfg.pipeline.pipe_partitioned is True
    with pytest.raises(ConfigError) as err:
        load_config({**base, "pipeline": {"stages": 0}}, world_size=1, registry=registry)
    assert err.value.path == "pipeline.stages"
    with pytest.raises(ConfigError) as err:
        load_config({**base, "pipeline": {"stagez": 2}}, world_size=1, registry=registry)
    assert err.value.path == "pipeline.stagez"


# ----------------------------------------------------------------------------------------- one-stage engine in process


def _one_stage(config: dict[str, Any], **module_kwargs: Any) -> Any:
    import dscore

    pipe = PipelineModule(
        layers=pm.layer_specs(), num_stages=1, loss_fn=pm.loss_fn, seed_layers=True, base_seed=pm.BASE_SEED,
        partition_method="uniform", **module_kwargs,
    )
    engine, optimizer, _, _ = dscore.initialize(model=pipe, config=config)
    return engine, pipe


def test_one_stage_pipeline_engine_trains_like_plain_torch() -> None:
    engine, pipe = _one_stage(pm.config(4, clip=0.05))
    try:
        assert type(engine).__name__ == "PipelineEngine"
        ref = pm.train_reference(2, 4, dp=1, clip=0.05)
        for step in range(2):
            loss = engine.train_batch(iter([pm.micro_batch(step, 0, mb) for mb in range(4)]))
            assert float(loss) == pytest.approx(ref["losses"][step], abs=2e-6)
            assert engine.get_global_grad_norm() == pytest.approx(ref["norms"][step], rel=1e-5)
        for idx, module in ((0, pipe.tied_modules["embed"]), (1, pipe.layer_module(1))):
            for key, value in module.state_dict().items():
                torch.testing.assert_close(value, ref["layers"][idx][key], rtol=0, atol=2e-6)
        before = [p.detach().clone() for p in pipe.parameters()]
        eval_loss = engine.eval_batch(iter([pm.micro_batch(9, 0, mb) for mb in range(4)]))
        assert eval_loss.dim() == 0 and all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
        with torch.no_grad():
            expected = sum(float(pm.loss_fn(pipe(t), y)) for t, y in (pm.micro_batch(9, 0, mb) for mb in range(2))) / 2
        pipe.train()
        assert float(engine.eval_batch(iter([pm.micro_batch(9, 0, mb) for mb in range(2)]), num_micro_batches=2)) == (
            pytest.approx(expected, abs=1e-6)
        )
        assert pipe.training
        with pytest.raises(PipelineError, match="Only train_batch"):
            engine(torch.zeros(2, 4, dtype=torch.long))
        with pytest.raises(PipelineError, match=r"\(inputs, labels\) pairs"):
            engine.train_batch(iter([torch.zeros(2)] * 4))
        with pytest.raises(PipelineError, match="ran out within a batch"):
            engine.train_batch(iter([pm.micro_batch(0, 0, 0)]))
    finally:
        engine.close()


@pytest.mark.parametrize(
    "extra,path",
    [
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
        ({"fp16": {"enabled": True}}, "fp16.enabled"),
        ({"pipeline": {"stages": 3}}, "pipeline.stages"),
        ({"pipeline": {"partition": "type:block"}}, "pipeline.partition"),
        ({"pipeline": {"seed_layers": True}}, "pipeline.seed_layers"),
    ],
)
def test_pipeline_engine_refuses_what_it_cannot_honour(extra: dict[str, Any], path: str) -> None:
    import dscore

    seed = path != "pipeline.seed_layers"
    pipe = PipelineModule(layers=pm.layer_specs(), num_stages=1, loss_fn=pm.loss_fn, seed_layers=seed)
    with pytest.raises(ConfigError) as err:
        dscore.initialize(model=pipe, config={**pm.config(2), **extra})
    assert err.value.path == path


def test_pipeline_block_sets_the_checkpoint_interval() -> None:
    engine, pipe = _one_stage({**pm.config(2), "pipeline": {"activation_checkpoint_interval": 2}})
    try:
        assert pipe.activation_checkpoint_interval == 2
        loss = engine.train_batch(iter([pm.micro_batch(0, 0, mb) for mb in range(2)]))
        assert torch.isfinite(loss)
    finally:
        engine.close()


def test_pipeline_checkpoint_readers_resolve_through_the_pipeline_engine_unit() -> None:
    """dscore.pipe.load_into_layers / layer_state_dicts are the engine plugin's functions; with the unit
    engine:pipeline disabled the model definition still imports and the readers are refused by name."""
    import os

    import dscore.pipe
    from dscore_plugins.engine.pipe import checkpoint

    assert dscore.pipe.load_into_layers is checkpoint.load_into_layers
    assert dscore.pipe.layer_state_dicts is checkpoint.layer_state_dicts
    code = (
        "from dscore.errors import ComponentNotFoundError\n"
        "from dscore.pipe import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec\n"
        "try:\n"
        "    from dscore.pipe import load_into_layers\n"
        "except ComponentNotFoundError as exc:\n"
        "    print('refused', exc)\n"
    )
    env = {**os.environ, "DSCORE_DISABLE_PLUGINS": "engine:pipeline"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused") and "engine:pipeline" in proc.stdout, proc.stdout


def test_dscore_import_stays_torch_free() -> None:
    code = "import sys, dscore, dscore.protocols, dscore.specs; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_one_stage_checkpoint_round_trip_and_missing_latest(tmp_path: Any) -> None:
    from dscore.errors import CheckpointNotFoundError

    engine, pipe = _one_stage(pm.config(2))
    try:
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)  # no `latest`: start fresh
        with pytest.raises(CheckpointNotFoundError):
            engine.load_checkpoint(str(tmp_path / "missing"))
        engine.train_batch(iter([pm.micro_batch(0, 0, mb) for mb in range(2)]))
        engine.save_checkpoint(str(tmp_path), client_state={"note": 1})
        saved = {k: v.clone() for k, v in pipe.state_dict().items()}
        engine.train_batch(iter([pm.micro_batch(1, 0, mb) for mb in range(2)]))
        path, client = engine.load_checkpoint(str(tmp_path))
        assert path.endswith("global_step1") and client == {"note": 1} and engine.global_steps == 1
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, saved[k]), k
    finally:
        engine.close()


def test_pipeline_engine_refuses_a_module_built_for_another_world_size() -> None:
    """A PipelineModule built before the process group existed (world 1) in a 2-process job."""
    from types import SimpleNamespace

    from dscore.protocols import EngineContext
    from dscore_plugins.engine.pipeline import build_pipeline_engine

    pipe = PipelineModule(layers=pm.layer_specs(), num_stages=1, loss_fn=pm.loss_fn)
    runtime = SimpleNamespace(comm=SimpleNamespace(get_world_size=lambda: 2))
    with pytest.raises(DistributedError, match="built for 1 process.*the job has 2.*init_distributed"):
        build_pipeline_engine(EngineContext(config=None, runtime=runtime, model=pipe))
