"""DeepSpeed's engine accessors, as a mixin of :class:`dscore.runtime.engine.DscoreEngine`.

The config accessors and attributes scripts and integrations (HF Trainer, Accelerate, Lightning) read
(``gradient_accumulation_steps()``, ``zero_optimization_stage()``, ``fp16_enabled()``, ``local_rank``, ...),
each answering from the validated config or the runtime, plus the state-dict and memory helpers of
DeepSpeed 0.19.8's engine (``module_state_dict``, ``_zero3_consolidated_16bit_state_dict``,
``empty_partition_cache``, ``offload_states`` / ``reload_states``, ``print_comms_summary``). See
docs/engine-api.md. Nothing here changes training state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from dscore.runtime.context import runtime_scoped
from dscore.runtime.engine_errors import EngineError
from dscore.runtime.timers import PhaseTimers

if TYPE_CHECKING:
    from dscore.config.model import DscoreConfig
    from dscore.protocols.zero import ZeroStage
    from dscore.runtime.runtime import Runtime

__all__ = ["DeepSpeedAccessors"]


class DeepSpeedAccessors:
    """DeepSpeed's engine accessors (module docs); mixed into :class:`~dscore.runtime.engine.DscoreEngine`,
    whose constructor sets the attributes declared here."""

    module: torch.nn.Module
    config: DscoreConfig
    runtime: Runtime
    zero_stage_impl: ZeroStage
    global_rank: int
    _gas: int
    _train_batch_size: int
    _micro_batch_size: int
    _wall_clock: bool
    _timers: PhaseTimers | None

    def gradient_accumulation_steps(self) -> int:
        """``gradient_accumulation_steps`` of the config."""
        return self._gas

    def train_batch_size(self) -> int:
        """``train_batch_size`` (samples per optimizer step over all data-parallel ranks)."""
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """``train_micro_batch_size_per_gpu``."""
        return self._micro_batch_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage number in use."""
        return int(type(self.zero_stage_impl).stage)

    # DeepSpeed's config accessors and attributes that scripts and integrations (HF Trainer, Accelerate,
    # Lightning) read; each answers from the validated config. See docs/engine-api.md.
    def _section(self, key: str) -> Any:
        return self.config.section(key, None)

    def _zero_offload_device(self, which: str) -> str:
        off = getattr(self._section("zero_optimization"), which, None)
        device = getattr(off, "device", None) if off is not None else None
        return str(getattr(device, "value", device) or "none").lower()

    def fp16_enabled(self) -> bool:
        """``fp16.enabled``."""
        return bool(getattr(self._section("fp16"), "enabled", False))

    def bfloat16_enabled(self) -> bool:
        """``bf16.enabled`` (DeepSpeed's name; ``bf16_enabled`` is an alias)."""
        return bool(getattr(self._section("bf16"), "enabled", False))

    bf16_enabled = bfloat16_enabled

    def amp_enabled(self) -> bool:
        """Always False: dscore has no apex AMP mode (DeepSpeed's ``amp`` block)."""
        return False

    def gradient_clipping(self) -> float:
        """``gradient_clipping``: the global gradient-norm bound (0 = off; DeepSpeed's default 1.0)."""
        return float(self.config.gradient_clipping or 0.0)

    def steps_per_print(self) -> int | None:
        """``steps_per_print`` (None: no periodic progress log)."""
        value = self.config.steps_per_print
        return int(value) if value else None

    def wall_clock_breakdown(self) -> bool:
        """``wall_clock_breakdown`` (forced on by ``flops_profiler.enabled``): forward/backward/step
        timings are logged."""
        return self._wall_clock

    @property
    def phase_timers(self) -> PhaseTimers | None:
        """The forward/backward/step timers (:class:`dscore.runtime.timers.PhaseTimers`) when
        :meth:`wall_clock_breakdown` is on, else None."""
        return self._timers

    def memory_breakdown(self) -> bool:
        """``memory_breakdown`` (accepted; dscore logs no memory breakdown)."""
        return False  # an accepted-and-ignored key: not a field of the config model

    def dynamic_loss_scale(self) -> bool:
        """True when fp16 uses dynamic loss scaling (``fp16.loss_scale == 0``)."""
        return self.fp16_enabled() and float(getattr(self._section("fp16"), "loss_scale", 0.0) or 0.0) == 0.0

    def loss_scale(self) -> float:
        """``fp16.loss_scale`` as configured (0 = dynamic); the live scale is :meth:`get_loss_scale`."""
        return float(getattr(self._section("fp16"), "loss_scale", 0.0) or 0.0)

    def initial_dynamic_scale(self) -> float:
        """``2 ** fp16.initial_scale_power``."""
        return float(2.0 ** int(getattr(self._section("fp16"), "initial_scale_power", 16)))

    def postscale_gradients(self) -> bool:
        """``not prescale_gradients`` (DeepSpeed's accessor)."""
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        """``gradient_predivide_factor``."""
        return float(self.config.gradient_predivide_factor)

    @property
    def communication_data_type(self) -> torch.dtype:
        """dtype of gradient communication: ``communication_data_type`` when set, else fp16/bf16/fp32 by mode."""
        name = self.config.communication_data_type
        if name:
            return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[str(name).lower()]
        if self.fp16_enabled():
            return torch.float16
        return torch.bfloat16 if self.bfloat16_enabled() else torch.float32

    def dataloader_drop_last(self) -> bool:
        """``dataloader_drop_last``."""
        return bool(self.config.dataloader_drop_last)

    def zero_optimization(self) -> bool:
        """True when a ZeRO stage above 0 is used."""
        return self.zero_optimization_stage() > 0

    def zero_offload_optimizer(self) -> bool:
        """True when ``zero_optimization.offload_optimizer.device`` is cpu or nvme."""
        return self._zero_offload_device("offload_optimizer") in ("cpu", "nvme")

    def zero_offload_param(self) -> bool:
        """True when ``zero_optimization.offload_param.device`` is cpu or nvme."""
        return self._zero_offload_device("offload_param") in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        """True when the optimizer is offloaded to the CPU."""
        return self._zero_offload_device("offload_optimizer") == "cpu"

    def _zero_key(self, key: str, default: Any) -> Any:
        value = getattr(self._section("zero_optimization"), key, default)
        return default if value is None else value

    def zero_reduce_bucket_size(self) -> int:
        """``zero_optimization.reduce_bucket_size`` (elements)."""
        return int(self._zero_key("reduce_bucket_size", 500_000_000))

    def zero_allgather_bucket_size(self) -> int:
        """``zero_optimization.allgather_bucket_size`` (elements)."""
        return int(self._zero_key("allgather_bucket_size", 500_000_000))

    def zero_overlap_comm(self) -> bool:
        """``zero_optimization.overlap_comm``; unset means true at stage 3 only (DeepSpeed's default)."""
        value = getattr(self._section("zero_optimization"), "overlap_comm", None)
        return self.zero_optimization_stage() == 3 if value is None else bool(value)

    def zero_contiguous_gradients(self) -> bool:
        """``zero_optimization.contiguous_gradients``."""
        return bool(self._zero_key("contiguous_gradients", True))

    def zero_reduce_scatter(self) -> bool:
        """``zero_optimization.reduce_scatter``."""
        return bool(self._zero_key("reduce_scatter", True))

    def zero_sub_group_size(self) -> int:
        """``zero_optimization.sub_group_size``."""
        return int(self._zero_key("sub_group_size", 1_000_000_000))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save``."""
        return bool(self._zero_key("gather_16bit_weights_on_model_save", False))

    def zero_allow_untested_optimizer(self) -> bool:
        """``zero_allow_untested_optimizer``."""
        return self.config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        """``zero_force_ds_cpu_optimizer``."""
        return self.config.zero_force_ds_cpu_optimizer

    def optimizer_name(self) -> str | None:
        """``optimizer.type`` as written, or None (a client optimizer, or none)."""
        opt = self.config.optimizer
        return None if opt is None else str(opt.type)

    def optimizer_params(self) -> dict[str, Any] | None:
        """``optimizer.params`` as written, or None."""
        opt = self.config.optimizer
        return None if opt is None else dict(opt.params or {})

    def scheduler_name(self) -> str | None:
        """``scheduler.type`` as written, or None."""
        sched = self.config.scheduler
        return None if sched is None else str(sched.type)

    def scheduler_params(self) -> dict[str, Any] | None:
        """``scheduler.params`` as written, or None."""
        sched = self.config.scheduler
        return None if sched is None else dict(sched.params or {})

    def checkpoint_tag_validation_enabled(self) -> bool:
        """``checkpoint.tag_validation`` is not IGNORE."""
        return str(getattr(self._section("checkpoint"), "tag_validation", "WARN")).upper() != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        """``checkpoint.tag_validation`` is FAIL."""
        return str(getattr(self._section("checkpoint"), "tag_validation", "WARN")).upper() == "FAIL"

    def elasticity_enabled(self) -> bool:
        """Always False: dscore has no elastic training."""
        return False

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (selects the device), from the launcher / discovery."""
        return int(self.runtime.comm.get_local_rank())

    @property
    def world_size(self) -> int:
        """Number of processes in the job (DeepSpeed's ``engine.world_size``)."""
        return int(self.runtime.comm.get_world_size())

    @property
    def mp_world_size(self) -> int:
        """Model-parallel (tensor-parallel, ``tensor_parallel.autotp_size``) world size; 1 without AutoTP."""
        mesh = getattr(self.runtime, "mesh", None)
        return 1 if mesh is None else int(mesh.tp_size)

    def get_sequence_parallel_group(self) -> Any:
        """The sequence-parallel process group (DeepSpeed's ``engine.get_sequence_parallel_group()``); the
        mesh's group, or ``None`` (the default group) when there is no mesh."""
        mesh = getattr(self.runtime, "mesh", None)
        return None if mesh is None else mesh.get_sequence_parallel_group()

    @property
    def seq_parallel_world_size(self) -> int:
        """Sequence-parallel world size (``sequence_parallel_size``); 1 without Ulysses."""
        mesh = getattr(self.runtime, "mesh", None)
        return 1 if mesh is None else int(mesh.sp_size)

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self._train_batch_size, self._micro_batch_size, self._gas

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's full state dict (under ZeRO-3 gathered: collective, call on every rank).

        Raises:
            EngineError: the states are offloaded (``offload_states()``): call ``reload_states()`` first.
        """
        from dscore.runtime.offload_states import refuse_while_offloaded

        refuse_while_offloaded(self, "engine.module_state_dict()")
        return self.zero_stage_impl.module_state_dict()

    def iter_full_params(
        self,
        bucket_bytes: int = 64 << 20,
        dtype: torch.dtype | None = None,
        trainable_only: bool = False,
        names: str = "hf",
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Stream the full weights as ``[(name, tensor), ...]`` buckets of at most ``bucket_bytes`` (a larger
        tensor alone), in state-dict order, under any ZeRO stage and AutoTP, for RLHF weight sync
        (:mod:`dscore.runtime.weight_export`, which states the memory bound: about one bucket plus one
        ZeRO-3 unit). Collective: every rank calls it and consumes every bucket.

        Args:
            bucket_bytes: most bytes per bucket in the output dtype (default 64 MiB).
            dtype: cast floating-point tensors to it (None: as held).
            trainable_only: only parameters with ``requires_grad``.
            names: ``"hf"`` (the model's own state-dict names, wrapper prefixes removed) or ``"module"``.

        Raises:
            EngineError: a bad argument (named), MoE expert parameters, or the states are offloaded
                (``offload_states()``: call ``reload_states()`` first).
        """
        from dscore.runtime.offload_states import refuse_while_offloaded
        from dscore.runtime.weight_export import iter_full_params

        refuse_while_offloaded(self, "engine.iter_full_params()")
        return iter_full_params(
            self.module, self.zero_stage_impl, bucket_bytes=bucket_bytes, dtype=dtype,
            trainable_only=trainable_only, names=names,
        )

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
        """ZeRO-3: the gathered module state dict (parameters in the compute dtype, buffers as held) on rank
        0 and None on the other ranks; DeepSpeed's ``engine._zero3_consolidated_16bit_state_dict`` (the
        name Accelerate and Lightning call, also provided). Collective: call on every rank.

        Args:
            exclude_frozen_parameters: leave out parameters with ``requires_grad=False``.

        Raises:
            EngineError: the ZeRO stage is not 3 (DeepSpeed raises ValueError "this function requires ZeRO-3
                mode"; EngineError is a RuntimeError, and Accelerate only calls it at stage 3); the states
                are offloaded (``offload_states()``): call ``reload_states()`` first.
        """
        if self.zero_optimization_stage() != 3:
            raise EngineError(
                "consolidated_16bit_state_dict() / _zero3_consolidated_16bit_state_dict() needs ZeRO stage 3; "
                f"this engine runs stage {self.zero_optimization_stage()} (use module_state_dict())"
            )
        from dscore.runtime.offload_states import refuse_while_offloaded

        refuse_while_offloaded(self, "engine.consolidated_16bit_state_dict()")
        state = self.zero_stage_impl.module_state_dict()
        if self.global_rank != 0:
            return None
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return {k: v.detach().to("cpu") for k, v in state.items()}

    _zero3_consolidated_16bit_state_dict = consolidated_16bit_state_dict

    def empty_partition_cache(self) -> None:
        """Release every gathered (non-persistent) ZeRO-3 parameter and the memory kept for re-gathering
        them, as DeepSpeed's ``engine.empty_partition_cache()`` (e.g. before generation or offloading the
        model between phases), then empties the accelerator's cache (a caching allocator keeps freed blocks
        reserved). Not collective; the next forward gathers again. Other stages keep no gathered
        parameters: nothing to release. Also ``engine.optimizer.empty_partition_cache()``."""
        self.zero_stage_impl.empty_partition_cache()
        self.runtime.accelerator.empty_cache()

    def offload_states(
        self, include: Any = None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """Move training state to host memory (DeepSpeed 0.19.8's API; :mod:`dscore.runtime.offload_states`).

        Args:
            include: kinds to move (``"optim_states"``, ``"hp_params"``, ``"lp_params"``, ``"lp_grads"``,
                ``"contiguous_grad_buffer"`` or enum members with those values); None: all.
            device: ``"cpu"`` (``"none"``: warn and do nothing).
            pin_memory: page-lock the host copies (where the accelerator can).
            non_blocking: queue the copies asynchronously.

        Raises:
            EngineError: no optimizer, ``offload_param`` on, another device, or an unknown kind.
        """
        from dscore.runtime.offload_states import offload_engine_states

        offload_engine_states(self, include, device, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what :meth:`offload_states` moved; training continues bit for bit."""
        from dscore.runtime.offload_states import reload_engine_states

        reload_engine_states(self, non_blocking=non_blocking)

    @runtime_scoped
    def print_comms_summary(self, show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
        """The ``comms_logger`` table (:func:`dscore.comm.log_summary`): collective; every rank calls it,
        rank 0 prints. Returns the statistics dict when ``return_dict``."""
        from dscore.comm.comms_logger import log_summary

        return log_summary(show_straggler=show_straggler, return_dict=return_dict)
