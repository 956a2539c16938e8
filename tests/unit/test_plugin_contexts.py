"""Typed factory contexts, optimizer capabilities declared by spec, op lookup through the runtime (issue 16)."""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest
import torch

import dscore
from dscore.config import load_config
from dscore.errors import ComponentNotFoundError, ConfigError
from dscore.protocols import OptimizerContext, TorchClassParams
from dscore.runtime.context import use_runtime
from dscore.runtime.optimizer_builder import component_section, is_offload_capable, is_zero_supported
from dscore.specs import OptimizerSpec, resolve
from dscore.testing.contexts import local_runtime


@pytest.fixture(scope="module")
def runtime():
    # a module fixture runs outside the per-test environment restore: undo what the runtime exported
    saved_env = dict(os.environ)
    yield local_runtime()
    os.environ.clear()
    os.environ.update(saved_env)


def _optimizer_specs(runtime) -> list[OptimizerSpec]:
    return [s for s in runtime.registry.specs("optimizer") if isinstance(s, OptimizerSpec) and s.name != "torch"]


def _load(runtime, opt_type: str, params: dict) -> None:
    load_config({"train_batch_size": 1, "optimizer": {"type": opt_type, "params": params}}, world_size=1,
                registry=runtime.registry)


def test_every_registered_optimizer_has_a_params_model(runtime) -> None:
    missing = [s.name for s in _optimizer_specs(runtime) if not s.params_model]
    assert not missing, f"optimizers without a params model (their factories would get raw params): {missing}"


@pytest.mark.parametrize(
    "bad, path, message",
    [
        ({"lr": -1.0}, "optimizer.params.lr", "optimizer.params.lr: Input should be greater than or equal to 0 (got -1.0)"),
        ({"betas": [0.9, 1.5]}, "optimizer.params.betas[1]", "optimizer.params.betas[1]: Input should be less than 1 (got 1.5)"),
        ({"betas": "x"}, "optimizer.params.betas", None),
        ({"lr_typo": 1e-3}, "optimizer.params.lr_typo", None),
    ],
)
def test_same_bad_value_same_config_error_in_every_optimizer(runtime, bad: dict, path: str, message) -> None:
    """At load (what initialize does) and at build (component_section), for every optimizer taking the key."""
    seen: dict[str, str] = {}
    for spec in _optimizer_specs(runtime):
        model = resolve(spec.params_model)
        if not set(bad) <= set(model.model_fields) and "typo" not in next(iter(bad)):
            continue
        for where in ("load", "build"):
            with pytest.raises(ConfigError) as info:
                if where == "load":
                    _load(runtime, spec.name, bad)
                else:
                    component_section(spec, runtime.registry, spec.name, bad, fallback=False, path="optimizer.params")
            err = info.value
            assert err.path == path, (spec.name, where, err.path)
            line = dict(err.errors)[path]
            if message is not None:
                assert line == message, (spec.name, where)
            seen[f"{spec.name}/{where}"] = line.split(" (valid keys here")[0]  # the list differs per optimizer
    assert len(seen) >= 4 and len(set(seen.values())) == 1, seen
    if "betas" in bad:
        assert {"adam/load", "lamb/load", "lion/load", "DscoreCPUAdam/load", "FusedAdam/load"} <= set(seen)


def test_defaults_come_from_the_params_model_only(runtime) -> None:
    # Adam's defaults: one place (AdamParams); the factory reads the validated section
    from dscore_plugins.optim.config import AdamParams

    spec = runtime.registry.get("optimizer", "Adam")
    section = component_section(spec, runtime.registry, "Adam", {}, fallback=False, path="optimizer.params")
    assert isinstance(section, AdamParams) and section == AdamParams()
    ctx = OptimizerContext(config=load_config({"train_batch_size": 1}, world_size=1, registry=runtime.registry),
                           section=section, runtime=runtime, path="optimizer.params")
    opt = resolve(spec.factory)([{"params": [torch.nn.Parameter(torch.zeros(2))]}], ctx)
    group = opt.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (
        section.lr, section.betas, section.eps, section.weight_decay,
    )
    # the torch fallback gets a context too: the type as written and its arguments for torch to check
    fallback = runtime.registry.get("optimizer", "torch")
    s = component_section(fallback, runtime.registry, "RMSprop", {"lr": 0.1}, fallback=True, path="optimizer.params")
    assert s == TorchClassParams(type_name="RMSprop", params={"lr": 0.1})


def test_zero_and_offload_capabilities_are_decided_by_spec(runtime) -> None:
    from dscore_plugins.ops.cpu_optim import DscoreCPUAdagrad, DscoreCPUAdam, DscoreCPULion
    from dscore_plugins.ops.fused_optim import FusedAdam, FusedLamb, FusedLion
    from dscore_plugins.optim.lamb import Lamb
    from dscore_plugins.optim.muon import MuonWithAuxAdam

    class MyAdam(torch.optim.Adam):  # a subclass may change step(): not known, as in DeepSpeed
        pass

    reg = runtime.registry
    known = [torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, FusedAdam, FusedLion, DscoreCPUAdam,
             DscoreCPUAdagrad, DscoreCPULion, MuonWithAuxAdam]
    assert all(is_zero_supported(reg, c) for c in known)
    assert not any(is_zero_supported(reg, c) for c in (torch.optim.SGD, torch.optim.RMSprop, Lamb, FusedLamb, MyAdam))
    assert all(is_offload_capable(reg, c) for c in (DscoreCPUAdam, DscoreCPUAdagrad, DscoreCPULion))
    assert not any(is_offload_capable(reg, c) for c in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, FusedAdam))
    # no class-name lists left in the core
    import inspect

    import dscore.runtime.optimizer_builder as ob

    src = inspect.getsource(ob)
    assert "_ZERO_SUPPORTED" not in src and "__name__ in" not in src


def test_a_plugin_declares_its_optimizer_zero_safe_by_spec() -> None:
    """An extra plugin's spec (zero_supported, classes) is all it takes; nothing matches by name."""
    from dscore import hookimpl

    class Sign(torch.optim.SGD):
        pass

    mod = types.ModuleType("_ctx_test_optim")
    mod.Sign = Sign

    sys.modules["_ctx_test_optim"] = mod
    try:
        class Plugin:
            @hookimpl
            def dscore_register_optimizers(self):
                return [OptimizerSpec(name="signx", factory="_ctx_test_optim:Sign", zero_supported=True,
                                      classes=("_ctx_test_optim:Sign",))]

        from dscore.plugin_manager import create_plugin_manager
        from dscore.registry import Registry

        reg = Registry(create_plugin_manager(extra_plugins=[("ctxtest", Plugin())]))
        assert is_zero_supported(reg, Sign) and not is_zero_supported(reg, torch.optim.SGD)
    finally:
        del sys.modules["_ctx_test_optim"]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))


def _cfg(stage: int, **extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage, **extra}}


@pytest.mark.parametrize("form", ["instance", "callable"])
def test_core_check_covers_client_instances_and_callables(form: str) -> None:
    def client(model: torch.nn.Module, cls: type, **kw: object):
        if form == "instance":
            return cls(model.parameters(), lr=0.1, **kw)
        return lambda groups: cls(groups, lr=0.1, **kw)

    m = _model()
    with pytest.raises(ConfigError) as info:
        dscore.initialize(model=m, optimizer=client(m, torch.optim.SGD), config=_cfg(2))
    assert info.value.path == "zero_allow_untested_optimizer" and "torch.optim.sgd.SGD" in str(info.value)
    m = _model()
    engine, opt, _, _ = dscore.initialize(model=m, optimizer=client(m, torch.optim.AdamW), config=_cfg(2))
    engine.close()
    m = _model()
    with pytest.raises(ConfigError) as info:
        dscore.initialize(model=m, optimizer=client(m, torch.optim.AdamW),
                          config=_cfg(2, offload_optimizer={"device": "cpu"}))
    assert info.value.path == "zero_force_ds_cpu_optimizer"


def test_op_lookup_uses_the_runtime_registry_so_plugins_disable_holds() -> None:
    from dscore.ops import get_op_builder

    # outside any runtime (the CLI): fresh discovery finds the op
    assert type(get_op_builder("cpu_adam")).__name__ == "CPUAdamBuilder"
    # inside a runtime whose config disables the ops plugin: refused, naming the plugin
    with use_runtime(local_runtime(disable=("ops",))):
        with pytest.raises(ComponentNotFoundError) as info:
            get_op_builder("cpu_adam")
    assert "'ops'" in str(info.value) and "disabled" in str(info.value)


def test_op_lookup_during_training_names_the_disabled_plugin() -> None:
    """An optimizer looking an op up in step(): the engine's runtime (ops disabled) answers, not a fresh scan."""
    from dscore.ops import get_op_builder

    class LooksUpAnOp(torch.optim.SGD):
        def step(self, closure=None):
            get_op_builder("cpu_adam")
            return super().step(closure)

    m = _model()
    cfg = {**_cfg(0), "plugins": {"disable": ["ops"]}}
    engine, *_ = dscore.initialize(model=m, optimizer=LooksUpAnOp(m.parameters(), lr=0.1), config=cfg)
    try:
        engine.backward(engine(torch.randn(2, 4)).sum())
        with pytest.raises(ComponentNotFoundError) as info:
            engine.step()
        assert "op builder 'cpu_adam'" in str(info.value) and "'ops'" in str(info.value)
    finally:
        engine.close()


def test_offloaded_adam_with_ops_disabled_falls_back_and_says_why(caplog) -> None:
    """Before: a fresh plugin scan built cpu_adam although the config disabled the ops plugin."""
    m = _model()
    cfg = {**_cfg(2, offload_optimizer={"device": "cpu"}), "plugins": {"disable": ["ops"]},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    with caplog.at_level(logging.WARNING, logger="dscore.optim"):
        engine, opt, _, _ = dscore.initialize(model=m, config=cfg)
    try:
        inner = getattr(opt, "optimizer", opt)
        assert type(inner).__module__.startswith("torch.optim"), type(inner)
        assert any("cpu_adam" in r.getMessage() and "'ops'" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()
