"""Train a small MLP classifier on scikit-learn's bundled digits dataset with dscore.

Single process::

    python examples/mlp/train.py

Several processes (each trains on its own shard; gradients are averaged)::

    dscore run --num_gpus 2 examples/mlp/train.py      # or: torchrun --nproc_per_node 2 examples/mlp/train.py

``dscore run`` passes ``--local_rank=N`` to each process; ``dscore.add_config_arguments`` adds that flag
(both spellings), so the script declares nothing for it.

The ds_config next to this file picks AdamW and a linear warm-up; pass ``--deepspeed_config`` to use
another. The script prints the held-out accuracy at the end (about 0.97 after the default 12 epochs;
0.90 is the bar the integration test holds it to).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import dscore

HERE = os.path.dirname(os.path.abspath(__file__))


class RankZeroParser(argparse.ArgumentParser):
    """Prints ``--help``, usage and errors on rank 0 only (``RANK`` unset counts as rank 0): under
    ``dscore run`` every rank parses the same argv, and the text should appear once."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if os.environ.get("RANK", "0").strip() in ("", "0"):
            super()._print_message(message, file)


class MLP(torch.nn.Module):
    """64 pixel intensities (8x8 image, scaled to [0, 1]) -> 10 class logits."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 64) float32
        return self.net(x)


def load_data(seed: int) -> tuple[torch.utils.data.TensorDataset, torch.Tensor, torch.Tensor]:
    """Train dataset and held-out (20%) test tensors. Features are pixel values / 16 (float32)."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
    )
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return torch.utils.data.TensorDataset(as_x(x_train), as_y(y_train)), as_x(x_test), as_y(y_test)


def main() -> float:
    parser = RankZeroParser(description="dscore MLP on sklearn digits")
    parser.add_argument("--epochs", type=int, default=12, help="passes over each rank's shard of the training set")
    parser.add_argument("--seed", type=int, default=0)
    parser = dscore.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None and getattr(args, "deepscale_config", None) is None:
        args.deepspeed_config = os.path.join(HERE, "ds_config.json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    torch.manual_seed(args.seed)
    train_set, x_test, y_test = load_data(args.seed)
    model = MLP()
    engine, optimizer, train_loader, scheduler = dscore.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=train_set
    )

    for _epoch in range(args.epochs):
        engine.train()
        for x, y in train_loader:
            loss = torch.nn.functional.cross_entropy(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()

    engine.eval()
    with torch.no_grad():
        predictions = engine(x_test.to(engine.device)).argmax(dim=1).cpu()
    accuracy = (predictions == y_test).float().mean().item()
    if engine.global_rank == 0:
        print(f"steps: {engine.global_steps}  held-out accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
