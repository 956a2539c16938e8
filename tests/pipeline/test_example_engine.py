"""A third-party engine written from public names only (examples/plugins/dscore-example-engine) is
selected by ``dscore.initialize`` through its predicate and trains like plain PyTorch plus its EMA."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

import dscore
from dscore.plugin_manager import create_plugin_manager

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "dscore-example-engine" / "src"


@pytest.fixture
def example_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``dscore.initialize`` see the example plugin as if it were pip-installed."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import dscore.runtime.initialize as init

    def with_example(**kwargs: Any) -> Any:
        return create_plugin_manager(extra_plugins=[("example_engine", "dscore_example_engine.plugin")], **kwargs)

    monkeypatch.setattr(init, "create_plugin_manager", with_example)


def _config(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}


def test_example_engine_selected_and_trains_with_ema(example_engine: None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    engine, _, _, _ = dscore.initialize(model=model, config=_config(ema={"enabled": True, "decay": 0.5}))
    try:
        assert type(engine).__name__ == "EmaEngine"
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        ema = {n: p.detach().clone() for n, p in ref.named_parameters()}
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            opt.step()
            for n, p in ref.named_parameters():
                ema[n] = 0.5 * ema[n] + 0.5 * p.detach()
        for n, t in engine.ema_state_dict().items():
            torch.testing.assert_close(t, ema[n], rtol=0, atol=1e-6)
    finally:
        engine.close()


def test_example_engine_not_selected_without_its_block(example_engine: None) -> None:
    engine, _, _, _ = dscore.initialize(model=torch.nn.Linear(3, 2), config=_config())
    try:
        assert type(engine).__name__ == "DscoreEngine"
    finally:
        engine.close()


def test_example_engine_imports_only_public_dscore_names() -> None:
    for path in (EXAMPLE / "dscore_example_engine").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dscore"):
                assert not any(part.startswith("_") for part in node.module.split(".")), (path, node.module)
                assert not any(a.name.startswith("_") for a in node.names), (path, node.module)
