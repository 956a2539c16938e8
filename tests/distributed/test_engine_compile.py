"""torch.compile on 2 gloo ranks: ``engine.compile()`` at ZeRO 0-3, ``initialize(model=torch.compile(m))``,
compiled autograd (issue 41 items 1, 2 and 6). Rank functions are in compile_runs.py.

The model is an ``nn.Sequential`` of torch.nn layers, on which torch 2.13's ``nn.Module.compile()`` captures no
graph: every test checks a graph was really produced with a recording backend.
"""

from __future__ import annotations

import compile_runs  # tests/distributed is on sys.path: pytest's prepend import mode
import pytest

from dscore.testing import run_distributed

pytestmark = pytest.mark.slow


def test_engine_compile_at_zero_0_to_3_matches_eager() -> None:
    """5 steps per stage: losses equal eager (1e-5), >= 1 graph, fullgraph=True and 0 breaks at 0-3 (ZeRO-3:
    one compiled region per Linear, the hooks between them); a second compile() is a no-op; is_compiled flips."""
    results = run_distributed(compile_runs.engine_compile_stages, 2, [0, 1, 2, 3], init_process_group=False, timeout=400)
    for rank, by_stage in enumerate(results):
        for stage in (0, 1, 2, 3):
            r = by_stage[f"stage{stage}"]
            assert r["compiled"] == pytest.approx(r["eager"], abs=1e-5), (rank, stage)
            assert r["graphs"] >= 1, (rank, stage)
            assert r["second_graphs"] == 0, (rank, stage)  # the second compile() installed nothing
            assert r["is_compiled"] == (False, True), (rank, stage)
            assert not any("_orig_mod" in k for k in r["keys"]), (rank, stage)
            assert r["breaks"] == 0, (rank, stage)
            # the Sequential's entries that hold parameters (the activations hold none)
            assert r["regions"] == (None if stage < 3 else ["0", "2", "4"]), (rank, stage, r["regions"])
    assert results[0]["stage0"]["eager"] != results[1]["stage0"]["eager"]  # each rank its own rows


def test_initialize_with_torch_compile_model_trains_and_checkpoints_both_ways(tmp_path) -> None:
    """initialize(model=torch.compile(model)) at ZeRO 2: the engine wraps the original module (no ``_orig_mod.``
    keys), its forward is compiled (a graph was recorded), losses equal eager; a plain-model checkpoint loads
    into it and its checkpoint loads into a plain-model engine."""
    results = run_distributed(compile_runs.adopted_torch_compile, 2, str(tmp_path), init_process_group=False, timeout=300)
    for r in results:
        assert r["module_type"] == "Sequential" and r["is_compiled"]
        assert r["graphs"] >= 1
        assert r["compiled"] == pytest.approx(r["eager"], abs=1e-5)
        assert r["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
        assert r["plain_into_compiled"] and r["compiled_into_plain"]


@pytest.mark.parametrize("stage", [0, 2])
def test_compiled_autograd_enabled_compiles_backward(stage: int) -> None:
    """compile(compiled_autograd_enabled=True): every backward runs with compiled autograd on and captures
    backward graphs; losses equal eager."""
    results = run_distributed(compile_runs.compiled_autograd_run, 2, stage, init_process_group=False, timeout=300)
    for r in results:
        assert r["ca_on_in_backward"] == [True] * compile_runs.STEPS
        assert r["ca_captures"] >= 1
        assert r["graphs"] >= 1
        assert r["compiled"] == pytest.approx(r["eager"], abs=1e-5)


def test_compile_refusals_and_backend_override_warning() -> None:
    """A DeepCompile schedule, an unknown backend name and a non-dict compile_kwargs are refused naming the
    argument (nothing compiled); a `backend` inside compile_kwargs is overridden by the argument with a warning."""
    r = run_distributed(compile_runs.compile_refusals, 2, init_process_group=False, timeout=300)[0]
    assert "schedule=" in r["schedule"] and "DeepCompile" in r["schedule"]
    assert "no-such-backend" in r["unknown_backend"] and "inductor" in r["unknown_backend"]
    assert "compile_kwargs must be a dict" in r["kwargs_type"]
    assert r["compiled_after_refusals"] is False
    assert r["graphs"] >= 1  # the Recorder argument won over compile_kwargs' "inductor"
    assert any("overridden" in w and "'inductor'" in w for w in r["warnings"])
    assert r["default_backend"] == "inductor"


_CPU = {"device": "cpu"}


@pytest.mark.parametrize(
    "zero",
    [
        {"stage": 3},
        {"stage": 3, "offload_param": _CPU, "offload_optimizer": _CPU},
        {"stage": 2, "offload_optimizer": _CPU},
    ],
    ids=["z3", "z3-offload", "z2-offload-optimizer"],
)
def test_llama_engine_compile_matches_eager(zero: dict) -> None:
    """A Hugging Face LlamaForCausalLM built from a config, 5 steps: compiled losses equal eager (1e-5) and 0
    graph breaks at every stage. At ZeRO-3 each decoder layer, the embedding, the final norm and the lm_head
    is a compiled region of its own, with the gather/release hooks run eagerly between them; below stage 3
    the whole model is one compiled module."""
    pytest.importorskip("transformers")
    results = run_distributed(compile_runs.llama_compile, 2, zero, init_process_group=False, timeout=400)
    for rank, r in enumerate(results):
        assert r["compiled"] == pytest.approx(r["eager"], abs=1e-5), rank
        assert r["breaks"] == 0, (rank, r["break_reasons"])
        if zero["stage"] < 3:
            assert r["regions"] is None and r["graphs"] >= 1, rank
        else:
            assert r["hooked_modules"] > 0
            layers = [f"model.layers.{i}" for i in range(compile_runs.LLAMA_LAYERS)]
            assert r["regions"] == ["model.embed_tokens", *layers, "model.norm", "lm_head"], r["regions"]
            # a graph per region at least (the recorder counts each compiled graph once)
            assert r["graphs"] >= len(r["regions"]), (rank, r["graphs"])
            # dscore.initialize(model=torch.compile(model)): the same regions, losses and 0 breaks
            assert r["adopted"] == pytest.approx(r["eager"], abs=1e-5), rank
            assert (r["adopted_breaks"], r["adopted_regions"]) == (0, len(r["regions"])), rank
