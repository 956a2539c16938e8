"""Opt-in test helpers for dscore and for plugin authors (``from dscore.testing import run_distributed``)."""

from __future__ import annotations

from dscore.testing.distributed import DistributedTestFailure, find_free_port, run_distributed

__all__ = ["DistributedTestFailure", "find_free_port", "run_distributed"]
