"""``engine.iter_full_params``: stream the model's full weights in bounded buckets (RLHF weight sync).

RLHF trainers copy the policy's weights into a generation engine after every few steps. Gathering the
whole state dict at once (``module_state_dict``, DeepSpeed's ``_zero3_consolidated_16bit_state_dict``)
needs the full model on top of the partitions; this export walks the state dict in the module's order and
hands out copies in buckets of at most ``bucket_bytes``, while the ZeRO stage gathers only what the next
tensors need (:meth:`dscore.protocols.zero.ZeroStage.iter_module_state`: stage 3 gathers one unit at a
time and releases it before the next; AutoTP gathers each split tensor over the tensor-parallel group).

**Memory bound** (extra over training, per rank): the bucket being filled, at most
``max(bucket_bytes, largest tensor)`` in the output dtype, plus under ZeRO-3 one gathered unit (the
largest non-persistent unit's full size in the compute dtype), plus under AutoTP one gathered split
tensor. Buckets the caller keeps are the caller's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from dscore.moe.utils import is_moe_param
from dscore.runtime.engine_errors import EngineError

if TYPE_CHECKING:
    from dscore.protocols.zero import ZeroStage

__all__ = ["NAME_STYLES", "iter_full_params"]

#: ``names=`` values: "hf" the wrapped model's own state-dict names (wrapper prefixes such as
#: torch.compile's ``_orig_mod.`` removed, what ``from_pretrained``/vLLM's ``load_weights`` expect);
#: "module" ``engine.module.state_dict()``'s keys as they are.
NAME_STYLES = ("hf", "module")
_WRAPPER_PREFIXES = ("_orig_mod.",)


def _hf_name(key: str) -> str:
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, stripped = key[len(prefix) :], True
    return key


def iter_full_params(
    module: torch.nn.Module,
    stage: ZeroStage,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    trainable_only: bool = False,
    names: str = "hf",
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``[(name, full tensor), ...]`` buckets covering the module's state dict (module docstring).

    Collective: every rank of the job calls it and exhausts the generator in step (stage 3 and AutoTP
    run gathers inside it); stopping early on one rank leaves the others waiting in a collective.

    Args:
        module: the engine's module.
        stage: the engine's ZeRO stage.
        bucket_bytes: most bytes (in the output dtype) per bucket; a tensor larger than that is a bucket
            of its own. Positive int.
        dtype: cast floating-point tensors to it on the way (integer/bool buffers keep theirs); None keeps
            each tensor's dtype (parameters in the compute dtype).
        trainable_only: only parameters with ``requires_grad`` (no buffers, no frozen parameters).
        names: one of :data:`NAME_STYLES`.

    Yields:
        Lists of ``(name, tensor)``, in the state dict's order; each tensor a fresh full copy on the device
        the stage holds it (the accelerator, or the host under parameter offload), never a view of
        training memory.

    Raises:
        EngineError: ``bucket_bytes`` not a positive int, ``dtype`` not a torch dtype, ``names`` not one of
            :data:`NAME_STYLES`, or the model has MoE expert parameters (use ``engine.module_state_dict()``).
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise EngineError(f"iter_full_params(bucket_bytes={bucket_bytes!r}): a positive number of bytes (int)")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise EngineError(f"iter_full_params(dtype={dtype!r}): a torch.dtype (e.g. torch.bfloat16) or None")
    if names not in NAME_STYLES:
        raise EngineError(f"iter_full_params(names={names!r}): one of {', '.join(map(repr, NAME_STYLES))}")
    if any(is_moe_param(p) for p in module.parameters()):
        raise EngineError(
            "iter_full_params: the model has MoE expert parameters; streaming them (gathered and renamed over the "
            "expert-parallel group) is not implemented: use engine.module_state_dict()"
        )
    keep = None
    if trainable_only:
        keep = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    return _buckets(stage, bucket_bytes, dtype, keep, names)  # arguments checked now, not at the first next()


def _buckets(
    stage: ZeroStage, bucket_bytes: int, dtype: torch.dtype | None, keep: set[str] | None, names: str
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    # no grad-mode context here: it would stay switched while the caller runs between buckets
    for piece in stage.iter_module_state():
        for key, value in piece.items():
            if keep is not None and key not in keep:
                continue
            cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
            nbytes = value.numel() * torch.empty((), dtype=cast, device="meta").element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            out = value.detach().to(dtype=cast, copy=True)
            bucket.append((_hf_name(key) if names == "hf" else key, out))
            size += nbytes
    if bucket:
        yield bucket
