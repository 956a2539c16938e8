"""The rollout interface: a request in, a batch out, the sampling knobs, and the engine contract.

DeepSpeed 0.19.8's ``deepspeed.runtime.rollout.base`` (same names, fields and defaults). A trainer asks its
rollout engine for responses to *left-padded* prompts (real tokens at the right edge, so generated tokens follow
them directly); unlike DeepSpeed, dscore checks that: a prompt whose attention mask has a 0 after a 1 is a
:class:`~dscore.errors.RolloutError` naming the row.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from dscore.errors import RolloutError

__all__ = ["RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest", "SamplingConfig"]


@dataclass
class RolloutConfig:
    """Which rollout engine :func:`dscore.rollout.build_rollout` builds.

    Attributes:
        engine: ``"hybrid_engine"`` (the only one: generation inside the training engine).
        use_graph_capture: capture decode steps in CUDA graphs (refused by dscore's engine when true).
    """

    engine: str = "hybrid_engine"
    use_graph_capture: bool = False


@dataclass
class SamplingConfig:
    """The sampling settings of one ``generate`` call.

    Attributes:
        max_new_tokens: tokens generated after each prompt (> 0).
        temperature: ``<= 0`` is greedy decoding; otherwise sampling at this temperature (default 1.0: sampling).
        top_p: nucleus sampling mass (1.0: off).
        top_k: top-k filtering; ``<= 0`` is off.
        n_samples_per_prompt: responses per prompt (rows of a prompt are adjacent in the output).
        continuous_batch_size: None, or the most requests decoded together (greedy, one sample each).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    continuous_batch_size: int | None = None


@dataclass
class RolloutRequest:
    """Prompts for ``RolloutEngine.generate``.

    Attributes:
        prompt_ids: ``[B, T_p]`` int token ids, left-padded with the pad token.
        prompt_attention_mask: ``[B, T_p]``, 1 on real prompt tokens, 0 on the left padding.

    Raises:
        RolloutError: not 2-D, shapes differing, or a row not left-padded (a 0 after a 1 in its mask).
    """

    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.prompt_ids.dim() != 2:
            raise RolloutError(f"RolloutRequest.prompt_ids must be 2-D [B, T_p]; got shape {tuple(self.prompt_ids.shape)}")
        if self.prompt_attention_mask.shape != self.prompt_ids.shape:
            raise RolloutError(
                f"RolloutRequest.prompt_attention_mask has shape {tuple(self.prompt_attention_mask.shape)} but "
                f"prompt_ids has {tuple(self.prompt_ids.shape)}"
            )
        mask = self.prompt_attention_mask.bool()
        if mask.shape[1] > 1:
            # left padding: once a row's mask is 1 it stays 1
            bad = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise RolloutError(
                    f"RolloutRequest: prompt row {row} is not left-padded (its prompt_attention_mask "
                    f"{mask[row].int().tolist()} has padding after a real token); pad prompts on the left "
                    "(tokenizer.padding_side = 'left') so generated tokens follow the prompt"
                )


@dataclass
class RolloutBatch:
    """What ``RolloutEngine.generate`` returns.

    Attributes:
        input_ids: ``[B * n, T_p + T_r]`` the left-padded prompt followed by the response, right-padded.
        attention_mask: ``[B * n, T_p + T_r]``, 1 on real prompt and response tokens.
        response_start_idx: ``[B * n]`` int, the column where each response starts.

    Raises:
        RolloutError: shapes inconsistent.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: torch.Tensor

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise RolloutError(f"RolloutBatch.input_ids must be 2-D; got shape {tuple(self.input_ids.shape)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise RolloutError(
                f"RolloutBatch.attention_mask has shape {tuple(self.attention_mask.shape)} but input_ids has "
                f"{tuple(self.input_ids.shape)}"
            )
        rows = int(self.input_ids.shape[0])
        if tuple(self.response_start_idx.shape) != (rows,):
            raise RolloutError(
                f"RolloutBatch.response_start_idx must be 1-D of length {rows}; got shape "
                f"{tuple(self.response_start_idx.shape)}"
            )

    @property
    def batch_size(self) -> int:
        """Rows (prompts times samples per prompt)."""
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        """Columns (prompt width plus response width)."""
        return int(self.input_ids.shape[1])


class RolloutEngine(abc.ABC):
    """What a rollout engine implements: ``generate``, ``sync_weights``, and optionally ``shutdown``."""

    name: str = "base"

    @abc.abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Responses to ``request``'s prompts, returned with the prompts in one batch."""

    @abc.abstractmethod
    def sync_weights(self, step: int) -> None:
        """Make the rollout backend use the training weights of ``step`` (nothing to do when it shares them)."""

    def shutdown(self) -> None:
        """Release what the backend holds (default: nothing)."""
        return None
