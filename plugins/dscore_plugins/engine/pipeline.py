"""The pipeline engine: 1F1B pipeline parallelism x data parallelism for a ``dscore.pipe.PipelineModule``.

Mirrors DeepSpeed's ``PipelineEngine`` (``deepspeed/runtime/pipe/engine.py``) from public dscore names:

* ``train_batch(data_iter)`` runs ``gradient_accumulation_steps`` micro-batches through the stages in the
  1F1B order (:func:`dscore_plugins.engine.pipe.schedule.train_schedule`), then one optimizer step, and returns the mean
  micro-batch loss (averaged over data-parallel replicas, broadcast from the last stage so every rank
  returns it). ``data_iter`` yields ``(inputs, labels)`` micro-batches; only the first stage reads it and
  sends each micro-batch's ``labels`` to the last stage (one sample stream per replica, so a dataset that
  draws at random cannot pair one sample's labels with another's inputs, DeepSpeed #3131; DeepSpeed lets the
  last stage read labels from its own iterator). Other stages' ``data_iter`` is not read.
  Without ``data_iter`` the engine's training loader (from ``training_data=``) is used, restarted at the
  end of an epoch.
* ``eval_batch(data_iter)`` runs the forwards only (no grad, eval mode) and returns the mean loss.
* Activations and gradients cross stages by point-to-point send/recv (:mod:`dscore_plugins.engine.pipe.p2p`, shapes
  exchanged once per link). Each micro-batch's loss is divided by ``gradient_accumulation_steps`` before
  backward (DeepSpeed's ``scale_wrt_gas``), so gradients equal those of one batch of all micro-batches.
* Gradients and the optimizer step are the ZeRO stage plugin's, built over this stage's layers with a
  ``Comm`` bound to the stage's data-parallel group: stage 0 (data parallelism) and stage 1 (optimizer
  state partitioned within the stage's replicas). Stages 2 and 3 are refused, as in DeepSpeed.
* Tied modules (``TiedLayerSpec``): after the last backward their gradients are summed over the stages
  owning them, so the replicas take identical steps.
* ``gradient_clipping``: the global L2 norm is taken over the whole model (every stage; a tied module
  counted once) after data-parallel averaging, and every stage scales by ``clip / (norm + 1e-6)`` capped
  at 1 before its optimizer step. The engine averages the gradients over the data-parallel group itself
  then (the ZeRO stage's own reduction of the already-equal gradients leaves them unchanged), so a clipped
  step communicates the gradients twice.
* Precision: fp32 and bf16 (bf16 activations cross stages in bf16). With ``bf16.check_grad_overflow``
  (default true) the ranks agree on a non-finite gradient anywhere (one scalar all-reduce) and then all
  skip the step (``skipped_steps``), so stages never diverge. fp16 (loss scaling across stages) is refused.
* Checkpoints are per layer (:mod:`dscore_plugins.engine.pipe.checkpoint`): a checkpoint saved with ``p`` stages loads
  with any number of stages, optimizer state included, and into a plain model
  (:func:`dscore.pipe.load_into_layers`). They are saved as the standard engine's are: into a temporary
  folder published in one rename with ``latest`` moved last, every phase agreed by all ranks.
* ``forward``, ``backward`` and ``step`` are not available (DeepSpeed: "Only train_batch() is accessible
  in pipeline mode."); they raise :class:`dscore.pipe.PipelineError`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from dscore.errors import ConfigError, DistributedError
from dscore.pipe import PipelineError, PipelineModule
from dscore.protocols.engine import EngineContext
from dscore.runtime.engine import DscoreEngine
from dscore.runtime.placement import to_module
from dscore_plugins.engine.pipe import engine_io
from dscore_plugins.engine.pipe.p2p import P2PLink, as_tuple
from dscore_plugins.engine.pipe.schedule import FORWARD, inference_schedule, train_schedule

__all__ = ["PipelineEngine", "build_pipeline_engine", "handles"]

log = logging.getLogger("dscore.pipe.engine")


def handles(model: Any, config: Any) -> bool:
    """True for a :class:`dscore.pipe.PipelineModule`."""
    return isinstance(model, PipelineModule)


def _check_pipeline_section(cfg: Any, model: PipelineModule) -> None:
    """Apply the ``pipeline`` block to the module, refusing contradictions (see the plugin's config docs)."""
    section = cfg.section("pipeline")
    if section is None:
        return
    if section.stages != "auto" and int(section.stages) != model.num_stages:
        raise ConfigError(
            f"pipeline.stages = {section.stages} but the PipelineModule has num_stages={model.num_stages}; "
            'use "auto" or the same number',
            path="pipeline.stages",
        )
    if section.partition != "best" and section.partition.lower() != model.partition_method.lower():
        raise ConfigError(
            f"pipeline.partition = {section.partition!r} but the PipelineModule was partitioned with "
            f"partition_method={model.partition_method!r}; use \"best\" or the same method",
            path="pipeline.partition",
        )
    if section.seed_layers and not model.seed_layers:
        raise ConfigError(
            "pipeline.seed_layers is true but the PipelineModule was built with seed_layers=False (its layers "
            "already exist); build it with PipelineModule(..., seed_layers=True)",
            path="pipeline.seed_layers",
        )
    interval = int(section.activation_checkpoint_interval)
    if interval:
        if model.activation_checkpoint_interval == 0:
            model.activation_checkpoint_interval = interval
        elif model.activation_checkpoint_interval != interval:
            raise ConfigError(
                f"pipeline.activation_checkpoint_interval = {interval} but the PipelineModule has "
                f"activation_checkpoint_interval={model.activation_checkpoint_interval}; set one of them",
                path="pipeline.activation_checkpoint_interval",
            )


def build_pipeline_engine(ctx: EngineContext) -> PipelineEngine:
    """The pipeline engine's factory (see the module docstring).

    Raises:
        ConfigError: ZeRO stage 2/3, fp16, a ``pipeline`` block contradicting the module, no ``loss_fn``,
            ``hybrid_engine.enabled``.
        DistributedError: the module was built for another number of processes than the job has.
    """
    cfg = ctx.config
    model = ctx.model
    assert isinstance(model, PipelineModule)
    world = int(ctx.runtime.comm.get_world_size())
    if world != model.topology().world_size():
        raise DistributedError(
            f"the PipelineModule was built for {model.topology().world_size()} process(es) but the job has {world}: "
            "call dscore.init_distributed() before building the PipelineModule so it sees the whole job"
        )
    _check_pipeline_section(cfg, model)
    hybrid = cfg.section("hybrid_engine", None)
    if hybrid is not None and hybrid.enabled:
        raise ConfigError(
            "hybrid_engine.enabled is true but the model is a PipelineModule: the hybrid engine (generate() for "
            "RLHF) cannot be combined with pipeline parallelism (as in DeepSpeed, which builds the pipeline "
            "engine for a PipelineModule); disable hybrid_engine or train a plain torch.nn.Module",
            path="hybrid_engine.enabled",
        )
    stage_number = int(cfg.zero_stage)
    if stage_number > 1:
        raise ConfigError(
            f"zero_optimization.stage {stage_number} cannot be combined with pipeline parallelism (gradients or "
            "parameters would be partitioned across micro-batches in flight); use stage 0 or 1",
            path="zero_optimization.stage",
        )
    if model.loss_fn is None:
        raise ConfigError("PipelineModule(loss_fn=...) is required to train with the pipeline engine")
    precision = ctx.select_precision()
    if precision.name == "fp16":
        raise ConfigError(
            "fp16 is not supported by the pipeline engine (dynamic loss scaling would need every stage to agree "
            "on overflow); use bf16 or fp32",
            path="fp16.enabled",
        )
    runtime = ctx.runtime
    grid = model.grid
    to_module(model, device=runtime.accelerator.device())  # keeps Parameter objects (ties) on any device
    model.synchronize_tied_weights()
    prepared = precision.prepare_module(model)
    module = model if prepared is None else prepared  # never a module's truth value (a PipelineModule has len())
    loss_scaler = precision.make_loss_scaler(zero_stage=stage_number)
    dp_comm = runtime.comm.bound_to(grid.dp_group) if grid.dp_group is not None else runtime.comm
    clip = float(cfg.gradient_clipping or 0.0)
    # the engine clips by the norm over all stages, so the stage plugin must not clip by its own norm
    stage_cfg = cfg.model_copy(update={"gradient_clipping": 0.0}) if clip > 0 else cfg
    zero_stage = ctx.build_zero_stage(
        module, precision=precision, loss_scaler=loss_scaler, comm=dp_comm, config=stage_cfg
    )
    scheduler = ctx.build_lr_scheduler(zero_stage.optimizer)
    loader = ctx.build_dataloader(dp_world_size=grid.data_parallel_size, dp_rank=grid.data_parallel_id)
    return PipelineEngine(
        module=module,
        config=cfg,
        runtime=runtime,
        zero_stage=zero_stage,
        precision=precision,
        loss_scaler=loss_scaler,
        lr_scheduler=scheduler,
        training_dataloader=loader,
        monitors=ctx.create_monitors(),
        rank=int(runtime.comm.get_rank()),
        dp_world_size=grid.data_parallel_size,
        clip=clip,
    )


class PipelineEngine(DscoreEngine):
    """The engine ``dscore.initialize`` returns for a :class:`dscore.pipe.PipelineModule`.

    Built by :func:`build_pipeline_engine`; arguments are :class:`DscoreEngine`'s plus ``clip`` (the
    ``gradient_clipping`` bound the engine applies by the global norm across stages, 0 = off).

    Attributes:
        stage_id / num_stages: this rank's stage and the stage count.
        grid: the :class:`dscore.pipe.PipelineGrid`.
        agg_train_loss: the last ``train_batch`` loss (a 0-dim fp32 tensor), or None.
    """

    def __init__(self, *, clip: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        pipe: PipelineModule = self.module
        self.grid = pipe.grid
        self.stage_id = pipe.stage_id
        self.num_stages = pipe.num_stages
        self._clip = float(clip)
        device = self.runtime.accelerator.device()
        self._prev = P2PLink(self.grid.stage_to_global(self.stage_id - 1), device, self.runtime.comm) if self.stage_id > 0 else None
        self._next = (
            P2PLink(self.grid.stage_to_global(self.stage_id + 1), device, self.runtime.comm)
            if self.stage_id < self.num_stages - 1
            else None
        )
        # the first stage sends each micro-batch's labels to the last one (its own tags, even when adjacent)
        self._labels_link: P2PLink | None = None
        if self.num_stages > 1 and self.stage_id in (0, self.num_stages - 1):
            peer = self.num_stages - 1 if self.stage_id == 0 else 0
            self._labels_link = P2PLink(self.grid.stage_to_global(peer), device, self.runtime.comm, channel=1)
        self._data_iterator: Iterator[Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.agg_eval_loss: torch.Tensor | None = None
        self._check_overflow = bool(getattr(self.precision, "check_overflow", False))
        self._tied_params = self._collect_tied()

    # ------------------------------------------------------------------ refused entry points
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: the pipeline runs whole batches (``train_batch`` / ``eval_batch``)."""
        raise PipelineError("Only train_batch() and eval_batch() are accessible in pipeline mode (engine(...) was called)")

    def backward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Refused: ``train_batch`` runs the backward passes."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode (engine.backward() was called)")

    def step(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Refused: ``train_batch`` steps the optimizer."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode (engine.step() was called)")

    # ------------------------------------------------------------------ queries
    def is_first_stage(self) -> bool:
        """True on stage 0."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """True on the last stage."""
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """Use ``iterator`` when ``train_batch`` / ``eval_batch`` get none (DeepSpeed's method)."""
        self._data_iterator = iterator

    def _collect_tied(self) -> list[tuple[torch.Tensor, Any, bool]]:
        """``(parameter, tied group, counted in the norm here)`` for every parameter of an owned tied module."""
        pipe: PipelineModule = self.module
        out = []
        for key, module in pipe.tied_modules.items():
            group, ranks = self.grid.tied_groups.get(key, (None, [self.grid.global_rank]))
            first_owner = ranks[0] == self.grid.global_rank
            for p in module.parameters():
                if p.requires_grad:
                    out.append((p, group if len(ranks) > 1 else None, first_owner))
        return out

    # ------------------------------------------------------------------ data
    def _next_batch(self, data_iter: Iterator[Any] | None) -> Any:
        it = data_iter if data_iter is not None else self._data_iterator
        if it is None:
            if self.training_dataloader is None:
                raise PipelineError(
                    "train_batch() needs data: pass data_iter=iter(loader), call set_dataiterator(), or give "
                    "training_data= to dscore.initialize"
                )
            self._data_iterator = it = iter(self.training_dataloader)
        try:
            return next(it)
        except StopIteration:
            if data_iter is None and self.training_dataloader is not None:
                self._data_iterator = it = iter(self.training_dataloader)
                return next(it)
            raise PipelineError(
                f"the data iterator of pipeline stage {self.stage_id} ran out within a batch: train_batch() and "
                f"eval_batch() read one (inputs, labels) pair per micro-batch ({self._gas} per batch by default)"
            ) from None

    def _split_batch(self, batch: Any) -> tuple[Any, Any]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise PipelineError(
                f"the data iterator must yield (inputs, labels) pairs for the pipeline engine, got {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
        device = self.runtime.accelerator.device()
        return _to_device(batch[0], device), _to_device(batch[1], device)

    # ------------------------------------------------------------------ the schedule
    def _run(self, data_iter: Iterator[Any] | None, *, train: bool, micro_batches: int | None = None) -> torch.Tensor:
        pipe: PipelineModule = self.module
        micro_batches = self._gas if micro_batches is None else micro_batches
        first, last = self.is_first_stage(), self.is_last_stage()
        where = f"pipeline stage {self.stage_id}"
        schedule = (
            train_schedule(micro_batches, self.num_stages, self.stage_id) if train else inference_schedule(micro_batches)
        )
        cast = self.precision.compute_dtype if self.precision.compute_dtype != torch.float32 else None
        store: dict[int, tuple[tuple[torch.Tensor, ...], Any]] = {}
        losses: list[torch.Tensor] = []
        try:
            for action, mb in schedule:
                if action == FORWARD:
                    labels = None
                    if first:
                        inputs, labels = self._split_batch(self._next_batch(data_iter))
                        if cast is not None:
                            inputs = _cast_floating(inputs, cast)
                        x = inputs
                        saved_inputs: tuple[torch.Tensor, ...] = ()
                    else:
                        assert self._prev is not None
                        saved_inputs = self._prev.recv_activations(mb, requires_grad=train)
                        x = saved_inputs[0] if len(saved_inputs) == 1 else saved_inputs
                        if last:
                            assert self._labels_link is not None
                            got = self._labels_link.recv_activations(mb, requires_grad=False)
                            labels = got[0] if len(got) == 1 else got
                    if train:
                        out = pipe(x)
                    else:
                        with torch.no_grad():
                            out = pipe(x)
                    if last:
                        assert pipe.loss_fn is not None
                        loss = pipe.loss_fn(out, labels)
                        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                            raise PipelineError(
                                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                            )
                        losses.append(loss.detach().float())
                        if train:
                            store[mb] = (saved_inputs, loss)
                    else:
                        outs = as_tuple(out, where)
                        assert self._next is not None
                        self._next.send_activations(outs, mb, where)
                        if first and self._labels_link is not None:
                            # after the activations: the last stage receives in that order (the first
                            # send of a link blocks on its meta, so the other order could deadlock)
                            self._labels_link.send_activations(
                                as_tuple(labels, f"the labels of micro-batch {mb}"), mb, "the labels"
                            )
                        if train:
                            store[mb] = (saved_inputs, outs)
                else:  # BACKWARD
                    saved_inputs, produced = store.pop(mb)
                    if last:
                        surrogate = produced / micro_batches if micro_batches != 1 else produced
                    else:
                        assert self._next is not None
                        grads = self._next.recv_gradients(mb)
                        terms = [
                            (o * g).sum()
                            for o, g in zip((t for t in produced if t.is_floating_point()), grads)
                            if o.requires_grad
                        ]
                        if not terms:
                            raise PipelineError(f"{where}: no output of the stage requires grad; nothing to train")
                        surrogate = terms[0] if len(terms) == 1 else torch.stack(terms).sum()
                    self.zero_stage_impl.backward(surrogate, boundary=False)
                    if not first:
                        assert self._prev is not None
                        self._prev.send_gradients(
                            [
                                t.grad if t.grad is not None else torch.zeros_like(t)
                                for t in saved_inputs
                                if t.is_floating_point()
                            ],
                            mb,
                        )
        finally:
            for link in (self._prev, self._next, self._labels_link):
                if link is not None:
                    link.wait()
        return self._aggregate_loss(losses)

    def _aggregate_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean micro-batch loss, averaged over the data-parallel replicas, on every rank."""
        comm = self.runtime.comm
        device = self.runtime.accelerator.device()
        if self.is_last_stage():
            value = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
            if self.grid.data_parallel_size > 1:
                comm.all_reduce(value, op="sum", group=self.grid.dp_group)
                value = value / self.grid.data_parallel_size
        else:
            value = torch.zeros((), dtype=torch.float32, device=device)
        if self.num_stages > 1:
            value = value.reshape(1).contiguous()
            comm.broadcast(value, src=self.grid.stage_to_global(self.num_stages - 1), group=self.grid.pipe_group)
            value = value.reshape(())
        return value

    # ------------------------------------------------------------------ gradients between stages
    def _reduce_tied_gradients(self) -> None:
        comm = self.runtime.comm
        for p, group, _ in self._tied_params:
            if group is not None and p.grad is not None:
                comm.all_reduce(p.grad, op="sum", group=group)

    def _clip_global(self) -> torch.Tensor:
        """Average the gradients over the data-parallel group, take the norm over all stages, scale."""
        comm = self.runtime.comm
        params = [p for p in self.module.parameters() if p.requires_grad and p.grad is not None]
        if self.grid.data_parallel_size > 1 and params:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            comm.all_reduce(flat, op="sum", group=self.grid.dp_group)
            flat /= self.grid.data_parallel_size
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        skip = {id(p) for p, _, counted in self._tied_params if not counted}
        device = self.runtime.accelerator.device()
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        for p in params:
            if id(p) not in skip:
                sq += p.grad.float().pow(2).sum()
        if self.num_stages > 1:
            comm.all_reduce(sq, op="sum", group=self.grid.pipe_group)
        norm = sq.sqrt().reshape(())
        coef = torch.clamp(self._clip / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    # ------------------------------------------------------------------ public API
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches (collective: every rank).

        Args:
            data_iter: yields ``(inputs, labels)`` micro-batches (``train_micro_batch_size_per_gpu`` samples);
                None = the iterator of :meth:`set_dataiterator` or of the training loader.

        Returns:
            The mean loss over the micro-batches and data-parallel replicas (0-dim fp32 tensor, on every rank).

        Raises:
            PipelineError: no data, a batch that is not ``(inputs, labels)``, a stage output that is not a
                tensor (tuple) or changed shape, a non-scalar loss.
        """
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() must not be called under torch.no_grad()")
        if self.zero_stage_impl.optimizer is None:
            raise PipelineError("train_batch() needs an optimizer: set optimizer.type in ds_config or pass optimizer=")
        self.module.train()
        loss = self._run(data_iter, train=True)
        self._reduce_tied_gradients()
        if self._track_loss:
            self._step_loss = loss.detach()
        self._backwards_since_step = self._gas
        if self._check_overflow and self._any_stage_overflowed():
            self._skip_step()
        else:
            norm = self._clip_global() if self._clip > 0 else None
            self._take_step(None)
            if norm is not None:
                self._global_grad_norm = norm
        self.micro_steps += self._gas
        self.agg_train_loss = loss
        return loss

    def _clip_for_post_norm(self) -> float:
        return self._clip  # the pipeline clips across stages itself (its ZeRO stage is built without clipping)

    def _any_stage_overflowed(self) -> bool:
        """True when any rank (any stage, any replica) holds a non-finite gradient (one scalar all-reduce).

        Each stage's ZeRO plugin checks only its own gradients; agreeing first keeps the stages in step:
        either all of them apply the step or none does."""
        device = self.runtime.accelerator.device()
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:  # no per-parameter device sync: one stacked reduction
            flag = torch.stack([~torch.isfinite(g).all() for g in grads]).any().to(torch.float32).reshape(1)
        if self.runtime.comm.get_world_size() > 1:
            self.runtime.comm.all_reduce(flag, op="max")
        return bool(flag.item())

    def _skip_step(self) -> None:
        """Drop the batch's gradients and count a skipped step on every rank (DeepSpeed's overflow skip)."""
        self.zero_stage_impl.zero_grad()
        self._step_applied = False
        self._global_grad_norm = None
        self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self._train_batch_size
        self._backwards_since_step = 0
        log.warning("step %d skipped: a pipeline stage has non-finite gradients", self.global_steps)
        if self._track_loss:
            self._report()
        if self._after_step_hook:
            self._pm.call("dscore_after_optimizer_step", engine=self, step_applied=False)

    def eval_batch(self, data_iter: Iterator[Any] | None = None, num_micro_batches: int | None = None) -> torch.Tensor:
        """Forward micro-batches without gradients (eval mode); the mean loss over them and the data-parallel
        replicas, on every rank (collective).

        Args:
            data_iter: yields ``(inputs, labels)``; None = as :meth:`train_batch`.
            num_micro_batches: how many (default ``gradient_accumulation_steps``, DeepSpeed's default).

        Raises:
            PipelineError: ``num_micro_batches < 1`` or bad data (as :meth:`train_batch`).
        """
        if num_micro_batches is not None and int(num_micro_batches) < 1:
            raise PipelineError(f"eval_batch(num_micro_batches={num_micro_batches}) needs at least 1 micro-batch")
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                loss = self._run(data_iter, train=False, micro_batches=num_micro_batches)
        finally:
            self.module.train(was_training)
        self.agg_eval_loss = loss
        return loss

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(  # type: ignore[override]
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save a per-layer pipeline checkpoint atomically (collective: call on every rank). Returns True.

        Layout and protocol: :mod:`dscore_plugins.engine.pipe.checkpoint`
        (:func:`~dscore_plugins.engine.pipe.checkpoint.save_pipeline_checkpoint`; the engine's part in
        :mod:`dscore_plugins.engine.pipe.engine_io`): the files are written into a private temporary folder
        and published under ``<save_dir>/<tag>`` in one rename once every rank wrote its part, then
        ``latest`` moves; a failed or killed save leaves the previous checkpoint of that tag and ``latest``
        untouched. ``tag`` defaults to ``global_step{N}`` (ranks' tags compared per
        ``checkpoint.tag_validation``); ``client_state`` (global rank 0's) is stored in ``engine_states.pt``;
        ``exclude_frozen_parameters`` leaves parameters with ``requires_grad=False`` out of the layer files.

        Raises:
            CheckpointError: on every rank, naming the failing rank: an invalid tag or ``save_dir``, a
                ``client_state`` value that cannot be stored safely, a failure writing on any rank (disk
                full, unwritable folder) or publishing; ``checkpoint_layout == "deepspeed"`` (DeepSpeed's
                pipeline layout is not written; the ``deepspeed`` compatibility layer sets it).
        """
        tag_text = engine_io.save_engine(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        if self._pm is not None and self._pm.has_implementations("dscore_checkpoint_saved"):
            self._pm.call("dscore_checkpoint_saved", engine=self, save_dir=os.path.abspath(save_dir), tag=tag_text)
        return True

    def load_checkpoint(  # type: ignore[override]
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a pipeline checkpoint saved with any number of stages (collective: every rank).

        The tag folder is found by the standard engine's rules
        (:func:`dscore_plugins.engine.pipe.checkpoint.find_checkpoint`): it must hold its ``_COMPLETE``
        marker (folders written before pipeline saves had one load with a warning), and each file read is
        checked against the size recorded at save. Every phase is agreed: an error on one rank is raised on
        every rank.

        Returns:
            ``(path of the tag folder, client_state)``; ``(None, None)`` with a warning when no tag is given
            and ``load_dir`` has no ``latest`` (start fresh, as the standard engine).

        Raises:
            CheckpointNotFoundError: ``load_dir``, the tag folder or a file this stage needs is missing, or
                the folder is incomplete (no ``_COMPLETE``).
            CheckpointError: ranks asked for different folders or tags; the folder is a standard-engine
                checkpoint; a file is truncated or unreadable; the checkpoint has another number of layers
                than the model, or its weights do not fit the layers.
        """
        path, client_state = engine_io.load_engine(
            self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states, load_module_only
        )
        if path is None:
            return None, None
        if self._pm is not None and self._pm.has_implementations("dscore_checkpoint_loaded"):
            self._pm.call(
                "dscore_checkpoint_loaded",
                engine=self,
                load_dir=os.path.abspath(os.fspath(load_dir)),
                tag=os.path.basename(path),
            )
        return path, client_state


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(t, device) for t in x)
    return x


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast_floating(t, dtype) for t in x)
    return x

