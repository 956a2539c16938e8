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
  labels (``shift_labels``), so no label crosses a shard boundary; batches that differ across the group's
  ranks are all-gathered first (DeepSpeed's semantics), one shared batch is sharded once.
* :func:`all_gather_differentiable`: gathers per-rank losses / token counts with a summing backward, for
  a loss weighted by unmasked tokens.
* :class:`TiledMLP` / :func:`sequence_tiled_compute`: run a token-wise function over sequence tiles and
  recompute it tile by tile in backward, so only one tile's intermediate activations live at a time.

Uneven splits are refused: the sequence length must be divisible by ``sp`` (pad the batch), the head
counts too (:class:`dscore.errors.ConfigError` naming both numbers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from dscore.errors import ConfigError, DscoreError

__all__ = ["as_comm", "heads_to_seq", "require_ulysses_attention", "seq_to_heads", "UlyssesSPAttentionHF"]

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
        ``max_length`` is its deprecated spelling. A model passed in (not a name) is switched to
        ``attn_implementation="ulysses"`` here (its attention must be ``core_attn_implementation``, as DeepSpeed
        checks; DeepSpeed instead replaces that implementation's registry entry for every model in the process);
        a model loaded later from the name needs ``attn_implementation="ulysses"``. Pass the returned mesh as
        ``dscore.initialize(mpu=...)``.

        Raises:
            DscoreError: transformers is not installed, or no process group exists.
            ConfigError: ``core_attn_implementation`` is unknown or not the given model's; head counts not divisible by the degree;
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
            hint = (
                " (Accelerate passes its DeepSpeedSequenceParallelConfig(sp_attn_implementation=...), unset by "
                "default: set it to the model's attention, e.g. 'sdpa')"
                if core_attn_implementation is None
                else ""
            )
            raise ConfigError(
                f"core_attn_implementation {core_attn_implementation!r} is not one of "
                f"{sorted(ALL_ATTENTION_FUNCTIONS.keys())}{hint}"
            )
        cfg = getattr(model_name_or_path, "config", None)
        loaded = cfg is not None
        if loaded:
            current = getattr(cfg, "_attn_implementation", None)
            if current is not None and current not in (core_attn_implementation, "ulysses"):
                raise ConfigError(
                    f"register_with_transformers: core_attn_implementation {core_attn_implementation!r} but the model "
                    f"runs attn_implementation {current!r}; set both to the same value (as DeepSpeed requires)"
                )
        else:
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
        if loaded and hasattr(model_name_or_path, "set_attn_implementation"):
            # DeepSpeed swaps the core implementation's entry process-wide, so a model it was given runs Ulysses
            # without further ado (Accelerate relies on that); dscore switches only this model to "ulysses"
            model_name_or_path.set_attn_implementation("ulysses")
        from dscore.parallel.groups import note_mesh

        note_mesh(mesh)  # deepspeed.utils.groups reads it until an engine is built (policy process_mesh)
        return mesh


def require_ulysses_attention(model: torch.nn.Module, sp: int) -> None:
    """Check on ``model``'s first forward that Ulysses attention ran (``dscore.initialize`` installs it when
    ``sequence_parallel_size > 1``): attention over only the local shard would train silently wrong.

    Raises (from that forward):
        ConfigError: no :class:`UlyssesSPAttentionHF` ran during it; says how to install one.
    """
    state: dict[str, Any] = {}

    def pre(module: torch.nn.Module, args: Any) -> None:
        if not state.get("done"):
            state["before"] = _ATTENTION_CALLS[0]

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        if state.get("done"):
            return
        state["done"] = True
        if not torch.compiler.is_compiling():
            # a traced graph cannot hold a handle made in another frame (a graph break): compiled, the two
            # hooks stay, returning at once from now on
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
