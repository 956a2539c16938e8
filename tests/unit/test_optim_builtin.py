"""Built-in optimizers against plain PyTorch references or their published update rules."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from dscore.errors import ComponentNotFoundError, ConfigError
from dscore.plugin_manager import create_plugin_manager
from dscore.registry import Registry
from dscore.specs import resolve
from dscore.testing.contexts import local_runtime, optimizer_context
from dscore_plugins.optim import config as cfg
from dscore_plugins.optim.adam import build_adam, build_adamw
from dscore_plugins.optim.lamb import Lamb
from dscore_plugins.optim.lion import Lion
from dscore_plugins.optim.muon import MuonWithAuxAdam, build_muon, newton_schulz5, set_muon_flags
from dscore_plugins.optim.plugin import OPTIMIZER_SPECS
from dscore_plugins.optim.torch_optim import build_adagrad, torch_optimizer_factory

_RUNTIME = None


def _ctx(type_name: str, params: dict | None = None):
    """The OptimizerContext dscore.initialize would build for ``optimizer.type = type_name``."""
    global _RUNTIME
    _RUNTIME = _RUNTIME or local_runtime()
    return optimizer_context(type_name, params, runtime=_RUNTIME)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def _grads(step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in like]


def _train(opt, params, steps: int = 5) -> list[torch.Tensor]:
    for t in range(steps):
        for p, g in zip(params, _grads(t, params)):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    ("build", "kw", "ref_cls"),
    [
        ("Adam", {}, torch.optim.AdamW),  # plain "Adam" = decoupled weight decay (DeepSpeed)
        ("Adam", {"adam_w_mode": False}, torch.optim.Adam),
        ("Adam", {"torch_adam": True}, torch.optim.AdamW),
        ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam),
        ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW),  # forced true
    ],
)
def test_adam_modes_match_torch_reference(build, kw, ref_cls) -> None:
    hp = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    ps, ref = _params(), _params()
    factory = build_adam if build == "Adam" else build_adamw
    opt = factory([{"params": ps}], _ctx(build, {**kw, **hp}))
    assert type(opt) is ref_cls
    want = _train(ref_cls(ref, foreach=False, **hp), ref)
    for a, b in zip(_train(opt, ps), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # decoupled vs L2 decay really differ on this problem (the test can tell them apart)
    other = torch.optim.Adam if ref_cls is torch.optim.AdamW else torch.optim.AdamW
    alt = _params()
    assert not torch.allclose(_train(other(alt, foreach=False, **hp), alt)[0], want[0])


def test_adam_rejects_bias_correction_false_and_params_model_rules() -> None:
    with pytest.raises(ConfigError, match="bias_correction"):
        build_adam([{"params": _params()}], _ctx("Adam", {"bias_correction": False}))
    with pytest.raises(ValidationError, match="gradient_clipping"):
        cfg.AdamParams(lr=1e-3, max_grad_norm=1.0)
    with pytest.raises(ValidationError):
        cfg.AdamParams(lr=1e-3, typo=1)
    with pytest.raises(ValidationError):
        cfg.AdamParams(lr=True)
    assert cfg.AdamParams().adam_w_mode is True


@pytest.mark.parametrize("given, want", [({}, True), ({"foreach": False}, False), ({"foreach": True}, True)])
def test_torch_adam_passes_foreach_through(given, want) -> None:
    """A DeepSpeed config's ``foreach`` reaches torch with ``torch_adam`` (dscore's unset default: for-each)."""
    opt = build_adamw([{"params": _params()}], _ctx("AdamW", {"torch_adam": True, **given}))
    assert opt.defaults["foreach"] is want
    fused = build_adamw([{"params": _params()}], _ctx("AdamW", {"torch_adam": True, "fused": True}))
    assert fused.defaults["fused"] is True and not fused.defaults["foreach"]


def test_foreach_and_fused_need_torch_adam() -> None:
    with pytest.raises((ConfigError, ValidationError), match="foreach applies only with torch_adam: true"):
        build_adam([{"params": _params()}], _ctx("Adam", {"foreach": True}))
    with pytest.raises((ConfigError, ValidationError), match="cannot both be true"):
        cfg.AdamParams(torch_adam=True, foreach=True, fused=True)


def test_lamb_matches_update_rule() -> None:
    hp = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, max_coeff=0.5, min_coeff=0.1)
    ps = _params()
    opt = Lamb(ps, **hp)
    ref = [p.detach().clone() for p in _params()]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    coeffs = []
    for t in range(1, 5):
        grads = _grads(t - 1, ref)
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        coeffs = []
        for i, g in enumerate(grads):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.99 * v[i] + 0.01 * g * g
            u = (m[i] / (1 - 0.9**t)) / ((v[i] / (1 - 0.99**t)).sqrt() + 1e-6) + 0.01 * ref[i]
            ratio = (ref[i].norm() / u.norm()).item()
            ratio = min(max(ratio, 0.1), 0.5)
            coeffs.append(ratio)
            ref[i] = ref[i] - 0.05 * ratio * u
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    assert opt.get_lamb_coeffs() == pytest.approx(coeffs)


def test_lion_matches_update_rule() -> None:
    ps = _params()
    opt = Lion(ps, lr=0.01, betas=(0.9, 0.99), weight_decay=0.5)
    ref = [p.detach().clone() for p in _params()]
    m = [torch.zeros_like(p) for p in ref]
    for t in range(4):
        grads = _grads(t, ref)
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            c = 0.9 * m[i] + 0.1 * g
            ref[i] = ref[i] * (1 - 0.01 * 0.5) - 0.01 * torch.sign(c)
            m[i] = 0.99 * m[i] + 0.01 * g
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a.detach(), b)


def test_newton_schulz_orthogonalises() -> None:
    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(newton_schulz5(g).float())
    assert s.min() > 0.5 and s.max() < 1.3  # near-orthogonal (quintic NS lands in ~[0.7, 1.2])


def test_muon_splits_params_and_steps_by_the_rule() -> None:
    from collections import OrderedDict

    model = torch.nn.Sequential(OrderedDict(embed=torch.nn.Embedding(5, 4), proj=torch.nn.Linear(4, 6)))
    set_muon_flags(model)
    assert model[0].weight.use_muon is False and model[1].weight.use_muon is True and model[1].bias.use_muon is False
    hp = dict(lr=0.1, adam_lr=0.01, momentum=0.9, nesterov=False, weight_decay=0.1)
    opt = build_muon([{"params": list(model.parameters())}], _ctx("muon", hp))
    assert isinstance(opt, MuonWithAuxAdam)
    muon_groups = [g for g in opt.param_groups if g["use_muon"]]
    assert len(muon_groups) == 1 and muon_groups[0]["params"] == [model[1].weight] and muon_groups[0]["lr"] == 0.1
    w0 = model[1].weight.detach().clone()
    e0 = model[0].weight.detach().clone()
    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    ge = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[1].weight.grad = g.clone()
    model[0].weight.grad = ge.clone()
    opt.step()
    buf = 0.1 * g  # (1 - mu) g from a zero buffer
    want = w0 * (1 - 0.1 * 0.1) - 0.1 * (6 / 4) ** 0.5 * newton_schulz5(buf)
    torch.testing.assert_close(model[1].weight.detach(), want)
    ref = torch.nn.Parameter(e0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1, foreach=False)
    ref.grad = ge.clone()
    ref_opt.step()
    torch.testing.assert_close(model[0].weight.detach(), ref.detach())
    with pytest.raises(ConfigError):
        build_muon([{"params": list(model.parameters())}], _ctx("muon", {"ns_method": "polar_express"}))


def test_adagrad_and_torch_fallback() -> None:
    from dscore.protocols import TorchClassParams

    opt = build_adagrad([{"params": _params()}], _ctx("adagrad"))
    assert isinstance(opt, torch.optim.Adagrad) and opt.defaults["lr"] == 1e-2 and opt.defaults["eps"] == 1e-10
    ctx = _ctx("RMSprop", {"lr": 0.1})
    assert isinstance(ctx.section, TorchClassParams) and ctx.section.type_name == "RMSprop"
    assert isinstance(torch_optimizer_factory(_params(), ctx), torch.optim.RMSprop)
    assert isinstance(torch_optimizer_factory(_params(), _ctx("rmsprop", {"lr": 0.1})), torch.optim.RMSprop)
    wrong = ctx.section.model_copy(update={"type_name": "RMSProb"})
    with pytest.raises(ComponentNotFoundError) as info:
        torch_optimizer_factory(_params(), type(ctx)(config=ctx.config, section=wrong, runtime=ctx.runtime))
    assert "RMSprop" in info.value.suggestions
    sgd = TorchClassParams(type_name="SGD", params={"lr": 0.1, "max_grad_norm": 1.0})
    with pytest.raises(ConfigError, match="gradient_clipping"):
        torch_optimizer_factory(_params(), type(ctx)(config=ctx.config, section=sgd, runtime=ctx.runtime))


def test_specs_resolve_and_case_insensitive_lookup() -> None:
    for spec in OPTIMIZER_SPECS:
        factory = resolve(spec.factory)
        if spec.params_model:
            resolve(spec.params_model)
            opt = factory([{"params": _params()}], _ctx(spec.name))  # every default from the params model
            assert isinstance(opt, torch.optim.Optimizer), spec.name
            # the classes a spec declares are exactly what its factory builds with the defaults
            if spec.classes:
                assert type(opt) in {resolve(c) for c in spec.classes}, spec.name
    registry = Registry(create_plugin_manager())
    for written, name in [
        ("Adam", "adam"),
        ("AdamW", "adamw"),
        ("OneBitAdam", "onebitadam"),
        ("onebitLAMB", "onebitlamb"),
        ("SGD", "sgd"),
        ("Lion", "lion"),
    ]:
        assert registry.get("optimizer", written).name == name
