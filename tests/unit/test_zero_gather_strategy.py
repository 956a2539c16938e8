"""FlatUnit's gather strategy (``dscore.zero.partition.GatherStrategy``): the default plain all-gather, and a
strategy of a third party's: it is called for gathers and re-gathers, told when the partition changes, and an
approximate gather it gives is re-gathered exactly and never written back."""

from __future__ import annotations

import pytest
import torch

from dscore.comm import Comm, Work
from dscore.zero.partition import ALL_GATHER, FlatUnit, GatherStrategy


class HalvingGather:
    """Gathers exactly when asked to, else half the values (an 'approximation'), and records every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def launch(self, unit: FlatUnit, *, exact: bool) -> tuple[Work | None, bool]:
        self.calls.append("exact" if exact else "approx")
        work, _ = ALL_GATHER.launch(unit, exact=True)
        if exact:
            return work, True
        return Work([work], lambda: unit.full.mul_(0.5)), False

    def invalidate(self, unit: FlatUnit) -> None:
        self.calls.append("invalidate")


def _unit() -> tuple[FlatUnit, torch.nn.Linear, list[torch.Tensor]]:
    lin = torch.nn.Linear(3, 2)
    values = [lin.weight.detach().clone(), lin.bias.detach().clone()]
    unit = FlatUnit(list(lin.parameters()), Comm(None), dtype=torch.float32, device=torch.device("cpu"))
    unit.load_full(values)
    return unit, lin, values


def test_the_default_strategy_is_the_plain_all_gather() -> None:
    unit, lin, values = _unit()
    assert unit.gather_strategy is ALL_GATHER
    unit.release()
    unit.gather(exact=False)  # the plain gather is exact whatever is allowed
    assert not unit.approximate and torch.equal(lin.weight.detach(), values[0])


def test_a_custom_strategy_is_used_and_its_approximation_is_regathered_exactly() -> None:
    unit, lin, values = _unit()
    strategy = HalvingGather()
    checked: GatherStrategy = strategy  # the protocol is structural
    unit.gather_strategy = checked
    unit.release()
    unit.gather(exact=False)
    assert unit.approximate and torch.equal(lin.weight.detach(), values[0] * 0.5)
    with pytest.raises(RuntimeError, match="approximate gather"):
        unit.write_back()
    unit.gather()  # exact: gathers again although gathered
    assert not unit.approximate and torch.equal(lin.weight.detach(), values[0])
    with torch.no_grad():
        lin.bias.add_(1.0)
    unit.write_back()  # the partition changed: the strategy is told
    unit.refresh()
    assert strategy.calls == ["approx", "exact", "invalidate", "invalidate", "exact"]
    assert torch.equal(lin.bias.detach(), values[1] + 1.0)
