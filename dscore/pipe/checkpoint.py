"""Per-layer checkpoints of a pipeline (DeepSpeed's ``layer_XX-model_states.pt`` layout).

A pipeline checkpoint ``<save_dir>/<tag>/`` holds

* ``layer_{idx:02d}-model_states.pt``: the state dict of layer ``idx`` (keys relative to the layer, e.g.
  ``"weight"``), one file per layer that has state, written by data-parallel rank 0 of the owning stage.
  A tied layer's file holds the tied module's state (every position of the tie has one, all equal);
* ``optim_states-stage_{s:02d}.pt``: stage ``s``'s ZeRO-stage optimizer state (world-size independent,
  keyed by the global parameter names ``"3.weight"`` / ``"tied_modules.embed.weight"``);
* ``engine_states.pt``: counters, LR scheduler, layout (``num_layers``, ``num_stages``, ``parts``);
* ``<save_dir>/latest``: the tag of the last complete save.

Because files are per layer and optimizer state is keyed by global names, a checkpoint saved with
``p`` stages loads with any other number of stages (each stage reads the layers it owns and picks its
parameters out of every stage's optimizer file), and into a plain model with :func:`load_into_layers`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from dscore.checkpoint._layout import LATEST_FILE, atomic_write, atomic_write_bytes
from dscore.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "ENGINE_FILE",
    "LATEST_FILE",
    "atomic_save",
    "layer_file",
    "layer_state_dicts",
    "load_file",
    "load_into_layers",
    "optim_file",
    "resolve_tag",
    "write_latest",
]

ENGINE_FILE = "engine_states.pt"
_LAYER_RE = re.compile(r"^layer_(\d+)-model_states\.pt$")


def layer_file(ckpt_dir: str, idx: int) -> str:
    """Path of layer ``idx``'s state in the tag folder ``ckpt_dir``."""
    return os.path.join(ckpt_dir, f"layer_{idx:02d}-model_states.pt")


def optim_file(ckpt_dir: str, stage: int) -> str:
    """Path of stage ``stage``'s optimizer state in the tag folder ``ckpt_dir``."""
    return os.path.join(ckpt_dir, f"optim_states-stage_{stage:02d}.pt")


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` through a temporary name and a rename, as every checkpoint file is written (a reader
    never sees half a file; ``DSCORE_CHECKPOINT_FSYNC=1`` makes it durable)."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``<save_dir>/latest`` at ``tag`` (atomically; the last step of a complete save)."""
    atomic_write_bytes(os.path.join(save_dir, LATEST_FILE), tag.encode("utf-8"))


def load_file(path: str) -> Any:
    """``torch.load`` on CPU (weights only: tensors, numbers, strings, lists, dicts).

    Raises:
        CheckpointNotFoundError: the file does not exist.
        CheckpointError: it cannot be read (names the file).
    """
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"pipeline checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read pipeline checkpoint file {path}: {type(exc).__name__}: {exc}") from exc


def resolve_tag(load_dir: str, tag: str | None) -> str:
    """The tag folder to read: ``tag``, else the content of ``<load_dir>/latest``.

    Raises:
        CheckpointNotFoundError: no ``latest`` file and no tag, or the tag folder does not exist.
    """
    if tag is None:
        latest = os.path.join(load_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            raise CheckpointNotFoundError(
                f"no tag given and {latest} does not exist; pass tag= or load a folder written by save_checkpoint"
            )
        with open(latest, encoding="utf-8") as fh:
            tag = fh.read().strip()
    path = os.path.join(load_dir, str(tag))
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"pipeline checkpoint folder {path} does not exist")
    return path


def layer_state_dicts(load_dir: str, tag: str | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """``{layer index: state dict}`` of every layer file of a pipeline checkpoint (on CPU).

    Raises:
        CheckpointNotFoundError: the folder (or ``latest``) is missing, or it holds no layer file.
    """
    path = resolve_tag(load_dir, tag)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name in sorted(os.listdir(path)):
        m = _LAYER_RE.match(name)
        if m:
            out[int(m.group(1))] = load_file(os.path.join(path, name))
    if not out:
        raise CheckpointNotFoundError(f"{path} holds no layer_XX-model_states.pt file; is it a pipeline checkpoint?")
    return out


def load_into_layers(
    layers: Sequence[torch.nn.Module | None], load_dir: str, tag: str | None = None, *, strict: bool = True
) -> list[int]:
    """Load a pipeline checkpoint into a plain model given as its layers, in pipeline order.

    ``layers[i]`` is the module playing layer ``i`` of the :class:`~dscore.pipe.PipelineModule` (the same
    module object may appear at several positions, e.g. an embedding reused as the output head), or None
    for a layer without state (a function).

    Returns:
        The layer indices loaded.

    Raises:
        CheckpointError: the number of layers differs from the checkpoint's, a module has no file, or
            (``strict``) keys do not match (names the layer).
    """
    states = layer_state_dicts(load_dir, tag)
    last = max(states)
    if last >= len(layers):
        raise CheckpointError(f"the checkpoint has layer files up to layer {last} but {len(layers)} layers were given")
    loaded = []
    for i, module in enumerate(layers):
        if module is None:
            continue
        if i not in states:
            if any(True for _ in module.state_dict()):
                raise CheckpointError(f"layer {i} ({type(module).__name__}) has state but the checkpoint has no file for it")
            continue
        try:
            module.load_state_dict(states[i], strict=strict)
        except RuntimeError as exc:
            raise CheckpointError(f"layer {i} ({type(module).__name__}): {exc}") from exc
        loaded.append(i)
    return loaded
