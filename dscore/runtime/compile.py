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

ZeRO-3 under compile (issue 41 item 2), the design chosen: **the ZeRO unit's block is the compiled region**.
A stage whose module hooks must not run inside compiled code says so through
:meth:`dscore.protocols.zero.ZeroStage.compile_regions`; stage 3 returns its regions (each transformer block,
i.e. each entry of an ``nn.ModuleList`` / ``nn.Sequential``, and each remaining module owning parameters: the
embedding, the final norm, the ``lm_head``; ``dscore_plugins.zero.regions``) and from then on runs the
gather/release/prefetch hooks of every module inside a region once, at the region's boundary. The engine
compiles each region's ``forward`` on its own (:func:`compile_regions`), so those hooks run in the region's
eager ``_call_impl`` around its graph, and the model's own ``forward`` between regions (masks, rotary
embeddings, the layer loop) stays eager. Measured on a 2-layer Llama: 0 graph breaks (22 when the hooks sat
inside one compiled module; DeepSpeed 0.19.8: 49), one graph per region, losses equal to eager, with and
without parameter offload; ``fullgraph=True`` works at stage 3 too. It is FSDP2's recommended use
(``fully_shard`` and ``torch.compile`` per block) with the coordinator's whole policy (prefetch order, LRU
eviction under ``max_live_parameters``, reuse distance, offload, NVMe, ZeRO++) unchanged, because that policy
runs between graphs in Python, where it may specialise freely. Each region's compiled function has a code
object of its own: dynamo caches per code object, and blocks sharing one would share its recompile limit (8).
Not done: a single graph across blocks, which would need the gathers written as traceable ops and the policy
turned into a static schedule (what DeepCompile does as a graph pass).

DeepCompile (``compile.deepcompile``) is not implemented (the config block is refused key by key, see
docs/config-keys.md), so a non-None ``schedule`` is refused with a :class:`dscore.errors.ConfigError`.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from dscore.errors import ConfigError

__all__ = ["CompileState", "compile_in_place", "compile_regions", "unwrap_compiled"]

log = logging.getLogger(__name__)

#: a ZeRO stage's ``compile_regions``: the regions to compile one by one, or None for the whole module
RegionsFn = Callable[[], "list[tuple[str, torch.nn.Module]] | None"]


def _through(call_impl: Callable[..., Any]) -> Callable[..., Any]:
    # a frame in a file dynamo traces, so ``_call_impl`` (torch.nn code, skipped as a top frame) is inlined
    def call(*args: Any, **kwargs: Any) -> Any:
        return call_impl(*args, **kwargs)

    return call


class _CompiledForward:
    """A region's ``forward``: the compiled call of its previous ``forward`` (see :func:`compile_regions`).

    ``copy.deepcopy`` of the module (a reference model, an EMA copy) gives the copy its plain ``forward``:
    the copy runs eagerly instead of calling into the original module's compiled code.
    """

    __slots__ = ("compiled", "plain")

    def __init__(self, compiled: Callable[..., Any], plain: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.plain = plain

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        import copy

        return copy.deepcopy(self.plain, memo)


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    # like _through, with a code object of its own: dynamo caches compiled code per code object, and regions
    # sharing one code object would share its cache (recompiling on each region's guards, up to dynamo's
    # recompile limit, then running eagerly)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    code = call.__code__.replace(co_name=name)
    return types.FunctionType(code, call.__globals__, name, call.__defaults__, call.__closure__)


def compile_regions(
    regions: list[tuple[str, torch.nn.Module]], compiler: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Compile each region's ``forward`` on its own, leaving ``_call_impl`` (the modules' hooks) eager.

    Used where a ZeRO stage runs its hooks at the regions' boundaries (:meth:`dscore.protocols.zero.ZeroStage.
    compile_regions`): the hooks of a region run before and after its compiled graph, never inside it.

    Args:
        regions: ``(qualified name, module)`` pairs; each module's ``forward`` is replaced in place.
        compiler: as in :func:`compile_in_place`.
    """
    for name, module in regions:
        plain = module.forward
        label = "dscore_region_" + "".join(c if c.isalnum() else "_" for c in (name or "root"))
        module.forward = _CompiledForward(compiler(_own_code(plain, label)), plain)  # type: ignore[method-assign]


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
        regions: the ``(name, module)`` regions compiled one by one, or None when the whole module was.
    """

    def __init__(self) -> None:
        self.compiled = False
        self.backend: Any = None
        self.compile_kwargs: dict[str, Any] = {}
        self.compiled_autograd = False
        self.regions: list[tuple[str, torch.nn.Module]] | None = None

    def adopt(self, module: torch.nn.Module, dynamo_ctx: Any, *, regions: RegionsFn | None = None) -> None:
        """Install the dynamo context of a user's ``torch.compile(model)`` on ``module`` in place (on each of
        ``regions()`` instead when that returns regions, as :meth:`compile`)."""
        chosen = regions() if regions is not None else None
        if chosen is not None:
            compile_regions(chosen, dynamo_ctx)
        else:
            compile_in_place(module, dynamo_ctx)
        self.compiled = True
        self.regions = chosen

    def compile(
        self,
        module: torch.nn.Module,
        *,
        backend: Any,
        compile_kwargs: Mapping[str, Any] | None,
        schedule: Any,
        compiled_autograd_enabled: bool,
        deepcompile: bool,
        regions: RegionsFn | None = None,
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
            regions: the ZeRO stage's :meth:`~dscore.protocols.zero.ZeroStage.compile_regions`, asked once the
                arguments are valid: when it returns regions, each region's ``forward`` is compiled on its own
                (:func:`compile_regions`) instead of the whole module.
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

        chosen = regions() if regions is not None else None
        if chosen is not None:
            compile_regions(chosen, compiler)
        else:
            compile_in_place(module, compiler)
        self.compiled = True
        self.regions = chosen
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
