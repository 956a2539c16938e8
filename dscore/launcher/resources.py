"""Resource resolution: which hosts and slots a job uses.

Inputs are the pool (``{host: [slot, ...]}`` from the hostfile, or ``{"localhost": [0..n)}``) and the
``-i/--include``, ``-e/--exclude``, ``--num_nodes`` and ``--num_gpus`` options, with DeepSpeed 0.19.8's
semantics:

* filter grammar ``host[:slot[,slot...]][@host[:slot...]...]``;
* include seeds from the pool: a bare host means all of its slots; slots are de-duplicated and sorted;
  when a host is named both bare and with slots, the named slots win (``a@a:1`` is slot 1 of ``a``);
* exclude removes a whole host (bare) or the named slots; hosts left without slots are dropped;
* the result keeps pool (hostfile) order;
* include and exclude are mutually exclusive, and neither may be combined with an explicit
  ``--num_nodes``/``--num_gpus`` (DeepSpeed checks ``>= 0``, so even ``--num_nodes 0`` conflicts);
* ``--num_nodes N`` keeps the first N hosts, ``--num_gpus K`` makes every host's slots ``[0..K)``.

dscore fails loudly where DeepSpeed is silent: an unknown host or slot, an empty slot list, a
malformed slot, ``--num_nodes`` larger than the pool or < 1, and ``--num_gpus`` < 1 are
:class:`~dscore.errors.LauncherArgumentError`\\ s (``ValueError``\\ s, as in DeepSpeed) naming the option, the bad value and the valid choices.
"""

from __future__ import annotations

from dscore.errors import LauncherArgumentError, did_you_mean

__all__ = ["WorldInfo", "parse_filter", "apply_filters", "select_resources"]

#: host -> sorted slot ids, in host order.
WorldInfo = dict[str, list[int]]


def _fmt_pool(pool: WorldInfo) -> str:
    return ", ".join(f"{h}:{','.join(map(str, s))}" for h, s in pool.items())


def parse_filter(text: str, pool: WorldInfo, *, option: str) -> dict[str, list[int] | None]:
    """Parse an include/exclude string against ``pool``.

    Args:
        text: e.g. ``"worker-0:0,2@worker-1"``.
        pool: the available hosts and slots.
        option: the option name for error messages (``"--include"``).

    Returns:
        host -> sorted requested slots, or ``None`` for a bare host (all slots), in order of first mention.
        When a host is named bare and with slots, the slots are kept.

    Raises:
        LauncherArgumentError: empty host spec, unknown host (with close matches), empty or malformed slot list,
            or a slot the host does not have (listing its slots).
    """
    out: dict[str, list[int] | None] = {}
    for part in text.split("@"):
        if not part.strip():
            raise LauncherArgumentError(
                f"{option} {text!r}: empty host entry; expected host[:slot,slot][@host...], "
                f"available: {_fmt_pool(pool)}"
            )
        host, sep, slot_text = part.strip().partition(":")
        if host not in pool:
            close = did_you_mean(host, pool)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise LauncherArgumentError(
                f"{option} {text!r}: host {host!r} is not in the hostfile/resource pool; "
                f"valid hosts: {', '.join(pool)}.{hint}"
            )
        if not sep:
            out.setdefault(host, None)
            continue
        slots: list[int] = []
        items = slot_text.split(",")
        if not slot_text.strip() or any(not s.strip() for s in items):
            raise LauncherArgumentError(
                f"{option} {text!r}: empty slot list for host {host!r}; write {host}:0,1 or just {host} for "
                f"all of its slots ({','.join(map(str, pool[host]))})"
            )
        for item in items:
            try:
                slot = int(item.strip())
            except ValueError:
                raise LauncherArgumentError(
                    f"{option} {text!r}: slot {item.strip()!r} of host {host!r} is not an integer; "
                    f"valid slots: {','.join(map(str, pool[host]))}"
                ) from None
            if slot not in pool[host]:
                raise LauncherArgumentError(
                    f"{option} {text!r}: host {host!r} has no slot {slot}; "
                    f"valid slots: {','.join(map(str, pool[host]))}"
                )
            slots.append(slot)
        previous = out.get(host)
        out[host] = sorted(set(slots) | set(previous or []))
    return out


def apply_filters(pool: WorldInfo, *, include: str = "", exclude: str = "") -> WorldInfo:
    """Apply ``--include`` or ``--exclude`` to ``pool`` (see the module docstring for semantics).

    Raises:
        LauncherArgumentError: both filters given, a malformed filter, or nothing left after filtering.
    """
    if include and exclude:
        raise LauncherArgumentError(f"--include {include!r} and --exclude {exclude!r} are mutually exclusive; use one of them")
    if include:
        wanted = parse_filter(include, pool, option="--include")
        result = {h: list(pool[h]) if wanted[h] is None else list(wanted[h] or []) for h in pool if h in wanted}
    elif exclude:
        dropped = parse_filter(exclude, pool, option="--exclude")
        result = {}
        for host, slots in pool.items():
            if host in dropped:
                removed = dropped[host]
                if removed is None:
                    continue
                slots = [s for s in slots if s not in removed]
            if slots:
                result[host] = list(slots)
    else:
        return {h: list(s) for h, s in pool.items()}
    if not result:
        which = f"--include {include!r}" if include else f"--exclude {exclude!r}"
        raise LauncherArgumentError(f"{which} leaves no slots to launch on; available: {_fmt_pool(pool)}")
    return result


def select_resources(
    pool: WorldInfo,
    *,
    include: str = "",
    exclude: str = "",
    num_nodes: int = -1,
    num_gpus: int = -1,
) -> WorldInfo:
    """Resolve the hosts and slots to launch on, DeepSpeed-style.

    Args:
        pool: available hosts and slots (hostfile order).
        include / exclude: filter strings ("" when unset).
        num_nodes: keep the first N hosts (-1: all).
        num_gpus: slots per host become ``[0..K)`` (-1: as in the pool). On CPU this is the number of
            processes per node.

    Raises:
        LauncherArgumentError: conflicting options, values out of range (naming the valid range), bad filters.
    """
    if (include or exclude) and (num_nodes >= 0 or num_gpus >= 0):
        which = f"--include {include!r}" if include else f"--exclude {exclude!r}"
        explicit = [f"--num_nodes {num_nodes}"] * (num_nodes >= 0) + [f"--num_gpus {num_gpus}"] * (num_gpus >= 0)
        raise LauncherArgumentError(
            f"{which} cannot be combined with {' and '.join(explicit)}; choose hosts/slots with the filter "
            "or with the counts, not both"
        )
    world = apply_filters(pool, include=include, exclude=exclude)
    if num_nodes >= 0 or num_nodes < -1:
        if not 1 <= num_nodes <= len(world):
            raise LauncherArgumentError(
                f"--num_nodes {num_nodes} is out of range: {len(world)} host(s) available "
                f"({', '.join(world)}); valid values are 1..{len(world)}"
            )
        world = dict(list(world.items())[:num_nodes])
    if num_gpus >= 0 or num_gpus < -1:
        if num_gpus < 1:
            raise LauncherArgumentError(f"--num_gpus/--nproc_per_node {num_gpus} is out of range; it must be >= 1")
        world = {h: list(range(num_gpus)) for h in world}
    return world
