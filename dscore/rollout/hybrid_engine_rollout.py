"""Rollouts generated inside the training engine (DeepSpeed 0.19.8's ``HybridEngineRollout`` semantics).

The rollout shares the engine's weights: ``sync_weights`` has nothing to copy. Generation runs the wrapped
Hugging Face model's ``generate`` inside ``engine.generation_mode()`` when the engine has it (every dscore
engine: ZeRO-3 gathers each unit once per call, no collective per token), else under ``torch.no_grad()``.

Default path (``continuous_batch_size`` None), as DeepSpeed: prompts repeated ``n_samples_per_prompt`` times
(adjacent rows), ``temperature <= 0`` greedy, else sampling with ``temperature``, ``top_p`` and ``top_k``
(``<= 0``: off); generation ignores EOS so every row gets ``max_new_tokens`` tokens, then everything after a
row's first EOS becomes padding. ``attention_mask`` is the prompt's mask followed by 1 on response tokens up to
and including the first EOS (a generated token equal to the pad id counts as padding, as in DeepSpeed);
``response_start_idx`` is the prompt width for every row.

Continuous path (``continuous_batch_size`` = k): greedy only, one sample per prompt, one row per request, each
request generating until its first EOS (kept) or ``max_new_tokens``; the responses are right-padded to the
longest and masked 1 on every generated token. DeepSpeed refills a freed row at the next decode step with a
static cache it compacts; dscore decodes the requests in waves of at most k rows with the model's own KV cache
(a wave ends when its last row finishes). The tokens are the same (greedy rows do not depend on their
neighbours); only the scheduling differs.

``HybridEngineRolloutConfig``'s profiling and graph options are DeepSpeed's; dscore accepts their defaults
and refuses the CUDA-graph, shared-prefill, decode-front and cache-trimming options (they tune DeepSpeed's
static-cache decoder, which dscore does not have).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dscore.errors import RolloutError
from dscore.rollout.base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig"]


@dataclass
class HybridEngineRolloutConfig:
    """DeepSpeed's options of its rollout decoder; dscore honours the defaults (see the module docstring).

    Attributes:
        use_graph_capture / use_shared_prefill / align_decode_fronts / enable_cache_trimming: refused when true.
        enable_profiling: refused when true (DeepSpeed's per-stage timings).
        continuous_cache_capacity: refused when set (dscore's waves use the model's own cache).
    """

    use_graph_capture: bool = False
    enable_profiling: bool = False
    use_shared_prefill: bool = False
    align_decode_fronts: bool = False
    enable_cache_trimming: bool = False
    continuous_cache_capacity: int | None = None


_REFUSED_OPTIONS = (
    "use_graph_capture", "enable_profiling", "use_shared_prefill", "align_decode_fronts", "enable_cache_trimming",
)


def pad_after_eos(output_ids: torch.Tensor, start: int, eos_token_id: Any, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each row's first response EOS, pad everything after it.

    Args:
        output_ids: ``[B, T]`` prompt plus response ids; the response starts at column ``start``.
        eos_token_id: an int, a list of ints, or None (nothing is padded).

    Returns:
        ``(ids, response_mask)``: ids with the tail padded (a copy when changed) and ``[B, T - start]`` int64,
        1 on response tokens (not the pad id, or the first EOS) up to the first EOS.
    """
    resp = output_ids[:, start:]
    mask = resp != pad_token_id
    if eos_token_id is None or resp.shape[1] == 0:
        return output_ids, mask.long()
    eos = torch.as_tensor(eos_token_id, dtype=resp.dtype, device=resp.device).flatten()
    is_eos = (resp.unsqueeze(-1) == eos).any(dim=-1)
    has = is_eos.any(dim=-1, keepdim=True)
    first = is_eos.long().argmax(dim=-1, keepdim=True)
    col = torch.arange(resp.shape[1], device=resp.device).unsqueeze(0)
    after = has & (col > first)
    at = has & (col == first)
    ids = output_ids.clone()
    ids[:, start:].masked_fill_(after, pad_token_id)
    return ids, ((mask | at) & ~after).long()


class HybridEngineRollout(RolloutEngine):
    """A :class:`RolloutEngine` over a training engine (see the module docstring).

    Args:
        engine: the engine (``engine.module`` is a Hugging Face causal LM; ``generation_mode()`` used if present).
        tokenizer: anything with ``pad_token_id`` and ``eos_token_id`` (a Hugging Face tokenizer).
        cfg: a :class:`HybridEngineRolloutConfig` (or an object with some of its attributes), or None.

    Raises:
        RolloutError: a refused option of ``cfg`` is set.
    """

    name = "hybrid_engine"

    def __init__(self, engine: Any, tokenizer: Any, cfg: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        for option in _REFUSED_OPTIONS:
            if getattr(cfg, option, False):
                raise RolloutError(
                    f"HybridEngineRollout: {option}=True tunes DeepSpeed's static-cache CUDA decoder, which dscore "
                    "does not have; leave it False"
                )
        if getattr(cfg, "continuous_cache_capacity", None) is not None:
            raise RolloutError(
                "HybridEngineRollout: continuous_cache_capacity sizes DeepSpeed's static cache; dscore's continuous "
                "batching uses the model's own cache: leave it None"
            )
        self._closed = False

    # ------------------------------------------------------------------ helpers
    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "eos_token_id", None)
        if pad is None:
            raise RolloutError("HybridEngineRollout: the tokenizer must define pad_token_id or eos_token_id")
        return int(pad)

    def _context(self) -> Any:
        mode = getattr(self.engine, "generation_mode", None)
        return mode() if callable(mode) else torch.no_grad()

    def _check(self, sampling: SamplingConfig) -> None:
        if self._closed:
            raise RolloutError("HybridEngineRollout.generate() after shutdown()")
        if sampling.max_new_tokens <= 0:
            raise RolloutError(f"SamplingConfig.max_new_tokens must be positive; got {sampling.max_new_tokens}")
        if sampling.n_samples_per_prompt <= 0:
            raise RolloutError(
                f"SamplingConfig.n_samples_per_prompt must be positive; got {sampling.n_samples_per_prompt}"
            )

    # ------------------------------------------------------------------ generate
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Responses to ``request`` (see the module docstring for both paths).

        Returns:
            a :class:`RolloutBatch` of ``B * n_samples_per_prompt`` rows on the prompts' device.

        Raises:
            RolloutError: a bad sampling setting; no pad/eos id; the continuous path's restrictions.
        """
        self._check(sampling)
        if sampling.continuous_batch_size is not None:
            return self._generate_continuous(request, sampling, int(sampling.continuous_batch_size))
        n = int(sampling.n_samples_per_prompt)
        pad = self._pad_id()
        ids, mask = request.prompt_ids, request.prompt_attention_mask
        if n > 1:
            ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        sample = sampling.temperature > 0.0
        kwargs: dict[str, Any] = {
            "attention_mask": mask,
            "max_new_tokens": int(sampling.max_new_tokens),
            "eos_token_id": None,  # every row (and rank) runs the same number of decode steps
            "do_sample": sample,
            "temperature": float(sampling.temperature) if sample else 1.0,
            "top_p": float(sampling.top_p) if sample else 1.0,
            "pad_token_id": pad,
        }
        if sample:
            kwargs["top_k"] = max(int(sampling.top_k), 0)
        with self._context():
            out = self.engine.module.generate(ids, **kwargs)
        width = int(ids.shape[1])
        out, resp_mask = pad_after_eos(out, width, getattr(self.tokenizer, "eos_token_id", None), pad)
        attention = torch.cat([mask.to(torch.long), resp_mask.to(torch.long)], dim=1)
        start = torch.full((int(out.shape[0]),), width, dtype=torch.long, device=out.device)
        return RolloutBatch(input_ids=out, attention_mask=attention, response_start_idx=start)

    def _generate_continuous(self, request: RolloutRequest, sampling: SamplingConfig, size: int) -> RolloutBatch:
        rows = int(request.prompt_ids.shape[0])
        if rows == 0:
            raise RolloutError("continuous batching requires at least one request")
        if size <= 0:
            raise RolloutError(f"SamplingConfig.continuous_batch_size must be positive; got {size}")
        if sampling.temperature > 0:
            raise RolloutError("continuous batching supports greedy decoding only (SamplingConfig.temperature <= 0)")
        if sampling.n_samples_per_prompt != 1:
            raise RolloutError("continuous batching supports one sample per prompt (n_samples_per_prompt = 1)")
        mask = request.prompt_attention_mask
        if not bool(mask.bool().any(dim=1).all()):
            raise RolloutError("continuous batching requires at least one prompt token per request")
        width = int(request.prompt_ids.shape[1])
        limit = getattr(getattr(self.engine.module, "config", None), "max_position_embeddings", None)
        if limit is not None and width + sampling.max_new_tokens > int(limit):
            raise RolloutError(
                f"continuous batching: prompt width {width} + max_new_tokens {sampling.max_new_tokens} exceeds the "
                f"model's max_position_embeddings {limit}"
            )
        pad = self._pad_id()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        responses: list[torch.Tensor] = []
        with self._context():
            for first in range(0, rows, size):
                ids = request.prompt_ids[first : first + size]
                out = self.engine.module.generate(
                    ids, attention_mask=mask[first : first + size], max_new_tokens=int(sampling.max_new_tokens),
                    do_sample=False, eos_token_id=eos, pad_token_id=pad,
                )
                for row in out[:, width:]:
                    responses.append(_until_eos(row, eos))
        longest = max(int(r.numel()) for r in responses)
        device = request.prompt_ids.device
        body = torch.full((rows, longest), pad, dtype=request.prompt_ids.dtype, device=device)
        resp_mask = torch.zeros((rows, longest), dtype=mask.dtype, device=device)
        for i, r in enumerate(responses):
            body[i, : r.numel()] = r
            resp_mask[i, : r.numel()] = 1
        return RolloutBatch(
            input_ids=torch.cat([request.prompt_ids, body], dim=1),
            attention_mask=torch.cat([mask, resp_mask], dim=1),
            response_start_idx=torch.full((rows,), width, dtype=torch.long, device=device),
        )

    # ------------------------------------------------------------------ weights and lifetime
    def sync_weights(self, step: int) -> None:
        """Nothing to copy: generation reads the engine's own (live) weights."""
        return None

    def shutdown(self) -> None:
        """Mark the rollout closed (a later ``generate`` is an error); the engine is the caller's to close."""
        self._closed = True


def _until_eos(row: torch.Tensor, eos: Any) -> torch.Tensor:
    """``row`` up to and including its first EOS (all of it without one)."""
    if eos is None:
        return row
    ids = torch.as_tensor(eos, dtype=row.dtype, device=row.device).flatten()
    hit = (row.unsqueeze(-1) == ids).any(dim=-1).nonzero()
    return row if hit.numel() == 0 else row[: int(hit[0, 0]) + 1]
