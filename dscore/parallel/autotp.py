"""AutoTP training: which layers split and how, ``tp_model_init``, and the tensor-parallel ZeRO wrapper.

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

What is refused with tensor parallelism (``ConfigError`` naming the key): fp16 (its overflow verdict would
differ across tensor-parallel ranks) and a client optimizer *instance* (its groups hold the unsplit
parameters). Gradient clipping is exact: the global norm counts every shard once and every replicated
parameter once (:class:`TensorParallelStage`). A checkpoint of a tensor-parallel run holds full tensors
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
    gather_full,
    shard_of,
)
from dscore.protocols.zero import StepOutcome, ZeroStage
from dscore.zero.optimizer import collective_device

if TYPE_CHECKING:
    from dscore.config.parallel import TensorParallelConfig
    from dscore.parallel.mesh import ParallelMesh

__all__ = [
    "Rule",
    "TensorParallelStage",
    "TPBatchMismatchError",
    "apply_autotp",
    "check_tp_config",
    "plan_autotp",
    "remap_parameters",
    "split_groups_for_tp",
    "wrap_stage",
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


def check_tp_config(cfg: Any, *, precision_name: str, client_optimizer: Any) -> None:
    """Refuse what AutoTP training cannot honour (see the module docstring).

    Raises:
        ConfigError: fp16 with ``autotp_size > 1``; ``activation_checkpointing.partition_activations``; a client
            optimizer instance; an explicit
            ``tensor_parallel.dtype`` other than the precision mode's.
    """
    if precision_name == "fp16":
        raise ConfigError(
            "fp16 with tensor_parallel.autotp_size > 1 is not supported by dscore: the overflow check of each "
            "tensor-parallel rank sees different shards; use bf16 or fp32",
            path="fp16.enabled",
        )
    block = cfg.tensor_parallel
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
    if cfg.activation_checkpointing.partition_activations:
        raise ConfigError(
            "activation_checkpointing.partition_activations with tensor_parallel.autotp_size > 1 is not implemented "
            "by dscore (saved inputs are not split across the tensor-parallel group); set it false",
            path="activation_checkpointing.partition_activations",
        )
    if isinstance(client_optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "tensor_parallel.autotp_size > 1 with a client optimizer instance: its param_groups hold the unsplit "
            "parameters; pass optimizer as a callable(param_groups) or set optimizer.type in ds_config",
            path="tensor_parallel.autotp_size",
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

    A model already split by :func:`tp_model_init` with the same degree is left as it is.

    Returns:
        The plan applied (``{module name: Rule}``).

    Raises:
        ConfigError: as :func:`plan_autotp`; a split dim not divisible by the degree (names the module); a model
            split before with another degree.
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

    from dscore.config.parallel import TensorParallelConfig
    from dscore.parallel.mesh import ParallelMesh

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
    * gradient clipping: the global norm is ``sqrt(sum over tp ranks of the split parameters' squared
      norms + the replicated parameters' squared norm once)``; the inner stage is built without clipping
      over :func:`split_groups_for_tp` groups (even groups replicated, odd groups split), and a step
      pre-hook on its optimizer (:meth:`torch.optim.Optimizer.register_step_pre_hook`: the gradients are
      reduced and unscaled by then) computes the norm and scales the gradients, as
      :func:`torch.nn.utils.clip_grad_norm_` (``clip / (norm + 1e-6)`` capped at 1);
    * checkpoints: ``module_state_dict`` / ``state_dict`` hold full tensors (split parameters gathered over
      the tensor-parallel group), loads slice them again, so a checkpoint loads at any degree, 1 included.
    """

    def __init__(self, inner: ZeroStage, module: torch.nn.Module, mesh: ParallelMesh, *, clip: float) -> None:
        """Wrap ``inner`` (built over :func:`split_groups_for_tp` groups with ``gradient_clipping: 0``).

        Args:
            clip: the configured ``gradient_clipping`` (0 disables), applied here with the exact norm.
        """
        super().__init__(inner.ctx)
        self.inner, self.mesh, self.module, self.clip = inner, mesh, module, float(clip)
        self.tp_comm = mesh.tp_comm
        self.split = tp_params_of(module)
        self._norm: torch.Tensor | None = None
        self._hook = module.register_forward_pre_hook(self._check_batch, with_kwargs=True)
        opt = inner.optimizer
        if self.clip > 0.0 and opt is not None:
            if not hasattr(opt, "register_step_pre_hook"):
                raise ConfigError(
                    f"gradient_clipping with tensor_parallel needs a torch.optim.Optimizer, got {type(opt).__name__}; "
                    "set gradient_clipping: 0",
                    path="gradient_clipping",
                )
            opt.register_step_pre_hook(self._clip_hook)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "mesh", "module", "split", "tp_comm", "_hook", "clip", "_norm"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @torch.no_grad()
    def _clip_hook(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # runs inside the inner step, after reduction and unscaling: .grad holds the true averaged gradients
        grads: list[list[torch.Tensor]] = [[], []]
        for gi, group in enumerate(opt.param_groups):
            grads[gi % 2].extend(p.grad for p in group["params"] if p.grad is not None)
        # on the collective device (NCCL refuses host tensors), and no host sync: the clip coefficient stays a tensor
        device = collective_device(grads[0] + grads[1])
        sq = torch.zeros(2, dtype=torch.float64, device=device)
        for kind in (0, 1):
            if grads[kind]:
                norms = torch._foreach_norm(grads[kind], 2.0)
                sq[kind] = torch.stack([n.to(device, torch.float64) for n in norms]).pow(2).sum()
        if int(self.inner.stage) >= 1:  # partitions are disjoint over the gradient group: add them up
            self.mesh.grad_comm.all_reduce(sq)
        shards = sq[1:].clone()
        self.tp_comm.all_reduce(shards)  # every shard counted once, replicated parameters once
        norm = (sq[0] + shards[0]).sqrt()
        self._norm = norm.to(torch.float32)
        coef = (self.clip / (norm + 1e-6)).clamp(max=1.0).to(torch.float32)
        for kind in (0, 1):
            if grads[kind]:
                torch._foreach_mul_(grads[kind], coef.to(grads[kind][0].device))

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
        self._norm = None
        outcome = self.inner.step()
        if self._norm is not None and outcome.applied:
            return StepOutcome(applied=True, overflow=outcome.overflow, global_grad_norm=self._norm)
        return outcome

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def partition_bytes(self) -> dict[str, int]:
        return self.inner.partition_bytes()

    def empty_partition_cache(self) -> None:
        self.inner.empty_partition_cache()

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


def wrap_stage(inner: ZeroStage, module: torch.nn.Module, mesh: ParallelMesh, *, clip: float) -> TensorParallelStage:
    """``inner`` wrapped in a :class:`TensorParallelStage` subclass whose class attribute ``stage`` is the inner
    stage's (the engine and checkpoints read ``type(stage).stage``)."""
    cls = type(f"TensorParallel{type(inner).__name__}", (TensorParallelStage,), {"stage": int(type(inner).stage)})
    wrapped: TensorParallelStage = cls(inner, module, mesh, clip=clip)
    return wrapped
