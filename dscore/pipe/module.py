"""``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec``: a model written as a list of layers, cut into
pipeline stages (DeepSpeed's ``deepspeed.pipe`` with the same meaning).

A :class:`PipelineModule` is a sequence of layers, each one of

* a :class:`LayerSpec` ``LayerSpec(cls, *args, **kwargs)``: the layer is *built only on the stage that owns
  it* (``cls(*args, **kwargs)``), so a model larger than one rank's memory is never materialised whole;
* a :class:`TiedLayerSpec` ``TiedLayerSpec(key, cls, *args, forward_fn=None, tied_weight_attr=("weight",))``:
  every spec with the same ``key`` shares one module (built once per owning stage, from the first spec of
  the key). Stages owning a key hold replicas whose gradients are summed after each batch, so the replicas
  stay equal (the classic case: the input embedding reused as the output head,
  ``forward_fn=lambda emb, x: x @ emb.weight.t()``);
* an ``nn.Module`` instance (built by the caller on every rank; kept only on its owning stage) or any
  callable (a function such as ``lambda x: x.relu()``; no parameters).

The output of layer ``i`` is the input of layer ``i + 1`` (a tensor or a tuple of tensors). On the last
stage ``loss_fn(outputs, labels)`` gives the micro-batch loss.

**Partitioning** (``partition_method``, case-insensitive) cuts the layers into ``num_stages`` contiguous
stages: ``"parameters"`` balances trainable parameter counts (each ``LayerSpec`` is built once, on CPU,
to count them, as DeepSpeed does), ``"uniform"`` balances the number of layers, ``"type:<regex>"`` balances
the number of layers whose class name matches ``regex`` (case-insensitive). The optimum minimises the
heaviest stage (:func:`dscore.pipe.partition.partition_balanced`).

**Activation checkpointing**: with ``activation_checkpoint_interval = k > 0`` a stage's layers run in
chunks of ``k``, each chunk through ``activation_checkpoint_func`` (default
:func:`dscore.checkpointing.checkpoint`) when it is checkpointable: its class names are in
``checkpointable_layers`` when given, else it holds a parameter (DeepSpeed's rule). Only while training.

**Parameter names** are global: the built layer ``i`` is the submodule ``str(i)`` and tied modules live
under ``tied_modules.<key>``, so a state dict key (``"3.weight"``) means the same tensor whatever the
number of stages — the basis of per-layer checkpoints (:mod:`dscore.pipe.checkpoint`).

Construction is collective when the process group has more than one rank (it creates the pipe, data and
tied groups, :class:`dscore.pipe.topology.PipelineGrid`). Without a process group the module is one stage
on one process.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dscore.errors import ConfigError, DistributedError
from dscore.pipe.partition import partition_balanced, partition_uniform
from dscore.pipe.topology import PipeDataParallelTopology, PipelineGrid, ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "partition_layers"]

log = logging.getLogger("dscore.pipe")


class LayerSpec:
    """A layer described by its class and constructor arguments, built only where it is needed.

    Args:
        typename: an ``nn.Module`` subclass.
        *module_args / **module_kwargs: passed to ``typename`` by :meth:`build`.

    Raises:
        ConfigError: ``typename`` is not an ``nn.Module`` subclass.
    """

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, torch.nn.Module)):
            raise ConfigError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log_build: bool = False) -> torch.nn.Module:
        """``typename(*module_args, **module_kwargs)``."""
        if log_build:
            log.info("building %r", self)
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A :class:`LayerSpec` whose module is shared by every spec with the same ``key``.

    Args:
        key: the tie name; all specs of one key share the module built from the first one.
        typename / module_args / module_kwargs: as :class:`LayerSpec`.
        forward_fn: ``forward_fn(module, inputs)`` used instead of ``module(inputs)`` at this position
            (e.g. an embedding used as the output projection).
        tied_weight_attr: the attribute(s) of the module that are tied (kept for DeepSpeed
            compatibility; every parameter of the shared module is tied, as it is one module).
    """

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        self.tied_weight_attr = (tied_weight_attr,) if isinstance(tied_weight_attr, str) else tuple(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


def _is_dist() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _refuse_before_process_group(stages: int) -> None:
    # issue 29 item 8: under a launcher (WORLD_SIZE > 1) a module built before the process group exists
    # would see a world of 1 and be partitioned for the wrong job
    import os

    launched = os.environ.get("WORLD_SIZE", "").strip()
    if launched.isdigit() and int(launched) > 1:
        raise DistributedError(
            f"PipelineModule(num_stages={stages}) was built before the process group exists, but this process "
            f"was launched with WORLD_SIZE={launched}: call dscore.init_distributed() before building the "
            "PipelineModule, so it is partitioned over the whole job"
        )


class PipelineModule(torch.nn.Module):
    """A model as a list of layers, partitioned over pipeline stages (see the module docstring).

    Args:
        layers: the layers (``LayerSpec``, ``TiedLayerSpec``, ``nn.Module`` or callables), in order.
        num_stages: number of pipeline stages; the data-parallel size is ``world_size // num_stages``.
            One of ``num_stages`` / ``topology`` is required.
        topology: a :class:`~dscore.pipe.topology.ProcessTopology` with axes ``pipe`` and ``data``.
        loss_fn: ``loss_fn(outputs, labels) -> scalar tensor`` computed on the last stage (required to train).
        seed_layers: reseed torch's RNG with ``base_seed + layer_index`` before building each layer, so a
            layer's initial weights do not depend on the partition.
        seed_fn: the reseeding function (default ``torch.manual_seed``).
        base_seed: the base of ``seed_layers``.
        partition_method: ``"parameters"`` (default), ``"uniform"`` or ``"type:<regex>"``.
        activation_checkpoint_interval: layers per checkpointed chunk (0 = no checkpointing).
        activation_checkpoint_func: ``func(fn, *args)``; default :func:`dscore.checkpointing.checkpoint`.
        checkpointable_layers: class names that may be checkpointed (default: any layer with parameters).

    Raises:
        ConfigError: no layers, neither/both of num_stages and topology, a bad partition method, a
            topology without ``pipe``/``data`` axes, a bad tie (a key reused with another class).
        DistributedError: the process group size is not ``num_stages x data-parallel size``, or
            ``num_stages > 1`` without a process group.
    """

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise ConfigError("PipelineModule needs at least one layer (layers=[...] is empty)")
        if (num_stages is None) == (topology is None):
            raise ConfigError("PipelineModule needs exactly one of num_stages= and topology=")
        stages = int(num_stages) if topology is None else int(topology.get_dim("pipe"))  # type: ignore[arg-type]
        if len(self._layer_specs) < stages:
            # DeepSpeed PR #4053: a stage without layers fails later with torch's "empty parameter list"
            raise ConfigError(
                f"PipelineModule has {len(self._layer_specs)} layer(s) for num_stages={stages}: every stage needs at "
                f"least one layer; use num_stages <= {len(self._layer_specs)} or split the model into more layers"
            )
        world = 1
        if _is_dist():
            import torch.distributed as dist

            world = dist.get_world_size()
        else:
            _refuse_before_process_group(stages)
        if topology is None:
            assert num_stages is not None
            if int(num_stages) < 1:
                raise ConfigError(f"PipelineModule num_stages must be >= 1, got {num_stages}")
            if world % int(num_stages):
                raise DistributedError(
                    f"PipelineModule num_stages={num_stages} does not divide the world size {world}: launch a "
                    "multiple of num_stages processes (num_stages x data-parallel size)"
                )
            topology = PipeDataParallelTopology(num_pp=int(num_stages), num_dp=world // int(num_stages))
        if "pipe" not in topology.axes or "data" not in topology.axes or any(
            d > 1 for a, d in zip(topology.axes, topology.dims) if a not in ("pipe", "data")
        ):
            raise ConfigError(
                f"PipelineModule topology must have axes 'pipe' and 'data' (others of size 1), got {topology.axes}"
            )
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        if self.num_stages > 1 and not _is_dist():
            raise DistributedError(
                f"PipelineModule with num_stages={self.num_stages} needs a process group: call "
                "dscore.init_distributed() (or torch.distributed.init_process_group) before building it"
            )
        self.loss_fn = loss_fn
        self.seed_layers = bool(seed_layers)
        self.seed_fn = seed_fn
        self.base_seed = int(base_seed)
        self.partition_method = str(partition_method)
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        if self.activation_checkpoint_interval < 0:
            raise ConfigError(
                f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}"
            )
        if activation_checkpoint_func is None:
            from dscore.checkpointing import checkpoint

            activation_checkpoint_func = checkpoint
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers is not None else None

        tie_classes: dict[str, type] = {}
        tie_owners_idx: dict[str, list[int]] = {}
        for i, spec in enumerate(self._layer_specs):
            if isinstance(spec, TiedLayerSpec):
                first = tie_classes.setdefault(spec.key, spec.typename)
                if first is not spec.typename:
                    raise ConfigError(
                        f"TiedLayerSpec key {spec.key!r} is used with {first.__name__} and {spec.typename.__name__}; "
                        "every spec of one key must build the same class"
                    )
                tie_owners_idx.setdefault(spec.key, []).append(i)
            elif not (isinstance(spec, (LayerSpec, torch.nn.Module)) or callable(spec)):
                raise ConfigError(f"PipelineModule layer {i} is {spec!r}: use a LayerSpec, an nn.Module or a callable")

        self.parts = self._partition()
        tie_owners = {
            key: sorted({self.stage_of(i) for i in idx}) for key, idx in tie_owners_idx.items()
        }
        self._grid = PipelineGrid.create(topology, tie_owners)
        self.stage_id = self._grid.stage_id
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.tied_modules = torch.nn.ModuleDict()
        self.tied_weight_attrs: dict[str, tuple[str, ...]] = {}
        self.tie_owners = tie_owners
        self.forward_funcs: list[Callable[..., Any]] = []
        self._build()
        # tied weights are made equal across stages by the engine, once the module is on its device
        # (synchronize_tied_weights): NCCL cannot broadcast the host tensors they are built as

    # ------------------------------------------------------------------ partitioning
    def _partition(self) -> list[int]:
        return partition_layers(self._layer_specs, self.num_stages, self.partition_method)

    def stage_of(self, layer_idx: int) -> int:
        """The stage owning layer ``layer_idx`` (the last non-empty stage whose range holds it)."""
        for s in range(self.num_stages):
            if self.parts[s] <= layer_idx < self.parts[s + 1]:
                return s
        raise IndexError(f"layer {layer_idx} is outside 0..{len(self._layer_specs) - 1}")

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        for idx in range(self._local_start, self._local_stop):
            spec = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + idx)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                module = self.tied_modules[spec.key]
                if spec.forward_fn is None:
                    self.forward_funcs.append(module)
                else:
                    self.forward_funcs.append(_TiedForward(spec.forward_fn, module))
            elif isinstance(spec, LayerSpec):
                module = spec.build()
                self.add_module(str(idx), module)
                self.forward_funcs.append(module)
            elif isinstance(spec, torch.nn.Module):
                self.add_module(str(idx), spec)
                self.forward_funcs.append(spec)
            else:
                self.forward_funcs.append(spec)

    def synchronize_tied_weights(self) -> None:
        """Copy every tied module from its first owner stage to the others (collective over each tie group),
        so all replicas start equal whichever stage built them with which seed.

        The pipeline engine calls it after moving the module to the accelerator's device, so the
        broadcasts move device tensors (a device backend such as NCCL refuses host tensors). Every rank
        of each tie group must call it.
        """
        from dscore.comm import active_comm

        for key in sorted(self._grid.tied_groups):
            group, ranks = self._grid.tied_groups[key]
            if group is None or len(ranks) < 2:
                continue
            comm = active_comm()
            with torch.no_grad():
                for p in self.tied_modules[key].parameters():
                    comm.broadcast(p.data, ranks[0], group=group)

    # ------------------------------------------------------------------ queries
    @property
    def num_layers(self) -> int:
        """Number of layers of the whole model."""
        return len(self._layer_specs)

    def layer_range(self) -> range:
        """Global indices of the layers on this stage."""
        return range(self._local_start, self._local_stop)

    def topology(self) -> ProcessTopology:
        """The pipe x data topology."""
        return self._topo

    def mpu(self) -> PipelineGrid:
        """The grid (DeepSpeed's model-parallel unit for a pipeline)."""
        return self._grid

    @property
    def grid(self) -> PipelineGrid:
        """The :class:`~dscore.pipe.topology.PipelineGrid` of this rank."""
        return self._grid

    def is_first_stage(self) -> bool:
        """True on stage 0."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """True on the last stage."""
        return self.stage_id == self.num_stages - 1

    def layer_module(self, idx: int) -> torch.nn.Module | None:
        """The module holding layer ``idx``'s state on this stage (the tied module for a tied layer),
        None for a function layer or a layer of another stage."""
        if not self._local_start <= idx < self._local_stop:
            return None
        spec = self._layer_specs[idx]
        if isinstance(spec, TiedLayerSpec):
            return self.tied_modules[spec.key]
        if isinstance(spec, (LayerSpec, torch.nn.Module)):
            return getattr(self, str(idx))
        return None

    def tied_key(self, idx: int) -> str | None:
        """The tie key of layer ``idx`` or None."""
        spec = self._layer_specs[idx]
        return spec.key if isinstance(spec, TiedLayerSpec) else None

    # ------------------------------------------------------------------ forward
    def _is_checkpointable(self, funcs: Sequence[Any]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(
            any(True for _ in f.parameters()) for f in funcs if isinstance(f, torch.nn.Module)
        )

    def compile_layers(
        self, compile_module: Callable[[torch.nn.Module], None], compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        """Compile this stage's layers one by one (what ``engine.compile()`` does to a pipeline, as DeepSpeed's
        ``PipelineModule.compile``): ``compile_module(layer)`` compiles an ``nn.Module`` layer in place (a tied
        module used by several layers once), ``compile_fn(f)`` returns the compiled version of a function layer
        (a plain function or a tied module's ``forward_fn``), which replaces it in ``forward_funcs``."""
        done: set[int] = set()
        for i, f in enumerate(self.forward_funcs):
            if isinstance(f, torch.nn.Module):
                if id(f) not in done:
                    compile_module(f)
                    done.add(id(f))
            else:
                self.forward_funcs[i] = compile_fn(f)

    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers on ``forward_input`` (a tensor or tuple of tensors)."""
        x = forward_input

        def run(start: int, end: int) -> Callable[..., Any]:
            def exec_range(*inputs: Any) -> Any:
                out: Any = inputs[0] if len(inputs) == 1 else inputs
                for f in self.forward_funcs[start:end]:
                    out = f(out)
                return out

            return exec_range

        k = self.activation_checkpoint_interval
        n = len(self.forward_funcs)
        if k == 0 or not self.training or not torch.is_grad_enabled():
            return run(0, n)(x)
        for start in range(0, n, k):
            end = min(start + k, n)
            funcs = self.forward_funcs[start:end]
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(funcs):
                x = self.activation_checkpoint_func(run(start, end), *args)
            else:
                x = run(start, end)(*args)
        return x


def _layer_weights(layers: Sequence[Any], method: str) -> list[float]:
    if method.lower() == "parameters":
        weights = []
        for spec in layers:
            if isinstance(spec, LayerSpec):
                module = spec.build()
            elif isinstance(spec, torch.nn.Module):
                module = spec
            else:
                weights.append(0.0)
                continue
            weights.append(float(sum(p.numel() for p in module.parameters() if p.requires_grad)))
        return weights
    if method.lower().startswith("type:"):
        pattern = method.split(":", 1)[1]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise ConfigError(f"partition_method {method!r}: bad regular expression: {exc}") from None
        return [1.0 if regex.search(_class_name(spec)) else 0.0 for spec in layers]
    raise ConfigError(
        f"PipelineModule partition_method={method!r} is not supported; valid: 'parameters', 'uniform', 'type:<regex>'"
    )


def _class_name(spec: Any) -> str:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    return type(spec).__name__ if isinstance(spec, torch.nn.Module) else getattr(spec, "__name__", type(spec).__name__)


def partition_layers(layers: Sequence[Any], num_stages: int, method: str) -> list[int]:
    """Stage boundaries for ``layers`` (see the module docstring for the methods).

    Returns:
        ``parts`` with ``parts[s] <= i < parts[s + 1]`` for the layers of stage ``s``.

    Raises:
        ConfigError: unknown method, bad regular expression, or a ``type:`` regex matching no layer.
    """
    if method.lower() == "uniform":
        return partition_uniform(len(layers), num_stages)
    weights = _layer_weights(layers, method)
    if method.lower().startswith("type:") and not any(weights):
        raise ConfigError(
            f"partition_method {method!r} matches no layer class; layer classes are "
            + ", ".join(sorted({_class_name(s) for s in layers}))
        )
    return partition_balanced(weights, num_stages)


class _TiedForward:
    """``forward_fn(module, x)`` bound to a tied module (not an ``nn.Module``: it owns no state)."""

    def __init__(self, forward_fn: Callable[[torch.nn.Module, Any], Any], module: torch.nn.Module) -> None:
        self.forward_fn = forward_fn
        self.module = module

    def __call__(self, x: Any) -> Any:
        return self.forward_fn(self.module, x)
