"""Issue 40 items 1-2 on the compat distribution: ``deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine`` is
the type of the engine ``deepspeed.initialize`` returns with ``hybrid_engine.enabled``, and
``deepspeed.runtime.rollout`` (and its submodules) are dscore's rollout names, no longer refused stand-ins."""

from __future__ import annotations

import importlib

import pytest
import rollout_jobs  # tests/compat is on sys.path: pytest's prepend import mode

from dscore.testing import run_distributed


def test_rollout_names_are_dscores() -> None:
    import dscore.rollout as native
    from dscore.rollout import continuous_batching

    ds = importlib.import_module("deepspeed.runtime.rollout")
    # dscore's own names, not DeepSpeed's: the compat package does not add them to deepspeed.runtime.rollout
    native_only = {"HybridEngineRolloutConfig", "WeightSyncGroup", "WeightSyncReceiver", "WeightSyncSender"}
    for name in native.__all__:
        if name not in native_only:
            assert getattr(ds, name) is getattr(native, name), name
    for sub in ("base", "opsd", "hybrid_engine_rollout", "continuous_batching"):
        mod = importlib.import_module(f"deepspeed.runtime.rollout.{sub}")
        for name in mod.__all__:
            assert callable(getattr(mod, name)), (sub, name)
    assert importlib.import_module("deepspeed.runtime.rollout.continuous_batching").ContinuousBatchScheduler is (
        continuous_batching.ContinuousBatchScheduler
    )


@pytest.mark.slow
def test_initialize_returns_a_deepspeed_hybrid_engine() -> None:
    from deepspeed._not_provided import NotProvidedError
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    assert run_distributed(rollout_jobs.hybrid_isinstance, 2, timeout=300) == [[True, 6, False]] * 2
    with pytest.raises(NotProvidedError, match="hybrid_engine"):
        DeepSpeedHybridEngine()
