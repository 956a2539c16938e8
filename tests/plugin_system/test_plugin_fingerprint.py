"""Ranks compare their plugin sets right after init_distributed and fail fast when they differ."""

from __future__ import annotations

import time

from dscore.comm.fingerprint import compare_plugin_sets
from dscore.testing import run_distributed

BASE = [("comm", "dscore", "0.1.0", "active"), ("cpu", "dscore", "0.1.0", "active")]


def test_identical_reports_are_fine() -> None:
    assert compare_plugin_sets([("h0", 0, "abc", BASE), ("h1", 1, "abc", BASE)]) == ""
    assert compare_plugin_sets([]) == ""


def test_differences_name_ranks_hosts_and_plugins() -> None:
    other = [("comm", "dscore", "0.2.0", "active"), ("cpu", "dscore", "0.1.0", "active"), ("x", "xpkg", "1", "active")]
    text = compare_plugin_sets([("hostB", 1, "fff", other), ("hostA", 0, "abc", BASE), ("hostA", 2, "abc", BASE)])
    lines = text.splitlines()
    assert len(lines) == 1  # rank 2 matches rank 0
    assert lines[0].startswith("rank 1 on hostB (fingerprint fff) differs from rank 0 on hostA (fingerprint abc)")
    assert "only on rank 1 (hostB): comm (dscore 0.2.0, active); x (xpkg 1, active)" in text
    assert "only on rank 0 (hostA): comm (dscore 0.1.0, active)" in text


class _ExtraPlugin:
    """A plugin with no hooks: enough to change the plugin set."""


def _mismatched_plugin_sets() -> tuple[str, float]:
    import torch.distributed as dist

    import dscore
    from dscore.errors import DistributedError
    from dscore.plugin_manager import create_plugin_manager

    rank = int(__import__("os").environ["RANK"])
    extra = [("only_on_rank_one", _ExtraPlugin())] if rank == 1 else []
    manager = create_plugin_manager(extra_plugins=extra)
    start = time.monotonic()
    try:
        dscore.init_distributed(plugin_manager=manager)
    except DistributedError as exc:
        assert not dist.is_initialized(), "the group dscore created is destroyed after the failed check"
        return str(exc), time.monotonic() - start
    raise AssertionError("differing plugin sets must fail on every rank")


def test_plugin_set_mismatch_fails_fast_on_every_rank() -> None:
    results = run_distributed(_mismatched_plugin_sets, 2, init_process_group=False, timeout=120)
    for message, elapsed in results:
        assert "ranks run different plugin sets" in message
        assert "rank 1 on " in message and "only on rank 1" in message and "only_on_rank_one" in message
        assert elapsed < 60  # no collective hang: both ranks fail at the same all_gather
