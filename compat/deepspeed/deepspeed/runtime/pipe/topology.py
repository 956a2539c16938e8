"""``deepspeed.runtime.pipe.topology``: DeepSpeed 0.19.8's process topologies on :mod:`dscore.pipe.topology`.

:class:`ProcessTopology` is dscore's (same rank layout: the last axis varies fastest) with DeepSpeed's
reading API on top: ``get_coord`` returns a named tuple (``coord.pipe``; ``coord["pipe"]`` reads as in
dscore), ``get_dim`` of an axis the topology lacks is 0, ``get_rank`` with some axes missing raises
``ValueError`` (a :class:`dscore.errors.ConfigError`), plus ``get_axis_names``, ``get_rank_repr`` and
``filter_match``. A topology of this module can be passed to ``PipelineModule(topology=...)``.
``PipelineParallelGrid`` (DeepSpeed builds it from a topology; dscore's :class:`dscore.pipe.PipelineGrid` is
built by the ``PipelineModule`` and read with ``module.mpu()``) and ``_prime_factors`` (private) are
not provided: using them raises :class:`deepspeed._not_provided.NotProvidedError`.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence
from typing import Any

from deepspeed._not_provided import not_provided
from dscore.errors import ConfigError
from dscore.pipe import ProcessTopology as _DscoreTopology

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
]


class ProcessTopology(_DscoreTopology):
    """DeepSpeed's ``ProcessTopology(axes, dims)``: global ranks on a Cartesian grid of named axes.

    Args:
        axes: axis names, outermost first (``["pipe", "data"]``).
        dims: the size of each axis.

    Raises:
        ConfigError: lengths differ, names repeat, or a size is below 1.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        super().__init__(axes, dims)
        base = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        axes_list = self.axes

        def getitem(coord: Any, key: Any) -> Any:
            # dscore's own code reads coordinates by axis name; DeepSpeed's by attribute or position
            return tuple.__getitem__(coord, axes_list.index(key) if isinstance(key, str) else key)

        self.ProcessCoord = type("ProcessCoord", (base,), {"__slots__": (), "__getitem__": getitem})

    def get_coord(self, rank: int) -> Any:  # type: ignore[override]
        """The coordinate of global ``rank`` as a ``ProcessCoord`` named tuple (``coord.pipe``).

        Raises:
            ValueError: ``rank`` is not in the topology.
        """
        if not 0 <= int(rank) < self.world_size():
            raise ValueError(f"rank {rank} not found in topology (world size {self.world_size()})")
        return self.ProcessCoord(*super().get_coord(int(rank)).values())

    def get_dim(self, axis: str) -> int:
        """Size of ``axis``; 0 when the topology has no such axis (DeepSpeed's convention)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coords: int) -> int:
        """The global rank at ``coords`` (every axis given).

        Raises:
            ConfigError (a ValueError): an axis missing or unknown, or an index out of range.
        """
        if set(coords) != set(self.axes):
            raise ConfigError(f"get_rank() needs exactly the axes {self.axes}, got {sorted(coords)} "
                              "(it does not take slices: use filter_match())")
        for axis, idx in coords.items():
            if not 0 <= int(idx) < self.get_dim(axis):
                raise ConfigError(f"get_rank(): {axis}={idx} is outside 0..{self.get_dim(axis) - 1}")
        return super().get_rank(**coords)

    def get_axis_names(self) -> list[str]:
        """The axis names, outermost first."""
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``rank``'s coordinate as text, e.g. ``"model_01"`` (``<axis><inner_sep><index:02d>`` joined by
        ``outer_sep`` over the axes not in ``omit_axes``); DeepSpeed names checkpoint files with it."""
        coord = self.get_coord(rank)
        omitted = frozenset(omit_axes)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in omitted)

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Global ranks (ascending) whose coordinates equal every ``axis=index`` given (no argument: all)."""
        unknown = sorted(set(filter_kwargs) - set(self.axes))
        if unknown:
            raise ConfigError(f"filter_match(): unknown axes {unknown}; the topology's axes are {self.axes}")
        return [r for r in range(self.world_size())
                if all(getattr(self.get_coord(r), a) == int(i) for a, i in filter_kwargs.items())]

    def __str__(self) -> str:
        return f"ProcessTopology(axes={self.axes}, dims={self.dims})"


class PipeDataParallelTopology(ProcessTopology):
    """Axes ``["pipe", "data"]``: ``num_pp`` stages times ``num_dp`` data-parallel replicas."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data"], [num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes ``["pipe", "data", "model"]`` (DeepSpeed's order). dscore's pipeline engine runs a topology whose
    ``model`` size is 1; a larger one is refused when the ``PipelineModule`` builds its groups."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data", "model"], [num_pp, num_dp, num_mp])


PipelineParallelGrid = not_provided(
    "deepspeed.runtime.pipe.topology.PipelineParallelGrid",
    "dscore builds the pipeline groups inside PipelineModule (dscore.pipe.PipelineGrid); read them with "
    "pipeline_module.mpu()",
)
_prime_factors = not_provided(
    "deepspeed.runtime.pipe.topology._prime_factors", "a DeepSpeed-private helper with no dscore counterpart"
)
