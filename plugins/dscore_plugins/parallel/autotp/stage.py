"""AutoTP training, the stage: the ZeRO wrapper that makes clipping, the same-batch check and checkpoints
exact over a tensor-parallel model (:class:`TensorParallelStage`), and the parameter groups it needs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError
from dscore.parallel.tp_layers import gather_full, shard_of
from dscore.protocols.zero import StepOutcome, ZeroStage
from dscore.zero.optimizer import collective_device
from dscore_plugins.parallel.autotp.plan import TPBatchMismatchError, tp_params_of

if TYPE_CHECKING:
    from dscore.parallel.mesh import ParallelMesh

__all__ = ["TensorParallelStage", "split_groups_for_tp", "wrap_stage"]

log = logging.getLogger("dscore.parallel.autotp")


def _fingerprint(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    values: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            flat = x.detach().reshape(-1).to("cpu", torch.float64)
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
            values.extend([flat.sum(), (flat * weights).sum(), torch.tensor(float(flat.numel()), dtype=torch.float64)])
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                visit(x[k])

    visit(args)
    visit(kwargs)
    return torch.stack(values) if values else torch.zeros(1, dtype=torch.float64)


def split_groups_for_tp(groups: list[dict[str, Any]], module: torch.nn.Module) -> list[dict[str, Any]]:
    """Each parameter group split in two with the same hyper-parameters: ``2i`` the replicated parameters of
    group ``i``, ``2i + 1`` its tensor-parallel shards (so the clipping norm can count each kind right).
    :class:`TensorParallelStage` shows the user's groups in checkpoints (pairs merged back)."""
    split_ids = {id(p) for n, p in module.named_parameters() if n in tp_params_of(module)}
    out: list[dict[str, Any]] = []
    for g in groups:
        ps = list(g["params"])
        out.append({**g, "params": [p for p in ps if id(p) not in split_ids]})
        out.append({**g, "params": [p for p in ps if id(p) in split_ids]})
    return out


class TensorParallelStage(ZeroStage):
    """A ZeRO stage over a tensor-parallel model: delegates to the inner stage (which reduces over the
    sequence x data ranks) and adds what tensor parallelism needs.

    * the first forward checks that every rank of the tensor-parallel group got the same batch
      (:class:`TPBatchMismatchError` naming the ranks);
    * the gradient norm, the overflow verdict and clipping are the whole model's: the inner stage (built over
      :func:`split_groups_for_tp` groups: even groups replicated, odd groups split) is given
      :meth:`model_norm_sq` as its :attr:`~dscore.protocols.zero.ZeroStage.grad_norm_sq`, one all-reduce over
      every rank (data x sequence x tensor: the whole world, since AutoTP refuses pipeline and expert
      parallelism) that sums each split parameter's shards and counts each replicated parameter once, and
      carries a non-finite flag. So an inf/NaN in one rank's shard skips the step on every rank (fp16's loss
      scaler backs off on every rank alike), clipping to the user's ``gradient_clipping`` uses the global
      norm (``clip / (norm + 1e-6)`` capped at 1, as :func:`torch.nn.utils.clip_grad_norm_`), and
      ``engine.get_global_grad_norm()`` is the same global norm on every rank, clipping or not;
    * checkpoints: ``module_state_dict`` / ``state_dict`` hold full tensors (split parameters gathered over
      the tensor-parallel group), loads slice them again, so a checkpoint loads at any degree, 1 included.
    """

    def __init__(self, inner: ZeroStage, module: torch.nn.Module, mesh: ParallelMesh) -> None:
        """Wrap ``inner`` (built over :func:`split_groups_for_tp` groups).

        Raises:
            ConfigError: ``inner`` does not honour :attr:`~dscore.protocols.zero.ZeroStage.grad_norm_sq`
                (a third-party stage), naming it and ``tensor_parallel.autotp_size``.
        """
        super().__init__(inner.ctx)
        self.inner, self.mesh, self.module = inner, mesh, module
        self.tp_comm = mesh.tp_comm
        self.split = tp_params_of(module)
        self._hook = module.register_forward_pre_hook(self._check_batch, with_kwargs=True)
        if not type(inner).supports_grad_norm_sq:
            raise ConfigError(
                f"tensor_parallel.autotp_size {mesh.tp_size} needs a ZeRO stage that takes the model-wide gradient "
                f"norm (ZeroStage.supports_grad_norm_sq); {type(inner).__name__} does not, so its overflow verdict "
                "and clipping would be per shard; use a built-in zero_optimization.implementation",
                path="tensor_parallel.autotp_size",
            )
        if self.ctx.runtime.comm.get_world_size() != mesh.shape.world:
            raise ConfigError(
                f"tensor_parallel.autotp_size {mesh.tp_size}: the mesh spans {mesh.shape.world} ranks but the world "
                f"has {self.ctx.runtime.comm.get_world_size()}; the model-wide gradient norm reduces over the world",
                path="tensor_parallel.autotp_size",
            )
        inner.grad_norm_sq = self.model_norm_sq

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "mesh", "module", "split", "tp_comm", "_hook"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @torch.no_grad()
    def model_norm_sq(self, device: torch.device) -> torch.Tensor:
        """The squared L2 norm of the inner optimizer's gradients over the whole model, and its verdict.

        Called by the inner stage at each boundary (its gradients reduced over the data x sequence ranks,
        still loss-scaled). One all-reduce (sum) over the world of ``[replicated, split, non-finite]``: a
        replicated parameter is counted on tensor-parallel rank 0 only, each split parameter's shard on
        every tensor-parallel rank; at ZeRO 0 the gradients are whole on every data-parallel rank, so only
        data-parallel rank 0 counts them (at 1-3 the partitions are disjoint and all count). Every rank
        flags its own inf/NaN, counted or not.

        Args:
            device: where the collective runs (the stage's collective device).

        Returns:
            0-dim float32 tensor on ``device``, equal on every rank: the squared norm, or ``inf`` when any
            rank's gradients hold an inf or NaN. No host sync.
        """
        opt = self.inner.optimizer
        grads: list[list[torch.Tensor]] = [[], []]
        if opt is not None:
            for gi, group in enumerate(opt.param_groups):
                grads[gi % 2].extend(p.grad for p in group["params"] if p.grad is not None and p.grad.numel())
        local = torch.zeros(2, dtype=torch.float64, device=device)
        for kind in (0, 1):
            if grads[kind]:
                norms = torch._foreach_norm(grads[kind], 2.0)
                local[kind] = torch.stack([n.to(device, torch.float64) for n in norms]).pow(2).sum()
        whole = int(self.inner.stage) == 0  # ZeRO 0: every data-parallel rank holds the same reduced gradients
        counted = 0 if whole and self.mesh.grad_comm.rank != 0 else 1
        weights = torch.tensor(
            [counted if self.mesh.tp_rank == 0 else 0, counted], dtype=torch.float64, device=device
        )
        parts = torch.empty(3, dtype=torch.float64, device=device)
        parts[2] = (~torch.isfinite(local).all()).to(torch.float64)
        # a non-finite value must not reach the sums as inf * 0 (NaN): the flag carries it
        parts[:2] = torch.where(torch.isfinite(local), local, torch.zeros_like(local)) * weights
        self.ctx.runtime.comm.all_reduce(parts)
        total = parts[0] + parts[1]
        return torch.where(parts[2] > 0, torch.full_like(total, float("inf")), total).to(torch.float32)

    # one-time check made of object collectives and a hook removal: under torch.compile it runs eagerly (one
    # graph break on the first forward) instead of dynamo tracing into pickling and failing ~30 times
    @torch.compiler.disable
    def _check_batch(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._hook.remove()
        mine = _fingerprint(args, kwargs).to(collective_device())
        sizes = self.tp_comm.all_gather_object(int(mine.numel()))
        if len(set(sizes)) == 1:
            outs = [torch.empty_like(mine) for _ in range(self.mesh.tp_size)]
            self.tp_comm.all_gather(outs, mine)
            same = all(torch.equal(outs[0], o) for o in outs[1:])
        else:
            same = False
        error = None
        if not same:
            ranks = self.mesh.shape.tp_ranks(self.mesh.rank)
            error = TPBatchMismatchError(
                f"the ranks {ranks} of one tensor-parallel group received different inputs on the first forward; "
                "every rank of a tensor-parallel group must get the same batch (shard the data over the "
                "data-parallel ranks only: engine.training_dataloader does, or use mesh.dp_rank / dp_size)"
            )
        # every rank learns the verdict, so no other group waits in a collective for the failing ranks
        self.ctx.runtime.comm.agree(error, "the tensor-parallel same-batch check", error_types=(TPBatchMismatchError,))

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.inner.optimizer

    @property
    def public_optimizer(self) -> Any:
        return self.inner.public_optimizer

    def backward(self, loss: torch.Tensor, *, boundary: bool, sync: bool = True, retain_graph: bool = False) -> None:
        self.inner.backward(loss, boundary=boundary, sync=sync, retain_graph=retain_graph)

    def step(self) -> StepOutcome:
        return self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def partition_bytes(self) -> dict[str, int]:
        return self.inner.partition_bytes()

    def empty_partition_cache(self) -> None:
        self.inner.empty_partition_cache()

    def generation_context(self) -> Any:
        return self.inner.generation_context()

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------------ checkpoints: full tensors
    def _gather(self, name: str, value: Any) -> Any:
        spec = self.split.get(name)
        if spec is None or not isinstance(value, torch.Tensor) or value.dim() <= spec.dim:
            return value
        return gather_full(value, spec, self.tp_comm)

    def _slice(self, name: str, value: Any, like: torch.Tensor | None) -> Any:
        spec = self.split.get(name)
        if spec is None or not isinstance(value, torch.Tensor) or value.dim() <= spec.dim:
            return value
        if like is not None and tuple(value.shape) == tuple(like.shape):
            return value  # already this rank's slice
        return shard_of(value, spec)

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors of every parameter and buffer (collective over the tensor-parallel group)."""
        sd = self.inner.module_state_dict()
        return type(sd)((k, self._gather(k, v)) for k, v in sd.items())

    def iter_module_state(self) -> Iterator[dict[str, torch.Tensor]]:
        """The inner stage's pieces with split parameters gathered to full size (collective over the
        tensor-parallel group, one tensor at a time)."""
        for piece in self.inner.iter_module_state():
            yield {k: self._gather(k, v) for k, v in piece.items()}

    def load_module_state_dict(self, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load full tensors (saved at any tensor-parallel degree), sliced to this rank."""
        own = dict(self.module.named_parameters())
        self.inner.load_module_state_dict(
            type(state)((k, self._slice(k, v, own.get(k))) for k, v in state.items()), strict=strict
        )

    def state_dict(self) -> dict[str, Any]:
        """The inner state with split parameters' tensors gathered to full size."""
        sd = dict(self.inner.state_dict())
        if isinstance(sd.get("state"), dict):
            sd["state"] = {
                n: ({k: self._gather(n, v) for k, v in st.items()} if isinstance(st, dict) else st)
                for n, st in sd["state"].items()
            }
        if isinstance(sd.get("fp32_params"), dict):
            sd["fp32_params"] = {n: self._gather(n, v) for n, v in sd["fp32_params"].items()}
        groups = sd.get("param_groups")
        if isinstance(groups, list) and len(groups) % 2 == 0:  # the user's groups: pairs merged back
            merged = []
            for rep, shard in zip(groups[0::2], groups[1::2]):
                names = list(rep.get("param_names", [])) + list(shard.get("param_names", []))
                merged.append({**rep, "param_names": names})
            sd["param_groups"] = merged
        sd["tensor_parallel"] = {"autotp_size": self.mesh.tp_size, "split": sorted(self.split)}
        return sd

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Load a state saved at any degree (full tensors are sliced to this rank)."""
        own = dict(self.module.named_parameters())
        sd = {k: v for k, v in state.items() if k != "tensor_parallel"}
        if isinstance(sd.get("state"), dict):
            sd["state"] = {
                n: ({k: self._slice(n, v, own.get(n)) for k, v in st.items()} if isinstance(st, dict) else st)
                for n, st in sd["state"].items()
            }
        if isinstance(sd.get("fp32_params"), dict):
            sd["fp32_params"] = {n: self._slice(n, v, own.get(n)) for n, v in sd["fp32_params"].items()}
        if isinstance(sd.get("param_groups"), list):  # each user group feeds its replicated and split halves
            sd["param_groups"] = [g for g in sd["param_groups"] for _ in (0, 1)]
        self.inner.load_state_dict(sd, load_optimizer_states=load_optimizer_states)


def wrap_stage(inner: ZeroStage, module: torch.nn.Module, mesh: ParallelMesh) -> TensorParallelStage:
    """``inner`` wrapped in a :class:`TensorParallelStage` subclass whose class attribute ``stage`` is the inner
    stage's (the engine and checkpoints read ``type(stage).stage``)."""
    cls = type(f"TensorParallel{type(inner).__name__}", (TensorParallelStage,), {"stage": int(type(inner).stage)})
    wrapped: TensorParallelStage = cls(inner, module, mesh)
    return wrapped
