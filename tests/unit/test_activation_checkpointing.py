"""dscore.checkpointing: gradients equal the plain forward (dropout included), saved-tensor bytes drop,
cpu/contiguous placement of saved inputs, the ``activation_checkpointing`` config block and
``dscore.initialize`` wiring."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dscore
from dscore import checkpointing as ck
from dscore.checkpointing import CheckpointingError
from dscore.config import load_config
from dscore.errors import ConfigError
from dscore_plugins.parallel.checkpointing import function

HIDDEN = 64
BATCH = 32


@pytest.fixture(autouse=True)
def _fresh_settings() -> Iterator[None]:
    ck._reset_for_tests()
    yield
    ck._reset_for_tests()


class Block(torch.nn.Module):
    """A residual MLP block with dropout (the unit a transformer checkpoints)."""

    def __init__(self, width: int = HIDDEN, p: float = 0.2) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Stack(torch.nn.Module):
    def __init__(self, depth: int = 8, seed: int = 0, p: float = 0.2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList(Block(p=p) for _ in range(depth))
        self.use_checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = ck.checkpoint(b, x) if self.use_checkpoint else b(x)
        return x


class SavedBytes:
    """Bytes autograd keeps for backward (saved_tensors_hooks), each storage counted once."""

    def __init__(self) -> None:
        self.storages: dict[tuple[int, str], int] = {}
        self.devices: list[str] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[(storage.data_ptr(), str(t.device))] = storage.nbytes()
        self.devices.append(t.device.type)
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def measure(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            return fn()


def _train_step(
    model: Stack, x: torch.Tensor, *, checkpointed: bool, seed: int = 7, seen: SavedBytes | None = None
) -> dict[str, Any]:
    """One forward/backward from a fixed RNG state; returns output, all grads and the next draw.
    ``seen`` records what the model's forward (only) saves for backward."""
    model.use_checkpoint = checkpointed
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = seen.measure(lambda: model(x)) if seen is not None else model(x)
    loss = out.pow(2).mean()
    loss.backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "x_grad": x.grad.clone(),
        "next_draw": torch.rand(4),  # the recompute must leave the caller's RNG stream where it was
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any], tol: float = 1e-6) -> None:
    assert torch.allclose(a["out"], b["out"], atol=tol, rtol=0)
    assert torch.allclose(a["x_grad"], b["x_grad"], atol=tol, rtol=0)
    for name, g in a["grads"].items():
        assert torch.allclose(g, b["grads"][name], atol=tol, rtol=0), (name, (g - b["grads"][name]).abs().max())
    assert torch.equal(a["next_draw"], b["next_draw"])


def test_gradients_equal_plain_forward_with_dropout() -> None:
    model = Stack(depth=6)
    x = torch.randn(BATCH, HIDDEN)
    plain = _train_step(model, x, checkpointed=False)
    ckpt = _train_step(model, x, checkpointed=True)
    _assert_same(plain, ckpt)
    # dropout is really active: another seed gives other gradients, so equality above is not vacuous
    other = _train_step(model, x, checkpointed=True, seed=8)
    assert not torch.allclose(other["x_grad"], plain["x_grad"], atol=1e-4)


def test_first_layer_without_grad_inputs_still_trains_parameters() -> None:
    model = Stack(depth=2)
    model.use_checkpoint = True
    x = torch.randn(4, HIDDEN)  # no requires_grad: torch's re-entrant checkpoint would drop the grads
    model(x).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_multiple_and_non_tensor_inputs_and_outputs() -> None:
    lin = torch.nn.Linear(HIDDEN, HIDDEN)

    def fn(a: torch.Tensor, scale: float, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = lin(a) * scale + b
        return h, h.argmax(dim=1), F.dropout(h, 0.5, training=True)

    a, b = torch.randn(3, HIDDEN, requires_grad=True), torch.randn(3, HIDDEN, requires_grad=True)
    torch.manual_seed(3)
    h, idx, d = fn(a, 2.0, b)
    (h.sum() + d.pow(2).sum()).backward()
    ref = [a.grad.clone(), b.grad.clone(), lin.weight.grad.clone()]
    a.grad = b.grad = lin.weight.grad = None
    torch.manual_seed(3)
    h2, idx2, d2 = ck.checkpoint(fn, a, 2.0, b)
    assert not idx2.requires_grad and torch.equal(idx, idx2)
    (h2.sum() + d2.pow(2).sum()).backward()
    for r, g in zip(ref, [a.grad, b.grad, lin.weight.grad], strict=True):
        assert torch.allclose(r, g, atol=1e-6)


def test_no_grad_mode_just_calls_the_function() -> None:
    block = Block()
    x = torch.randn(2, HIDDEN)
    with torch.no_grad():
        out = ck.checkpoint(block.eval(), x)
    assert out.grad_fn is None and torch.allclose(out, block(x))


def test_checkpointing_saves_far_fewer_bytes_for_backward() -> None:
    depth = 16
    model = Stack(depth=depth)
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    plain, ckpt = SavedBytes(), SavedBytes()
    model.use_checkpoint = False
    out_plain = plain.measure(lambda: model(x))
    model.use_checkpoint = True
    out_ckpt = ckpt.measure(lambda: model(x))
    # checkpointed: exactly the block inputs (depth activations of BATCH x HIDDEN fp32), nothing inside
    assert ckpt.total == depth * BATCH * HIDDEN * 4
    ratio = ckpt.total / plain.total
    # plain keeps ~ layernorm in/stats, 4x-wide up/gelu outputs, dropout mask per block: > 10x the input
    assert ratio < 0.1, (ckpt.total, plain.total, ratio)
    out_plain.sum().backward()
    out_ckpt.sum().backward()  # both graphs still back-propagate after measuring


def test_cpu_checkpointing_keeps_saved_inputs_on_host() -> None:
    ck.configure(checkpoint_in_cpu=True)
    assert ck.settings().cpu_checkpointing and ck.is_configured()
    model = Stack(depth=4)
    x = torch.randn(BATCH, HIDDEN)
    plain = _train_step(model, x, checkpointed=False)
    seen = SavedBytes()
    ckpt = _train_step(model, x, checkpointed=True, seen=seen)
    assert seen.devices and set(seen.devices) == {"cpu"}
    _assert_same(plain, ckpt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to see inputs leave it")
def test_cpu_checkpointing_moves_device_inputs_to_host_and_back() -> None:
    dev = torch.device("cuda")
    model = Stack(depth=4).to(dev)
    x = torch.randn(BATCH, HIDDEN, device=dev)
    plain = _train_step(model, x, checkpointed=False)
    for cpu in (False, True):
        ck.configure(checkpoint_in_cpu=cpu)
        seen = SavedBytes()
        got = _train_step(model, x, checkpointed=True, seen=seen)
        assert set(seen.devices) == ({"cpu"} if cpu else {"cuda"}), seen.devices
        _assert_same(plain, got, tol=1e-5)  # cuda RNG state is replayed too: dropout masks match


def test_contiguous_buffers_hold_saved_inputs_and_are_reused() -> None:
    depth = 5
    ck.configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=depth)
    model = Stack(depth=depth)
    x = torch.randn(BATCH, HIDDEN)
    plain = _train_step(model, x, checkpointed=False)
    for _ in range(2):  # the second step reuses the slots the first one freed
        seen = SavedBytes()
        got = _train_step(model, x, checkpointed=True, seen=seen)
        _assert_same(plain, got)
        (pool,) = function._pools.values()
        buffers = {b.untyped_storage().data_ptr() for b in pool.buffers[0]}
        assert len(buffers) == depth and {ptr for ptr, _ in seen.storages} == buffers
        assert sorted(pool.free) == list(range(depth))  # every slot released after backward

    # more live checkpoints than number_checkpoints
    ck.set_num_layers(depth - 1)
    model.use_checkpoint = True
    with pytest.raises(CheckpointingError, match="number_checkpoints = 4"):
        model(x)
    # a graph dropped without backward gives its slots back
    ck.set_num_layers(depth)
    model(x)
    model(x)
    # smaller inputs fit the buffers sized by the first checkpoint; larger ones or another dtype do not
    ck.checkpoint(model.blocks[0], torch.randn(2, HIDDEN)).sum().backward()
    with pytest.raises(CheckpointingError, match="inputs of one size"):
        ck.checkpoint(model.blocks[0], torch.randn(BATCH + 1, HIDDEN))
    with pytest.raises(CheckpointingError, match="inputs of one size"):
        ck.checkpoint(model.blocks[0].double(), torch.randn(2, HIDDEN, dtype=torch.float64))
    ck.reset()  # DeepSpeed's reset: the idle buffers are let go
    assert not function._pools


def test_contiguous_slot_is_not_reused_by_a_second_backward() -> None:
    ck.configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1)
    out = ck.checkpoint(Block(), torch.randn(2, HIDDEN, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(CheckpointingError, match="second backward"):
        out.backward()


class CountingAccelerator:
    """An accelerator stand-in recording synchronize calls and serving a separate RNG stream."""

    device_type = "fake"

    def __init__(self) -> None:
        self.syncs = 0
        self.state = torch.tensor([0], dtype=torch.uint8)
        self.sets: list[int] = []

    def synchronize(self) -> None:
        self.syncs += 1

    def get_rng_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.sets.append(int(state[0]))
        self.state = state.clone()


def test_synchronize_boundary_profile_and_accelerator_rng(caplog: pytest.LogCaptureFixture) -> None:
    acc = CountingAccelerator()
    ck.configure(synchronize=True, profile=True, accelerator=acc)
    block = Block()
    with caplog.at_level(logging.INFO, logger="dscore.checkpointing"):
        out = ck.checkpoint(block, torch.randn(2, HIDDEN))
        assert acc.syncs == 2  # start and end of the forward
        acc.state = torch.tensor([5], dtype=torch.uint8)  # the stream moves on before backward
        out.sum().backward()
    assert acc.syncs == 4  # and of the recompute+backward
    assert acc.sets == [0, 5]  # the forward's state for the recompute, then the caller's back
    text = caplog.text
    assert "checkpoint Block forward:" in text and "checkpoint Block recompute+backward:" in text
    ck.configure(synchronize=False, profile=False, accelerator=acc)
    ck.checkpoint(block, torch.randn(2, HIDDEN)).sum().backward()
    assert acc.syncs == 4


def test_config_block_keys_defaults_and_errors_name_the_key_path() -> None:
    base = {"train_batch_size": 8}
    cfg = load_config(base)
    assert cfg.activation_checkpointing.model_dump() == {
        "partition_activations": False,
        "number_checkpoints": None,
        "contiguous_memory_optimization": False,
        "cpu_checkpointing": False,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }
    assert (
        load_config({**base, "activation_checkpointing": None}).activation_checkpointing == cfg.activation_checkpointing
    )
    full = {
        "partition_activations": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 12,
        "cpu_checkpointing": True,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    assert load_config({**base, "activation_checkpointing": full}).activation_checkpointing.model_dump() == full
    cases = [
        ({"contiguous_memory_optimization": True, "partition_activations": True},
         "activation_checkpointing.contiguous_memory_optimization", "number_checkpoints"),
        ({"contiguous_memory_optimization": True, "number_checkpoints": 2},
         "activation_checkpointing.contiguous_memory_optimization", "partition_activations"),
        ({"number_checkpoints": 0}, "activation_checkpointing.number_checkpoints", "greater than 0"),
        ({"number_checkpoints": True}, "activation_checkpointing.number_checkpoints", "boolean"),
        ({"cpu_checkpointing": "yes"}, "activation_checkpointing.cpu_checkpointing", "boolean"),
        ({"profil": True}, "activation_checkpointing.profil", "did you mean 'profile'"),
    ]  # fmt: skip
    for block, path, words in cases:
        with pytest.raises(ConfigError) as info:
            load_config({**base, "activation_checkpointing": block})
        assert info.value.path == path and words in str(info.value), (block, str(info.value))
    # configure() applies the same rules, keyword overrides over the config block
    with pytest.raises(ConfigError) as info:
        ck.configure(contiguous_checkpointing=True, partition_activations=True)
    assert info.value.path == "activation_checkpointing.contiguous_memory_optimization"
    ck.configure(deepspeed_config={**base, "activation_checkpointing": full}, profile=False, num_checkpoints=3)
    assert ck.settings().cpu_checkpointing and ck.settings().number_checkpoints == 3 and not ck.settings().profile
    with pytest.raises(ConfigError, match="activation_checkpointing.number_checkpoints"):
        ck.set_num_layers(0)

    class Mpu:
        def get_model_parallel_world_size(self) -> int:
            return 2

    with pytest.raises(CheckpointingError, match="model-parallel world size of 2"):
        ck.configure(Mpu(), partition_activations=True)
    ck.configure(Mpu(), partition_activations=False)  # nothing to partition: accepted


def test_initialize_configures_checkpointing_from_the_config() -> None:
    model = Stack(depth=3, p=0.0)
    ref = Stack(depth=3, p=0.0)
    block = {"cpu_checkpointing": True, "profile": False}
    engine, opt, _, _ = dscore.initialize(
        model=model,
        config={
            "train_batch_size": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "gradient_clipping": 0.0,
            "activation_checkpointing": block,
        },
    )
    assert ck.is_configured() and ck.settings().cpu_checkpointing
    assert ck.settings().accelerator is engine.runtime.accelerator
    model.use_checkpoint = True
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(0)
    for _ in range(2):
        x = torch.randn(4, HIDDEN)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)
    # a config without the block leaves the configuration alone
    dscore.initialize(model=Stack(depth=1), config={"train_batch_size": 4})
    assert ck.settings().cpu_checkpointing


def test_importing_the_module_does_not_import_torch() -> None:
    code = "import sys, dscore, dscore.checkpointing; dscore.checkpointing.settings(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
