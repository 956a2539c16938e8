"""Ulysses sequence parallelism (ALST) with DeepSpeed's names.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509) and Arctic Long Sequence Training (ALST, Bekman
et al. 2025, arXiv:2506.13996): every rank of a sequence-parallel group holds ``S / sp`` tokens of each
sample. Outside attention every layer is token-wise, so it runs on the local shard. Around attention an
all-to-all turns ``[b, S/sp, h, d]`` (sequence-sharded, all heads) into ``[b, S, h/sp, d]`` (full sequence,
a slice of the heads), attention runs on whole sequences, and the reverse all-to-all restores the
sequence shards. The backward of each all-to-all is the opposite all-to-all. Parameters are replicated
over the group; their gradients are averaged over the sequence x data ranks (the mesh's gradient group).

* :class:`UlyssesSPAttentionHF`: wraps a core attention function (Hugging Face attention-interface
  signature); ``register_with_transformers`` registers it with ``transformers`` and returns the mesh to
  pass as ``mpu=`` to ``dscore.initialize``.
* :class:`UlyssesSPDataLoaderAdapter`: cuts each batch's sequence into the rank's shard and pre-shifts the
  labels (``shift_labels``), so no label crosses a shard boundary.
* :func:`all_gather_differentiable`: gathers per-rank losses / token counts with a summing backward, for
  a loss weighted by unmasked tokens.
* :class:`TiledMLP` / :func:`sequence_tiled_compute`: run a token-wise function over sequence tiles and
  recompute it tile by tile in backward, so only one tile's intermediate activations live at a time.

Uneven splits are refused: the sequence length must be divisible by ``sp`` (pad the batch), the head
counts too (:class:`dscore.errors.ConfigError` naming both numbers).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dscore.errors import ConfigError, DscoreError
from dscore.zero.optimizer import collective_device

__all__ = [
    "as_comm",
    "require_ulysses_attention",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "all_gather_differentiable",
    "heads_to_seq",
    "seq_to_heads",
    "sequence_tiled_compute",
]

log = logging.getLogger("dscore.parallel.ulysses")

# Calls of UlyssesSPAttentionHF.forward in this process (a diagnostic count: the first forward of a
# sequence-parallel model must run at least one, see require_ulysses_attention).
_ATTENTION_CALLS = [0]


def as_comm(group: Any) -> Any:
    """A :class:`dscore.comm.Comm` for ``group``: a Comm as is; a ``torch.distributed`` group wrapped; None is
    the default (world) group, as in ``torch.distributed``."""
    from dscore.comm.facade import Comm

    return group if isinstance(group, Comm) else Comm(group)


def _a2a(x: torch.Tensor, comm: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into ``sp`` chunks, send chunk ``r`` to rank ``r``, concatenate the
    received chunks along ``gather_dim`` (rank order)."""
    sp = int(comm.world_size)
    if sp == 1:
        return x
    chunks = x.chunk(sp, dim=scatter_dim)
    send = torch.stack([c.contiguous() for c in chunks])  # [sp, ...chunk]
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send)
    return torch.cat(list(recv.unbind(0)), dim=gather_dim)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, seq_dim: int, head_dim: int) -> torch.Tensor:
        ctx.comm, ctx.seq_dim, ctx.head_dim = comm, seq_dim, head_dim
        return _a2a(x, comm, scatter_dim=head_dim, gather_dim=seq_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _a2a(grad, ctx.comm, scatter_dim=ctx.seq_dim, gather_dim=ctx.head_dim), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, seq_dim: int, head_dim: int) -> torch.Tensor:
        ctx.comm, ctx.seq_dim, ctx.head_dim = comm, seq_dim, head_dim
        return _a2a(x, comm, scatter_dim=seq_dim, gather_dim=head_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _a2a(grad, ctx.comm, scatter_dim=ctx.head_dim, gather_dim=ctx.seq_dim), None, None, None


def _check_heads(heads: int, sp: int, what: str) -> None:
    if heads % sp != 0:
        raise ConfigError(
            f"{what} = {heads} is not divisible by sequence_parallel_size {sp}: Ulysses gives every rank "
            f"{heads}/{sp} whole heads; use a sequence_parallel_size dividing {heads}",
            path="sequence_parallel_size",
        )


def seq_to_heads(x: torch.Tensor, comm: Any, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Sequence-sharded to head-sharded (differentiable): ``[.., S/sp, .., h, ..]`` -> ``[.., S, .., h/sp, ..]``.

    Raises:
        ConfigError: ``h`` not divisible by the group size.
    """
    _check_heads(int(x.shape[head_dim]), int(comm.world_size), "the number of attention heads")
    out: torch.Tensor = _SeqToHeads.apply(x, comm, seq_dim, head_dim)
    return out


def heads_to_seq(x: torch.Tensor, comm: Any, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Head-sharded back to sequence-sharded (differentiable), the inverse of :func:`seq_to_heads`.

    Raises:
        ConfigError: the full sequence length is not divisible by the group size.
    """
    sp = int(comm.world_size)
    if x.shape[seq_dim] % sp:
        raise ConfigError(
            f"sequence length {x.shape[seq_dim]} is not divisible by sequence_parallel_size {sp}; pad it to a "
            f"multiple of {sp}",
            path="sequence_parallel_size",
        )
    out: torch.Tensor = _HeadsToSeq.apply(x, comm, seq_dim, head_dim)
    return out


class UlyssesSPAttentionHF(torch.nn.Module):
    """Sequence-parallel wrapper of a core attention function (DeepSpeed's class of the same name).

    ``forward(module, query, key, value, attention_mask, *args, **kwargs)`` takes Hugging Face's layout,
    ``[b, heads, S/sp, head_dim]`` per rank, all-to-alls to ``[b, heads/sp, S, head_dim]``, calls
    ``attn(module, q, k, v, None, *args, **kwargs)`` (which returns ``(out [b, S, heads/sp, head_dim],
    weights)``, as transformers' attention functions do) and returns ``(out [b, S/sp, heads, head_dim],
    weights)``. The attention mask is dropped: attention over the full sequence is causal by position
    (pass ``position_ids`` of the global sequence), as in DeepSpeed.

    Args:
        attn: the core attention function.
        local_seq_length / global_seq_length / batch_size: DeepSpeed's shape hints; checked against the
            inputs unless ``seq_length_is_variable``.
        attn_head_count / kv_head_count / attn_head_size: head counts and size (both counts must be
            divisible by the group size).
        num_hidden_layers: accepted for DeepSpeed compatibility (not needed).
        process_group: the sequence-parallel :class:`dscore.comm.Comm` (``mesh.sp_comm``) or its
            ``torch.distributed`` group (``mesh.get_sequence_parallel_group()``).

    Raises:
        ConfigError: head counts not divisible by the group size; an input whose shape disagrees with the
            hints (fixed lengths).
    """

    def __init__(
        self,
        attn: Callable[..., Any],
        local_seq_length: int,
        global_seq_length: int,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = False,
    ) -> None:
        super().__init__()
        self.attn, self.comm = attn, as_comm(process_group)
        self.sp = 1 if self.comm is None else int(self.comm.world_size)
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.batch_size, self.seq_length_is_variable = batch_size, seq_length_is_variable
        self.attn_head_count, self.kv_head_count, self.attn_head_size = attn_head_count, kv_head_count, attn_head_size
        self.num_hidden_layers = num_hidden_layers
        _check_heads(attn_head_count, self.sp, "attn_head_count")
        _check_heads(kv_head_count, self.sp, "kv_head_count")
        if not seq_length_is_variable and global_seq_length != local_seq_length * self.sp:
            raise ConfigError(
                f"global_seq_length {global_seq_length} != local_seq_length {local_seq_length} x sp {self.sp}",
                path="sequence_parallel_size",
            )

    def forward(
        self,
        module: torch.nn.Module | None,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if not self.seq_length_is_variable and query.shape[2] != self.local_seq_length:
            raise ConfigError(
                f"UlyssesSPAttentionHF was built for local_seq_length {self.local_seq_length} but got {query.shape[2]} "
                "tokens; pass seq_length_is_variable=True for variable lengths",
                path="sequence_parallel_size",
            )
        _ATTENTION_CALLS[0] += 1
        if self.sp == 1:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
        q = seq_to_heads(query, self.comm, seq_dim=2, head_dim=1)
        k = seq_to_heads(key, self.comm, seq_dim=2, head_dim=1)
        v = seq_to_heads(value, self.comm, seq_dim=2, head_dim=1)
        out, weights = self.attn(module, q, k, v, None, *args, **kwargs)  # out: [b, S, h/sp, d]
        return heads_to_seq(out, self.comm, seq_dim=1, head_dim=2), weights

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        max_length: int | None = None,
    ) -> Any:
        """Register Ulysses attention with ``transformers`` as ``"ulysses"`` and return the mesh (``mpu``).

        DeepSpeed 0.19.8's signature (Accelerate calls it with these keywords). ``model_name_or_path`` is a
        model (its ``config`` is read) or a name/path for ``AutoConfig``. ``seq_length`` is the global
        sequence length, needed when ``seq_length_is_variable`` is False (every batch then must have it);
        ``max_length`` is its deprecated spelling. Set ``attn_implementation="ulysses"`` on the model config
        and pass the returned mesh as ``dscore.initialize(mpu=...)`` with ``sequence_parallel_size`` in
        ds_config.

        Raises:
            DscoreError: transformers is not installed, or no process group exists.
            ConfigError: ``core_attn_implementation`` is unknown; head counts not divisible by the degree;
                ``seq_length`` missing with ``seq_length_is_variable=False``, or not divisible by the degree;
                ``seq_length`` and ``max_length`` disagree.
        """
        if max_length is not None:
            log.warning("register_with_transformers: max_length is deprecated (as in DeepSpeed); pass seq_length")
            if seq_length is not None and seq_length != max_length:
                raise ConfigError(f"register_with_transformers: seq_length {seq_length} != max_length {max_length}")
            seq_length = max_length
        if seq_length is None and not seq_length_is_variable:
            raise ConfigError(
                "register_with_transformers: seq_length_is_variable=False needs seq_length (the fixed global length)",
                path="sequence_parallel_size",
            )
        try:
            import transformers
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise DscoreError(
                "UlyssesSPAttentionHF.register_with_transformers needs `pip install transformers`"
            ) from exc
        import torch.distributed as dist

        from dscore.comm.facade import Comm
        from dscore.parallel.mesh import ParallelMesh

        if not (dist.is_available() and dist.is_initialized()):
            raise DscoreError("register_with_transformers needs a process group: call dscore.init_distributed() first")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ConfigError(
                f"core_attn_implementation {core_attn_implementation!r} is not one of "
                f"{sorted(ALL_ATTENTION_FUNCTIONS.keys())}"
            )
        cfg = getattr(model_name_or_path, "config", None)
        if cfg is None:
            cfg = transformers.AutoConfig.from_pretrained(model_name_or_path)
        mesh = ParallelMesh.create(Comm(None), sp=int(sequence_parallel_size))
        heads = int(cfg.num_attention_heads)
        wrapper = cls(
            attn=ALL_ATTENTION_FUNCTIONS[core_attn_implementation],
            local_seq_length=(seq_length or 0) // int(sequence_parallel_size),
            global_seq_length=seq_length or 0,
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            kv_head_count=int(getattr(cfg, "num_key_value_heads", None) or heads),
            num_hidden_layers=int(cfg.num_hidden_layers),
            process_group=mesh.sp_comm,
            seq_length_is_variable=seq_length_is_variable,
        )

        def ulysses_attention(
            module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *a: Any, **kw: Any
        ) -> Any:
            return wrapper(module, query, key, value, attention_mask, *a, **kw)

        ALL_ATTENTION_FUNCTIONS.register("ulysses", ulysses_attention)
        return mesh


def require_ulysses_attention(model: torch.nn.Module, sp: int) -> None:
    """Check on ``model``'s first forward that Ulysses attention ran (``dscore.initialize`` installs it when
    ``sequence_parallel_size > 1``): attention over only the local shard would train silently wrong.

    Raises (from that forward):
        ConfigError: no :class:`UlyssesSPAttentionHF` ran during it; says how to install one.
    """
    state: dict[str, Any] = {}

    def pre(module: torch.nn.Module, args: Any) -> None:
        state["before"] = _ATTENTION_CALLS[0]

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        state["pre"].remove()
        state["post"].remove()
        if _ATTENTION_CALLS[0] == state["before"]:
            raise ConfigError(
                f"sequence_parallel_size is {sp} but the model's first forward ran no Ulysses attention, so attention "
                "saw only this rank's shard of the sequence; wrap the core attention in UlyssesSPAttentionHF, or call "
                "UlyssesSPAttentionHF.register_with_transformers(...) and load the model with attn_implementation="
                "'ulysses'",
                path="sequence_parallel_size",
            )

    state["pre"] = model.register_forward_pre_hook(pre)
    state["post"] = model.register_forward_hook(post)


def _all_gather_sum_backward(x: torch.Tensor, comm: Any) -> torch.Tensor:
    return _GatherAll.apply(x, comm)  # type: ignore[no-any-return]


class _GatherAll(torch.autograd.Function):
    """Stacked all-gather ``[world, *x.shape]``; backward sums every rank's gradient for this rank's slot
    (a reduce-scatter, as ``torch.distributed.nn.functional.all_gather``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any) -> torch.Tensor:
        ctx.comm = comm
        x = x.contiguous()
        outs = [torch.empty_like(x) for _ in range(int(comm.world_size))]
        comm.all_gather(outs, x)
        return torch.stack(outs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad[int(ctx.comm.rank)], None


def all_gather_differentiable(tensor: torch.Tensor, comm: Any) -> torch.Tensor:
    """Every rank's ``tensor`` stacked (``[world, *shape]``), differentiable.

    The backward sums, over the group, the gradient each rank computed for this rank's entry. With a loss
    every sequence-parallel rank computes identically (the token-weighted mean of the per-rank losses), the
    engine's average over the sequence x data ranks then gives exactly the gradient of that loss::

        losses = all_gather_differentiable(local_mean_loss, mesh.sp_comm)
        counts = all_gather_differentiable(local_valid_tokens.float(), mesh.sp_comm)
        loss = (losses * counts).sum() / counts.sum()
    """
    comm = as_comm(comm)
    if comm is None or int(comm.world_size) == 1:
        return tensor.unsqueeze(0)
    return _all_gather_sum_backward(tensor, comm)


class UlyssesSPDataLoaderAdapter:
    """Iterate ``dl`` yielding this rank's sequence shard of every batch (DeepSpeed's class of the same name).

    Each batch is a dict with ``input_ids`` ``[b, S]`` and optionally ``labels``, ``position_ids``,
    ``attention_mask`` and other ``[b, S]`` tensors. Labels are shifted on the full sequence first
    (``shift_labels[:, i] = labels[:, i + 1]``, ``-100`` at the end) so no target crosses a shard boundary;
    the yielded dict holds ``shift_labels`` instead of ``labels``, ``position_ids`` of the global sequence
    (created as ``arange(S)`` when missing), and no ``attention_mask`` (attention is causal by position).

    Stricter than DeepSpeed, which all-gathers the different batches the ranks of a group received and
    yields ``sp`` shards per batch: dscore requires every rank of the group to receive the same batch
    (the engine's loader shards over data-parallel ranks only) and checks it on the first batch.

    Raises (while iterating):
        ConfigError: ``S`` not divisible by ``sp_world_size`` (pad the batch to a multiple).
        DscoreError: the ranks of the group received different first batches.
    """

    def __init__(self, dl: Iterable[Any], sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.comm, self.sp = dl, int(sp_rank), as_comm(sp_group), int(sp_world_size)
        if self.comm is not None and int(self.comm.world_size) != self.sp:
            raise ConfigError(
                f"UlyssesSPDataLoaderAdapter: sp_world_size {self.sp} but the group has {self.comm.world_size} ranks",
                path="sequence_parallel_size",
            )
        self.device = torch.device(device) if device is not None else None
        self._checked = False

    def __len__(self) -> int:
        return len(self.dl)  # type: ignore[arg-type]

    def _check_same(self, batch: dict[str, Any]) -> None:
        if self.comm is None or self.sp == 1:
            return
        ids = batch["input_ids"]
        mine = torch.stack(
            [
                ids.double().sum(),
                (ids.double().flatten() * torch.arange(ids.numel(), device=ids.device)).sum(),
                torch.tensor(float(ids.numel()), dtype=torch.float64, device=ids.device),
            ]
        ).to(collective_device([ids], device=self.device))  # a loader's batch is on the host; NCCL needs the device

        outs = [torch.empty_like(mine) for _ in range(self.sp)]
        self.comm.all_gather(outs, mine)
        if not all(torch.equal(outs[0], o) for o in outs[1:]):
            raise DscoreError(
                "the ranks of a sequence-parallel group received different batches; every rank of the group must "
                "get the same batch (shard the data over data-parallel ranks only, as engine.training_dataloader does)"
            )

    def shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's shard of one batch (see the class docstring)."""
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise DscoreError("UlyssesSPDataLoaderAdapter needs batches that are dicts with an 'input_ids' tensor")
        ids = batch["input_ids"]
        b, s = ids.shape[0], ids.shape[-1]
        if s % self.sp:
            raise ConfigError(
                f"sequence length {s} is not divisible by sequence_parallel_size {self.sp}; pad every batch to a "
                f"multiple of {self.sp} (labels -100 on the padding)",
                path="sequence_parallel_size",
            )
        out: dict[str, Any] = {}
        full = dict(batch)
        full.pop("attention_mask", None)
        if "position_ids" not in full:
            full["position_ids"] = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
        if "labels" in full:
            labels = full.pop("labels")
            full["shift_labels"] = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)
        chunk = s // self.sp
        lo, hi = self.sp_rank * chunk, (self.sp_rank + 1) * chunk
        for key, value in full.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == s:
                value = value[..., lo:hi].contiguous()
            if isinstance(value, torch.Tensor) and self.device is not None:
                value = value.to(self.device)
            out[key] = value
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.dl:
            if not self._checked:
                self._check_same(batch)
                self._checked = True
            yield self.shard(batch)


@dataclass(frozen=True)
class _TileSpec:
    fn: Callable[..., torch.Tensor]
    module: Any
    shards: int
    dim: int
    params: tuple[torch.nn.Parameter, ...]


class _Tiled(torch.autograd.Function):
    """Forward ``fn`` tile by tile without keeping graphs; backward recomputes each tile with grad."""

    @staticmethod
    def forward(ctx: Any, spec: _TileSpec, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.spec = spec
        ctx.save_for_backward(x)
        with torch.no_grad():
            if spec.shards == 1:  # one tile: the output may be anything (a scalar loss)
                return spec.fn(spec.module, x)
            outs = [spec.fn(spec.module, piece) for piece in x.chunk(spec.shards, dim=spec.dim)]
        return torch.cat(outs, dim=spec.dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        spec: _TileSpec = ctx.spec
        (x,) = ctx.saved_tensors
        need_x = bool(ctx.needs_input_grad[1])
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
        param_grads: list[torch.Tensor | None] = [None] * len(spec.params)
        x_grads: list[torch.Tensor] = []
        if spec.shards == 1:
            tiles = [(x.detach(), grad)]
        else:
            tiles = list(zip(x.detach().chunk(spec.shards, dim=spec.dim), grad.chunk(spec.shards, dim=spec.dim)))
        for piece, g in tiles:
            piece = piece.detach().requires_grad_(need_x)
            with torch.enable_grad():
                out = spec.fn(spec.module, piece)
            inputs = ([piece] if need_x else []) + [spec.params[i] for i in wanted]
            if not inputs:
                continue
            got = torch.autograd.grad(out, inputs, g, allow_unused=True)
            if need_x:
                x_grads.append(got[0] if got[0] is not None else torch.zeros_like(piece))
                got = got[1:]
            for i, gi in zip(wanted, got):
                if gi is not None:
                    acc = param_grads[i]
                    param_grads[i] = gi if acc is None else acc + gi
        x_grad = torch.cat(x_grads, dim=spec.dim) if need_x else None
        return (None, x_grad, *param_grads)


class TiledMLP:
    """DeepSpeed's ``TiledMLP``: ``TiledMLP.apply(fn, module, x, shards, compute_params)``.

    Computes ``fn(module, x)`` (a token-wise function, usually an MLP's forward) over ``shards`` tiles of the
    sequence dim (dim -2 of ``[b, S, h]``): the forward keeps no intermediate activations, the backward
    recomputes each tile and accumulates the gradients of ``compute_params`` (the module's parameters) and
    of ``x``. Outputs equal the untiled function's; parameter gradients are sums over tiles.
    """

    @staticmethod
    def apply(
        fn: Callable[..., torch.Tensor],
        module: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Iterable[torch.nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """Run ``fn(module, x)`` tiled (see the class docstring).

        Raises:
            ConfigError: ``shards`` below 1.
        """
        if int(shards) < 1:
            raise ConfigError(f"TiledMLP: shards must be at least 1, got {shards}")
        params = [p for p in (compute_params if compute_params is not None else module.parameters()) if p.requires_grad]
        return _tiled(fn, module, x, int(shards), x.dim() - 2, params)


def _tiled(
    fn: Callable[..., torch.Tensor],
    module: Any,
    x: torch.Tensor,
    shards: int,
    dim: int,
    params: list[torch.nn.Parameter],
) -> torch.Tensor:
    spec = _TileSpec(fn, module, shards, dim, tuple(params))
    result: torch.Tensor = _Tiled.apply(spec, x, *params)
    return result


def sequence_tiled_compute(
    fn: Callable[..., Any],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, torch.Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Iterable[torch.nn.Parameter] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """DeepSpeed's ``SequenceTiledCompute``: ``fn(**tile_kwargs, **kwargs_to_pass)`` over sequence tiles.

    Each tensor of ``kwargs_to_shard`` is cut along dim 1 (its sequence dim, length ``seqlen``) into
    ``shards`` tiles; ``fn`` runs per tile without keeping its graph and is recomputed per tile in the
    backward. The per-tile outputs are concatenated along ``output_unshard_dimension``
    (``output_reduction=None``), or combined as their ``"sum"`` or ``"mean"`` (mean weights every tile by
    its length, so it equals ``fn`` over the whole sequence for a per-token mean such as a loss).

    Raises:
        ConfigError: a sharded tensor's dim 1 is not ``seqlen``; ``output_reduction`` unknown.
    """
    if output_reduction not in (None, "sum", "mean"):
        raise ConfigError(
            f"sequence_tiled_compute: output_reduction must be None, 'sum' or 'mean', got {output_reduction!r}"
        )
    for key, t in kwargs_to_shard.items():
        if t.shape[1] != seqlen:
            raise ConfigError(
                f"sequence_tiled_compute: {key} has {t.shape[1]} positions on dim 1, expected seqlen {seqlen}"
            )
    x = kwargs_to_shard[grad_requiring_tensor_key]
    others = {k: v for k, v in kwargs_to_shard.items() if k != grad_requiring_tensor_key}
    step = math.ceil(seqlen / shards)
    params = [p for p in (compute_params or []) if p.requires_grad]
    outs = []
    weights = []
    for lo in range(0, seqlen, step):
        hi = min(seqlen, lo + step)

        def tile_fn(_module: Any, piece: torch.Tensor, lo: int = lo, hi: int = hi) -> torch.Tensor:
            tile = {k: v[:, lo:hi] for k, v in others.items()}
            out: torch.Tensor = fn(**{grad_requiring_tensor_key: piece}, **tile, **kwargs_to_pass)
            return out

        piece = x[:, lo:hi]
        outs.append(_tiled(tile_fn, None, piece, 1, 1, params))
        weights.append(hi - lo)
    if output_reduction is None:
        return torch.cat(outs, dim=output_unshard_dimension)
    total = (
        torch.stack(outs).sum(0) if output_reduction == "sum" else sum(o * (w / seqlen) for o, w in zip(outs, weights))
    )
    assert isinstance(total, torch.Tensor)
    return total
