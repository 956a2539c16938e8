"""The bucketed gradient reducer shared by every ZeRO stage (0-3) and open to third-party stages.

A stage decides *which* parameters share a bucket (its bucketing policy) and *where* each bucket's
reduced gradient goes; :class:`GradientReducer` does the rest, the way DDP's reducer does:

* **Readiness from autograd.** :meth:`GradientReducer.register_hooks` puts one
  ``register_post_accumulate_grad_hook`` on every trainable parameter. The hook is the only
  per-parameter Python work of a backward: a dict lookup, a counter, and (for staged buckets) one copy of
  the gradient into the bucket's staging buffer, after which ``p.grad`` may be freed.
* **Asynchronous launch as buckets fill.** Between :meth:`begin` (``launch=True``) and :meth:`end`, a
  bucket whose parameters all have their gradient is launched at once as one asynchronous
  :class:`dscore.comm.Comm` collective (``overlap_comm``). ``ordered=True`` launches strictly in bucket
  index order on every rank, so collectives match even when ranks see gradients in different orders
  or some parameters get none; ``ordered=False`` launches each bucket when it is ready (stage 3, whose
  units are ready in the same order on every rank). :meth:`flush` launches what is left (all of it
  without ``overlap_comm``) and waits.
* **No extra copies.** A bucket either *owns* a persistent gradient buffer (``grad=``; the stage makes
  ``p.grad`` views into it, so autograd accumulates in place and the collective reads it directly) or is
  *staged* (gradients are copied into a pooled buffer, at the hook or at launch). A reduce-scatter writes
  straight into the bucket's ``target`` chunk when it can (same dtype/device, first reduction of the
  window); otherwise into a temporary that is copied or added into ``target`` when the work finishes.
  At most ``max_inflight`` buckets are in flight (0: no limit), which bounds staging memory.

Numerics: sums of the same gradients as each stage computed before the reducer existed (each element is
reduced once per collective; buckets only group elements), so results are bitwise those of the stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dscore.comm.facade import Work
from dscore.zero.layout import packed_offsets

if TYPE_CHECKING:
    from dscore.comm import Comm

__all__ = ["GradientReducer", "ReduceBucket", "comm_dtype_of", "gradient_divisors"]

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def comm_dtype_of(name: str | None) -> torch.dtype | None:
    """``communication_data_type`` (``"fp32"``/``"fp16"``/``"bf16"`` or None) as a torch dtype (None: reduce
    in the gradients' own dtype)."""
    return None if name is None else _COMM_DTYPES[name]


def gradient_divisors(
    *, op: str, prescale: bool, predivide: float, world: int, default: tuple[float, float]
) -> tuple[float, float]:
    """``(pre, post)``: divide gradients by ``pre`` before the sum across ranks and by ``post`` after it.

    DeepSpeed 0.19.8's rules (``DeepSpeedEngine.allreduce_bucket``, ``gradient_reduction_w_predivide``):
    ``gradient_allreduce_op: "sum"`` divides by nothing; ``prescale_gradients: true`` divides by the world
    size before the sum (``gradient_predivide_factor`` unused); otherwise a ``gradient_predivide_factor``
    f != 1 divides by f before and by world/f after. With neither key the stage's own ``default`` order is
    used (both give the mean; they differ only in rounding and fp16 headroom).

    Args:
        op: ``gradient_allreduce_op`` (``"mean"`` or ``"sum"``).
        prescale: ``prescale_gradients``.
        predivide: ``gradient_predivide_factor`` (> 0).
        world: data-parallel world size.
        default: the stage's ``(pre, post)`` for a plain mean.
    """
    if world <= 1 or op == "sum":
        return 1.0, 1.0
    if prescale:
        return float(world), 1.0
    if predivide != 1.0:
        return float(predivide), world / float(predivide)
    return default


class ReduceBucket:
    """One bucket: parameters whose gradients are reduced together by one collective.

    Layout: the parameters' gradients lie back to back (``offsets[k]``, ``numels[k]`` elements), then
    zero padding up to ``padded = chunk * pad_to`` elements (``pad_to``: the world size for a
    reduce-scatter, 1 for an all-reduce).

    Args:
        params: the parameters, in layout order.
        pad_to: pad to a multiple of this (the world size for reduce-scatter buckets).
        dtype, device: of the gradients (default: the first parameter's).
        grad: a persistent 1-D buffer of ``padded`` elements the stage made ``p.grad`` views into (the
            bucket then reduces it in place), or None for a staged bucket.
        target: where this rank's reduced chunk goes (``chunk`` elements, any dtype/device), or None to
            keep the all-reduced result in the input buffer (stage 0).
        numels: element counts when ``p.numel()`` cannot be trusted (parameters already released).

    Attributes (set by the reducer during a backward): ``ready`` (parameters whose gradient arrived),
    ``launched``, ``staging``, ``got`` (per parameter: copied into staging this window).
    Stages may subclass to keep their own per-bucket data.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        pad_to: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        grad: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
        numels: Sequence[int] | None = None,
    ) -> None:
        self.index = -1
        self.params = list(params)
        self.numels = [int(n) for n in numels] if numels is not None else [p.numel() for p in self.params]
        self.offsets, self.numel = packed_offsets(self.numels)
        self.chunk = max(1, -(-self.numel // pad_to))
        self.padded = self.chunk * pad_to if pad_to > 1 else self.numel
        first = self.params[0]
        self.dtype = dtype if dtype is not None else first.dtype
        self.device = device if device is not None else first.device
        self.grad = grad
        self.target = target
        self.expected = sum(1 for p in self.params if p.requires_grad)
        self.ready = 0
        self.launched = False
        self.staging: torch.Tensor | None = None
        self.got: list[bool] = [False] * len(self.params)
        self.work: Work | None = None
        self.out: torch.Tensor | None = None
        self.converted: torch.Tensor | None = None
        #: launched only by :meth:`GradientReducer.flush` (in bucket order), never from a hook: for buckets
        #: a rank may not fill in every backward (a ZeRO-3 leaf module's experts)
        self.defer = False


class GradientReducer:
    """Reduces :class:`ReduceBucket` s over a :class:`dscore.comm.Comm` (see the module docstring).

    Args:
        comm: the data-parallel group's comm.
        buckets: every bucket, in launch order (their ``index`` is set here).
        reduce_scatter: True: reduce-scatter into each bucket's ``target`` chunk; False: all-reduce (the
            result stays in the input, or this rank's chunk of it is copied/added into ``target``).
        copy_on_hook: staged buckets copy each gradient into staging in the hook (False: at launch).
        free_grads: set ``p.grad = None`` once a gradient was copied into staging (partitioned
            gradients: the full gradient never exists at once).
        ordered: launch in bucket order only (False: each bucket as soon as it is ready).
        max_inflight: at most this many buckets in flight (0: no limit).
        max_message: all-reduce a large owned bucket in pieces of at most this many elements (0: whole).
        on_launched: called with each bucket right after its collective started (stage 3 releases the
            gathered unit there).
        comm_dtype: reduce in this dtype (``communication_data_type``; None: the gradients' dtype). Staged
            buckets stage in it; an owned buffer of another dtype is converted at launch and the reduced
            values copied back when the work finishes.
        reduce_scatter_fn: ``fn(output, input) -> Work`` replacing ``comm.reduce_scatter_tensor`` for
            reduce-scatter buckets (ZeRO++ qgZ: the ``zero_feature:qgz`` unit's quantized reduce-scatter); its output
            is in the target's dtype, so the sum reaches an fp32 target unrounded.

    Raises:
        ValueError: a parameter is in two buckets, or a reduce-scatter bucket has no ``target``.
    """

    def __init__(
        self,
        comm: Comm,
        buckets: Sequence[ReduceBucket],
        *,
        reduce_scatter: bool,
        copy_on_hook: bool = True,
        free_grads: bool = False,
        ordered: bool = True,
        max_inflight: int = 2,
        max_message: int = 0,
        on_launched: Callable[[ReduceBucket], None] | None = None,
        comm_dtype: torch.dtype | None = None,
        reduce_scatter_fn: Callable[[torch.Tensor, torch.Tensor], Work] | None = None,
    ) -> None:
        self.comm = comm
        self.reduce_scatter_fn = reduce_scatter_fn
        self.rank = comm.rank
        self.world = comm.world_size
        self.buckets = list(buckets)
        self.reduce_scatter = reduce_scatter
        self.copy_on_hook = copy_on_hook
        self.free_grads = free_grads
        self.ordered = ordered
        self.max_inflight = max_inflight
        self.max_message = max_message
        self.on_launched = on_launched
        self.comm_dtype = comm_dtype
        if comm_dtype is not None:
            for b in self.buckets:
                if b.grad is None:
                    b.dtype = comm_dtype
        self._where: dict[int, tuple[ReduceBucket, int]] = {}
        for i, b in enumerate(self.buckets):
            b.index = i
            if reduce_scatter and b.target is None:
                raise ValueError(f"reduce-scatter bucket {i} needs a target chunk")
            for k, p in enumerate(b.params):
                if id(p) in self._where:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two reduce buckets")
                self._where[id(p)] = (b, k)
        self._pool: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._inflight: list[ReduceBucket] = []
        self._next = 0
        self._launching = False
        self.prescale = 1.0
        self.accumulate = False
        self.timed = False
        #: seconds spent copying gradients into staging in hooks / launching collectives since :meth:`begin`
        self.copy_seconds = 0.0
        self.launch_seconds = 0.0

    # ------------------------------------------------------------------ hooks
    def register_hooks(self, params: Sequence[torch.nn.Parameter] | None = None) -> list[Any]:
        """Register :meth:`grad_ready` as a post-accumulate-grad hook on ``params`` (default: every trainable
        parameter of every bucket). Returns the hook handles."""
        targets = params if params is not None else [p for b in self.buckets for p in b.params if p.requires_grad]
        return [p.register_post_accumulate_grad_hook(self.grad_ready) for p in targets]

    def grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: count ``p``, stage its gradient, launch what became ready."""
        b, k = self._where[id(p)]
        if b.grad is None and self.copy_on_hook:
            t0 = time.perf_counter() if self.timed else 0.0
            if b.staging is None:
                b.staging = self._acquire(b)
            off = b.offsets[k]
            b.staging[off : off + b.numels[k]].copy_(p.grad.reshape(-1))  # type: ignore[union-attr]
            b.got[k] = True
            if self.free_grads:
                p.grad = None
            if self.timed:
                self.copy_seconds += time.perf_counter() - t0
        b.ready += 1
        if not self._launching or b.ready < b.expected:
            return
        if not self.ordered:
            if not b.defer:
                self.launch(b)
            return
        buckets = self.buckets
        while self._next < len(buckets):
            nb = buckets[self._next]
            if nb.ready < nb.expected or nb.defer:
                break
            self.launch(nb)
            self._next += 1

    # ------------------------------------------------------------------ window
    def begin(self, *, launch: bool, prescale: float = 1.0, accumulate: bool = False, timed: bool = False) -> None:
        """Start a backward: reset readiness; with ``launch`` the hooks launch buckets as they fill.

        Args:
            launch: overlap reduction with this backward (``overlap_comm`` and a reducing micro step).
            prescale: divide each bucket's input by this before reducing (1: nothing).
            accumulate: add reduced chunks into ``target`` (False: overwrite it).
            timed: measure :attr:`copy_seconds` / :attr:`launch_seconds`.
        """
        for b in self.buckets:
            b.ready = 0
            b.launched = False
        self._next = 0
        self._launching = launch
        self.prescale = prescale
        self.accumulate = accumulate
        self.timed = timed
        self.copy_seconds = 0.0
        self.launch_seconds = 0.0

    def end(self) -> None:
        """Stop launching from hooks (backward finished)."""
        self._launching = False

    def flush(self) -> None:
        """Launch every bucket not launched yet (in bucket order) and wait for all of them.

        Consecutive unlaunched buckets that own adjacent slices of one gradient buffer and keep their
        result in place (stage 0) go out as one region, cut into ``max_message`` pieces from its start:
        without ``overlap_comm`` that is one message per ``max_message`` elements of the whole buffer.
        """
        pending = [b for b in self.buckets if not b.launched]
        i = 0
        while i < len(pending):
            b = pending[i]
            j = i + 1
            if b.target is None and b.grad is not None and not self._converts(b):
                lo = b.grad
                while j < len(pending) and _precedes(pending[j], lo):
                    lo = pending[j].grad  # type: ignore[assignment]
                    j += 1
            if j - i == 1:
                self.launch(b)
            else:
                self._launch_region(pending[i:j])
            i = j
        self.wait_all()

    def _launch_region(self, run: list[ReduceBucket]) -> None:
        """Launch adjacent owned buckets (``run[k + 1]`` just before ``run[k]`` in memory) as one region."""
        first, last = run[0], run[-1]
        assert first.grad is not None and last.grad is not None
        base = last.grad
        region = base.as_strided((sum(b.padded for b in run),), (1,), base.storage_offset())
        if self.prescale != 1.0:
            region.div_(self.prescale)
        step = self.max_message or region.numel()
        works = [
            self.comm.all_reduce(region[a : min(region.numel(), a + step)], op="sum", async_op=True)
            for a in range(0, region.numel(), step)
        ]
        for b in run:
            b.launched = True
        first.work = works[0] if len(works) == 1 else Work(works)
        first.out = None
        self._inflight.append(first)

    def wait_all(self) -> None:
        """Finish every in-flight bucket (results written into their targets)."""
        while self._inflight:
            self._finish(self._inflight.pop(0))

    def reset(self) -> None:
        """Drop a window without using it: wait for in-flight collectives, discard their results and
        return staging buffers to the pool."""
        while self._inflight:
            b = self._inflight.pop(0)
            assert b.work is not None
            b.work.wait()
            b.work, b.out, b.converted = None, None, None
        for b in self.buckets:
            self._recycle(b)
            b.launched = False
            b.ready = 0

    def buffers(self) -> list[torch.Tensor]:
        """Every gradient buffer the reducer holds: pooled and current staging buffers and the buckets'
        own gradient buffers (what ``engine.offload_states`` calls ``contiguous_grad_buffer``)."""
        out = [buf for pool in self._pool.values() for buf in pool]
        out += [b.staging for b in self.buckets if b.staging is not None]
        out += [b.grad for b in self.buckets if b.grad is not None]
        return out

    # ------------------------------------------------------------------ launch / finish
    def launch(self, b: ReduceBucket) -> None:
        """Start ``b``'s collective now (asynchronously); no-op when already launched this window."""
        if b.launched:
            return
        t0 = time.perf_counter() if self.timed else 0.0
        if self.max_inflight:
            while len(self._inflight) >= self.max_inflight:
                self._finish(self._inflight.pop(0))
        inp = self._input(b)
        if self._converts(b):
            inp = inp.to(self.comm_dtype)  # type: ignore[arg-type]
            b.converted = inp
        if self.prescale != 1.0:
            inp.div_(self.prescale)
        comm = self.comm
        target = b.target
        if target is None:  # all-reduce in place, result stays in the input
            step = self.max_message or b.padded
            works = [
                comm.all_reduce(inp[a : min(b.padded, a + step)], op="sum", async_op=True)
                for a in range(0, b.padded, step)
            ]
            b.work = works[0] if len(works) == 1 else Work(works)
            b.out = inp if b.converted is not None else None  # copied back into the owned buffer
        elif self.reduce_scatter:
            rs_fn = self.reduce_scatter_fn
            out_dtype = inp.dtype if rs_fn is None else target.dtype
            direct = not self.accumulate and target.dtype == out_dtype and target.device == inp.device
            out = target if direct else torch.empty(b.chunk, dtype=out_dtype, device=inp.device)
            if rs_fn is None:
                b.work = comm.reduce_scatter_tensor(out, inp, async_op=True, input_reusable=True)
            else:
                b.work = rs_fn(out, inp)
            b.out = None if direct else out
        else:
            b.work = comm.all_reduce(inp, op="sum", async_op=True)
            b.out = inp[self.rank * b.chunk : (self.rank + 1) * b.chunk]
        b.launched = True
        self._inflight.append(b)
        if self.on_launched is not None:
            self.on_launched(b)
        if self.timed:
            self.launch_seconds += time.perf_counter() - t0

    def _input(self, b: ReduceBucket) -> torch.Tensor:
        if b.grad is not None:
            return b.grad
        if b.staging is None:
            b.staging = self._acquire(b)
        staging = b.staging
        if not self.copy_on_hook:
            for k, (p, off, n) in enumerate(zip(b.params, b.offsets, b.numels)):
                if p.grad is not None:
                    staging[off : off + n].copy_(p.grad.reshape(-1))
                    b.got[k] = True
                    if self.free_grads:
                        p.grad = None
        if not all(b.got):  # parameters without a gradient contribute zeros
            for k, (off, n) in enumerate(zip(b.offsets, b.numels)):
                if not b.got[k]:
                    staging[off : off + n].zero_()
        return staging

    def _finish(self, b: ReduceBucket) -> None:
        assert b.work is not None
        b.work.wait()
        b.work = None
        out, b.out = b.out, None
        b.converted = None
        target = b.target
        if out is not None and target is None and b.grad is not None:
            b.grad.copy_(out)
        elif out is not None and target is not None and out.data_ptr() != target.data_ptr():
            if self.accumulate:
                if out.device != target.device:
                    # a host target (optimizer offload) accumulates the device result: copy it over first
                    # (device and host tensors cannot meet in one add)
                    out = out.to(target.device)
                target.add_(out)
            else:
                target.copy_(out)
        self._recycle(b)

    def _converts(self, b: ReduceBucket) -> bool:
        """An owned buffer reduced in another dtype (``comm_dtype``)."""
        return b.grad is not None and self.comm_dtype is not None and b.grad.dtype != self.comm_dtype

    def _acquire(self, b: ReduceBucket) -> torch.Tensor:
        """A staging buffer of ``b.padded`` elements from the pool (padding zeroed, the rest undefined)."""
        pool = self._pool.get((b.padded, b.dtype, b.device))
        buf = pool.pop() if pool else torch.empty(b.padded, dtype=b.dtype, device=b.device)
        if b.numel < b.padded:
            buf[b.numel :].zero_()
        b.got = [False] * len(b.params)
        return buf

    def _recycle(self, b: ReduceBucket) -> None:
        if b.staging is None:
            return
        pool = self._pool.setdefault((b.padded, b.dtype, b.device), [])
        if len(pool) < max(2, self.max_inflight):
            pool.append(b.staging)
        b.staging = None


def _precedes(b: ReduceBucket, start: torch.Tensor) -> bool:
    """True when ``b`` owns the slice of the same buffer that ends exactly where ``start`` begins."""
    g = b.grad
    return (
        b.target is None
        and g is not None
        and not b.launched
        and g.untyped_storage().data_ptr() == start.untyped_storage().data_ptr()
        and g.dtype == start.dtype
        and g.storage_offset() + g.numel() == start.storage_offset()
    )
