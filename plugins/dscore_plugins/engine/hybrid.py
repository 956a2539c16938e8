"""The hybrid engine: the standard engine plus ``generate`` for RLHF (DeepSpeed 0.19.8's ``DeepSpeedHybridEngine``).

Selected when the ``hybrid_engine`` block is enabled (:class:`dscore_plugins.engine.config.HybridEngineConfig`)
for any ``torch.nn.Module`` that is not a pipeline model. It trains exactly like the standard engine (it *is* the
standard engine, built by :func:`dscore.runtime.assembly.build_standard_engine`) and adds:

* ``engine.generate(*args, **kwargs)``: the wrapped model's Hugging Face ``generate`` (``input_ids``,
  ``attention_mask``, ``max_new_tokens``, greedy and sampling, ``eos_token_id`` / ``pad_token_id``, the KV
  cache) run inside :meth:`~dscore.runtime.engine.DscoreEngine.generation_mode`: under ZeRO-3 with
  ``pin_parameters`` (the default) every parameter unit is gathered once per call and the per-module hooks are
  idle, so no collective runs per token and ranks may finish at different lengths. With ``pin_parameters``
  false the stage's own hooks gather each layer per forward (with its prefetch) and ``synced_gpus=True`` keeps
  the ranks stepping together (Hugging Face's rule for ZeRO-3), as DeepSpeed gathers layer by layer then.
* ``engine.eval()`` / ``engine.train()``: the module's mode, and DeepSpeed's latency counters
  (``_t_start``, ``_total_latency``, ``_iters``, ``_generate_latency``, ``_gather_latency``,
  ``_training_latency``, ``_total_batch_size``; seconds). Every ``eval()`` after the first closes one
  train/generate iteration; DeepSpeed prints its line at every such ``eval()`` on rank 0, dscore logs the same
  figures (logger ``dscore_plugins.engine.hybrid``, INFO) on rank 0 when ``_iters`` is a multiple of
  ``steps_per_print`` (never when it is unset), so a long run is not flooded.

The keys, as dscore applies them:

* ``max_out_tokens``: prompt length plus the tokens ``generate`` may add (``max_new_tokens``, else
  ``max_length``, else the model's ``generation_config``) above it is a :class:`~dscore.errors.ConfigError`
  naming the key, before anything runs.
* ``release_inference_cache``: after each ``generate`` the returned output carries no ``past_key_values``
  (when it is a ``ModelOutput``), Python's garbage is collected and the accelerator's cached memory freed
  (``accelerator.empty_cache()``); off, the output is ``generate``'s own.
* ``inference_tp_size`` > 1 is refused (a value not dividing the world size says so first): dscore generates
  with each rank's whole model. ``enable_cuda_graph`` is refused: off a CUDA device it cannot run, and dscore
  does not capture decode graphs. ``tp_gather_partition_size`` is read by DeepSpeed only with
  ``inference_tp_size`` > 1 (warned when set).

At construction the accelerator's RNG state of rank 0 is broadcast to every rank (as DeepSpeed does), so
sampling draws the same numbers on every rank.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Any

import torch

from dscore.errors import ConfigError
from dscore.protocols import DscoreEngine, EngineContext
from dscore.runtime.assembly import build_standard_engine

__all__ = ["HybridEngine", "build_hybrid_engine", "handles"]

log = logging.getLogger(__name__)


def handles(model: Any, config: Any) -> bool:
    """True when ``hybrid_engine.enabled`` is on (any ``torch.nn.Module``; a pipeline model goes to the pipeline
    engine, which refuses the block)."""
    section = config.section("hybrid_engine", None) if config is not None else None
    return bool(section is not None and section.enabled and isinstance(model, torch.nn.Module))


def check_hybrid_section(section: Any, *, world_size: int, device_type: str) -> None:
    """Refuse the ``hybrid_engine`` settings dscore cannot honour (see the module docstring).

    Raises:
        ConfigError: ``inference_tp_size`` > 1 (first: not dividing ``world_size``), ``enable_cuda_graph`` true.
    """
    tp = int(section.inference_tp_size)
    if tp > 1 and world_size % tp:
        raise ConfigError(
            f"hybrid_engine.inference_tp_size = {tp} does not divide the world size {world_size}; "
            "use a divisor of it (dscore supports only 1)",
            path="hybrid_engine.inference_tp_size",
        )
    if tp > 1:
        raise ConfigError(
            f"hybrid_engine.inference_tp_size = {tp}: dscore's hybrid engine generates with each rank's whole "
            "model (no tensor-parallel inference shards); use 1",
            path="hybrid_engine.inference_tp_size",
        )
    if section.enable_cuda_graph:
        where = (
            f"this job runs on {device_type!r}, and CUDA graphs need a CUDA device"
            if device_type != "cuda"
            else "dscore's hybrid engine does not capture decode steps in CUDA graphs"
        )
        raise ConfigError(
            f"hybrid_engine.enable_cuda_graph = true cannot be honoured: {where}; set it to false",
            path="hybrid_engine.enable_cuda_graph",
        )


def build_hybrid_engine(ctx: EngineContext) -> HybridEngine:
    """The hybrid engine's factory: the settings checked, then the standard engine's assembly as a
    :class:`HybridEngine`.

    Raises:
        ConfigError: as :func:`check_hybrid_section`; as the standard engine.
    """
    section = ctx.config.section("hybrid_engine")
    check_hybrid_section(
        section,
        world_size=int(ctx.runtime.comm.get_world_size()),
        device_type=str(getattr(ctx.runtime.accelerator, "device_type", "cpu")),
    )
    engine = build_standard_engine(ctx, engine_class=HybridEngine)
    assert isinstance(engine, HybridEngine)
    return engine


def _new_tokens(module: Any, prompt_len: int, kwargs: dict[str, Any]) -> tuple[int, str]:
    """How many tokens ``generate`` may add, and which argument said so."""
    if kwargs.get("max_new_tokens") is not None:
        return int(kwargs["max_new_tokens"]), "max_new_tokens"
    if kwargs.get("max_length") is not None:
        return int(kwargs["max_length"]) - prompt_len, "max_length"
    gen = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    if gen is not None and getattr(gen, "max_new_tokens", None) is not None:
        return int(gen.max_new_tokens), "generation_config.max_new_tokens"
    if gen is not None and getattr(gen, "max_length", None) is not None:
        return int(gen.max_length) - prompt_len, "generation_config.max_length"
    return 0, "nothing"


class HybridEngine(DscoreEngine):
    """The standard engine plus ``generate`` and DeepSpeed's latency counters (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        section = self.config.section("hybrid_engine")
        self.hybrid_config = section
        self._z3 = int(self.config.zero_stage) == 3
        self._pin = bool(section.pin_parameters)
        self._max_out_tokens = int(section.max_out_tokens)
        self._release_cache = bool(section.release_inference_cache)
        # DeepSpeed's counters (seconds); names kept so scripts reading them work
        self._t_start: float | None = None
        self._total_latency = 0.0
        self._iters = 0
        self._training_start_time: float | None = None
        self._generate_latency = 0.0
        self._training_latency = 0.0
        self._total_batch_size: int | None = None
        self._gather_latency = 0.0
        self._sync_rng()

    def _sync_rng(self) -> None:
        comm = self.runtime.comm
        if int(comm.get_world_size()) < 2:
            return
        acc = self.runtime.accelerator
        state = acc.get_rng_state().to(self.device)  # collectives take device tensors
        comm.broadcast(state, src=0)
        acc.set_rng_state(state.to("cpu"))

    # ------------------------------------------------------------------ generate
    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped model's Hugging Face ``generate(*inputs, **kwargs)``, parameters gathered once (see the
        module docstring). Collective under ZeRO-3: every data-parallel rank calls it.

        Args:
            inputs / kwargs: as ``module.generate`` (``input_ids`` ``[batch, prompt]`` int64 on the engine's
                device, ``attention_mask``, ``max_new_tokens``, ``do_sample``, ``eos_token_id``, ...).

        Returns:
            what ``module.generate`` returns (``[batch, prompt + new]`` token ids by default).

        Raises:
            ConfigError: prompt plus new tokens above ``hybrid_engine.max_out_tokens``.
            EngineError: the module has no ``generate``; the training states are offloaded.
        """
        from dscore.runtime.engine_errors import EngineError

        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise EngineError(
                f"engine.generate(): the wrapped model ({type(self.module).__name__}) has no generate() method; "
                "the hybrid engine generates with a Hugging Face model (transformers' GenerationMixin)"
            )
        ids = inputs[0] if inputs else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise EngineError("engine.generate(): input_ids must be a 2-D [batch, prompt] tensor of token ids")
        prompt_len = int(ids.shape[1])
        new, source = _new_tokens(self.module, prompt_len, kwargs)
        if prompt_len + new > self._max_out_tokens:
            raise ConfigError(
                f"engine.generate(): prompt length {prompt_len} + {new} new tokens ({source}) = "
                f"{prompt_len + new} exceeds hybrid_engine.max_out_tokens = {self._max_out_tokens}; raise the key "
                "or generate fewer tokens",
                path="hybrid_engine.max_out_tokens",
            )
        if self._total_batch_size is None:
            self._total_batch_size = int(ids.shape[0]) * int(self.runtime.comm.get_world_size())
        t0 = time.time()
        with contextlib.ExitStack() as stack:
            if self._z3 and not self._pin:
                # per-layer gathers from the stage's hooks: ranks must run the same number of forwards
                stack.enter_context(torch.no_grad())
                if int(self.runtime.comm.get_world_size()) > 1:
                    kwargs.setdefault("synced_gpus", True)
            else:
                stack.enter_context(self.generation_mode())
            self._gather_latency = time.time() - t0
            out = generate(*inputs, **kwargs)
        if self._release_cache:
            if hasattr(out, "past_key_values"):
                out.past_key_values = None
            gc.collect()
            self.runtime.accelerator.empty_cache()
        self._generate_latency = time.time() - t0 - self._gather_latency
        return out

    # ------------------------------------------------------------------ modes and counters
    def eval(self) -> HybridEngine:
        """The module in eval mode; closes one train/generate iteration of the latency counters."""
        now = time.time()
        if self._t_start is not None:
            latency = now - self._t_start
            self._total_latency += latency
            self._iters += 1
            if self.global_rank == 0 and self._steps_per_print and self._iters % self._steps_per_print == 0:
                self._log_latency(latency)
        self._t_start = now
        self._training_latency = 0.0
        super().eval()
        return self

    def _log_latency(self, latency: float) -> None:
        def pct(x: float) -> float:
            return 100.0 * x / latency if latency > 0 else 0.0

        others = latency - (self._generate_latency + self._training_latency)
        rates = ""
        if self._total_batch_size is not None and latency > 0:
            avg = self._total_latency / self._iters
            rates = (
                f" |CurSamplesPerSec={self._total_batch_size / latency:.2f}"
                f" |AvgSamplesPerSec={self._total_batch_size / avg:.2f}"
            )
        log.info(
            "|E2E latency=%.2fs |Gather latency=%.2fs (%.2f%%) |Generate time=%.2fs (%.2f%%) "
            "|Training time=%.2fs (%.2f%%) |Others=%.2f (%.2f%%)%s",
            latency, self._gather_latency, pct(self._gather_latency), self._generate_latency,
            pct(self._generate_latency), self._training_latency, pct(self._training_latency), others, pct(others),
            rates,
        )

    def train(self, mode: bool = True) -> HybridEngine:
        """The module in train mode (``mode`` true: starts the training clock of the latency counters)."""
        super().train(mode)
        if mode:
            self._training_start_time = time.time()
        return self

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """``DscoreEngine.step``, then the time since the last step (or ``train()``) added to the training latency."""
        super().step(lr_kwargs)
        if self._training_start_time is not None:
            now = time.time()
            self._training_latency += now - self._training_start_time
            self._training_start_time = now
