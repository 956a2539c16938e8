"""AutoTP training, the plan: which layers split and how, the split itself and ``tp_model_init``.

Rule priority (DeepSpeed 0.19.8's ``tensor_parallel`` semantics; the first rule that matches a parameter
name decides):

1. ``partition_config.layer_specs`` (the user's regular expressions, ``re.match`` on the parameter name
   ``layers.0.self_attn.q_proj.weight``); with ``use_default_specs: false`` nothing else is consulted;
2. ``preset_model`` (Llama-family rules);
3. the model's Hugging Face plan (``model._tp_plan``, then ``model.config.base_model_tp_plan`` under
   ``model.base_model_prefix``): ``colwise`` / ``rowwise`` / ``colwise_rep``;
4. the built-in parser: attention ``q/k/v`` (and ``query/key/value``) column, ``o_proj``/``out_proj`` row; MLP
   ``gate/up`` column, ``down`` row; ``lm_head``/``embed_out`` column with the output gathered; token
   embeddings (``embed_tokens``, ``wte``, ``word_embeddings``) split along the embedding dim and gathered.

Stricter than DeepSpeed: a user pattern that matches no parameter, a model in which no layer was split, a
dim that does not divide by the degree, or attention heads not divisible by it are :class:`ConfigError`\\ s
naming the pattern / module; DeepSpeed trains unsharded without a word.

The split starts from one model: :func:`apply_autotp` first broadcasts the unsplit model's parameters and
buffers from world rank 0 over the world, so a rank-dependent seed cannot make the tensor ranks slice
different weights (DeepSpeed 0.19.8 assumes an equal seed there).

A client optimizer *instance* (the Hugging Face Trainer's own AdamW when the ds_config has no ``optimizer``
block) was built over the unsplit parameters: :func:`remap_client_optimizer` re-points each of its groups at
the split successors, position for position, keeping every group's hyper-parameters (DeepSpeed 0.19.8's
engine remaps a client optimizer after module replacement too); one that already holds state for a replaced
parameter is refused, since that state has the unsplit shape. Refused with tensor parallelism
(``ConfigError`` naming the key): a model built under ``dscore.zero.Init`` (its partitions cannot be sliced;
DeepSpeed 0.19.8 gathers them first, dscore does not yet). fp16 and bf16 are both supported: the gradient norm, the overflow verdict
(so the skip and the loss scaler's update) and clipping are the whole model's, agreed in one all-reduce over
every rank (:class:`dscore_plugins.parallel.autotp.stage.TensorParallelStage`): the global norm counts every
shard once and every replicated parameter once. A checkpoint of a tensor-parallel run holds full tensors
and user-shaped parameter groups, so it loads at any degree (1 included) and into a plain model.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import ConfigError, DscoreError
from dscore.parallel.tp_layers import (
    ColumnParallelLinear,
    EmbeddingDimSplit,
    RowParallelLinear,
    TPParam,
)
from dscore.runtime.replicas import broadcast_replicas
from dscore.zero.partition import unit_of

if TYPE_CHECKING:
    from dscore.parallel.mesh import ParallelMesh
    from dscore_plugins.parallel.config_tp import TensorParallelConfig

__all__ = [
    "Rule",
    "TPBatchMismatchError",
    "apply_autotp",
    "check_tp_config",
    "plan_autotp",
    "remap_client_optimizer",
    "remap_parameters",
    "tp_model_init",
    "tp_params_of",
]

log = logging.getLogger("dscore.parallel.autotp")

_COLUMN = {
    "q_proj",
    "k_proj",
    "v_proj",
    "query",
    "key",
    "value",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "w1",
    "w3",
    "fc_in",
    "c_fc",
}
_ROW = {"o_proj", "out_proj", "down_proj", "w2", "fc_out", "dense_4h_to_h"}
_EMBED = {"embed_tokens", "wte", "word_embeddings"}
_PRESETS: dict[str, list[tuple[str, str]]] = {
    name: [
        (r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", "column"),
        (r".*\.(o_proj|down_proj)\.weight$", "row"),
    ]
    for name in ("llama", "qwen2", "mistral")
}


class TPBatchMismatchError(DscoreError):
    """Ranks of one tensor-parallel group received different batches on the first step."""


@dataclass(frozen=True)
class Rule:
    """How one module is split: ``kind`` column / row / embedding / skip, from ``source``."""

    kind: str
    source: str
    parts: int = 1
    gather_output: bool = False


def check_tp_config(cfg: Any, *, precision_name: str) -> None:
    """Refuse what AutoTP training cannot honour (see the module docstring).

    Raises:
        ConfigError: ``activation_checkpointing.partition_activations``; an explicit
            ``tensor_parallel.dtype`` other than the precision mode's.
    """
    block = cfg.section("tensor_parallel")
    if block.keep_module_on_host:
        log.warning(
            "tensor_parallel.keep_module_on_host: true changes nothing in dscore: AutoTP splits the module where it "
            "is, before dscore.initialize moves the shards to the device"
        )
    if "dtype" in block.model_fields_set:
        wanted = {
            "fp32": "fp32",
            "float32": "fp32",
            "torch.float32": "fp32",
            "bf16": "bf16",
            "bfloat16": "bf16",
            "torch.bfloat16": "bf16",
        }.get(block.dtype, "fp16")
        if wanted != precision_name:
            raise ConfigError(
                f"tensor_parallel.dtype = {block.dtype!r} but the precision mode is {precision_name} (the fp16/bf16 "
                "blocks decide the dtype dscore.initialize trains in); make them agree or drop tensor_parallel.dtype",
                path="tensor_parallel.dtype",
            )
    if getattr(cfg.section("activation_checkpointing", None), "partition_activations", False):
        raise ConfigError(
            "activation_checkpointing.partition_activations with tensor_parallel.autotp_size > 1 is not implemented "
            "by dscore (saved inputs are not split across the tensor-parallel group); set it false",
            path="activation_checkpointing.partition_activations",
        )


def _hf_plan(model: torch.nn.Module) -> dict[str, str]:
    plan: dict[str, str] = {}
    cfg = getattr(model, "config", None)
    base = getattr(cfg, "base_model_tp_plan", None)
    prefix = getattr(model, "base_model_prefix", "") or ""
    if isinstance(base, dict):
        has_prefix = prefix and hasattr(model, prefix)
        for k, v in base.items():
            plan[f"{prefix}.{k}" if has_prefix else k] = v
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, dict):
        plan.update(own)
    return plan


# Hugging Face tp_plan styles -> dscore's split. Every dscore split is exact (the layer's output equals the
# unsplit layer's), so an embedding HF would split by rows (vocabulary) is split along its embedding dim here.
_HF_KINDS = {
    "colwise": ("column", False),
    "rowwise": ("row", False),
    "colwise_rep": ("column", True),
    "colwise_gather_output": ("column", True),
    "rowwise_rep": ("row", False),
    "local_colwise": ("column", False),
    "local_rowwise": ("row", False),
    "replicate": ("skip", False),
    "embedding_rowwise": ("embedding", False),
    "embedding_colwise": ("embedding", False),
}


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _targets(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, mod in model.named_modules():
        if type(mod) in (torch.nn.Linear, torch.nn.Embedding):
            yield name, mod


def plan_autotp(model: torch.nn.Module, config: TensorParallelConfig) -> dict[str, Rule]:
    """Decide, for every ``Linear`` / ``Embedding`` of ``model``, how it splits (no module is changed).

    Returns:
        ``{module name: Rule}`` of the modules that split (``skip`` rules left out).

    Raises:
        ConfigError: a user pattern matches no parameter (names it), or no layer would split (names every
            rule source consulted).
    """
    part = config.partition_config
    specs = list(part.layer_specs) if part is not None else []
    use_defaults = part is None or part.use_default_specs
    lm_head = list(part.lm_head_patterns) if part is not None else ["lm_head", "embed_out"]
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "").lower()
    hf = _hf_plan(model) if use_defaults else {}
    preset = _PRESETS.get(config.preset_model or "", []) if use_defaults else []
    used = [False] * len(specs)
    plan: dict[str, Rule] = {}
    owners: dict[int, list[str]] = {}  # tied weights (lm_head = embed_tokens): one tensor, several modules
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname_, p in m.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append(f"{mname}.{pname_}" if mname else pname_)
    for name, mod in _targets(model):
        pname = f"{name}.weight"
        rule: Rule | None = None
        for i, spec in enumerate(specs):
            if spec.model_types and model_type not in [m.lower() for m in spec.model_types]:
                continue
            if any(re.match(p, pname) or re.match(p, name) for p in spec.patterns):
                used[i] = True
                rule = Rule(
                    spec.partition_type, f"partition_config.layer_specs[{i}]", spec.sub_params(), spec.gather_output
                )
                break
        if rule is None and use_defaults:
            for pattern, kind in preset:
                if re.match(pattern, pname):
                    rule = Rule(kind, f"preset_model {config.preset_model}")
                    break
        if rule is None and use_defaults:
            for key, value in hf.items():
                if fnmatch.fnmatchcase(name, key):
                    if value not in _HF_KINDS:
                        raise ConfigError(
                            f"the model's Hugging Face tp_plan gives {name!r} the style {value!r}, which dscore's "
                            f"AutoTP does not implement (known: {', '.join(sorted(_HF_KINDS))}); override it with "
                            "tensor_parallel.partition_config.layer_specs",
                            path="tensor_parallel.partition_config",
                        )
                    kind, gather = _HF_KINDS[value]
                    rule = Rule(kind, f"the model's tp_plan {key!r}", 1, gather)
                    break
        if rule is None and use_defaults:
            leaf = _leaf(name)
            if isinstance(mod, torch.nn.Embedding):
                if leaf in _EMBED:
                    rule = Rule("embedding", "the built-in parser")
            elif leaf in _COLUMN:
                rule = Rule("column", "the built-in parser")
            elif leaf in _ROW:
                rule = Rule("row", "the built-in parser")
            elif any(leaf == p or re.fullmatch(p, name) for p in lm_head):
                rule = Rule("column", "the built-in parser (lm_head)", 1, True)
        tied = sorted(set(owners.get(id(mod.weight), [])))
        if rule is not None and rule.kind != "skip" and len(tied) > 1:
            if rule.source.startswith("partition_config"):
                raise ConfigError(
                    f"{rule.source} splits {name!r}, whose weight is tied to {', '.join(tied)}; a split would untie "
                    "them. Give every tied module partition_type skip",
                    path="tensor_parallel.partition_config.layer_specs",
                )
            log.warning(
                "AutoTP: %s stays whole: its weight is tied (%s) and splitting would untie it", name, ", ".join(tied)
            )
            rule = None
        if rule is not None and rule.kind != "skip":
            if isinstance(mod, torch.nn.Embedding) and rule.kind != "embedding":
                raise ConfigError(
                    f"{rule.source} splits the Embedding {name!r} as {rule.kind}; embeddings split only along the "
                    "embedding dim (leave them to the built-in parser or use partition_type skip)",
                    path="tensor_parallel.partition_config.layer_specs",
                )
            plan[name] = rule
    unused = [(i, specs[i].patterns) for i, u in enumerate(used) if not u]
    if unused:
        listed = "; ".join(f"layer_specs[{i}] {p}" for i, p in unused)
        raise ConfigError(
            f"tensor_parallel.partition_config: {listed} matched no parameter of the model (patterns are "
            "re.match'ed against full parameter names such as 'layers.0.self_attn.q_proj.weight'); fix or remove them",
            path="tensor_parallel.partition_config.layer_specs",
        )
    if not plan:
        consulted = [f"layer_specs {[s.patterns for s in specs]}"] if specs else []
        if use_defaults:
            if preset:
                consulted.append(f"preset_model {config.preset_model}")
            consulted.append(f"the model's tp_plan {sorted(hf)}" if hf else "no Hugging Face tp_plan")
            consulted.append("the built-in parser (q/k/v/o_proj, gate/up/down_proj, lm_head, embed_tokens)")
        raise ConfigError(
            f"tensor_parallel.autotp_size > 1 but no layer of {type(model).__name__} would be split (consulted: "
            f"{'; '.join(consulted)}); add partition_config.layer_specs naming its Linear layers",
            path="tensor_parallel.partition_config",
        )
    return plan


def _check_heads(model: torch.nn.Module, tp: int) -> None:
    cfg = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(cfg, key, None)
        if isinstance(heads, int) and heads % tp != 0:
            raise ConfigError(
                f"model.config.{key} = {heads} is not divisible by tensor_parallel.autotp_size {tp}; every rank "
                "must hold whole attention heads",
                path="tensor_parallel.autotp_size",
            )


def _set_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def apply_autotp(model: torch.nn.Module, mesh: ParallelMesh, config: TensorParallelConfig) -> dict[str, Rule]:
    """Split ``model`` in place over ``mesh``'s tensor-parallel group (see the module docstring).

    Collective over the world: before anything is sliced, every parameter and buffer of the unsplit model
    becomes world rank 0's (:func:`dscore.runtime.replicas.broadcast_replicas` over
    :attr:`~dscore.parallel.mesh.ParallelMesh.world_comm`), so each tensor rank's shard is its slice of one
    model and the replicated parameters are equal on every tensor rank whatever seed each rank built with
    (DeepSpeed 0.19.8 broadcasts only over the data-parallel group and so assumes an equal seed). Afterwards
    every tensor of ``model`` is equal over each group of ranks sharing a tensor-parallel rank.

    A model already split by :func:`tp_model_init` with the same degree is left as it is (it was made equal
    when it was split).

    Returns:
        The plan applied (``{module name: Rule}``).

    Raises:
        ConfigError: as :func:`plan_autotp`; a split dim not divisible by the degree (names the module); a model
            split before with another degree; a model built under ``dscore.zero.Init`` (partitioned
            parameters, names the first).
        DscoreError: ``mesh`` has no :attr:`~dscore.parallel.mesh.ParallelMesh.world_comm` (not built by
            ``ParallelMesh.create``).
    """
    tp, rank = mesh.tp_size, mesh.tp_rank
    done = getattr(model, "_dscore_autotp", None)
    if done is not None:
        if done["tp"] != tp:
            raise ConfigError(
                f"the model was split by tp_model_init with tp_size {done['tp']} but tensor_parallel.autotp_size is {tp}",
                path="tensor_parallel.autotp_size",
            )
        plan: dict[str, Rule] = done["plan"]
        return plan
    _check_heads(model, tp)
    plan = plan_autotp(model, config)
    partitioned = [n for n, p in model.named_parameters() if unit_of(p) is not None]
    if partitioned:
        raise ConfigError(
            f"tensor_parallel.autotp_size {tp}: the model was built under dscore.zero.Init ({len(partitioned)} "
            f"partitioned parameter(s), first {partitioned[0]!r}), and AutoTP slices full weights; build the model "
            "outside zero.Init (ZeRO stage 3 still partitions each shard over the data-parallel group at "
            "dscore.initialize) or set tensor_parallel.autotp_size to 1",
            path="tensor_parallel.autotp_size",
        )
    world = mesh.world_comm
    if world is None:
        raise DscoreError(
            "apply_autotp needs a mesh built by ParallelMesh.create (its world_comm broadcasts the unsplit model "
            "from world rank 0 before the split); this mesh has none"
        )
    # one model before slicing: the shards and the replicated parameters all come from world rank 0's weights
    broadcast_replicas(model, world, device=_collective_device(model))
    comm = mesh.tp_comm
    # old parameter id -> (weak reference to the old parameter, its successor); the weak reference guards
    # against an id reused by a new object once the old parameter is freed
    replaced: dict[int, tuple[Any, torch.nn.Parameter]] = {}

    def record(old: torch.Tensor, new: Any) -> None:
        replaced[id(old)] = (weakref.ref(old), new)

    for name, rule in plan.items():
        mod = model.get_submodule(name)
        if isinstance(mod, torch.nn.Embedding):
            if mod.embedding_dim % tp:
                raise ConfigError(
                    f"embedding {name!r}: embedding_dim {mod.embedding_dim} is not divisible by tp {tp}",
                    path="tensor_parallel.autotp_size",
                )
            emb = EmbeddingDimSplit(mod, comm=comm, tp=tp, rank=rank)
            record(mod.weight, emb.weight)
            _set_module(model, name, emb)
            continue
        assert isinstance(mod, torch.nn.Linear)
        size = mod.out_features if rule.kind == "column" else mod.in_features
        if size % (tp * rule.parts):
            raise ConfigError(
                f"{rule.source} splits {name!r} as {rule.kind}, but its {'out' if rule.kind == 'column' else 'in'}_features "
                f"{size} does not divide into {rule.parts} part(s) x tp {tp}",
                path="tensor_parallel.autotp_size",
            )
        new: torch.nn.Module
        if rule.kind == "column":
            new = ColumnParallelLinear.from_linear(
                mod, comm=comm, tp=tp, rank=rank, parts=rule.parts, gather_output=rule.gather_output
            )
        else:
            new = RowParallelLinear.from_linear(mod, comm=comm, tp=tp, rank=rank, parts=rule.parts)
        record(mod.weight, new.weight)
        if mod.bias is not None and new.bias is not None:
            record(mod.bias, new.bias)
        _set_module(model, name, new)
    model._dscore_autotp = {"tp": tp, "plan": plan, "replaced": replaced}  # type: ignore[assignment]
    log.info("AutoTP: %d module(s) split over tp %d: %s", len(plan), tp, ", ".join(sorted(plan)))
    return plan


def _collective_device(model: torch.nn.Module) -> torch.device:
    """Where the pre-split broadcast runs: the runtime's accelerator inside ``initialize``; outside one
    (:func:`tp_model_init`) the device the default group's collectives take
    (:func:`dscore.comm.objects.object_device`), else the model's device."""
    import torch.distributed as dist

    from dscore.runtime.context import current_runtime

    try:
        return torch.device(current_runtime().accelerator.current_device_name())
    except DscoreError:
        pass
    if dist.is_available() and dist.is_initialized():
        from dscore.comm.objects import object_device

        return object_device(None)  # the host for gloo/MPI, else torch's current accelerator device
    probe = next(iter(model.parameters()), None)
    return probe.device if probe is not None else torch.device("cpu")


def remap_parameters(model: torch.nn.Module, model_parameters: Any) -> Any:
    """``model_parameters`` (tensors, ``(name, tensor)`` pairs or group dicts) with every parameter AutoTP
    replaced swapped for its split successor, so a list built before the split trains the split model.

    Raises:
        ConfigError: an element is still a tensor the split model does not own (names its position).
    """
    if model_parameters is None:
        return None
    done = getattr(model, "_dscore_autotp", None) or {}
    replaced: dict[int, tuple[Any, torch.nn.Parameter]] = done.get("replaced", {})
    owned = {id(p) for p in model.parameters()}

    def swap(t: Any, where: str) -> Any:
        if isinstance(t, torch.Tensor):
            hit = replaced.get(id(t))
            if hit is not None and hit[0]() is t:
                t = hit[1]
            if id(t) not in owned:
                raise ConfigError(
                    f"model_parameters {where} is a tensor of shape {tuple(t.shape)} that is not a parameter of the "
                    "model after the AutoTP split; pass parameters of the model (or none)",
                    path="tensor_parallel.autotp_size",
                )
        return t

    out: list[Any] = []
    for i, x in enumerate(list(model_parameters)):
        if isinstance(x, dict):
            raw = x.get("params", [])
            raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
            out.append({**x, "params": [swap(p, f"group {i}") for p in raw]})
        elif isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor):
            out.append((x[0], swap(x[1], f"entry {i} ({x[0]})")))
        else:
            out.append(swap(x, f"entry {i}"))
    return out


def remap_client_optimizer(model: torch.nn.Module, optimizer: Any) -> int:
    """Re-point a client optimizer built before the AutoTP split at the split parameters, in place.

    Each parameter :func:`apply_autotp` replaced is swapped for its successor at the same position of the same
    group, so every group keeps its hyper-parameters (``lr``, ``weight_decay``, ...) and its members; parameters
    the split did not touch stay as they are. Anything but a ``torch.optim.Optimizer`` (None, a callable) is left
    alone: it is built after the split.

    Returns:
        The number of parameters swapped.

    Raises:
        ConfigError: the optimizer already holds state (e.g. ``exp_avg``) for a replaced parameter: that state
            has the unsplit shape and cannot follow the shard (names the group and position; build the optimizer
            fresh, or load the state after ``dscore.initialize`` from a checkpoint).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return 0
    done = getattr(model, "_dscore_autotp", None) or {}
    replaced: dict[int, tuple[Any, torch.nn.Parameter]] = done.get("replaced", {})
    swapped = 0
    for gi, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        for pos, p in enumerate(params):
            hit = replaced.get(id(p))
            if hit is None or hit[0]() is not p:
                continue
            if optimizer.state.get(p):
                raise ConfigError(
                    f"tensor_parallel.autotp_size {done.get('tp')}: the client optimizer's param_groups[{gi}] "
                    f"position {pos} (shape {tuple(p.shape)}) already holds optimizer state "
                    f"({', '.join(sorted(map(str, optimizer.state[p])))}), which cannot be split with the parameter; "
                    "pass an optimizer that has not stepped yet (or set optimizer.type in ds_config) and load "
                    "saved state after dscore.initialize with engine.load_checkpoint",
                    path="tensor_parallel.autotp_size",
                )
            optimizer.state.pop(p, None)
            params[pos] = hit[1]
            swapped += 1
        group["params"] = params
    if swapped:
        log.info("AutoTP: the client optimizer's groups now hold %d split parameter(s) in place of the unsplit ones", swapped)
    return swapped


def tp_params_of(module: torch.nn.Module) -> dict[str, TPParam]:
    """``{parameter name: TPParam}`` of every split parameter of ``module``."""
    out: dict[str, TPParam] = {}
    for name, mod in module.named_modules():
        specs = getattr(mod, "tp_params", None)
        if isinstance(specs, dict):
            for pname, spec in specs.items():
                out[f"{name}.{pname}" if name else pname] = spec
    return out


def tp_model_init(
    model: torch.nn.Module,
    tp_size: int,
    dtype: torch.dtype | None = None,
    config: dict[str, Any] | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: split ``model`` over ``tp_size`` ranks before ``initialize``.

    Needs an initialised default process group (``dscore.init_distributed()``); builds the mesh of the world
    with ``tp_size`` tensor-parallel ranks and splits ``model`` in place. ``dscore.initialize`` with
    ``tensor_parallel.autotp_size == tp_size`` then trains it without splitting again.

    Args:
        model: the full model (on any device).
        tp_size: the tensor-parallel degree (> 1; must divide the world size).
        dtype: cast the model to this dtype first (None: keep).
        config: the ``tensor_parallel`` block (or a whole ds_config holding one) for the rules.

    Returns:
        ``model``, split.

    Raises:
        ConfigError: as :func:`apply_autotp`; ``tp_size`` below 2; unknown keyword arguments.
        DscoreError: no process group exists.
    """
    if kwargs:
        raise ConfigError(f"tp_model_init: unknown keyword argument(s) {sorted(kwargs)}")
    if int(tp_size) < 2:
        raise ConfigError(f"tp_model_init: tp_size must be at least 2, got {tp_size}")
    import torch.distributed as dist

    from dscore.parallel.mesh import ParallelMesh
    from dscore_plugins.parallel.config_tp import TensorParallelConfig

    if not (dist.is_available() and dist.is_initialized()):
        raise DscoreError("tp_model_init needs a process group: call dscore.init_distributed() first")
    block = dict(config or {})
    if (
        "tensor_parallel" in block
        and isinstance(block["tensor_parallel"], dict)
        and "autotp_size" in block["tensor_parallel"]
    ):
        block = dict(block["tensor_parallel"])
    block["autotp_size"] = int(tp_size)
    tp_config = TensorParallelConfig.model_validate(block)
    from dscore.comm.facade import Comm

    mesh = ParallelMesh.create(Comm(None), tp=int(tp_size))
    if dtype is not None:
        model.to(dtype)
    apply_autotp(model, mesh, tp_config)
    return model
