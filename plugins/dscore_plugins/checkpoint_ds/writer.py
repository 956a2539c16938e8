"""Writing DeepSpeed 0.19.8's checkpoint layout, for tools that read DeepSpeed's files directly.

``engine.save_checkpoint(...)`` with ``engine.checkpoint_layout = "deepspeed"`` (what the ``deepspeed``
compatibility distribution sets) writes, inside the same atomic save protocol as dscore's own format
(temporary folder, every phase agreed across ranks, one rename, ``latest`` last)::

    <save_dir>/latest                                         the tag
    <save_dir>/<tag>/mp_rank_00_model_states.pt               ZeRO 1/2 (rank 0)
    <save_dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   ZeRO 3 (every rank)
    <save_dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   every rank
    <save_dir>/<tag>/_COMPLETE                                dscore's manifest ("layout": "deepspeed")

with DeepSpeed's keys and partitioning (``deepspeed/runtime/engine.py`` ``_save_checkpoint`` /
``_save_zero_checkpoint``, ``deepspeed/utils/zero_to_fp32.py``): the model-states file holds ``module``,
``buffer_names``, ``param_shapes`` (one ordered name -> shape map per parameter group), ``shared_params``,
``frozen_param_shapes`` / ``frozen_param_fragments``, ``lr_scheduler``, the counters, ``dp_world_size``,
``ds_config``, ``ds_version`` and the client state's keys. ZeRO 1/2 optimizer files hold
``single_partition_of_fp32_groups`` (each group's parameters flattened in order, padded to a multiple of
``2 * world_size``, cut into ``world_size`` equal partitions), the base optimizer's state over the same
partition, ``partition_count``, ``group_paddings`` and ``param_slice_mappings``; ZeRO-3 files hold
``fp32_flat_groups`` (per parameter ``ceil(numel / world_size)`` elements, rank ``r``'s slice, in
``param_shapes`` order). So DeepSpeed's ``zero_to_fp32.py`` and Lightning's converter read them, and
dscore reads them back with its safe loader (:mod:`dscore_plugins.checkpoint_ds.api`).

MoE models (``dscore.moe.layer.MoE``, AutoEP layers; ZeRO 1/2), as DeepSpeed's ``_save_moe_checkpoint``: the
model file without expert entries plus ``num_experts``; ``layer_<l>_expert_<e>_mp_rank_00_model_states.pt`` per
expert (global id ``e``, its entries named by it), written by the ranks of expert-data-parallel rank 0; each
expert group's optimizer partition covers the rank's own experts under local names, split over its
expert-data-parallel group (``partition_count`` per group). Expert entries are chosen by the layer's
``deepspeed_experts.`` prefix rather than DeepSpeed's "name contains 'expert'" test, so an AutoEP layer's
shared experts stay in the model file. Groups are flattened in module order, as DeepSpeed does.

Written without DeepSpeed classes: no loss-scaler object (the layout is written for fp32 and bf16 runs;
fp16 is refused), ``param_slice_mappings`` entries are ``{"start", "numel"}`` dicts instead of DeepSpeed's
``fragment_address`` objects (only DeepSpeed's universal-checkpoint conversion reads them).

ZeRO stage 0 (fp32), as DeepSpeed: rank 0 writes only ``mp_rank_00_model_states.pt`` whose ``optimizer`` is the
torch optimizer's ``state_dict()`` (state and ``params`` by index; the index of a parameter is its position among
the module's parameters, which is how the reader maps it back), ``param_shapes`` / ``shared_params`` /
``frozen_param_*`` None. Refused at stage 0: bf16 (DeepSpeed writes its BF16_Optimizer's ZeRO files there) and
frozen parameters (the index order cannot name them for the reader).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from dscore.errors import CheckpointError

__all__ = [
    "DEEPSPEED_VERSION",
    "ExpertLayer",
    "check_supported",
    "deepspeed_files",
    "expert_file_name",
    "model_file_name",
    "optim_file_name",
]

DEEPSPEED_VERSION = "0.19.8"


def model_file_name(stage: int, rank: int) -> str:
    """``mp_rank_00_model_states.pt`` (stages 1-2) or ``zero_pp_rank_<rank>_mp_rank_00_model_states.pt`` (3)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


def optim_file_name(rank: int) -> str:
    """``zero_pp_rank_<rank>_mp_rank_00_optim_states.pt``."""
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def expert_file_name(layer_id: int, expert_id: int) -> str:
    """``layer_<layer_id>_expert_<expert_id>_mp_rank_00_model_states.pt`` (global expert id)."""
    return f"layer_{layer_id}_expert_{expert_id}_mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer as the writer needs it (``dscore.moe.layer.MoE`` and AutoEP layers, in module order).

    Attributes:
        prefix: ``<layer>.deepspeed_moe.experts.deepspeed_experts.`` (the expert entries' name prefix).
        num_experts / ep_size: experts over ``ep_size`` expert-parallel ranks (``num_experts / ep_size`` each;
            a rank's EP position is ``rank % ep_size``, its expert-data-parallel one ``rank // ep_size``).
    """

    prefix: str
    num_experts: int
    ep_size: int

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    def split(self, name: str) -> tuple[int, str] | None:
        """``name`` -> (expert index, rest of the name), or None when it is not one of this layer's experts."""
        if not name.startswith(self.prefix):
            return None
        index, _, rest = name[len(self.prefix) :].partition(".")
        return (int(index), rest) if index.isdigit() else None


def _expert_of(layers: list[ExpertLayer], name: str) -> tuple[ExpertLayer, int, str] | None:
    for layer in layers:
        if (hit := layer.split(name)) is not None:
            return layer, hit[0], hit[1]
    return None


def check_supported(
    stage: int, fp16: bool, has_optimizer: bool, *, moe: bool = False, bf16: bool = False, frozen: bool = False
) -> None:
    """Refuse what this writer does not produce.

    Raises:
        CheckpointError: fp16 (DeepSpeed stores a loss-scaler object), no optimizer, an MoE model at ZeRO
            stage 0 or 3 (``moe``; DeepSpeed 0.19.8 has no ZeRO-3 layout for ``deepspeed.moe``), or at ZeRO stage 0
            bf16 or frozen parameters (``frozen``).
    """
    if moe and stage == 3:
        raise CheckpointError(
            "saving an MoE model (dscore.moe.layer.MoE) in DeepSpeed's checkpoint layout is supported at ZeRO stages "
            "1 and 2 (DeepSpeed's per-expert layer_<l>_expert_<e>_mp_rank_00_model_states.pt files); at stage 3 use "
            "engine.checkpoint_layout = 'dscore' (loads at any ep_size and stage)"
        )
    if stage == 0 and (bf16 or frozen or moe):
        what = "bf16 (DeepSpeed writes BF16_Optimizer ZeRO files there)" if bf16 else (
            "an MoE model" if moe else "frozen parameters (the optimizer's parameter indices cannot name them)"
        )
        raise CheckpointError(
            f"saving in DeepSpeed's checkpoint layout at ZeRO stage 0 is not supported with {what}; use ZeRO "
            "stage 1-3, or engine.checkpoint_layout = 'dscore'"
        )
    if fp16:
        raise CheckpointError(
            "saving in DeepSpeed's checkpoint layout is not supported with fp16 (DeepSpeed stores its loss-scaler "
            "object); use bf16 or fp32, or engine.checkpoint_layout = 'dscore'"
        )
    if not has_optimizer:
        raise CheckpointError(
            "saving in DeepSpeed's checkpoint layout needs an optimizer (the layout is built from its partitions); "
            "use engine.checkpoint_layout = 'dscore' for an optimizer-less engine"
        )


def _flat(tensors: list[torch.Tensor], total: int) -> torch.Tensor:
    out = torch.zeros(total, dtype=tensors[0].dtype if tensors else torch.float32, device="cpu")
    off = 0
    for t in tensors:
        n = t.numel()
        out[off : off + n].copy_(t.reshape(-1))
        off += n
    return out


def _shared_params(module: torch.nn.Module) -> dict[str, str]:
    """alias name -> the first name of the same parameter (tied weights), as DeepSpeed records them."""
    first: dict[int, str] = {}
    shared: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared[name] = first[id(p)]
        else:
            first[id(p)] = name
    return shared


def _run_state(counters: dict[str, Any], world: int, ds_config: Any) -> dict[str, Any]:
    """The run's keys of DeepSpeed's ``mp_rank_*_model_states.pt`` (counters, world sizes, config, version)."""
    return {
        "skipped_steps": int(counters.get("skipped_steps", 0)),
        "global_steps": int(counters.get("global_steps", 0)),
        "global_samples": int(counters.get("global_samples", 0)),
        "dp_world_size": world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config,
        "ds_version": DEEPSPEED_VERSION,
    }


def _stage0_files(
    module: torch.nn.Module,
    module_sd: dict[str, torch.Tensor],
    optim_sd: dict[str, Any],
    rank: int,
    world: int,
    counters: dict[str, int],
    lr_scheduler_state: Any,
    ds_config: dict[str, Any],
    client_state: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """ZeRO stage 0: rank 0's model-states file holding the torch-format optimizer state (see the module docs)."""
    if rank != 0:
        return {}
    index = {n: i for i, (n, _) in enumerate(module.named_parameters())}  # tied parameters once, module order
    groups: list[dict[str, Any]] = optim_sd.get("param_groups") or []
    by_name: dict[str, dict[str, Any]] = optim_sd.get("state") or {}
    owned = [n for g in groups for n in g.get("param_names") or []]
    if sorted(owned, key=lambda n: index.get(n, -1)) != list(index) or len(set(owned)) != len(owned):
        raise CheckpointError(
            "the optimizer's parameters are not the module's parameters one for one "
            f"({len(owned)} in the optimizer, {len(index)} in the module); DeepSpeed's stage-0 layout maps optimizer "
            "indices to module parameters in order: use engine.checkpoint_layout = 'dscore'"
        )
    param_groups = [
        {**{k: v for k, v in g.items() if k != "param_names"}, "params": [index[n] for n in g.get("param_names") or []]}
        for g in groups
    ]
    state = {index[n]: dict(v) for n, v in by_name.items() if v}
    model_state: dict[str, Any] = {
        "module": OrderedDict((k, v.detach().cpu()) for k, v in module_sd.items()),
        "buffer_names": [n for n, _ in module.named_buffers() if n in module_sd],
        "optimizer": {"state": state, "param_groups": param_groups},
        "param_shapes": None,
        "frozen_param_shapes": None,
        "shared_params": None,
        "frozen_param_fragments": None,
        "lr_scheduler": lr_scheduler_state,
        "data_sampler": None,
        "random_ltd": None,
        **_run_state(counters, world, ds_config),
    }
    model_state.update(client_state)  # DeepSpeed merges the client's keys into the same dict
    return {model_file_name(0, 0): model_state}


def deepspeed_files(
    *,
    module: torch.nn.Module,
    module_sd: dict[str, torch.Tensor],
    optim_sd: dict[str, Any],
    stage: int,
    rank: int,
    world: int,
    counters: dict[str, int],
    lr_scheduler_state: Any,
    ds_config: dict[str, Any],
    client_state: dict[str, Any],
    experts: list[ExpertLayer] | None = None,
) -> dict[str, dict[str, Any]]:
    """The objects this rank writes (file name -> object for ``torch.save``).

    Args:
        module: the engine's module (names of parameters, buffers, tied and frozen parameters).
        module_sd: the full module state dict (``ZeroStage.module_state_dict()``, collective).
        optim_sd: the full optimizer state (``ZeroStage.state_dict()``: ``param_groups`` with
            ``param_names``, ``state`` and ``fp32_params`` by name).
        stage: ZeRO stage 0, 1, 2 or 3; rank / world: this rank and the data-parallel world size.
        counters: ``global_steps``, ``global_samples``, ``skipped_steps``.
        lr_scheduler_state: the engine's scheduler state dict or None.
        ds_config: the config as given (stored for inspection, as DeepSpeed does).
        client_state: the user's keys, merged into the model-states dict (DeepSpeed's behaviour).
        experts: the model's MoE layers in module order (stages 1-2). ``module_sd`` / ``optim_sd`` name
            experts by global id (dscore's stage state dicts do); then, as DeepSpeed's ``_save_moe_checkpoint``:
            the model file holds no expert entries plus ``num_experts`` (one count per layer) and
            ``ds_autoep_layers: None``; ranks of expert-data-parallel rank 0 write
            ``layer_<l>_expert_<e>_mp_rank_00_model_states.pt`` per own expert (its entries, global ids);
            an expert group's optimizer partition covers this rank's experts under their *local* names,
            split over the ``world / ep_size`` ranks of its expert-data-parallel group.

    Raises:
        CheckpointError: a parameter of a group has no fp32 master in ``optim_sd``, or a group mixes expert
            and other parameters.
    """
    if stage == 0:
        return _stage0_files(module, module_sd, optim_sd, rank, world, counters, lr_scheduler_state, ds_config, client_state)
    layers = list(experts or [])
    fp32: dict[str, torch.Tensor] = optim_sd.get("fp32_params") or {}
    state: dict[str, dict[str, Any]] = optim_sd.get("state") or {}
    groups: list[dict[str, Any]] = optim_sd.get("param_groups") or []
    names_by_group = [list(g.get("param_names") or []) for g in groups]
    missing = [n for names in names_by_group for n in names if n not in fp32]
    if missing:
        raise CheckpointError(f"no fp32 master weights for {missing[:4]} in the optimizer state; cannot write the layout")
    # per group: (this rank's name, the state dicts' name), partition world size, this rank's partition
    views: list[tuple[list[tuple[str, str]], int, int]] = []
    for g, names in enumerate(names_by_group):
        hits = [_expert_of(layers, n) for n in names]
        if not names or not any(hits):
            views.append(([(n, n) for n in names], world, rank))
            continue
        ep_sizes = {h[0].ep_size for h in hits if h is not None}
        if not all(hits) or len(ep_sizes) != 1:
            raise CheckpointError(
                f"optimizer parameter group {g} mixes MoE expert parameters with others (or expert-parallel sizes); "
                "DeepSpeed's layout needs split_params_into_different_moe_groups_for_optimizer groups"
            )
        ep = ep_sizes.pop()
        own = []
        for n, hit in zip(names, hits):
            assert hit is not None
            layer, gid, rest = hit
            if gid // layer.num_local == rank % ep:
                own.append((f"{layer.prefix}{gid % layer.num_local}.{rest}", n))
        views.append((own, world // ep, rank // ep))
    # DeepSpeed flattens each group in registration order (dscore's stages may keep another order)
    position = {n: i for i, (n, _) in enumerate(module.named_parameters(remove_duplicate=False))}
    for view, _, _ in views:
        if all(local in position for local, _ in view):
            view.sort(key=lambda pair: position[pair[0]])
    shapes = [OrderedDict((local, torch.Size(fp32[n].shape)) for local, n in view) for view, _, _ in views]
    trainable = {n for names in names_by_group for n in names}
    shared = _shared_params(module)

    def global_name(local: str) -> str:
        hit = _expert_of(layers, local)
        if hit is None:
            return local
        layer, index, rest = hit
        return f"{layer.prefix}{(rank % layer.ep_size) * layer.num_local + index}.{rest}"

    frozen = [
        global_name(n) for n, p in module.named_parameters() if not p.requires_grad and global_name(n) not in trainable
    ]
    frozen = [n for n in frozen if _expert_of(layers, n) is None]  # frozen experts: in their expert files
    buffer_names = [n for n, _ in module.named_buffers() if n in module_sd]
    hypers = [{k: v for k, v in g.items() if k != "param_names"} for g in groups]

    base_state: dict[int, dict[str, Any]] = {}
    out: dict[str, dict[str, Any]] = {}
    if stage in (1, 2):
        parts, mappings, paddings, counts = [], [], [], []
        for g, (view, part_world, part_rank) in enumerate(views):
            names = [n for _, n in view]
            align = 2 * part_world  # DeepSpeed aligns each group to 2 x its partition group's size
            total = sum(fp32[n].numel() for n in names)
            padded = max(align, math.ceil(total / align) * align)
            per = padded // part_world
            lo, hi = part_rank * per, (part_rank + 1) * per
            parts.append(_flat([fp32[n].float() for n in names], padded)[lo:hi].clone())
            slot: dict[str, Any] = {}
            keys = {k for n in names for k, v in state.get(n, {}).items() if torch.is_tensor(v) and v.dim() > 0}
            for k in sorted(keys):
                slot[k] = _flat([state[n][k] for n in names], padded)[lo:hi].clone()
            for n in names:  # scalar entries (Adam's step) are per group in DeepSpeed's flat optimizer
                for k, v in state.get(n, {}).items():
                    if k not in keys:
                        slot.setdefault(k, v.clone() if torch.is_tensor(v) else v)
            base_state[g] = slot
            mapping: OrderedDict[str, dict[str, int]] = OrderedDict()
            off = 0
            for local, n in view:
                numel = fp32[n].numel()
                start, end = max(off, lo), min(off + numel, hi)
                if start < end:
                    mapping[local] = {"start": start - lo, "numel": end - start}
                off += numel
            mappings.append(mapping)
            paddings.append(padded - total if part_rank == part_world - 1 else 0)
            counts.append(part_world)
        osd: dict[str, Any] = {
            "loss_scaler": None,
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": None,
            "base_optimizer_state": {
                "state": base_state,
                "param_groups": [dict(h, params=[g]) for g, h in enumerate(hypers)],
            },
            "single_partition_of_fp32_groups": parts,
            "zero_stage": stage,
            "group_paddings": paddings,
            "partition_count": counts,
            "ds_version": DEEPSPEED_VERSION,
            "param_slice_mappings": mappings,
        }
    else:
        flats = []
        for g, names in enumerate(names_by_group):
            pers = [math.ceil(fp32[n].numel() / world) for n in names]

            def own(t: torch.Tensor, per: int) -> torch.Tensor:
                full = torch.zeros(per * world, dtype=t.dtype, device="cpu")
                full[: t.numel()].copy_(t.reshape(-1))
                return full[rank * per : (rank + 1) * per]

            flats.append(torch.cat([own(fp32[n].float(), per) for n, per in zip(names, pers)]) if names else
                         torch.zeros(0, dtype=torch.float32, device="cpu"))
            keys = {k for n in names for k, v in state.get(n, {}).items() if torch.is_tensor(v) and v.dim() > 0}
            slot = {k: torch.cat([own(state[n][k], per) for n, per in zip(names, pers)]) for k in sorted(keys)}
            for n in names:
                for k, v in state.get(n, {}).items():
                    if k not in keys:
                        slot.setdefault(k, v.clone() if torch.is_tensor(v) else v)
            base_state[g] = slot
        osd = {
            "zero_stage": 3,
            "loss_scaler": None,
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": world,
            "optimizer_state_dict": {
                "state": base_state,
                "param_groups": [dict(h, params=[g]) for g, h in enumerate(hypers)],
            },
            "fp32_flat_groups": flats,
            "ds_version": DEEPSPEED_VERSION,
        }
    out[optim_file_name(rank)] = {"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": DEEPSPEED_VERSION}

    if layers and rank // min(layer.ep_size for layer in layers) == 0:
        # DeepSpeed: expert-data-parallel rank 0 of each layer's groups writes its own experts, one file each
        for layer_id, layer in enumerate(layers):
            if rank // layer.ep_size:
                continue
            for local in range(layer.num_local):
                gid = (rank % layer.ep_size) * layer.num_local + local
                head = f"{layer.prefix}{gid}."
                entries = {k: v.detach().cpu().clone() for k, v in module_sd.items() if k.startswith(head)}
                out[expert_file_name(layer_id, gid)] = entries
    if layers:
        module_sd = OrderedDict((k, v) for k, v in module_sd.items() if _expert_of(layers, k) is None)

    if stage == 3 or rank == 0:
        param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        if stage == 3:  # DeepSpeed's stage-3 module state holds empty placeholders for partitioned parameters
            sd = OrderedDict(
                (k, torch.empty(0, dtype=v.dtype, device="cpu") if k in param_names and k not in frozen else v.detach().cpu())
                for k, v in module_sd.items()
            )
            fragments = {}
            for n in frozen:
                t = module_sd[n].detach().cpu().reshape(-1)
                per = math.ceil(t.numel() / world)
                full = torch.zeros(per * world, dtype=t.dtype, device="cpu")
                full[: t.numel()].copy_(t)
                fragments[n] = full[rank * per : (rank + 1) * per].clone()
        else:
            sd = OrderedDict((k, v.detach().cpu()) for k, v in module_sd.items())
            fragments = {n: module_sd[n].detach().cpu() for n in frozen}
        model_state: dict[str, Any] = {
            "module": sd,
            "buffer_names": buffer_names,
            "optimizer": None,
            "param_shapes": shapes,
            "frozen_param_shapes": OrderedDict((n, torch.Size(module_sd[n].shape)) for n in frozen),
            "shared_params": shared,
            "frozen_param_fragments": fragments,
            "lr_scheduler": lr_scheduler_state,
            "data_sampler": None,
            "random_ltd": None,
            **_run_state(counters, world, ds_config),
        }
        if layers:
            model_state["num_experts"] = [layer.num_experts for layer in layers]
            model_state["ds_autoep_layers"] = None
        for key, value in client_state.items():  # DeepSpeed merges the client's keys into the same dict
            model_state[key] = value
        out[model_file_name(stage, rank)] = model_state
    return out
