"""AutoTP and Ulysses against one process: one 2-rank and one 4-rank spawn run every check.

* 2 ranks: tp 2 (exact clipping across shards, checkpoint loaded at tp 1, same-batch check) and sp 2
  (64 tokens; uneven splits and head counts refused), see ``autotp_runs.py`` / ``ulysses_runs.py``; a
  Hugging Face Llama split by its own ``tp_plan`` and served by ``register_with_transformers``
  (``hf_runs.py``);
* 4 ranks: tp 2 x dp 2 at ZeRO 1 and 3, sp 2 x dp 2 at ZeRO 3 (128 tokens), tp 2 x sp 2 at ZeRO 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import autotp_runs
import hf_runs
import pytest
import ulysses_runs

from dscore.testing import run_distributed


def _two(tmp: str) -> dict[str, Any]:
    return {"tp": autotp_runs.two_ranks(tmp), "sp": ulysses_runs.two_ranks(), "hf": hf_runs.two_ranks()}


def _four() -> dict[str, Any]:
    return {"tp": autotp_runs.four_ranks(), "sp": ulysses_runs.four_ranks()}


@pytest.mark.slow
def test_tensor_and_sequence_parallel_two_ranks(tmp_path: Path) -> None:
    results = run_distributed(_two, 2, str(tmp_path / "ckpt"), timeout=400)
    autotp_runs.check_two_ranks([r["tp"] for r in results])
    ulysses_runs.check_two_ranks([r["sp"] for r in results])
    hf_runs.check_two_ranks([r["hf"] for r in results])


@pytest.mark.slow
def test_tensor_and_sequence_parallel_four_ranks() -> None:
    results = run_distributed(_four, 4, timeout=600)
    autotp_runs.check_four_ranks([r["tp"] for r in results])
    ulysses_runs.check_four_ranks([r["sp"] for r in results])
