"""1-bit compression pieces in one process (world size 1): packing, error-feedback identity, warm-up rule."""

from __future__ import annotations

import pytest
import torch

from dscore_plugins.optim.onebit import (
    OneBitAdam,
    OneBitLamb,
    compressed_allreduce,
    error_buffer_sizes,
    pack_signs,
    unpack_signs,
)


def test_pack_unpack_round_trip_and_zero_is_positive() -> None:
    x = torch.tensor([1.0, -2.0, 0.0, -0.5, 3.0, -1.0, -1.0, 2.0, -4.0, 5.0, 6.0, -7.0, 0.1, -0.1, 9.0, -9.0])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 2
    assert unpack_signs(packed).tolist() == [1.0 if v >= 0 else -1.0 for v in x.tolist()]
    assert error_buffer_sizes(17, 2) == (32, 16) and error_buffer_sizes(3, 1) == (8, 8)


def test_error_feedback_identity_sum_of_outputs() -> None:
    """Sum over T calls of the output == T x - worker residue - server residue (exactly, world size 1)."""
    x = torch.randn(13, generator=torch.Generator().manual_seed(0))
    we, se = torch.zeros(16), torch.zeros(16)
    total = torch.zeros(13)
    for _ in range(50):
        out = compressed_allreduce(x, we, se)
        assert out.shape == x.shape
        assert torch.unique(out.abs()).numel() == 1  # one scale times signs
        total += out
    torch.testing.assert_close(total, 50 * x - we[:13] - se[:13], rtol=1e-5, atol=1e-4)
    assert (we[13:] == 0).all() and (se[13:] == 0).all()  # padding carries no error
    # the residues stay bounded, so the running mean converges to x
    assert (total / 50 - x).abs().max() < 0.2


def test_onebit_adam_warmup_is_adam_without_bias_correction_then_compresses() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(10))
    ref = p.detach().clone()
    opt = OneBitAdam([p], lr=0.1, freeze_step=3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    m = torch.zeros(10)
    v = torch.zeros(10)
    for t in range(3):
        assert opt.gradient_allreduce_needed and not opt.compression_active
        g = torch.randn(10, generator=torch.Generator().manual_seed(t))
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        ref = ref - 0.1 * (m / (v.sqrt() + 1e-8) + 0.01 * ref)
    torch.testing.assert_close(p.detach(), ref)
    assert opt.compression_active and not opt.gradient_allreduce_needed
    v_frozen = opt.state[p]["exp_avg_sq"].clone()
    p.grad = torch.randn(10)
    opt.step()
    assert torch.equal(opt.state[p]["exp_avg_sq"], v_frozen)  # variance frozen
    m_after = opt.state[p]["exp_avg"]
    assert torch.unique(m_after.abs()).numel() == 1  # momentum went through 1-bit compression
    sd = opt.state_dict()
    assert sd["onebit_global_step"] == 4
    opt2 = OneBitAdam([torch.nn.Parameter(torch.zeros(10))], lr=0.1, freeze_step=3)
    opt2.load_state_dict(sd)
    assert opt2.global_step == 4 and opt2.compression_active


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_onebit_optimizers_reduce_a_quadratic_locally(cls) -> None:
    torch.manual_seed(0)
    target = torch.randn(32)
    p = torch.nn.Parameter(torch.zeros(32))
    opt = cls([p], lr=0.05, freeze_step=10)
    start = float(((p.detach() - target) ** 2).sum())
    for _ in range(80):
        opt.zero_grad()
        ((p - target) ** 2).sum().backward()
        opt.step()
    assert float(((p.detach() - target) ** 2).sum()) < 0.1 * start
    with pytest.raises(ValueError):
        cls([torch.nn.Parameter(torch.zeros(1))], amsgrad=True)
