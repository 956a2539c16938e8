"""``torch.compile`` for engines: ``engine.compile()`` and ``dscore.initialize(model=torch.compile(model))``.

DeepSpeed 0.19.8's ``engine.compile(backend, compile_kwargs, schedule, compiled_autograd_enabled)`` compiles
the wrapped module in place (``module.compile(**compile_kwargs, backend=backend)``), does nothing when called
again, warns when ``compile_kwargs`` holds a ``backend`` (the argument wins), takes ``schedule`` only for
DeepCompile and, with ``compiled_autograd_enabled``, runs ``loss.backward()`` under
``torch._dynamo.compiled_autograd._enable(torch.compile(backend=<accelerator default>, **compile_kwargs))``.

dscore keeps those semantics with two documented differences:

* The in-place compile goes through one extra frame defined here (:func:`_through`) instead of
  ``nn.Module.compile``: torch 2.13 treats ``nn.Module._call_impl`` of a module built only from torch.nn
  classes (an ``nn.Sequential`` of ``nn.Linear``) as skipped code, so ``module.compile()`` captures no graph
  at all unless a Python hook sits on the module. The extra frame makes dynamo inline ``_call_impl``, so a
  graph is captured for every module and the module's own hooks are traced with it. The result is installed
  where ``nn.Module.compile`` puts it (``module._compiled_call_impl``), so ``engine.module(...)`` runs
  compiled too and ``state_dict`` keys stay those of the plain module.
* ``initialize(model=torch.compile(model))``: DeepSpeed wraps the ``OptimizedModule`` itself (its
  checkpoints then carry ``_orig_mod.`` key prefixes). dscore unwraps it: the engine's module is the original
  module (ZeRO hooks, parameters and checkpoint keys are the plain model's) and the ``OptimizedModule``'s own
  dynamo context (same backend and options) is installed in place on it, as :meth:`engine.compile` would.
  The engine then reports ``is_compiled`` and a later ``engine.compile()`` is a no-op.

A :class:`dscore.pipe.PipelineModule` is compiled layer by layer (DeepSpeed 0.19.8's
``PipelineModule.compile``): each ``nn.Module`` layer in place as above, each function layer replaced by its
compiled version. The stage's own loop over its layers (and activation checkpointing between them) stays
eager, so a graph is produced per layer and no graph spans a pipeline send/receive.

ZeRO-3 under compile (issue 41 item 2), the design chosen: **one eager region per ZeRO unit**. The stage-3
gather/release hooks (``dscore_plugins.zero.coordinator.ModuleHook``) run under ``torch.compiler.disable``,
so the user's graph breaks at each hooked module's hooks (pre- and post-forward share one region boundary;
the root module's post-forward hook adds one): measured on a 2-layer Llama, 22 breaks for 21 hooked modules,
what DeepSpeed 0.19.8 does too (its coordinator is disabled the same way). The released-parameter guard
(:mod:`dscore.zero.released`) lets dynamo's fake-tensor probing through (it reads metadata only), so a graph
may hold a released parameter whose shape alone it uses; a real use still raises
``PartitionedParameterError``. 0 breaks would need FSDP2's approach: the pre-forward gather written as a
traceable function (functional all-gather into a pre-allocated flat buffer, ``torch.ops.fsdp``-style
copy-in/split ops registered as custom ops, the released/gathered state held in tensors rather than in
Python objects and a Python class swap) and backward reduce hooks that compiled autograd can trace. The
coordinator's policy (prefetch order, LRU eviction under ``max_live_parameters``, reuse distance) is Python
control flow on counters that would specialise and recompile every step, so it would first have to become a
static per-graph schedule, which is what DeepCompile does as a graph pass. Not done here: the per-unit
bound is what DeepSpeed offers, keeps every ZeRO-3 option (offload, NVMe, ZeRO++) working unchanged, and
is exact.

DeepCompile (``compile.deepcompile``) is not implemented (the config block is refused key by key, see
docs/config-keys.md), so a non-None ``schedule`` is refused with a :class:`dscore.errors.ConfigError`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from dscore.errors import ConfigError

__all__ = ["CompileState", "compile_in_place", "unwrap_compiled"]

log = logging.getLogger(__name__)


def _through(call_impl: Callable[..., Any]) -> Callable[..., Any]:
    # a frame in a file dynamo traces, so ``_call_impl`` (torch.nn code, skipped as a top frame) is inlined
    def call(*args: Any, **kwargs: Any) -> Any:
        return call_impl(*args, **kwargs)

    return call


def compile_in_place(module: torch.nn.Module, compiler: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Make ``module(...)`` run ``compiler(<module's call>)`` from now on (``nn.Module.compile``'s slot).

    Args:
        module: the module to compile; its parameters, hooks and ``state_dict`` keys are unchanged.
        compiler: maps a callable to its compiled version (``functools.partial(torch.compile, backend=...)``
            or an ``OptimizedModule``'s ``dynamo_ctx``).
    """
    per_layer = getattr(module, "compile_layers", None)
    if callable(per_layer):  # dscore.pipe.PipelineModule: each layer is its own compiled region
        per_layer(lambda m: compile_in_place(m, compiler), compiler)
        return
    module._compiled_call_impl = compiler(_through(module._call_impl))  # type: ignore[assignment]


def unwrap_compiled(model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """Split ``torch.compile(model)`` into ``(original module, its dynamo context)``; other modules pass.

    Returns:
        ``(model, None)`` for a module that is not a ``torch._dynamo.eval_frame.OptimizedModule``, else
        ``(model._orig_mod, model.dynamo_ctx)``.

    Raises:
        ConfigError: an ``OptimizedModule`` without the ``dynamo_ctx`` dscore re-installs (a torch version
            whose wrapper differs); the message says to pass the plain model and call ``engine.compile()``.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(model, OptimizedModule):
        return model, None
    ctx = getattr(model, "dynamo_ctx", None)
    if ctx is None or not callable(ctx):
        raise ConfigError(
            f"dscore.initialize(model=torch.compile(...)): this torch {torch.__version__} OptimizedModule has no "
            "callable dynamo_ctx to re-install on the original module; pass the plain model and call "
            "engine.compile(backend=..., compile_kwargs=...) instead"
        )
    return model._orig_mod, ctx


class CompileState:
    """What an engine knows about its compilation (one per engine).

    Attributes:
        compiled: True after :meth:`compile` (or an adopted ``torch.compile(model)``).
        backend / compile_kwargs: what :meth:`compile` used (None / {} for an adopted OptimizedModule).
        compiled_autograd: True when backward runs under compiled autograd (:meth:`backward_context`).
    """

    def __init__(self) -> None:
        self.compiled = False
        self.backend: Any = None
        self.compile_kwargs: dict[str, Any] = {}
        self.compiled_autograd = False

    def adopt(self, module: torch.nn.Module, dynamo_ctx: Any) -> None:
        """Install the dynamo context of a user's ``torch.compile(model)`` on ``module`` in place."""
        compile_in_place(module, dynamo_ctx)
        self.compiled = True

    def compile(
        self,
        module: torch.nn.Module,
        *,
        backend: Any,
        compile_kwargs: Mapping[str, Any] | None,
        schedule: Any,
        compiled_autograd_enabled: bool,
        deepcompile: bool,
        where: str = "engine.compile()",
    ) -> None:
        """DeepSpeed 0.19.8's ``engine.compile`` on ``module`` (see the module docstring).

        Args:
            module: the engine's wrapped module, compiled in place.
            backend: a dynamo backend name or callable (``torch.compile``'s ``backend``).
            compile_kwargs: other ``torch.compile`` keyword arguments (``fullgraph``, ``dynamic``, ``mode``,
                ``options``); a ``backend`` key in it is overridden by ``backend`` with a warning.
            schedule: DeepCompile's pass schedule; must be None (DeepCompile is not implemented).
            compiled_autograd_enabled: run backward under compiled autograd (:meth:`backward_context`).
            deepcompile: whether the config turned DeepCompile on (always refused earlier today).
            where: the call named in errors.

        Raises:
            ConfigError: ``schedule`` is not None; ``compile_kwargs`` is not a mapping; a backend name that
                ``torch._dynamo.list_backends`` does not know (the message lists them).
        """
        if compile_kwargs is None:
            compile_kwargs = {}
        if not isinstance(compile_kwargs, Mapping):
            raise ConfigError(f"{where}: compile_kwargs must be a dict of torch.compile arguments, got {type(compile_kwargs).__name__}")
        if schedule is not None and not deepcompile:
            raise ConfigError(
                f"{where}: schedule={schedule!r} is a DeepCompile pass schedule, and DeepCompile is off "
                "(compile.deepcompile is not implemented by dscore); call engine.compile() without schedule"
            )
        if self.compiled:
            return  # DeepSpeed: a second call does nothing
        if "backend" in compile_kwargs:
            log.warning(
                "%s: the `backend` in compile_kwargs (%r) is overridden by the backend argument (%r)",
                where,
                compile_kwargs["backend"],
                backend,
            )
        if isinstance(backend, str):
            from torch._dynamo import list_backends

            known = list_backends(exclude_tags=())
            if backend not in known:
                raise ConfigError(f"{where}: backend={backend!r} is not a torch.compile backend; valid: {', '.join(sorted(known))}")
        options = {**compile_kwargs, "backend": backend}

        def compiler(fn: Callable[..., Any]) -> Callable[..., Any]:
            return torch.compile(fn, **options)  # type: ignore[no-any-return]

        compile_in_place(module, compiler)
        self.compiled = True
        self.backend = backend
        self.compile_kwargs = dict(compile_kwargs)
        self.compiled_autograd = bool(compiled_autograd_enabled)

    @contextlib.contextmanager
    def backward_context(self, default_backend: Any) -> Iterator[None]:
        """Run the enclosed ``loss.backward()`` under compiled autograd when it was enabled (else nothing).

        Compiled autograd compiles the backward graph with ``torch.compile(backend=default_backend,
        **compile_kwargs)``, DeepSpeed's choice (the accelerator's default backend, not the forward's).
        """
        if not self.compiled_autograd or torch.compiler.is_compiling():
            yield
            return
        from torch._dynamo import compiled_autograd

        options = {k: v for k, v in self.compile_kwargs.items() if k != "backend"}
        compiler_fn = torch.compile(backend=default_backend, **options)
        with compiled_autograd._enable(compiler_fn):
            yield
