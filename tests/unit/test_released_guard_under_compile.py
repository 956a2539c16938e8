"""The ZeRO-3 released-parameter guard under torch.compile (issue 41 item 2): dynamo's fake-tensor probing of a
released parameter (``Tensor.is_conj``, ``is_neg``, ...) reads only metadata and is let through, while a real use
of its values still raises :class:`dscore.errors.PartitionedParameterError`, eager or compiled."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dscore.errors import PartitionedParameterError
from dscore.zero.released import mark_available, mark_released


def _released() -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(4, 3, device="cpu"))
    mark_released(p)
    return p


def test_fake_tensor_conversion_of_a_released_parameter_reads_only_metadata() -> None:
    p = _released()
    fake = FakeTensorMode().from_tensor(p)
    assert fake.shape == (4, 3) and fake.dtype == p.dtype and fake.requires_grad


def test_compiled_metadata_use_works_and_value_use_raises_the_dscore_error() -> None:
    torch._dynamo.reset()
    p = _released()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def shape_only(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(p.shape) + x.sum() * p.shape[0]

    out = shape_only(torch.ones(2, device="cpu"))
    assert out.shape == (4, 3) and float(out[0, 0]) == 8.0

    @torch.compile(backend="aot_eager")
    def uses_values(x: torch.Tensor) -> torch.Tensor:
        return x @ p

    with pytest.raises(PartitionedParameterError, match="matmul"):
        uses_values(torch.ones(2, 4, device="cpu"))
    with pytest.raises(PartitionedParameterError):
        p.sum()  # eager use still refused
    mark_available(p)
    assert p.sum().isfinite()
