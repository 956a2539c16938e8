"""Each rank's random-number generator states: captured at save, restored (or derived) at load.

A rank that existed at save restores its torch CPU, accelerator, Python ``random`` and NumPy (when
imported) states; a rank that did not is seeded with ``sha256("dscore-rng:<tag>:<rank>:" + rank 0's saved
CPU RNG state)[:8]`` (deterministic, distinct per rank).
"""

from __future__ import annotations

import hashlib
import logging
import random
import sys
from typing import Any

import torch

from dscore.comm.objects import tensor_bytes

__all__ = ["derived_seed", "restore_rng", "rng_states", "seed_everything"]

logger = logging.getLogger("dscore.checkpoint")


def rng_states(acc: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"rng/torch_cpu": torch.get_rng_state()}
    if acc is not None and getattr(acc, "device_type", "cpu") != "cpu":
        try:
            tensors["rng/accelerator"] = acc.get_rng_state()
        except Exception as exc:  # a device without an RNG: record nothing, say so
            logger.warning("could not read the %s RNG state (%s); it is not checkpointed", acc.device_type, exc)
    other: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        other["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))
    return tensors, other


def restore_rng(acc: Any, tensors: dict[str, torch.Tensor], other: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    if "rng/accelerator" in tensors and acc is not None and getattr(acc, "device_type", "cpu") != "cpu":
        acc.set_rng_state(tensors["rng/accelerator"])
    version, state, gauss = other["python"]
    random.setstate((version, tuple(state), gauss))
    np = sys.modules.get("numpy")
    if np is not None and other.get("numpy") is not None:
        kind, keys, pos, has_gauss, g = other["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, g))


def derived_seed(tag: str, rank: int, rank0_cpu_state: torch.Tensor) -> int:
    """Seed for a rank that did not exist at save time: sha256(tag, rank, rank 0's saved CPU RNG state)."""
    h = hashlib.sha256(f"dscore-rng:{tag}:{rank}:".encode())
    h.update(tensor_bytes(rank0_cpu_state))  # not .numpy(): numpy is optional
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


def seed_everything(seed: int, acc: Any) -> None:
    torch.manual_seed(seed)  # seeds the CPU and every device generator torch knows
    if acc is not None and getattr(acc, "device_type", "cpu") != "cpu":
        try:
            acc.manual_seed(seed)
        except Exception:
            logger.debug("accelerator manual_seed failed", exc_info=True)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % (1 << 32))
