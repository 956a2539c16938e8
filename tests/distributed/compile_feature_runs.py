"""Rank functions for tests/distributed/test_compile_features.py: features under engine.compile() on 2 gloo
ranks: dscore.checkpointing.checkpoint (issue 41 item 3), AutoTP, Ulysses and MoE (item 5)."""

from __future__ import annotations

from typing import Any

WIDTH, MICRO, STEPS = 16, 4, 3


class Recorder:
    """A dynamo backend that counts its graphs and hands them to ``inner`` (a registered backend name)."""

    def __init__(self, inner: str) -> None:
        self.inner, self.graphs = inner, 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        if self.inner == "eager":
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)


def _model(checkpointed: bool) -> Any:
    import torch

    from dscore import checkpointing as ck

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lins = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, device="cpu") for _ in range(2))
            self.drop = torch.nn.Dropout(0.5)

        def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.drop(self.lins[i](x)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i in range(2):
                x = ck.checkpoint(self.block, i, x) if checkpointed else self.block(i, x)
            return x

    return Net()


def checkpoint_under_engine_compile(backend: str, stage: int) -> dict[str, Any]:
    """Plain vs checkpointed model, both engine.compile()d with ``backend``, same seeds: losses, weights, breaks."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import dscore

    out: dict[str, Any] = {}
    for name in ("plain", "ckpt"):
        torch._dynamo.reset()
        counters.clear()
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = dscore.initialize(model=_model(name == "ckpt"), config=config)
        rank = dist.get_rank()
        rec = Recorder(backend)
        engine.compile(backend=rec)
        g = torch.Generator().manual_seed(5 + rank)
        torch.manual_seed(100 + rank)  # each rank its own dropout masks
        losses = []
        for _ in range(STEPS):
            x = torch.randn(MICRO, WIDTH, generator=g).to(engine.device)
            loss = (engine(x) ** 2).sum()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        with torch.no_grad():
            weights = [p.detach().to("cpu").clone() for p in engine.module.parameters()]
        out[name] = {
            "losses": losses,
            "weights": weights,
            "breaks": sum(counters["graph_break"].values()),
            "graphs": rec.graphs,
        }
        engine.close()
    return out


def _llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _ids(step: int) -> Any:
    import torch

    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1 + step), device="cpu")


def _measure(build: Any, step: Any, backend: str) -> dict[str, Any]:
    """Eager then engine.compile(backend=Recorder(backend)) runs of ``build()`` for STEPS ``step(engine, i)``s."""
    import torch
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {}
    for name in ("eager", "compiled"):
        torch._dynamo.reset()
        counters.clear()
        engine = build()
        rec = Recorder(backend)
        if name == "compiled":
            engine.compile(backend=rec)
        losses = []
        for i in range(STEPS):
            loss = step(engine, i)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[name] = losses
        out[f"{name}_breaks"] = sum(counters["graph_break"].values())
        out[f"{name}_graphs"] = rec.graphs
        out[f"{name}_reasons"] = sorted({k.split("\n")[0] for k in counters["graph_break"]})
        engine.close()
    return out


def _hf_config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 1e6,
        **extra,
    }


def autotp_compiled(backend: str) -> dict[str, Any]:
    """AutoTP tp 2 on a tiny LlamaForCausalLM (its own tp_plan): eager vs engine.compile() losses, breaks."""
    import dscore

    def build() -> Any:
        engine, *_ = dscore.initialize(model=_llama(), config=_hf_config(tensor_parallel={"autotp_size": 2}))
        return engine

    def step(engine: Any, i: int) -> Any:
        return engine(input_ids=_ids(i), labels=_ids(i)).loss

    return _measure(build, step, backend)


def ulysses_compiled(backend: str) -> dict[str, Any]:
    """Ulysses sp 2 on a tiny LlamaForCausalLM (attn_implementation="ulysses"): eager vs compiled losses, breaks."""
    import torch

    import dscore
    from dscore.parallel.ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, all_gather_differentiable

    state: dict[str, Any] = {}

    def build() -> Any:
        model = _llama()
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 2, seq_length=16)
        model.set_attn_implementation("ulysses")
        engine, *_ = dscore.initialize(model=model, config=_hf_config(sequence_parallel_size=2), mpu=mpu)
        state["mpu"] = mpu
        return engine

    def step(engine: Any, i: int) -> Any:
        mpu = state["mpu"]
        data = [{"input_ids": _ids(i), "labels": _ids(i)}]
        batch = next(iter(UlyssesSPDataLoaderAdapter(data, mpu.sp_rank, mpu.sp_comm, 2, "cpu")))
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        labels = batch["shift_labels"]
        loss_sum = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        sums = all_gather_differentiable(loss_sum, mpu.sp_comm)
        counts = all_gather_differentiable((labels != -100).sum().float(), mpu.sp_comm)
        return sums.sum() / counts.sum()

    return _measure(build, step, backend)


def moe_compiled(backend: str) -> dict[str, Any]:
    """dscore.moe MoE with 2 experts on 2 ranks (ep 2): eager vs engine.compile() losses, breaks."""
    import torch
    import torch.distributed as dist

    import dscore
    from dscore.moe.layer import MoE
    from dscore.moe.utils import split_params_into_different_moe_groups_for_optimizer

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp = torch.nn.Linear(8, 8, device="cpu")
            expert = torch.nn.Sequential(
                torch.nn.Linear(8, 16, device="cpu"), torch.nn.ReLU(), torch.nn.Linear(16, 8, device="cpu")
            )
            self.moe = MoE(8, expert, num_experts=2, ep_size=2, k=1, drop_tokens=False, min_capacity=0)
            self.out = torch.nn.Linear(8, 3, device="cpu")

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
            return self.out(h), l_aux

    def build() -> Any:
        model = Net()
        cfg = {"train_micro_batch_size_per_gpu": 6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
        engine, *_ = dscore.initialize(model=model, model_parameters=groups, config=cfg)
        return engine

    def step(engine: Any, i: int) -> Any:
        g = torch.Generator().manual_seed(10 * i + dist.get_rank())
        x = torch.randn(6, 8, generator=g, device="cpu")
        y = torch.randn(6, 3, generator=g, device="cpu")
        out, l_aux = engine(x)
        return ((out - y) ** 2).mean() + 0.01 * l_aux

    return _measure(build, step, backend)


def features_compiled(backend: str) -> dict[str, Any]:
    """AutoTP, Ulysses and MoE, each eager vs engine.compile(), in one spawn (see the functions above)."""
    return {"autotp": autotp_compiled(backend), "ulysses": ulysses_compiled(backend), "moe": moe_compiled(backend)}
