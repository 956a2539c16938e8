"""engine.compile() on the pipeline engine (issue 41 item 5): each stage's layers are compiled one by one, as
DeepSpeed 0.19.8's ``PipelineModule.compile``; 2 gloo ranks, 2 stages, losses equal eager."""

from __future__ import annotations

import pipe_models as pm  # tests/pipeline is on sys.path: pytest's prepend import mode
import pytest

from dscore.testing import run_distributed


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_interval", [0, 1])
def test_pipeline_engine_compile_matches_eager_per_layer(checkpoint_interval: int) -> None:
    """3 steps x 2 micro-batches on 2 stages (tied embedding/head, a function layer): the compiled losses
    equal eager (1e-5), each stage produced graphs (not the 0-graph trap), the flag flips; with activation
    checkpointing between layers too."""
    runs = [
        {"checkpoint_interval": checkpoint_interval},
        {"checkpoint_interval": checkpoint_interval, "compiled": True},
    ]
    per_rank = run_distributed(pm.train_many, 2, 2, 3, 2, runs, timeout=300)
    stages = set()
    for eager, compiled in per_rank:
        stages.add(compiled["stage"])
        assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5), compiled["stage"]
        assert compiled["is_compiled"] and not eager["is_compiled"]
        assert compiled["graphs"] >= 2, compiled  # one per compiled layer at least (each stage holds >= 2)
        assert compiled["graph_breaks"] == 0, compiled
    assert stages == {0, 1}
