"""Issue 39: one rank of a 2-process gloo job checking DeepSpeed's checkpoint-tag rules on dscore (``import
deepspeed``, ZeRO stage 0, DeepSpeed's checkpoint layout)."""

from __future__ import annotations

import os
from typing import Any


def tag_rules(save_root: str) -> dict[str, Any]:
    """Per ``checkpoint.tag_validation`` mode: what a save under a rank-unique tag does; then the default tag
    and the empty ``save_dir`` errors. Returns what this rank saw."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from dscore.errors import CheckpointError

    rank = dist.get_rank()
    seen: dict[str, Any] = {}
    for mode in ("Fail", "Warn", "Ignore"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
               "checkpoint": {"tag_validation": mode}}
        engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
        root = os.path.join(save_root, mode)
        try:
            engine.save_checkpoint(root, tag=f"tag-{rank}")
            seen[mode] = sorted(os.listdir(root))
        except AssertionError as e:
            seen[mode] = ("AssertionError", isinstance(e, CheckpointError), "not the same on every rank" in str(e))
    engine.backward(engine(torch.ones(2, 4, device="cpu")).sum())
    engine.step()
    engine.save_checkpoint(os.path.join(save_root, "default"))
    with open(os.path.join(save_root, "default", "latest")) as f:
        seen["default"] = (sorted(os.listdir(os.path.join(save_root, "default"))), f.read().strip())
    for bad in (None, ""):
        try:
            engine.save_checkpoint(bad)
            seen[repr(bad)] = "saved"
        except ValueError as e:
            seen[repr(bad)] = ("ValueError", isinstance(e, CheckpointError))
    return seen
