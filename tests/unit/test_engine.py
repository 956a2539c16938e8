"""The engine on one process (world size 1): counters, numerics against plain PyTorch, precision, selection.

Every numerical test runs a hand-written PyTorch loop next to the engine and compares weights.
"""

from __future__ import annotations

import argparse
import copy
import logging

import pytest
import torch

import dscore
from dscore.errors import ComponentNotFoundError, ConfigError, DscoreError

IN, OUT = 6, 3


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUT))


def make_data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def base_config(**overrides: object) -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0}
    cfg.update(overrides)
    return cfg


def reference_train(model, opt, x, y, *, micro, gas, clip, steps):
    """Plain PyTorch: gas micro-batches of `micro` rows, loss / gas, clip by global norm, step, zero."""
    i = 0
    for _ in range(steps):
        for _ in range(gas):
            loss = mse(model(x[i : i + micro]), y[i : i + micro]) / gas
            loss.backward()
            i += micro
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def engine_train(engine, x, y, *, micro, n_micro):
    for k in range(n_micro):
        loss = mse(engine(x[k * micro : (k + 1) * micro]), y[k * micro : (k + 1) * micro])
        engine.backward(loss)
        engine.step()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, tol: float = 1e-6) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.detach().float(), pb.detach().float(), rtol=tol, atol=tol, msg=name)


# ------------------------------------------------------------------------------------------ counting
def test_gas4_over_8_micro_batches_gives_two_optimizer_and_scheduler_steps() -> None:
    model = make_model()
    calls = {"opt": 0}

    class CountingSGD(torch.optim.SGD):
        def step(self, closure=None):
            calls["opt"] += 1
            return super().step(closure)

    opt = CountingSGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    engine, eopt, loader, esched = dscore.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=base_config(gradient_accumulation_steps=4)
    )
    assert eopt is opt and esched is sched and loader is None
    x, y = make_data(32)
    boundaries = []
    for k in range(8):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(mse(engine(x[4 * k : 4 * k + 4]), y[4 * k : 4 * k + 4]))
        engine.step()
        assert engine.was_step_applied() == (k % 4 == 3)
    assert boundaries == [False, False, False, True] * 2
    assert calls["opt"] == 2
    assert sched.last_epoch == 2  # constructed at 0, stepped twice
    assert (engine.micro_steps, engine.global_steps, engine.skipped_steps) == (8, 2, 0)
    assert engine.global_samples == 2 * 16


def test_micro8_gas1_equals_micro4_gas2_and_plain_pytorch_with_clipping() -> None:
    x, y = make_data(8)
    results = []
    for micro, gas in ((8, 1), (4, 2)):
        model = make_model()
        cfg = base_config(
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=gas,
            gradient_clipping=0.05,
            optimizer={"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
        )
        engine, *_ = dscore.initialize(model=model, config=cfg)
        engine_train(engine, x, y, micro=micro, n_micro=gas)
        assert engine.global_steps == 1
        results.append(model)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    reference_train(ref, ref_opt, x, y, micro=8, gas=1, clip=0.05, steps=1)
    assert_same_weights(results[0], results[1])
    assert_same_weights(results[0], ref)
    # and the step changed something (the comparison can fail)
    assert not torch.allclose(ref[0].weight, make_model()[0].weight)


@pytest.mark.parametrize("clip", [0.0, 0.3])
def test_stage0_fp32_matches_plain_loop_over_many_steps(clip: float) -> None:
    micro, gas, steps = 4, 3, 5
    x, y = make_data(micro * gas * steps)
    model, ref = make_model(), make_model()
    cfg = base_config(
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        gradient_clipping=clip,
        optimizer={"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
    )
    engine, opt, _, _ = dscore.initialize(model=model, config=cfg)
    engine_train(engine, x, y, micro=micro, n_micro=gas * steps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    reference_train(ref, ref_opt, x, y, micro=micro, gas=gas, clip=clip, steps=steps)
    assert_same_weights(model, ref, tol=2e-6)
    assert engine.global_steps == steps
    norm = engine.get_global_grad_norm()
    assert (norm is None) == (clip == 0.0)


def test_clipping_reports_unscaled_norm_and_limits_update() -> None:
    model = make_model()
    x, y = make_data(4)
    probe = make_model()
    mse(probe(x), y).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in probe.parameters()])).item()
    engine, *_ = dscore.initialize(
        model=model,
        config=base_config(gradient_clipping=1e-3, optimizer={"type": "SGD", "params": {"lr": 1.0}}),
    )
    before = [p.detach().clone() for p in model.parameters()]
    engine_train(engine, x, y, micro=4, n_micro=1)
    assert engine.get_global_grad_norm() == pytest.approx(expected, rel=1e-5)
    delta = torch.linalg.vector_norm(torch.stack([(p - b).norm() for p, b in zip(model.parameters(), before)]))
    assert delta.item() == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("clip", [1e-3, 1e3, 0.0])
def test_post_clip_norm_is_the_norm_of_the_applied_gradients(clip: float) -> None:
    # SGD with lr 1 and no momentum moves each parameter by exactly its applied gradient
    model = make_model()
    x, y = make_data(4)
    engine, *_ = dscore.initialize(
        model=model, config=base_config(gradient_clipping=clip, optimizer={"type": "SGD", "params": {"lr": 1.0}})
    )
    before = [p.detach().clone() for p in model.parameters()]
    engine_train(engine, x, y, micro=4, n_micro=1)
    applied = torch.linalg.vector_norm(torch.stack([(p - b).norm() for p, b in zip(model.parameters(), before)]))
    pre, post = engine.get_global_grad_norm(), engine.get_global_grad_norm_post_clip()
    if clip == 0.0:  # fp32 at ZeRO 0 without clipping computes no norm: both are None
        assert pre is None and post is None
        return
    assert post == pytest.approx(applied.item(), rel=1e-5)
    assert post == pytest.approx(min(pre, clip), rel=1e-5)  # min(norm, clip) up to clip_grad_norm_'s 1e-6
    assert (post < pre) == (clip < pre)


# ------------------------------------------------------------------------------------------ precision
def _master_params(engine) -> list[torch.Tensor]:
    return [p for g in engine.optimizer.param_groups for p in g["params"]]


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_clipping_applies_equally_in_every_precision(precision: str) -> None:
    clip, lr = 1e-3, 1.0
    cfg = base_config(gradient_clipping=clip, optimizer={"type": "SGD", "params": {"lr": lr}})
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    model = make_model()
    engine, *_ = dscore.initialize(model=model, config=cfg)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    assert next(model.parameters()).dtype == dtype
    masters = _master_params(engine)
    assert all(p.dtype == torch.float32 for p in masters)
    before = [p.detach().clone() for p in masters]
    x, y = make_data(4)
    engine.backward(mse(engine(x.to(dtype)), y))
    engine.step()
    assert engine.was_step_applied()
    delta = torch.linalg.vector_norm(torch.stack([(p - b).norm() for p, b in zip(masters, before)]))
    assert delta.item() == pytest.approx(lr * clip, rel=1e-3)
    # the module's low-precision weights follow the fp32 masters
    for p, m in zip(model.parameters(), masters):
        torch.testing.assert_close(p.detach(), m.detach().to(dtype))


def test_fp16_overflow_example_counts_skipped_steps_and_scheduler() -> None:
    cfg = base_config(
        gradient_clipping=1.0,
        fp16={"enabled": True, "initial_scale_power": 16},
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10}},
    )
    model = make_model()
    engine, opt, _, sched = dscore.initialize(model=model, config=cfg)
    sched_steps = {"n": 0}
    original = sched.step

    def counting(*a, **k):
        sched_steps["n"] += 1
        return original(*a, **k)

    sched.step = counting  # type: ignore[method-assign]
    x, y = make_data(40)
    applied = []
    for step in range(1, 11):
        xb, yb = x[4 * step - 4 : 4 * step].half(), y[4 * step - 4 : 4 * step]
        loss = mse(engine(xb), yb)
        if step <= 6:
            loss = loss * float("inf")  # every gradient becomes inf/NaN
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False] * 6 + [True] * 4
    assert engine.global_steps == 10
    assert engine.skipped_steps == 6
    assert sched_steps["n"] == 4
    # no-ZeRO fp16 halves at every overflow (DeepSpeed FP16_Optimizer, no hysteresis)
    assert engine.get_loss_scale() == 2.0**10
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_on_cpu_trains_with_fp32_master_weights() -> None:
    model = make_model()
    ref = make_model()
    cfg = base_config(
        train_micro_batch_size_per_gpu=8,
        gradient_clipping=1.0,
        bf16={"enabled": True},
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
    )
    engine, opt, _, _ = dscore.initialize(model=model, config=cfg)
    x, y = make_data(8 * 20)
    losses = []
    for k in range(20):
        loss = mse(engine(x[8 * k : 8 * k + 8].bfloat16()), y[8 * k : 8 * k + 8])
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    assert losses[-1] < losses[0]
    # the fp32 masters track an fp32 reference closely (bf16 only rounds the forward/backward)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    reference_train(ref, ref_opt, x, y, micro=8, gas=1, clip=1.0, steps=20)
    for m, r in zip(_master_params(engine), ref.parameters()):
        torch.testing.assert_close(m.detach(), r.detach(), rtol=0.05, atol=0.02)


def test_bf16_without_optimizer_returns_an_optimizer_like_deepspeed() -> None:
    engine, opt, _, sched = dscore.initialize(model=make_model(), config=base_config(bf16={"enabled": True}))
    assert opt is not None and sched is None


# ------------------------------------------------------------------------------------------ returns / errors
def test_returns_none_exactly_when_deepspeed_would() -> None:
    engine, opt, loader, sched = dscore.initialize(
        model=make_model(),
        config=base_config(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}}),
    )
    assert opt is None and loader is None and sched is None  # no optimizer => no scheduler either
    with pytest.raises(DscoreError, match="needs an optimizer"):
        engine.backward(mse(engine(make_data(4)[0]), make_data(4)[1]))
    with pytest.raises(ConfigError, match="ZeRO stage 2 requires an optimizer"):
        dscore.initialize(model=make_model(), config=base_config(zero_optimization={"stage": 2}))


def test_missing_model_or_config_are_clear_errors() -> None:
    with pytest.raises(DscoreError, match="requires a model"):
        dscore.initialize(config=base_config())
    with pytest.raises(DscoreError, match="first positional argument is `args`"):
        dscore.initialize(make_model(), config=base_config())
    with pytest.raises(DscoreError, match="requires a ds_config"):
        dscore.initialize(model=make_model())
    args = argparse.Namespace(deepspeed_config="x.json", deepscale_config=None)
    with pytest.raises(DscoreError, match="given twice"):
        dscore.initialize(args=args, model=make_model(), config=base_config())


def test_invalid_config_fails_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from dscore.runtime import runtime as runtime_mod

    def no_runtime(*a, **k):
        raise AssertionError("Runtime.create (process-group work) ran before the config was validated")

    monkeypatch.setattr(runtime_mod.Runtime, "create", classmethod(no_runtime))
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        dscore.initialize(model=make_model(), config={"train_micro_batch_size_per_gpu": 0})
    with pytest.raises(ConfigError):
        dscore.initialize(model=make_model(), config={"train_batch_size": 4, "zero_optimization": {"stage": 7}})


def test_non_scalar_loss_and_no_sync_with_zero2_are_refused() -> None:
    engine, *_ = dscore.initialize(
        model=make_model(), config=base_config(optimizer={"type": "SGD", "params": {"lr": 0.1}})
    )
    x, y = make_data(4)
    with pytest.raises(DscoreError, match="scalar loss"):
        engine.backward((engine(x) - y) ** 2)
    engine2, *_ = dscore.initialize(
        model=make_model(),
        config=base_config(optimizer={"type": "SGD", "params": {"lr": 0.1}}, zero_optimization={"stage": 2}),
    )
    with pytest.raises(DscoreError, match="ZeRO stage 2"):
        with engine2.no_sync():
            pass


def test_config_params_and_args_sources(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}')
    parser = dscore.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, opt, _, _ = dscore.initialize(args=args, model=make_model())
    assert engine.train_micro_batch_size_per_gpu() == 2 and isinstance(opt, torch.optim.SGD)
    engine2, *_ = dscore.initialize(model=make_model(), config_params={"train_batch_size": 3})
    assert engine2.train_batch_size() == 3


def test_two_engines_in_one_process_are_independent() -> None:
    m1, m2 = make_model(0), make_model(1)
    cfg = base_config(optimizer={"type": "SGD", "params": {"lr": 0.1}})
    e1, *_ = dscore.initialize(model=m1, config=cfg)
    e2, *_ = dscore.initialize(model=m2, config=dict(cfg, gradient_accumulation_steps=2))
    assert e1.runtime is not e2.runtime
    x, y = make_data(8)
    engine_train(e1, x, y, micro=4, n_micro=2)
    engine_train(e2, x, y, micro=4, n_micro=2)
    assert (e1.global_steps, e2.global_steps) == (2, 1)


# ------------------------------------------------------------------------------------------ optimizer selection
def test_optimizer_from_registry_torch_fallback_client_instance_and_callable() -> None:
    e, opt, _, _ = dscore.initialize(
        model=make_model(), config=base_config(optimizer={"type": "RMSprop", "params": {"lr": 0.01}})
    )
    assert isinstance(opt, torch.optim.RMSprop)
    with pytest.raises((ComponentNotFoundError, ConfigError, DscoreError)):
        dscore.initialize(model=make_model(), config=base_config(optimizer={"type": "NoSuchOpt", "params": {}}))
    e, opt, _, _ = dscore.initialize(
        model=make_model(), optimizer=lambda params: torch.optim.Adagrad(params, lr=0.1), config=base_config()
    )
    assert isinstance(opt, torch.optim.Adagrad)
    model = make_model()
    client = torch.optim.SGD(model.parameters(), lr=0.2)
    e, opt, _, _ = dscore.initialize(model=model, optimizer=client, config=base_config())
    assert opt is client and e.get_lr() == [0.2]


def test_offload_with_non_offload_client_optimizer_names_the_escape_hatch() -> None:
    model = make_model()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = base_config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ConfigError, match="zero_force_ds_cpu_optimizer"):
        dscore.initialize(model=model, optimizer=client, config=cfg)


def test_scheduler_client_callable_and_config() -> None:
    model = make_model()
    e, opt, _, sched = dscore.initialize(
        model=model,
        config=base_config(optimizer={"type": "SGD", "params": {"lr": 0.1}}),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )
    x, y = make_data(4)
    engine_train(e, x, y, micro=4, n_micro=1)
    assert e.get_lr() == [pytest.approx(0.05)]
    e, opt, _, sched = dscore.initialize(
        model=make_model(),
        config=base_config(
            optimizer={"type": "SGD", "params": {"lr": 0.1}},
            scheduler={"type": "StepLR", "params": {"step_size": 1, "gamma": 0.1}},
        ),
    )
    engine_train(e, x, y, micro=4, n_micro=1)
    assert e.get_lr() == [pytest.approx(0.01)]


# ------------------------------------------------------------------------------------------ engine surface
def test_module_forwarding_train_eval_and_attribute_fallthrough() -> None:
    model = make_model()
    model.custom_attribute = 42
    engine, *_ = dscore.initialize(model=model, config=base_config(optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    assert engine.module is model
    assert engine.custom_attribute == 42
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training
    x, _ = make_data(2)
    torch.testing.assert_close(engine(x), model(x))


def test_no_sync_accumulates_then_reduces_and_refuses_step() -> None:
    model, ref = make_model(), make_model()
    engine, *_ = dscore.initialize(
        model=model, config=base_config(gradient_accumulation_steps=2, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    )
    x, y = make_data(8)
    with engine.no_sync():
        engine.backward(mse(engine(x[:4]), y[:4]))
        with pytest.raises(DscoreError, match="no_sync"):
            engine.step()
        with pytest.raises(DscoreError, match="re-entering"):
            with engine.no_sync():
                pass
    engine.step()
    engine.backward(mse(engine(x[4:]), y[4:]))
    engine.step()
    assert engine.global_steps == 1
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, micro=4, gas=2, clip=0.0, steps=1)
    assert_same_weights(model, ref)


def test_unmanaged_gradient_accumulation_every_step_is_a_boundary() -> None:
    model, ref = make_model(), make_model()
    cfg = base_config(
        gradient_accumulation_steps=2,
        managed_gradient_accumulation=False,
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
    )
    engine, *_ = dscore.initialize(model=model, config=cfg)
    x, y = make_data(8)
    assert not engine.is_gradient_accumulation_boundary()
    engine.backward(mse(engine(x[:4]), y[:4]))
    engine.backward(mse(engine(x[4:]), y[4:]))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    assert engine.global_samples == (8 // 2) * 2
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y, micro=4, gas=2, clip=0.0, steps=1)
    assert_same_weights(model, ref)
    engine.set_gradient_accumulation_boundary(True)
    assert engine.is_gradient_accumulation_boundary()


def test_progress_log_every_steps_per_print(caplog: pytest.LogCaptureFixture) -> None:
    cfg = base_config(steps_per_print=2, wall_clock_breakdown=True, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    engine, *_ = dscore.initialize(model=make_model(), config=cfg)
    x, y = make_data(16)
    with caplog.at_level(logging.INFO, logger="dscore.runtime.engine"):
        engine_train(engine, x, y, micro=4, n_micro=4)
    lines = [r.getMessage() for r in caplog.records if "step=" in r.getMessage()]
    assert len(lines) == 2 and "step=2" in lines[0] and "step=4" in lines[1]
    assert "loss=" in lines[0] and "samples/s=" in lines[0] and "loss_scale=" in lines[0]
    assert any("forward" in r.getMessage() and "backward" in r.getMessage() for r in caplog.records)


def test_csv_monitor_receives_train_events(tmp_path) -> None:
    cfg = base_config(
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"},
    )
    engine, *_ = dscore.initialize(model=make_model(), config=cfg)
    x, y = make_data(12)
    engine_train(engine, x, y, micro=4, n_micro=3)
    engine.destroy()
    written = "\n".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    names = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert any("train_loss" in n for n in names), names
    assert any("lr" in n for n in names), names
    assert written


# ------------------------------------------------------------------------------------------ data
def test_training_dataloader_batches_and_sampler_state() -> None:
    dataset = torch.utils.data.TensorDataset(*make_data(10))
    engine, _, loader, _ = dscore.initialize(
        model=make_model(),
        training_data=dataset,
        config=base_config(train_micro_batch_size_per_gpu=4, optimizer={"type": "SGD", "params": {"lr": 0.1}}),
    )
    assert loader is engine.training_dataloader
    assert len(loader) == 3  # ceil(10 / 4) with one rank
    first_epoch = [b[0] for b in loader]
    assert [len(b) for b in first_epoch] == [4, 4, 2]
    assert engine.data_sampler_state == {"epoch": 1, "batches_consumed": 0}
    it = iter(loader)
    next(it)
    state = engine.data_sampler_state
    assert state == {"epoch": 1, "batches_consumed": 1}
    rest = [b[0] for b in it]
    engine.load_data_sampler_state(state)
    resumed = [b[0] for b in loader]
    assert len(resumed) == 2
    for a, b in zip(resumed, rest):
        torch.testing.assert_close(a, b)


def test_training_dataloader_collate_fn_and_drop_last() -> None:
    dataset = torch.utils.data.TensorDataset(*make_data(10))
    seen = []

    def collate(samples):
        seen.append(len(samples))
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    _, _, loader, _ = dscore.initialize(
        model=make_model(),
        training_data=dataset,
        collate_fn=collate,
        config=base_config(
            train_micro_batch_size_per_gpu=4,
            dataloader_drop_last=True,
            optimizer={"type": "SGD", "params": {"lr": 0.1}},
        ),
    )
    assert len(loader) == 2
    assert [len(b[0]) for b in loader] == [4, 4]
    assert seen == [4, 4]


def test_checkpoint_state_accessors_round_trip() -> None:
    engine, *_ = dscore.initialize(
        model=make_model(),
        config=base_config(
            optimizer={"type": "SGD", "params": {"lr": 0.1}},
            scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        ),
    )
    x, y = make_data(8)
    engine_train(engine, x, y, micro=4, n_micro=2)
    state = copy.deepcopy(engine.state_for_checkpoint())
    assert state["counters"]["global_steps"] == 2
    assert state["zero_stage"] == 0
    engine_train(engine, x, y, micro=4, n_micro=2)
    engine.load_state_from_checkpoint(state)
    assert engine.global_steps == 2 and engine.lr_scheduler.state_dict() == state["lr_scheduler"]
    opt_state = engine.zero_stage_impl.state_dict()
    assert set(opt_state["param_names"]) == {n for n, _ in engine.module.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_engine_checkpoint_methods_round_trip(tmp_path, precision: str) -> None:
    cfg = base_config(
        optimizer={"type": "AdamW", "params": {"lr": 0.01}},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    )
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = make_model()
    engine, *_ = dscore.initialize(model=model, config=cfg)
    x, y = make_data(24)

    def run(k0: int, n: int) -> None:
        for k in range(k0, k0 + n):
            engine.backward(mse(engine(x[4 * k : 4 * k + 4].to(dtype)), y[4 * k : 4 * k + 4]))
            engine.step()

    run(0, 3)
    assert engine.save_checkpoint(str(tmp_path), client_state={"note": 7}) is True
    run(3, 3)
    after_resume_ref = [p.detach().clone() for p in model.parameters()]
    path, client = engine.load_checkpoint(str(tmp_path))
    assert path is not None and client["note"] == 7
    assert engine.global_steps == 3
    run(3, 3)  # the same three steps again from the restored state
    for p, q in zip(model.parameters(), after_resume_ref):
        torch.testing.assert_close(p.detach(), q)
    assert engine.save_16bit_model(str(tmp_path / "export")) is True
    assert (tmp_path / "export" / "pytorch_model.bin").exists()


def test_lifecycle_hooks_reach_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    import dscore.runtime.initialize as init_mod

    seen: list[tuple] = []

    class Probe:
        @dscore.hookimpl
        def dscore_configure(self, config):
            seen.append(("configure", config.train_micro_batch_size_per_gpu))

        @dscore.hookimpl
        def dscore_engine_created(self, engine):
            seen.append(("created", engine.global_steps))

        @dscore.hookimpl
        def dscore_after_optimizer_step(self, engine, step_applied):
            seen.append(("after_step", engine.global_steps, step_applied))

    real = init_mod.create_plugin_manager
    monkeypatch.setattr(init_mod, "create_plugin_manager", lambda **kw: real(**kw, extra_plugins=[("probe", Probe())]))
    engine, *_ = dscore.initialize(
        model=make_model(),
        config=base_config(gradient_accumulation_steps=2, optimizer={"type": "SGD", "params": {"lr": 0.1}}),
    )
    x, y = make_data(16)
    engine_train(engine, x, y, micro=4, n_micro=4)
    assert seen == [("configure", 4), ("created", 0), ("after_step", 1, True), ("after_step", 2, True)]
