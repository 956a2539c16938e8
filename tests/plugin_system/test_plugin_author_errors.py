"""What a third-party plugin author gets wrong, and the dscore error each mistake must produce.

Every case uses a fake installed distribution (real ``importlib.metadata`` discovery) or the protocol
itself: an incomplete ZeRO stage, an import-string typo, an unregistered/disabled section, a monitor whose
section cannot be enabled, an unknown ``zero_optimization.implementation``, a manifest that imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fakedist import write_distribution

import dscore
from dscore.config import load_config
from dscore.errors import ComponentNotFoundError, ConfigError, PluginLoadError, PluginValidationError
from dscore.protocols import StepOutcome, ZeroStage

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("DSCORE_DISABLE_PLUGINS", raising=False)
    handlers = logging.root.handlers[:]
    yield root
    logging.root.handlers[:] = handlers  # the CLI's logging.basicConfig
    for mod in [m for m in sys.modules if m.startswith("authorplug_")]:
        del sys.modules[mod]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _cfg(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, **extra}


# ------------------------------------------------------------------ 1: load_module_state_dict
class _NoModuleLoad(ZeroStage):
    """Everything but ``load_module_state_dict``: the method whose old default left fp32 masters stale."""

    stage = 2

    @property
    def optimizer(self) -> None:
        return None

    def backward(self, loss: torch.Tensor, *, boundary: bool, sync: bool = True, retain_graph: bool = False) -> None:
        loss.backward(retain_graph=retain_graph)

    def step(self) -> StepOutcome:
        return StepOutcome(applied=True, overflow=False, global_grad_norm=None)

    def zero_grad(self) -> None:
        self.ctx.module.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        del state, load_optimizer_states

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        return self.ctx.module.state_dict()

    def partition_bytes(self) -> dict[str, int]:
        return {"optimizer_state": 0, "parameters": 0, "gradients": 0}


def test_load_module_state_dict_is_abstract_every_stage_implements_it() -> None:
    assert "load_module_state_dict" in ZeroStage.__abstractmethods__
    with pytest.raises(TypeError, match="load_module_state_dict"):
        _NoModuleLoad(None)  # type: ignore[arg-type]
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    registry = Registry(create_plugin_manager())
    for spec in registry.specs("zero_stage"):
        cls = registry.load(spec)
        assert not getattr(cls, "__abstractmethods__", None), (spec.name, cls.__abstractmethods__)


STAGE_PLUGIN = """
from dscore import hookimpl
from dscore.specs import ZeroStageSpec

@hookimpl
def dscore_register_zero_stages():
    return [
        ZeroStageSpec(name="incomplete2", stage=2, default=False, factory="{incomplete}"),
        ZeroStageSpec(name="typo2", stage=2, default=False, factory="authorplug_stage:Stage2Typo"),
        ZeroStageSpec(name="nomodule2", stage=2, default=False, factory="authorplug_nosuch.mod:Stage"),
    ]
"""


def test_initialize_names_the_plugin_for_an_incomplete_stage_and_factory_typos(site: Path) -> None:
    incomplete = f"{__name__}:_NoModuleLoad"
    write_distribution(
        site, "dscore-author-stage", "0.3", {"author_stage": "authorplug_stage"},
        {"authorplug_stage": STAGE_PLUGIN.format(incomplete=incomplete)},
    )
    opt = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(PluginLoadError) as info:
        dscore.initialize(model=_model(), config=_cfg(optimizer=opt, zero_optimization={"stage": 2, "implementation": "incomplete2"}))
    text = str(info.value)
    assert "author_stage (dscore-author-stage 0.3)" in text and "load_module_state_dict" in text
    for impl, target, cause in (
        ("typo2", "authorplug_stage:Stage2Typo", "AttributeError"),
        ("nomodule2", "authorplug_nosuch.mod:Stage", "ModuleNotFoundError"),
    ):
        with pytest.raises(PluginLoadError) as info:
            dscore.initialize(model=_model(), config=_cfg(optimizer=opt, zero_optimization={"stage": 2, "implementation": impl}))
        text = str(info.value)
        for part in ("author_stage (dscore-author-stage 0.3)", f"zero stage {impl!r}", f"factory={target!r}", cause):
            assert part in text, (part, text)
        assert info.value.plugin == "author_stage" and info.value.distribution == "dscore-author-stage"


OPT_PLUGIN = """
from dscore import hookimpl
from dscore.specs import OptimizerSpec

def build_sgd(param_groups, ctx):
    import torch
    return torch.optim.SGD(param_groups, lr=0.1)

@hookimpl
def dscore_register_optimizers():
    return [OptimizerSpec(name="TypoOpt", factory="authorplug_opt:build_typo")]
"""


def test_optimizer_factory_typo_is_a_plugin_load_error(site: Path) -> None:
    write_distribution(site, "dscore-author-opt", "1.2", {"author_opt": "authorplug_opt"}, {"authorplug_opt": OPT_PLUGIN})
    with pytest.raises(PluginLoadError) as info:
        dscore.initialize(model=_model(), config=_cfg(optimizer={"type": "TypoOpt", "params": {}}))
    text = str(info.value)
    for part in ("author_opt (dscore-author-opt 1.2)", "optimizer 'TypoOpt'", "factory='authorplug_opt:build_typo'"):
        assert part in text, (part, text)
    assert isinstance(info.value.__cause__, AttributeError)


# ------------------------------------------------------------------ 3 + 5: sections, disabled plugins
SECTION_PLUGIN = """
from pydantic import BaseModel, ConfigDict
from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, OptimizerSpec

class EmaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    decay: float = 0.99

@hookimpl
def dscore_register_config_sections():
    return [ConfigSectionSpec(name="ema_author", model="authorplug_sec:EmaConfig")]

@hookimpl
def dscore_register_optimizers():
    return [OptimizerSpec(name="EmaSGD", factory="torch.optim:SGD")]
"""


def test_section_lookup_is_strict_unless_a_default_is_given(site: Path) -> None:
    write_distribution(site, "dscore-author-sec", "0.1", {"author_sec": "authorplug_sec"}, {"authorplug_sec": SECTION_PLUGIN})
    cfg = load_config(_cfg(ema_author={"decay": 0.5}))
    assert cfg.section("ema_author").decay == 0.5
    assert cfg.section("zero_optimization").stage == 0
    assert cfg.section("nothing_here", None) is None
    with pytest.raises(ComponentNotFoundError) as info:
        cfg.section("zero_optimisation")
    text = str(info.value)
    assert "Did you mean 'zero_optimization'" in text and "ema_author" in text and "config.section('zero_optimisation', None)" in text


def test_disabled_plugin_is_named_for_its_section_and_components(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_distribution(site, "dscore-author-sec", "0.1", {"author_sec": "authorplug_sec"}, {"authorplug_sec": SECTION_PLUGIN})
    disable = {"plugins": {"disable": ["author_sec"]}}
    expected = "installed plugin author_sec (dscore-author-sec 0.1), which is disabled"
    with pytest.raises(ConfigError) as info:
        load_config(_cfg(ema_author={"decay": 0.5}, **disable))
    assert expected in str(info.value) and "remove author_sec from DSCORE_DISABLE_PLUGINS" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(_cfg(optimizer={"type": "EmaSGD", "params": {"lr": 0.1}}, **disable))
    assert expected in str(info.value) and "may not be installed" not in str(info.value)
    monkeypatch.setenv("DSCORE_DISABLE_PLUGINS", "author_sec")
    cfg = load_config(_cfg())
    with pytest.raises(ComponentNotFoundError, match="ds_config section 'ema_author' is provided by the installed plugin author_sec"):
        cfg.section("ema_author")


# ------------------------------------------------------------------ 4: monitor sections
MONITOR_PLUGIN = """
from pydantic import BaseModel
from dscore import hookimpl
from dscore.specs import ConfigSectionSpec, MonitorSpec

class NoEnabled(BaseModel):
    path: str = "x"

@hookimpl
def dscore_register_config_sections():
    return [ConfigSectionSpec(name="author_mon", model="authorplug_mon:NoEnabled")]

@hookimpl
def dscore_register_monitors():
    return [MonitorSpec(name="authormon", config_key="{key}", factory="authorplug_mon:NoEnabled")]
"""


@pytest.mark.parametrize(("key", "message"), [("author_mon", "has no 'enabled' field"), ("author_mon_typo", "no active plugin registers that section")])
def test_monitor_that_could_never_be_enabled_is_an_error(site: Path, key: str, message: str) -> None:
    write_distribution(site, "dscore-author-mon", "0.2", {"author_mon": "authorplug_mon"}, {"authorplug_mon": MONITOR_PLUGIN.replace("{key}", key)})
    with pytest.raises(PluginValidationError) as info:
        dscore.initialize(model=_model(), config=_cfg(author_mon={"path": "y"}))
    text = str(info.value)
    assert message in text and "author_mon (dscore-author-mon 0.2)" in text and "monitor 'authormon'" in text


# ------------------------------------------------------------------ 6: zero_optimization.implementation
def test_config_check_validates_and_shows_the_zero_implementation(tmp_path: Path, site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dscore.cli.main import main

    with pytest.raises(ConfigError) as info:
        load_config(_cfg(zero_optimization={"stage": 2, "implementation": "boundary_stage22"}))
    assert info.value.path == "zero_optimization.implementation"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg(zero_optimization={"stage": 2, "implementation": "no_such_impl"})))
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "zero_optimization.implementation" in err and "no_such_impl" in err
    path.write_text(json.dumps(_cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}}, zero_optimization={"stage": 2})))
    assert main(["config", "check", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["zero_stage"] == 2 and isinstance(out["zero_implementation"], str) and out["zero_implementation"]
    assert main(["config", "check", str(path)]) == 0
    assert f"zero_implementation = {out['zero_implementation']}" in capsys.readouterr().out


# ------------------------------------------------------------------ 8: heavy manifests
def test_plugins_list_warns_about_a_manifest_that_imports_torch(tmp_path: Path) -> None:
    site = tmp_path / "heavy_site"
    site.mkdir()
    manifest = "import torch\nfrom dscore import hookimpl\n"
    write_distribution(site, "dscore-aaa-heavy", "0.9", {"aaa_heavy": "authorplug_heavy"}, {"authorplug_heavy": manifest})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    env.pop("DSCORE_DISABLE_PLUGINS", None)
    code = "import sys; from dscore.cli.main import main; sys.exit(main(['plugins', 'list', '--json']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "plugin aaa_heavy (dscore-aaa-heavy 0.9)" in done.stderr and "imported torch" in done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert rows["aaa_heavy"]["warnings"] and all(not rows[n]["warnings"] for n in rows if n != "aaa_heavy")


# ------------------------------------------------------------------ dscore.testing.contexts for every factory kind
def test_monitor_and_precision_contexts_feed_the_builtin_factories(tmp_path: Path) -> None:
    from dscore.protocols import PrecisionMode
    from dscore.specs import resolve
    from dscore.testing.contexts import monitor_context, precision_context

    ctx = monitor_context("csv", {"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    assert ctx.path == "csv_monitor" and ctx.section.enabled and ctx.section.job_name == "j"
    registry = ctx.runtime.registry
    monitor = resolve(registry.get("monitor", "csv").factory)(ctx)
    monitor.write_events([("Train/loss", 0.5, 4)])
    monitor.close()
    assert (tmp_path / "j" / "Train_loss.csv").read_text().splitlines() == ["step,loss", "4,0.5"]
    pctx = precision_context("fp16", {"enabled": True, "initial_scale_power": 8})
    assert pctx.section.initial_scale_power == 8 and pctx.path == "fp16"
    mode = resolve(registry.get("precision", "fp16").factory)(pctx)
    assert isinstance(mode, PrecisionMode) and mode.compute_dtype == torch.float16
    assert precision_context("fp32").section is None
    with pytest.raises(ConfigError, match="fp16.initial_scale_power"):
        precision_context("fp16", {"enabled": True, "initial_scale_power": "x"})


@pytest.mark.parametrize(
    "zero",
    [{"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 3}],
    ids=["stage0", "stage1", "stage2", "stage3"],
)
def test_load_module_only_then_step_uses_the_loaded_weights(tmp_path: Path, zero: dict[str, Any]) -> None:
    """The repro of the bug the abstract method prevents: after ``load_module_only`` the next step must
    start from the loaded weights (fp32 masters refreshed), i.e. equal a fresh engine built on them."""
    cfg = _cfg(optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, zero_optimization=zero, gradient_clipping=0.0)
    cfg["bf16"] = {"enabled": True}  # fp32 masters separate from the module's weights on every stage
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)

    def step(engine: Any, i: int) -> None:
        out = engine(x[2 * i : 2 * i + 2].to(next(engine.module.parameters()).dtype))
        engine.backward(torch.nn.functional.mse_loss(out.float(), y[2 * i : 2 * i + 2]))
        engine.step()

    saved, *_ = dscore.initialize(model=_model(), config=cfg)
    step(saved, 0)
    step(saved, 1)
    saved.save_checkpoint(str(tmp_path))
    weights = {k: v.detach().clone() for k, v in saved.zero_stage_impl.module_state_dict().items()}
    saved.close()

    torch.manual_seed(123)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    loaded, *_ = dscore.initialize(model=other, config=cfg)
    loaded.load_checkpoint(str(tmp_path), load_module_only=True)
    step(loaded, 2)
    reference_model = _model()
    reference_model.load_state_dict({k: v.float() for k, v in weights.items()})
    reference, *_ = dscore.initialize(model=reference_model, config=cfg)
    step(reference, 2)
    got = loaded.zero_stage_impl.module_state_dict()
    want = reference.zero_stage_impl.module_state_dict()
    assert got.keys() == want.keys()
    for k in got:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=0, atol=0, msg=k)
    assert any(not torch.equal(got[k].float(), weights[k].float()) for k in got)  # the step did move them
    loaded.close()
    reference.close()
