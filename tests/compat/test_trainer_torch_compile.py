"""The unchanged HF Trainer with ``torch_compile=True`` on the compat ``deepspeed``: Accelerate calls
``engine.compile(backend=..., compile_kwargs=...)`` (issue 41 item 1). Tiny Llama from a config, 2 gloo ranks."""

from __future__ import annotations

import deepspeed
import hf_jobs  # tests/compat is on sys.path: pytest's prepend import mode
import pytest

from dscore.testing import run_distributed

assert getattr(deepspeed, "__dscore__", False), f"`deepspeed` at {deepspeed.__file__} is not dscore's layer"

pytestmark = pytest.mark.slow


def test_trainer_torch_compile_at_zero3_matches_eager(tmp_path) -> None:
    """4 steps eager then compiled (aot_eager) at ZeRO-3 (the stage whose hooks compile as regions; stages 0-2
    compile the whole module, tests/distributed/test_engine_compile.py): the engine is compiled, graphs were
    captured with no break, and the logged losses and gradient norms equal eager's within 1e-5."""
    results = run_distributed(hf_jobs.trainer_compile_job, 2, 3, str(tmp_path), init_process_group=False, timeout=600)
    for r in results:
        eager, compiled = r["eager"], r["compiled"]
        assert compiled["is_compiled"] and compiled["unique_graphs"] >= 1 and compiled["graph_breaks"] == 0
        assert sorted(compiled["losses"]) == [1, 2, 3, 4]
        for step in range(1, 5):
            assert compiled["losses"][step] == pytest.approx(eager["losses"][step], abs=1e-5), step
            assert compiled["grad_norms"][step] == pytest.approx(eager["grad_norms"][step], abs=1e-5), step
