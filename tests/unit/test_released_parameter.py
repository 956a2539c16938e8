"""Single-process rules of a released ZeRO-3 parameter (:mod:`dscore.zero.released`): which torch calls pass
(metadata, autograd bookkeeping, no-op conversions), which raise ``PartitionedParameterError`` naming the
parameter (before: SIGSEGV or a read of freed memory), and that gathering gives the plain class back.
The 2-rank behaviour around ``zero.Init`` and ``initialize`` is tests/distributed/test_released_parameter_touch.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from dscore.comm import Comm
from dscore.errors import PartitionedParameterError
from dscore.zero import name_parameters
from dscore.zero.partition import FlatUnit


def _released() -> tuple[torch.nn.Module, FlatUnit]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    lin = model[0]
    unit = FlatUnit([lin.weight, lin.bias], Comm(None), dtype=torch.float32, device=torch.device("cpu"))
    unit.load_full([torch.ones(3, 4), torch.zeros(3)])
    name_parameters(model)
    unit.release()
    return model, unit


def test_metadata_and_bookkeeping_pass_on_a_released_parameter() -> None:
    model, unit = _released()
    w = model[0].weight
    assert type(w).__name__ == "ReleasedParameter" and isinstance(w, torch.nn.Parameter)
    assert w.shape == (3, 4) and w.numel() == 12 and w.dim() == 2 and w.dtype == torch.float32
    assert w.requires_grad and w.is_leaf and w.grad is None and w.device.type == "cpu"
    assert w.untyped_storage().nbytes() == 0  # really released
    assert w.to("cpu") is w and w.to(torch.float32) is w and w.cpu() is w
    w.requires_grad_(False)
    w.requires_grad_(True)
    w.grad = torch.zeros(3, 4)
    w.grad = None
    assert len({w, model[0].bias}) == 2  # hashing (optimizers build sets of parameters)
    model.to("cpu")  # Module._apply with a no-op conversion
    sd = model.state_dict(keep_vars=True)  # no data read; the engine's module_state_dict gathers
    assert sd["0.weight"] is w
    unit.gather()
    assert type(w) is torch.nn.Parameter and torch.equal(w, torch.ones(3, 4))


@pytest.mark.parametrize(
    "touch",
    [
        lambda p: p.sum(),
        lambda p: p.detach().sum(),
        lambda p: p.detach().detach().clone(),
        lambda p: p.data,
        lambda p: p[0],
        lambda p: p.to(torch.float16),
        lambda p: p + 1,
        lambda p: p.add_(1),
        lambda p: repr(p),
        lambda p: p.tolist(),
        lambda p: p.numpy(),
        lambda p: copy.deepcopy(p),
        lambda p: torch.save(p, io.BytesIO()),
        lambda p: torch.cat([p, p]),
        lambda p: torch.nn.functional.linear(torch.ones(1, 4), p),
    ],
    ids=["sum", "detach-sum", "detach-detach-clone", "data", "getitem", "to-half", "add", "add_", "repr", "tolist", "numpy", "deepcopy", "save",
         "cat", "linear"],
)
def test_reading_or_writing_values_raises_naming_the_parameter(touch) -> None:
    model, _ = _released()
    with pytest.raises(PartitionedParameterError, match=r"'0\.weight'.*dscore\.zero\.GatheredParameters") as info:
        touch(model[0].weight)
    assert info.value.name == "0.weight"


def test_state_dict_of_a_released_module_is_metadata_only_and_deepcopy_raises() -> None:
    model, unit = _released()
    # transformers' from_pretrained reads state_dict().keys() inside zero.Init: keys and metadata pass,
    # the values (0-byte storages) refuse every data use, saving included
    sd = model.state_dict()
    w = sd["0.weight"]
    assert w.shape == (3, 4) and w.dtype == model[0].weight.dtype and not isinstance(w, torch.nn.Parameter)
    assert w.ds_shape == model[0].weight.ds_shape
    for touch in (lambda: w.sum(), lambda: w.clone(), lambda: torch.save(sd, io.BytesIO()), lambda: repr(w)):
        with pytest.raises(PartitionedParameterError, match="'0.weight'"):
            touch()
    with pytest.raises(PartitionedParameterError):
        copy.deepcopy(model)
    unit.gather()
    assert torch.equal(model.state_dict()["0.weight"], torch.ones(3, 4))
