"""Response-token targets and the generalized Jensen-Shannon loss for on-policy distillation (OPSD).

DeepSpeed 0.19.8's ``deepspeed.runtime.rollout.opsd`` semantics. The generalized JSD with mixing weight
``beta`` (Agarwal et al., "On-Policy Distillation of Language Models", 2024, GKD) is, per vocabulary entry,
``beta * T * (log T - log M) + (1 - beta) * S * (log S - log M)`` with ``M = (1 - beta) * S + beta * T``;
``beta = 0`` is the forward KL ``KL(T || S)`` and ``beta = 1`` the reverse ``KL(S || T)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dscore.errors import RolloutError
from dscore.rollout.base import RolloutBatch

__all__ = ["JSDLossOutput", "ResponseTokenBatch", "generalized_jsd_loss"]


@dataclass(frozen=True)
class ResponseTokenBatch:
    """Causal training targets on the response tokens of a rollout.

    Attributes:
        input_ids / attention_mask: the rollout's ``[B, T]`` tensors.
        target_ids: ``[B, T - 1]``, ``input_ids[:, 1:]``: logits at position ``i`` predict ``target_ids[:, i]``.
        response_mask: ``[B, T - 1]`` bool, true where the target is a real response token.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    response_mask: torch.Tensor

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch) -> ResponseTokenBatch:
        """The response-only targets of ``rollout``.

        Raises:
            RolloutError: tensors on different devices, a non-integer ``response_start_idx``, or one outside
                ``[1, T]``.
        """
        ids, mask, start = rollout.input_ids, rollout.attention_mask, rollout.response_start_idx
        if ids.device != mask.device or ids.device != start.device:
            raise RolloutError(
                "ResponseTokenBatch.from_rollout: input_ids, attention_mask and response_start_idx must be on one "
                f"device; got {ids.device}, {mask.device}, {start.device}"
            )
        if start.dtype not in (torch.int32, torch.int64):
            raise RolloutError(f"ResponseTokenBatch.from_rollout: response_start_idx must be int32/int64; got {start.dtype}")
        length = int(ids.shape[1])
        if bool(((start < 1) | (start > length)).any()):
            raise RolloutError(f"ResponseTokenBatch.from_rollout: response_start_idx must lie in [1, {length}]")
        positions = torch.arange(1, length, device=ids.device)
        in_response = positions.unsqueeze(0) >= start.unsqueeze(1)
        return cls(
            input_ids=ids,
            attention_mask=mask,
            target_ids=ids[:, 1:],
            response_mask=mask[:, 1:].bool() & in_response,
        )

    def select_causal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits[:, :-1]`` (``[B, T - 1, V]``), aligned with :attr:`target_ids`.

        Raises:
            RolloutError: ``logits`` not ``[B, T, V]`` for this batch's ``[B, T]``.
        """
        if logits.dim() != 3:
            raise RolloutError(f"select_causal_logits: logits must be 3-D [B, T, V]; got shape {tuple(logits.shape)}")
        if tuple(logits.shape[:2]) != tuple(self.input_ids.shape):
            raise RolloutError(
                f"select_causal_logits: logits are {tuple(logits.shape)} but input_ids {tuple(self.input_ids.shape)}"
            )
        return logits[:, :-1, :]


@dataclass(frozen=True)
class JSDLossOutput:
    """The loss and its unreduced parts (to sum across ranks before dividing).

    Attributes:
        loss: 0-dim, ``loss_sum / max(valid_token_count, 1)``.
        loss_sum: 0-dim, the divergence summed over vocabulary and valid tokens.
        valid_token_count: 0-dim int64, the number of true entries of the mask.
    """

    loss: torch.Tensor
    loss_sum: torch.Tensor
    valid_token_count: torch.Tensor


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_top_k: int | None = None,
    pointwise_clip: float | None = None,
) -> JSDLossOutput:
    """Generalized JSD between student and teacher next-token distributions on the masked tokens.

    Args:
        student_logits / teacher_logits: ``[B, T, V]``, same shape (float).
        response_mask: ``[B, T]``, true (1) on the tokens that count.
        beta: mixing weight in ``[0, 1]`` (see the module docstring).
        temperature: both logits are divided by it (> 0).
        teacher_top_k: keep only the teacher's ``k`` most likely entries (1..V) in both distributions,
            renormalised over them.
        pointwise_clip: cap (>= 0) on each vocabulary entry's contribution before summing over the vocabulary.

    Returns:
        :class:`JSDLossOutput` in the logits' dtype.

    Raises:
        RolloutError: shapes or any argument out of range (the message names it).
    """
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 3:
        raise RolloutError(
            f"generalized_jsd_loss: student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must have one 3-D shape [B, T, V]"
        )
    if tuple(response_mask.shape) != tuple(student_logits.shape[:2]):
        raise RolloutError(
            f"generalized_jsd_loss: response_mask {tuple(response_mask.shape)} must be the logits' [B, T] "
            f"{tuple(student_logits.shape[:2])}"
        )
    vocab = int(student_logits.shape[-1])
    if not 0.0 <= beta <= 1.0:
        raise RolloutError(f"generalized_jsd_loss: beta must be in [0, 1]; got {beta}")
    if temperature <= 0.0:
        raise RolloutError(f"generalized_jsd_loss: temperature must be positive; got {temperature}")
    if teacher_top_k is not None and not 0 < teacher_top_k <= vocab:
        raise RolloutError(f"generalized_jsd_loss: teacher_top_k must be in 1..{vocab} (the vocabulary); got {teacher_top_k}")
    if pointwise_clip is not None and pointwise_clip < 0.0:
        raise RolloutError(f"generalized_jsd_loss: pointwise_clip must be >= 0; got {pointwise_clip}")

    s, t = student_logits / temperature, teacher_logits / temperature
    if teacher_top_k is not None:
        keep = t.topk(teacher_top_k, dim=-1).indices
        s, t = s.gather(-1, keep), t.gather(-1, keep)
    log_s, log_t = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    if beta == 0.0:
        point = log_t.exp() * (log_t - log_s)
    elif beta == 1.0:
        point = log_s.exp() * (log_s - log_t)
    else:
        # the mixture weights' logs in the logits' dtype (bit-equal to DeepSpeed's float32 results)
        w_t = torch.tensor(beta, dtype=s.dtype, device=s.device)
        log_m = torch.logaddexp(log_s + torch.log1p(-w_t), log_t + torch.log(w_t))
        point = beta * log_t.exp() * (log_t - log_m) + (1.0 - beta) * log_s.exp() * (log_s - log_m)
    if pointwise_clip is not None:
        point = point.clamp(max=pointwise_clip)
    weights = response_mask.to(point.dtype)
    loss_sum = (point.sum(dim=-1) * weights).sum()
    count = weights.sum().to(torch.int64)
    return JSDLossOutput(loss=loss_sum / count.clamp_min(1), loss_sum=loss_sum, valid_token_count=count)
