"""Cutting a list of layers into contiguous pipeline stages (pure Python, no torch).

``parts`` lists are boundaries: stage ``s`` owns layers ``parts[s] <= i < parts[s + 1]``; ``parts[0] == 0``
and ``parts[-1] == num_items`` (DeepSpeed's representation).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["partition_balanced", "partition_uniform"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries giving each part ``num_items // num_parts`` items, the first ``num_items % num_parts``
    parts one more. With fewer items than parts the trailing parts are empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + chunk + (1 if p < residual else 0))
    return parts


def partition_balanced(weights: Sequence[int | float], num_parts: int) -> list[int]:
    """Contiguous boundaries minimising the heaviest part's total weight (exact, dynamic programming).

    Among optimal cuts the one whose earlier parts are as heavy as the bound allows is taken, so ties
    put layers on earlier stages. ``O(n^2 * num_parts)``, fine for the tens to hundreds of layers
    of a model.
    """
    n = len(weights)
    if num_parts <= 0:
        raise ValueError("num_parts must be >= 1")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: minimal bottleneck of the first i items cut into k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(n + 1):
            for j in range(i + 1):
                if best[k - 1][j] == inf:
                    continue
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i] = cost
    bound = best[num_parts][n]
    # greedy walk with the bound: each part takes as many items as fit while the rest stays feasible
    parts = [0]
    start = 0
    for k in range(num_parts, 0, -1):
        end = start
        if k == 1:
            end = n
        else:
            end = _take(prefix, start, n, k, bound, keep_rest=n - start >= k)
            if end < 0:
                end = max(_take(prefix, start, n, k, bound, keep_rest=False), start)
        parts.append(end)
        start = end
    return parts


def _take(prefix: list[float], start: int, n: int, k: int, bound: float, *, keep_rest: bool) -> int:
    """The furthest end of the part starting at ``start`` keeping the rest feasible in ``k - 1`` parts
    (with ``keep_rest``: also leaving one item per remaining part), or -1."""
    for i in range(n, start - 1, -1):
        if keep_rest and (n - i < k - 1 or i == start):
            continue
        if prefix[i] - prefix[start] <= bound + 1e-9 and _feasible(prefix, i, n, k - 1, bound):
            return i
    return -1


def _feasible(prefix: list[float], start: int, n: int, parts: int, bound: float) -> bool:
    """Can items ``start..n`` be cut into ``parts`` parts (empty ones allowed) of weight <= bound?"""
    used = 0
    i = start
    while i < n:
        used += 1
        if used > parts:
            return False
        j = i
        while j < n and prefix[j + 1] - prefix[i] <= bound + 1e-9:
            j += 1
        if j == i:
            return False
        i = j
    return True
