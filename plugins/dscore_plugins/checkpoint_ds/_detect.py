"""Recognising a DeepSpeed save directory and resolving the tag to load, with DeepSpeed's rules.

File names DeepSpeed 0.19.8 writes (see :mod:`dscore_plugins.checkpoint_ds._layout` for what is in them),
the keys of its model-states file, and the cheap checks (directory listings, ``latest`` files) the layout's
``detect`` and ``resolve_tag`` are made of.
"""

from __future__ import annotations

import json
import os
import re

from dscore.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "DEEPSPEED_ENGINE_KEYS",
    "find_deepspeed_files",
    "is_deepspeed_checkpoint",
    "looks_like_deepspeed_tag_dir",
    "resolve_deepspeed_tag",
]

MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_Z3MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
PIPE_RE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$|^layer_\d+-model_states\.pt$")
EXPERT_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MOE_RE = re.compile(r"(^|_)expp?_rank_\d+|(^|_)expert_\d+")

#: Keys DeepSpeed's engine writes into the model-states file; every other top-level key is the user's
#: ``client_state`` (DeepSpeed merges the two dicts).
DEEPSPEED_ENGINE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
        "num_experts",
        "ds_autoep_layers",
        "autoep_layers",
    }
)


def find_deepspeed_files(tag_dir: str) -> list[str]:
    """Names in ``tag_dir`` that DeepSpeed writes (model/optimizer states, pipeline layers); [] if none."""
    try:
        names = os.listdir(tag_dir)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    return sorted(
        n
        for n in names
        if MODEL_RE.match(n)
        or _Z3MODEL_RE.match(n)
        or OPTIM_RE.match(n)
        or PIPE_RE.match(n)
        or (n.endswith("model_states.pt") or n.endswith("optim_states.pt"))
    )


def looks_like_deepspeed_tag_dir(path: str) -> bool:
    """True when ``path`` is a directory holding DeepSpeed checkpoint files (a tag directory)."""
    return os.path.isdir(path) and bool(find_deepspeed_files(path))


def is_deepspeed_checkpoint(save_dir: str, tag: str | None = None) -> bool:
    """Whether ``save_dir`` is a DeepSpeed save directory (not a dscore one).

    True when the tag (given, or named by ``latest`` / ``latest_universal``) or, without those, any
    sub-directory holds DeepSpeed-named files (``*model_states.pt`` / ``*optim_states.pt``) and no dscore
    ``_COMPLETE`` manifest. Reads only directory listings and the ``latest`` files.
    """
    if not os.path.isdir(save_dir):
        return False
    candidates: list[str] = []
    if tag is not None:
        candidates.append(str(tag))
    for marker in ("latest", "latest_universal"):
        try:
            with open(os.path.join(save_dir, marker), encoding="utf-8") as f:
                candidates.append(f.read().strip())
        except (OSError, UnicodeDecodeError):
            pass
    if not candidates:
        try:
            candidates = [n for n in os.listdir(save_dir) if not n.startswith(".")]
        except OSError:
            return False
    for name in candidates:
        if not name or "/" in name or name in (".", ".."):
            continue
        path = os.path.join(save_dir, name)
        if os.path.exists(os.path.join(path, "_COMPLETE")):
            # dscore's manifest; a save in DeepSpeed's layout (dscore_plugins.checkpoint_ds.writer) says so in it
            try:
                with open(os.path.join(path, "_COMPLETE"), encoding="utf-8") as f:
                    return json.load(f).get("layout") == "deepspeed"
            except (OSError, ValueError, AttributeError):
                return False
        if looks_like_deepspeed_tag_dir(path) or os.path.isdir(os.path.join(path, "zero")):
            return True
        if tag is not None:
            return False
    return False


def resolve_deepspeed_tag(
    save_dir: str, tag: str | None, *, universal: bool = False, missing_ok: bool = False
) -> str | None:
    """The tag to load from a DeepSpeed save directory (DeepSpeed's rules, with clear errors).

    ``tag`` None reads ``latest`` (``latest_universal`` with ``universal``, as DeepSpeed's
    ``checkpoint.load_universal``).

    Returns:
        The tag; None only with ``missing_ok`` when there is no ``latest`` file (nothing to resume).

    Raises:
        CheckpointNotFoundError: no such directory or tag; no ``latest_universal`` with ``universal``; no
            ``latest`` without ``missing_ok``.
        CheckpointError: ``save_dir`` is a file or a tag directory; an empty ``latest``; a universal
            (``ds_to_universal``) tag, which dscore does not need.
    """
    d = os.path.abspath(save_dir)
    if not os.path.exists(d):
        raise CheckpointNotFoundError(f"checkpoint directory {d} does not exist")
    if not os.path.isdir(d):
        raise CheckpointError(f"{d} is a file; pass the directory given to DeepSpeed's save_checkpoint")
    if looks_like_deepspeed_tag_dir(d):
        parent, name = os.path.split(d)
        raise CheckpointError(
            f"{d} is a DeepSpeed checkpoint tag directory, not a save directory; use "
            f"load_checkpoint({parent!r}, tag={name!r})"
        )
    if tag is None:
        marker = "latest_universal" if universal else "latest"
        path = os.path.join(d, marker)
        try:
            with open(path, encoding="utf-8") as f:
                tag = f.read().strip()
        except FileNotFoundError:
            tags = sorted(n for n in os.listdir(d) if looks_like_deepspeed_tag_dir(os.path.join(d, n)))
            if universal:
                raise CheckpointNotFoundError(
                    f'"checkpoint": {{"load_universal": true}} reads the tag from {path}, which does not exist '
                    f"(DeepSpeed tags here: {', '.join(tags) or 'none'}). dscore loads DeepSpeed ZeRO checkpoints "
                    "at any world size and stage directly: set checkpoint.load_universal to false, or pass tag=..."
                ) from None
            if missing_ok:
                return None
            raise CheckpointNotFoundError(
                f"{d} has no '{marker}' file; pass tag=... (DeepSpeed tags here: {', '.join(tags) or 'none'})"
            ) from None
        if not tag:
            raise CheckpointError(f"{path} is empty; pass tag=...")
    tag = str(tag)
    if "/" in tag or tag in (".", "..") or "\0" in tag:
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: a tag is one directory name")
    tag_dir = os.path.join(d, tag)
    if not os.path.isdir(tag_dir):
        tags = sorted(n for n in os.listdir(d) if looks_like_deepspeed_tag_dir(os.path.join(d, n)))
        raise CheckpointNotFoundError(
            f"checkpoint tag {tag!r} does not exist in {d} (DeepSpeed tags here: {', '.join(tags) or 'none'})"
        )
    if os.path.isdir(os.path.join(tag_dir, "zero")):
        raise CheckpointError(
            f"{tag_dir} is a DeepSpeed universal checkpoint (ds_to_universal output, a 'zero/' folder); dscore reads "
            "the original ZeRO checkpoint at any world size and stage instead: load that directory with "
            "checkpoint.load_universal false"
        )
    return tag
