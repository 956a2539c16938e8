"""Issue 33 item 7, issue 29 item 8: PipelineModule's early refusals (item 2, one sample stream, is
``test_pipeline_stages_read_one_sample_stream`` in test_pipeline_distributed.py, sharing its 2-rank job)."""

from __future__ import annotations

from typing import Any

import pytest
from pipe_models import Scale
from pipe_models import mse as _mse

from dscore.errors import ConfigError, DistributedError
from dscore.pipe import PipelineModule


def test_fewer_layers_than_stages_is_refused_naming_the_counts() -> None:
    with pytest.raises(ConfigError, match=r"1 layer\(s\) for num_stages=2.*num_stages <= 1"):
        PipelineModule(layers=[Scale()], num_stages=2, loss_fn=_mse)


def test_pipeline_module_before_the_process_group_names_the_launched_world(monkeypatch: Any) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedError, match=r"WORLD_SIZE=2.*dscore.init_distributed\(\)"):
        PipelineModule(layers=[Scale(), Scale()], num_stages=2, loss_fn=_mse)
