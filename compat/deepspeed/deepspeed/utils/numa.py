"""``deepspeed.utils.numa``: ``parse_range_list`` (dscore's ``--bind_core_list`` parser); ``get_numactl_cmd`` and
the other numactl helpers import and raise :class:`deepspeed._not_provided.NotProvidedError` when used
(dscore's launcher binds cores itself: ``dscore launch --bind_cores_to_rank --bind_core_list``)."""

from __future__ import annotations

from deepspeed._not_provided import not_provided

__all__ = ["get_numa_cores", "get_numactl_cmd", "parse_range", "parse_range_list"]

_WHY = "dscore's launcher builds the numactl binding itself (--bind_cores_to_rank, --bind_core_list)"
get_numactl_cmd = not_provided("deepspeed.utils.numa.get_numactl_cmd", _WHY)
get_numa_cores = not_provided("deepspeed.utils.numa.get_numa_cores", _WHY)


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]`` (:func:`dscore.launcher.ranks.parse_range_list`).

    Raises:
        ValueError: a malformed item, a descending range or overlapping/unsorted entries (as DeepSpeed; the
            message is dscore's ``LauncherError``'s).
    """
    from dscore.errors import LauncherError
    from dscore.launcher.ranks import parse_range_list as parse

    try:
        return parse(range_str)
    except LauncherError as exc:
        raise ValueError(str(exc)) from exc


def parse_range(rng: str) -> list[int]:
    """One item of :func:`parse_range_list` (``"2-4"`` -> ``[2, 3, 4]``, ``"5"`` -> ``[5]``).

    Raises:
        ValueError: malformed or descending.
    """
    if "," in rng:
        raise ValueError(f"bad range {rng!r}: one item (N or N-M) expected")
    return parse_range_list(rng)
