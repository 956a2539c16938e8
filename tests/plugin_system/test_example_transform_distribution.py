"""Tier 3: a third-party model transform (examples/plugins/dscore-example-transform) is pip-installed into a
temporary venv, listed by `dscore plugins list --json`, run by ``dscore.initialize`` from its own config section
(the frozen parameters do not move in a step, the others do), refused when its unit is disabled, then uninstalled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_example_plugin_distribution import _pip, _plugins_json, plugin_venv  # noqa: F401 - the shared venv fixture

REPO = Path(__file__).resolve().parents[2]
TRANSFORM_SRC = REPO / "examples" / "plugins" / "dscore-example-transform"

pytestmark = pytest.mark.slow

STEP = r"""
import json, sys
import torch, dscore

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
before = {n: p.detach().clone() for n, p in model.named_parameters()}
cfg = {"train_batch_size": 1, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
cfg.update(json.loads(sys.argv[1]))
engine, opt, _, _ = dscore.initialize(model=model, config=cfg)
loss = engine(torch.ones(1, 3)).square().sum()
engine.backward(loss)
engine.step()
moved = sorted(n for n, p in engine.module.named_parameters() if not torch.equal(p.detach(), before[n]))
trained = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
print(json.dumps({"moved": moved, "trained": trained}))
engine.close()
"""


def _step(py: Path, section: dict, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [py, "-c", STEP, json.dumps(section)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_install_list_transform_disable_uninstall(plugin_venv: Path, tmp_path: Path) -> None:  # noqa: F811
    py = plugin_venv
    src = tmp_path / "dscore-example-transform"
    shutil.copytree(TRANSFORM_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = _pip(py, "install", "--no-deps", "--no-build-isolation", str(src))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        rows = {r["name"]: r for r in _plugins_json(py)}
        row = rows["example_transform"]
        assert row["builtin"] is False and row["status"] == "active", row
        assert row["provides"] == {"config_section": ["freeze"], "model_transform": ["freeze"]}
        assert {"autotp", "autoep", "ulysses", "activation_checkpointing"} <= set(
            rows["parallel"]["provides"]["model_transform"]
        )

        # the transform froze the first Linear: only the second one moves, and only it is trained
        proc = _step(py, {"freeze": {"enabled": True, "patterns": ["0.*"]}})
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out == {"moved": ["2.bias", "2.weight"], "trained": ["2.bias", "2.weight"]}, out

        # without the section nothing is frozen: every parameter moves
        proc = _step(py, {})
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.strip().splitlines()[-1])["moved"] == ["0.bias", "0.weight", "2.bias", "2.weight"]

        # its own checks name its key
        proc = _step(py, {"freeze": {"enabled": True, "patterns": ["encoder.*"]}})
        assert proc.returncode != 0 and "ConfigError" in proc.stderr and "freeze.patterns" in proc.stderr

        # the unit disabled: a config that enables it is refused naming the unit, not trained unfrozen
        proc = _step(py, {"freeze": {"enabled": True, "patterns": ["0.*"]}}, {"DSCORE_DISABLE_PLUGINS": "model_transform:freeze"})
        assert proc.returncode != 0 and "model_transform:freeze" in proc.stderr, proc.stderr
    finally:
        proc = _pip(py, "uninstall", "-y", "dscore-example-transform")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "example_transform" not in {r["name"] for r in _plugins_json(py)}
