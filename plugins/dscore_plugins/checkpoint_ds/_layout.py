"""Recognising a DeepSpeed save directory and working out where every parameter's bytes are.

A DeepSpeed 0.19.8 save directory (``engine.save_checkpoint(save_dir)``)::

    <save_dir>/latest                                         text: the newest tag
    <save_dir>/<tag>/mp_rank_00_model_states.pt               stages 0-2: module, counters, scheduler,
                                                              client_state keys; stage 0: the optimizer
    <save_dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3: one per rank (placeholders
                                                              for the partitioned parameters)
    <save_dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  stages 1-3 (and bf16 stage 0
                                                              in some versions): rank r's partition of
                                                              the fp32 master weights and moments

MoE (ZeRO 1/2): ``layer_<l>_expert_<e>_mp_rank_00_model_states.pt`` hold expert ``e`` (global id) of MoE layer
``l``; the model file lists ``num_experts`` per layer and no expert entries; an expert group's optimizer
partition on rank r covers the experts of EP rank ``r % ep_size`` under local names, over ``ws / ep_size``
ranks (``partition_count``). They are renamed to global ids here, so any ep_size loads them.

How each layout stores a parameter (facts from DeepSpeed's files and its ``zero_to_fp32`` script):

* **ZeRO 1/2** (and ``BF16_Optimizer``): per parameter group, one flat fp32 vector split evenly over the
  ranks (``single_partition_of_fp32_groups[g]``); ``param_slice_mappings[g]`` gives, per rank, each
  parameter's ``(start, numel)`` inside that rank's partition; moments have the partition's layout.
* **ZeRO 3**: every parameter is split on its own into ``ceil(numel / world_size)``-element slices (the
  last rank's padded); rank r's ``fp32_flat_groups[i]`` concatenates its slices of the parameters of
  sub-group i in ``param_shapes`` order.
* **Stage 0**: the optimizer's own ``state_dict`` in the model file: either torch-style (state by
  parameter index, fp32 module weights are the masters) or FP16_Optimizer-style (``fp32_groups_flat``:
  one flat master vector per group over the group's parameters in module order).

Every layout is reduced to :class:`Piece` lists (one contiguous run of a parameter's flattened elements
inside one flat source tensor of one file), so assembling full tensors (engine load) and streaming them
into a file (import/export) share one description, validated before anything is read in bulk.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from typing import Any

from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore_plugins.checkpoint_ds._detect import (
    _Z3MODEL_RE,
    DEEPSPEED_ENGINE_KEYS,
    EXPERT_RE,
    MODEL_RE,
    MOE_RE,
    OPTIM_RE,
    PIPE_RE,
    resolve_deepspeed_tag,
)
from dscore_plugins.checkpoint_ds._pieces import (
    ParamInfo,
    Piece,
    Shard,
    bad_file,
    base_groups,
    optimizer_sd,
    scaler_state,
)
from dscore_plugins.checkpoint_ds._unpickle import DSFragment, safe_load

__all__ = ["DeepSpeedCheckpoint", "ordered"]


class DeepSpeedCheckpoint:
    """One tag of a DeepSpeed save directory, parsed and validated (metadata only; tensors stay on disk).

    Args:
        save_dir: the directory given to DeepSpeed's ``save_checkpoint``.
        tag: the tag directory name; None reads ``latest`` (``latest_universal`` with ``universal``).
        universal: resolve through ``latest_universal`` (DeepSpeed's ``checkpoint.load_universal``).

    Attributes:
        tag, tag_dir, stage (0-3), world_size (data-parallel ranks at save), params (trainable
        :class:`ParamInfo` in optimizer order), module_keys, buffer_names, shared (alias -> source name),
        shards (:class:`Shard` per file with pieces), group_hypers (per group, or None), counters,
        lr_scheduler, loss_scaler (dscore form), client_state, ds_config, model_file.

    Raises:
        CheckpointNotFoundError: the directory, tag or a shard file is missing (named).
        CheckpointError: an unknown layout (pipeline/tensor/expert parallel, mp_rank_01, universal), a world
            size that cannot be worked out, shards that disagree, or a file that cannot be read safely.
    """

    def __init__(self, save_dir: str | os.PathLike[str], tag: str | None = None, *, universal: bool = False) -> None:
        self.save_dir = os.path.abspath(os.fspath(save_dir))
        resolved = resolve_deepspeed_tag(self.save_dir, tag, universal=universal)
        assert resolved is not None
        self.tag = resolved
        self.tag_dir = os.path.join(self.save_dir, self.tag)
        self._scan()
        self._parse()

    # ------------------------------------------------------------------------------------ files
    def _scan(self) -> None:
        names = sorted(os.listdir(self.tag_dir))
        td = self.tag_dir
        pipe = [n for n in names if PIPE_RE.match(n)]
        if pipe:
            raise CheckpointError(
                f"{td} holds pipeline-parallel layer files ({', '.join(pipe[:4])}{' ...' if len(pipe) > 4 else ''}); "
                "dscore reads data-parallel (ZeRO) DeepSpeed checkpoints only"
            )
        self.expert_files: dict[tuple[int, int], str] = {}
        for n in names:
            if (m := EXPERT_RE.match(n)) and m.group(3) == "00":
                self.expert_files[(int(m.group(1)), int(m.group(2)))] = n
        moe = [n for n in names if MOE_RE.search(n) and n.endswith(".pt") and n not in self.expert_files.values()]
        if moe:
            raise CheckpointError(
                f"{td} holds expert-parallel (MoE) files dscore does not read ({', '.join(moe[:4])}): it reads "
                "DeepSpeed's per-layer expert files layer_<l>_expert_<e>_mp_rank_00_model_states.pt with ZeRO 1/2 "
                "optimizer files (not the pre-0.6 expert_<e>_* names, nor stage 0's expp_rank_<r>_* optimizer files)"
            )
        model0 = [n for n in names if MODEL_RE.match(n)]
        z3model = [n for n in names if _Z3MODEL_RE.match(n)]
        optim = [n for n in names if OPTIM_RE.match(n)]
        mp = sorted(
            {int(m.group(1)) for n in model0 if (m := MODEL_RE.match(n))}
            | {int(m.group(2)) for n in z3model if (m := _Z3MODEL_RE.match(n))}
            | {int(m.group(3)) for n in optim if (m := OPTIM_RE.match(n))}
        )
        if mp and mp != [0]:
            others = [n for n in names if re.search(r"mp_rank_(?!00_)\d+", n)]
            raise CheckpointError(
                f"{td} holds tensor/model-parallel files ({', '.join(others[:4])}): model-parallel ranks {mp}; "
                "dscore reads data-parallel (ZeRO) DeepSpeed checkpoints only (mp_rank_00)"
            )
        if not model0 and not z3model:
            found = ", ".join(names[:8]) or "nothing"
            raise CheckpointNotFoundError(
                f"{td} has no DeepSpeed model-states file (mp_rank_00_model_states.pt or "
                f"zero_pp_rank_<r>_mp_rank_00_model_states.pt); it holds: {found}"
            )
        by_rank: dict[int, str] = {}
        for n in optim:
            m = OPTIM_RE.match(n)
            assert m is not None
            r = int(m.group(2))
            if r in by_rank:
                raise CheckpointError(
                    f"{td} holds two optimizer-state files for rank {r} ({by_rank[r]} and {n}); remove the stale one"
                )
            by_rank[r] = n
        self.optim_files = by_rank
        self.z3_model_files = {int(m.group(1)): n for n in z3model if (m := _Z3MODEL_RE.match(n))}
        self.model_file = os.path.join(td, model0[0] if model0 else self.z3_model_files.get(0, z3model[0]))

    def _rank_files(self, files: dict[int, str], ws: int, what: str, pattern: str) -> list[str]:
        missing = [pattern.format(r=r) for r in range(ws) if r not in files]
        extra = [files[r] for r in sorted(files) if r >= ws]
        if missing:
            raise CheckpointNotFoundError(
                f"DeepSpeed checkpoint {self.tag_dir} was saved by {ws} rank(s) but is missing {what} "
                f"{', '.join(missing)}; every rank's file is needed"
            )
        if extra:
            raise CheckpointError(
                f"DeepSpeed checkpoint {self.tag_dir} records {ws} rank(s) but also holds {', '.join(extra)}; "
                "the files come from different saves"
            )
        return [os.path.join(self.tag_dir, files[r]) for r in range(ws)]

    # ------------------------------------------------------------------------------------ parse
    def _parse(self) -> None:
        ms = safe_load(self.model_file)
        if not isinstance(ms, dict) or "module" not in ms:
            raise bad_file(self.model_file, "no 'module' entry")
        self.model_state = ms
        path = self.model_file
        dims = ms.get("checkpoint_parallel_dimensions") or {}
        if isinstance(dims, dict) and any(int(dims.get(k, 1) or 1) > 1 for k in ("pp_degree", "tp_degree")):
            raise CheckpointError(
                f"{path} was saved with pipeline/tensor parallelism ({dims}); dscore reads data-parallel (ZeRO) "
                "DeepSpeed checkpoints only"
            )
        if int(ms.get("mp_world_size", 1) or 1) != 1:
            raise CheckpointError(
                f"{path} records mp_world_size={ms['mp_world_size']}; dscore reads data-parallel (ZeRO) DeepSpeed "
                "checkpoints only"
            )
        module = ms["module"]
        if not isinstance(module, dict):
            raise bad_file(path, f"'module' is a {type(module).__name__}, expected a state dict")
        self.module = module
        self.moe_layers: list[tuple[str, int]] = []  # (key prefix, num_experts) per MoE layer id
        if self.expert_files:
            self._merge_experts(ms)
        self.module_keys = list(module.keys())
        self.buffer_names = [str(b) for b in (ms.get("buffer_names") or [])]
        self.shared: dict[str, str] = {str(k): str(v) for k, v in (ms.get("shared_params") or {}).items()}
        self.ds_config = ms.get("ds_config") if isinstance(ms.get("ds_config"), dict) else {}
        self.client_state = {k: v for k, v in ms.items() if k not in DEEPSPEED_ENGINE_KEYS}
        self.counters = {
            "global_steps": int(ms.get("global_steps", 0) or 0),
            "global_samples": int(ms.get("global_samples", 0) or 0),
            "skipped_steps": int(ms.get("skipped_steps", 0) or 0),
        }
        self.lr_scheduler = ms.get("lr_scheduler")
        self.data_sampler = ms.get("data_sampler")
        ws_saved = ms.get("dp_world_size")
        if self.optim_files or self.z3_model_files:
            counts = len(self.optim_files) if self.optim_files else len(self.z3_model_files)
            if ws_saved is None:
                ranks = sorted(self.optim_files or self.z3_model_files)
                if ranks != list(range(len(ranks))):
                    files = sorted((self.optim_files or self.z3_model_files).values())
                    raise CheckpointError(
                        f"cannot work out the world size of DeepSpeed checkpoint {self.tag_dir}: {path} has no "
                        f"dp_world_size and the rank files present ({', '.join(files)}) are not ranks 0..N-1"
                    )
                ws_saved = counts
        self.world_size = int(ws_saved or 1)
        if self.world_size < 1:
            raise CheckpointError(f"{path} records dp_world_size={ws_saved}; expected a positive integer")
        self.group_hypers: list[dict[str, Any]] | None = None
        self.loss_scaler: dict[str, Any] | None = None
        self.shards: list[Shard] = []
        self.params: list[ParamInfo] = []
        self.frozen_pieces: list[Shard] = []
        self.frozen_shapes: dict[str, tuple[int, ...]] = {}
        self.has_optimizer = True
        self.slot_steps: dict[tuple[int, int], Any] = {}
        if self.expert_files and (self.z3_model_files or not self.optim_files):
            raise CheckpointError(
                f"DeepSpeed checkpoint {self.tag_dir} holds MoE expert files with "
                f"{'ZeRO-3' if self.z3_model_files else 'no ZeRO'} state; dscore reads DeepSpeed's MoE layout at ZeRO "
                "stages 1 and 2"
            )
        if self.z3_model_files:
            self.stage = 3
            self._parse_zero3()
        elif self.optim_files:
            self._parse_zero12()
        elif isinstance(ms.get("optimizer"), dict):
            self.stage = 0
            self._parse_stage0(ms["optimizer"])
        else:
            self.stage = int(((self.ds_config or {}).get("zero_optimization") or {}).get("stage", 0) or 0)
            if self.stage:
                raise CheckpointNotFoundError(
                    f"DeepSpeed checkpoint {self.tag_dir} was saved with ZeRO stage {self.stage} (ds_config) but holds "
                    "no zero_pp_rank_<r>_mp_rank_00_optim_states.pt files"
                )
            self.has_optimizer = False
            self._params_from_module(None)
        self._check_pieces()

    def _merge_experts(self, ms: dict[str, Any]) -> None:
        """Add every expert file's entries (global expert ids in the names) to :attr:`module`; record each
        MoE layer's key prefix and expert count (``num_experts`` of the model file, by layer id)."""
        counts = ms.get("num_experts")
        if not isinstance(counts, list) or not all(isinstance(c, int) and c > 0 for c in counts):
            first = min(self.expert_files)
            raise bad_file(
                self.model_file,
                f"expert files are present ({self.expert_files[first]}, ...) but "
                f"'num_experts' is {counts!r}, not a list",
            )
        wanted = {(layer, e) for layer, n in enumerate(counts) for e in range(n)}
        missing = sorted(wanted - set(self.expert_files))
        extra = sorted(set(self.expert_files) - wanted)
        if missing:
            raise CheckpointNotFoundError(
                f"DeepSpeed checkpoint {self.tag_dir} records num_experts={counts} but lacks "
                f"{', '.join(f'layer_{a}_expert_{b}_mp_rank_00_model_states.pt' for a, b in missing[:4])}"
                f"{' ...' if len(missing) > 4 else ''}; every expert's file is needed"
            )
        if extra:
            raise CheckpointError(
                f"DeepSpeed checkpoint {self.tag_dir} records num_experts={counts} but also holds "
                f"{', '.join(self.expert_files[k] for k in extra[:4])}; the files come from different saves"
            )
        for layer, n in enumerate(counts):
            prefix = None
            for e in range(n):
                path = os.path.join(self.tag_dir, self.expert_files[(layer, e)])
                sd = safe_load(path)
                if not isinstance(sd, dict) or not sd:
                    raise bad_file(path, "not a non-empty state dict")
                for key, value in sd.items():
                    m = re.match(rf"^(.*\.deepspeed_experts\.){e}\.", str(key))
                    if m is None or (prefix is not None and m.group(1) != prefix):
                        raise bad_file(path, f"entry {key!r} is not expert {e} of MoE layer {layer}")
                    prefix = m.group(1)
                    if key in self.module:
                        raise bad_file(path, f"entry {key!r} is also in {self.model_file}")
                    self.module[key] = value
            assert prefix is not None
            self.moe_layers.append((prefix, n))

    def _expert_renamer(self, rank: int, ep_size: int, path: str) -> Any:
        """Local expert name on ``rank`` (one of ``ep_size`` expert-parallel ranks: DeepSpeed's EP group of
        a rank is ``rank % ep_size``) -> the global name the expert files use."""

        def rename(name: str) -> str:
            for prefix, n in self.moe_layers:
                if name.startswith(prefix):
                    local, _, rest = name[len(prefix) :].partition(".")
                    if n % ep_size or not local.isdigit() or int(local) >= n // ep_size:
                        raise CheckpointError(
                            f"{path}: expert entry {name!r} does not fit {n} experts over {ep_size} expert-parallel "
                            "rank(s)"
                        )
                    return f"{prefix}{(rank % ep_size) * (n // ep_size) + int(local)}.{rest}"
            raise CheckpointError(f"{path}: {name!r} is in an expert parameter group but is no MoE layer's expert")

        return rename

    def _module_param_names(self) -> list[str]:
        """Parameter names of the module state dict in order, tied duplicates (shared storage) dropped."""
        import torch

        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        out: list[str] = []
        buffers = set(self.buffer_names)
        for k, v in self.module.items():
            if k in buffers or not isinstance(v, torch.Tensor):
                continue
            if k in self.shared:
                continue
            key: tuple[int, int, tuple[int, ...]] = (
                (int(v.untyped_storage().data_ptr()), int(v.storage_offset()), tuple(int(s) for s in v.shape))
                if v.numel()
                else (id(v), 0, ())
            )
            if key in seen:
                self.shared.setdefault(k, next(n for n in out if self._key_of(n) == key))
                continue
            seen.add(key)
            out.append(k)
        return out

    def _key_of(self, name: str) -> tuple[int, int, tuple[int, ...]]:
        v = self.module[name]
        return (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else (id(v), 0, ())

    def _params_from_module(self, groups_of: list[int] | None) -> None:
        names = self._module_param_names()
        self.params = [
            ParamInfo(n, tuple(self.module[n].shape), 0 if groups_of is None else groups_of[i])
            for i, n in enumerate(names)
        ]

    # stage 0 ------------------------------------------------------------------------------------
    def _parse_stage0(self, opt: dict[str, Any]) -> None:
        import torch

        path = self.model_file
        self.loss_scaler = scaler_state(opt)
        names = self._module_param_names()
        shard = Shard(path, 0, "torch0")
        if "fp32_groups_flat" in opt or "fp32_groups" in opt:
            inner = opt.get("optimizer_state_dict")
            if not isinstance(inner, dict):
                raise bad_file(path, "the stage-0 optimizer has no 'optimizer_state_dict'")
            self.group_hypers = inner.get("param_groups")
            if "fp32_groups_flat" in opt:
                flats = opt["fp32_groups_flat"]
                shard.kind = "flat0"
                i = 0
                for g, flat in enumerate(flats):
                    if not isinstance(flat, torch.Tensor):
                        raise bad_file(path, f"fp32_groups_flat[{g}] is not a tensor")
                    off = 0
                    while off < flat.numel() and i < len(names):
                        n = names[i]
                        shape = tuple(self.module[n].shape)
                        numel = int(math.prod(shape))
                        self.params.append(ParamInfo(n, shape, g))
                        shard.pieces.append(Piece(n, g, off, 0, numel))
                        off += numel
                        i += 1
                    if off != flat.numel():
                        raise CheckpointError(
                            f"{path}: fp32_groups_flat[{g}] holds {flat.numel()} elements but the module's parameters "
                            f"in order give {off}; the parameter groups are not contiguous in module order, which "
                            "dscore cannot map back to names for a stage-0 checkpoint"
                        )
                if i != len(names):
                    raise CheckpointError(
                        f"{path}: fp32_groups_flat covers {i} of the module's {len(names)} parameters "
                        f"(first not covered: {names[i]!r}); frozen parameters in a stage-0 fp16/bf16 checkpoint are "
                        "not supported"
                    )
            else:  # FP16_UnfusedOptimizer: per-parameter fp32 masters
                shard.kind = "torch0"
                i = 0
                for g, group in enumerate(opt["fp32_groups"]):
                    for t in group:
                        if i >= len(names) or tuple(t.shape) != tuple(self.module[names[i]].shape):
                            raise CheckpointError(f"{path}: fp32_groups do not follow the module's parameter order")
                        self.params.append(ParamInfo(names[i], tuple(t.shape), g))
                        shard.pieces.append(Piece(names[i], i, 0, 0, t.numel()))
                        i += 1
            self.shards = [shard]
            self._stage0_inner = inner
            return
        # torch-style optimizer state dict: state and params by index in param_groups order
        groups = opt.get("param_groups")
        if not isinstance(groups, list):
            raise bad_file(path, "the stage-0 optimizer state has no 'param_groups' list")
        self.group_hypers = groups
        index_group: dict[int, int] = {}
        for g, grp in enumerate(groups):
            for idx in grp.get("params", []):
                index_group[int(idx)] = g
        order = sorted(index_group)
        if order != list(range(len(order))) or len(order) != len(names):
            raise CheckpointError(
                f"{path}: the optimizer has {len(order)} parameter(s) but the module {len(names)}; dscore maps "
                "stage-0 optimizer entries to module parameters in order and cannot here (frozen parameters?)"
            )
        state = opt.get("state", {})
        for i, n in enumerate(names):
            shape = tuple(self.module[n].shape)
            for k, v in (state.get(i) or {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != shape:
                    raise CheckpointError(
                        f"{path}: optimizer state {k!r} of parameter #{i} has shape {tuple(v.shape)} but module "
                        f"parameter {n!r} (#{i} in order) has {shape}; parameter groups not in module order"
                    )
            self.params.append(ParamInfo(n, shape, index_group[i]))
            shard.pieces.append(Piece(n, i, 0, 0, int(math.prod(shape))))
        self.shards = [shard]
        self._stage0_inner = opt

    # ZeRO 1/2 -----------------------------------------------------------------------------------
    def _parse_zero12(self) -> None:
        import torch

        ms = self.model_state
        files = self._rank_files(
            self.optim_files,
            self.world_size,
            "optimizer-state file(s)",
            "[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        )
        shapes = ms.get("param_shapes")
        if not isinstance(shapes, list) or not shapes:
            raise bad_file(self.model_file, "a ZeRO checkpoint without 'param_shapes'")
        ws = self.world_size
        # MoE: an expert group is partitioned over its expert-data-parallel group (ws / ep_size ranks) and
        # each rank's file names its own experts by local index; param_shapes lists rank 0's experts only
        osd0 = optimizer_sd(safe_load(files[0]), files[0])
        pc0 = osd0.get("partition_count")
        pcs0 = pc0 if isinstance(pc0, list) else [pc0] * len(shapes)
        ep_sizes: list[int] = []
        for p in pcs0:
            count = int(p) if p is not None else ws
            if count != ws and not (self.moe_layers and count >= 1 and ws % count == 0):
                raise CheckpointError(
                    f"{files[0]} was partitioned over {pcs0} rank(s) but {self.model_file} records dp_world_size="
                    f"{ws}; the files come from different saves"
                )
            ep_sizes.append(ws // count if self.moe_layers and count != ws else 1)
        expert_groups = {g for g, grp in enumerate(shapes) if self.moe_layers and self._is_expert_group(grp)}
        for g, e in enumerate(ep_sizes):
            if e > 1 and g not in expert_groups:
                raise CheckpointError(
                    f"{files[0]}: parameter group {g} is partitioned over {pcs0[g]} of {ws} ranks but holds "
                    "non-expert parameters; the files come from different saves"
                )
        order: list[ParamInfo] = []
        for g, grp in enumerate(shapes):
            views = range(ep_sizes[g]) if g in expert_groups else [None]
            for view in views:
                rename = self._expert_renamer(view, ep_sizes[g], self.model_file) if view is not None else str
                for n, s in grp.items():
                    order.append(ParamInfo(rename(str(n)), tuple(int(x) for x in s), g))
        self.params = order
        by_name = {p.name: p for p in order}
        filled: dict[str, int] = {}
        stage = None
        for r, fpath in enumerate(files):
            osd = osd0 if r == 0 else optimizer_sd(safe_load(fpath), fpath)
            stage_r = osd.get("zero_stage")
            stage = int(stage_r) if stage_r is not None else (stage if stage is not None else 2)
            pc = osd.get("partition_count")
            pcs = pc if isinstance(pc, list) else [pc] * len(shapes)
            if [int(p) if p is not None else ws for p in pcs] != [ws // e for e in ep_sizes]:
                raise CheckpointError(
                    f"{fpath} was partitioned over {pcs} rank(s) but {files[0]} over {pcs0}; the files come from "
                    "different saves"
                )
            if r == 0:
                self.loss_scaler = scaler_state(osd)
                _, self.group_hypers = base_groups(osd, fpath)
            parts = osd.get("single_partition_of_fp32_groups")
            maps = osd.get("param_slice_mappings")
            if (
                not isinstance(parts, list)
                or not isinstance(maps, list)
                or len(parts) != len(shapes)
                or len(maps) != len(shapes)
            ):
                raise bad_file(fpath, "single_partition_of_fp32_groups / param_slice_mappings missing or not one per group")
            shard = Shard(fpath, r, "zero12")
            for g, (part, mapping) in enumerate(zip(parts, maps)):
                if not isinstance(part, torch.Tensor):
                    raise bad_file(fpath, f"single_partition_of_fp32_groups[{g}] is not a tensor")
                for n, frag in mapping.items():
                    if isinstance(frag, dict) and set(frag) == {"start", "numel"}:  # dscore's writer: plain dicts
                        frag = DSFragment.of(int(frag["start"]), int(frag["numel"]))
                    if not isinstance(frag, DSFragment):
                        raise bad_file(fpath, f"param_slice_mappings[{g}][{n!r}] is a {type(frag).__name__}")
                    if g in expert_groups:
                        n = self._expert_renamer(r, ep_sizes[g], fpath)(str(n))
                    if n not in by_name:
                        raise CheckpointError(f"{fpath} holds a slice of {n!r}, which {self.model_file} does not list")
                    if frag.start + frag.numel > part.numel():
                        raise CheckpointError(
                            f"{fpath}: the slice of {n!r} ends at {frag.start + frag.numel}, past the partition's "
                            f"{part.numel()} elements"
                        )
                    shard.pieces.append(Piece(str(n), g, frag.start, filled.get(n, 0), frag.numel))
                    filled[n] = filled.get(n, 0) + frag.numel
            self.shards.append(shard)
        self.stage = stage if stage is not None else 2
        if self.stage not in (0, 1, 2):
            raise CheckpointError(f"{files[0]} records zero_stage={self.stage} but has the ZeRO-1/2 layout")

    # ZeRO 3 -------------------------------------------------------------------------------------
    def _parse_zero3(self) -> None:
        import torch

        ms = self.model_state
        ws = self.world_size
        mfiles = self._rank_files(
            self.z3_model_files, ws, "model-state file(s)", "zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        )
        files = self._rank_files(
            self.optim_files, ws, "optimizer-state file(s)", "[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        )
        shapes = ms.get("param_shapes")
        if not isinstance(shapes, list) or not shapes:
            raise bad_file(self.model_file, "a ZeRO-3 checkpoint without 'param_shapes'")
        order = [ParamInfo(str(n), tuple(int(x) for x in s), g) for g, grp in enumerate(shapes) for n, s in grp.items()]
        self.params = order
        # frozen parameters: every rank's model file holds its slice
        fshapes = ms.get("frozen_param_shapes") or {}
        self.frozen_shapes = {str(k): tuple(int(x) for x in v) for k, v in fshapes.items()}
        if self.frozen_shapes:
            for r, mpath in enumerate(mfiles):
                frags = (safe_load(mpath) if r else ms).get("frozen_param_fragments") or {}
                shard = Shard(mpath, r, "frozen3")
                for n, shape in self.frozen_shapes.items():
                    numel = int(math.prod(shape))
                    per = math.ceil(numel / ws)
                    t = frags.get(n)
                    if not isinstance(t, torch.Tensor):
                        raise CheckpointError(f"{mpath} has no frozen_param_fragments entry for frozen parameter {n!r}")
                    take = max(0, min(per, numel - r * per))
                    shard.pieces.append(Piece(n, 0, 0, r * per, take))
                self.frozen_pieces.append(shard)
        for r, fpath in enumerate(files):
            osd = optimizer_sd(safe_load(fpath), fpath)
            pc = osd.get("partition_count")
            if pc is not None and int(pc if not isinstance(pc, list) else pc[0]) != ws:
                raise CheckpointError(
                    f"{fpath} was partitioned over {pc} rank(s) but the model files record dp_world_size={ws}"
                )
            if r == 0:
                self.loss_scaler = scaler_state(osd)
                _, self.group_hypers = base_groups(osd, fpath)
                self._subgroups_to_groups(shapes, fpath)
            flats = osd.get("fp32_flat_groups")
            if not isinstance(flats, list) or not all(isinstance(t, torch.Tensor) for t in flats):
                raise bad_file(fpath, "no 'fp32_flat_groups' list of tensors")
            bounds = []
            total = 0
            for t in flats:
                bounds.append((total, total + t.numel()))
                total += t.numel()
            shard = Shard(fpath, r, "zero3")
            off = 0
            slot = 0
            for p in order:
                per = math.ceil(p.numel / ws)
                while slot < len(bounds) and off >= bounds[slot][1]:
                    slot += 1
                if slot >= len(bounds) or off + per > bounds[slot][1]:
                    raise CheckpointError(
                        f"{fpath}: the fp32_flat_groups ({total} elements) do not hold rank {r}'s slice of {p.name!r} "
                        f"at {off}..{off + per} (ZeRO-3 slices are ceil(numel / {ws}) per parameter)"
                    )
                take = max(0, min(per, p.numel - r * per))
                shard.pieces.append(Piece(p.name, slot, off - bounds[slot][0], r * per, take))
                off += per
            if off != total:
                raise CheckpointError(
                    f"{fpath}: fp32_flat_groups hold {total} elements but the parameters in param_shapes need {off} "
                    f"per rank at world size {ws}"
                )
            self.shards.append(shard)

    def _is_expert_group(self, grp: dict[str, Any]) -> bool:
        """Whether a ``param_shapes`` group holds MoE experts (all of it; DeepSpeed keeps them apart)."""
        hits = [any(str(n).startswith(prefix) for prefix, _ in self.moe_layers) for n in grp]
        if any(hits) and not all(hits):
            raise CheckpointError(f"{self.model_file}: a param_shapes group mixes expert and non-expert parameters")
        return bool(hits) and all(hits)

    def _subgroups_to_groups(self, shapes: list[Any], path: str) -> None:
        """ZeRO-3's ``param_shapes`` has one entry per *sub-group* (``sub_group_size``); the optimizer's
        ``param_groups[g]["params"]`` lists the sub-groups of group g. Give each parameter its group."""
        hypers = self.group_hypers
        if not hypers:
            return
        slot_group: dict[int, int] = {}
        for g, grp in enumerate(hypers):
            for slot in grp.get("params", []):
                slot_group[int(slot)] = g
        if sorted(slot_group) != list(range(len(shapes))):
            raise CheckpointError(
                f"{path}: the optimizer's parameter groups list sub-groups {sorted(slot_group)} but "
                f"{self.model_file} has {len(shapes)} param_shapes entries; the files come from different saves"
            )
        for p in self.params:
            p.group = slot_group[p.group]

    # ------------------------------------------------------------------------------------ checks
    def _check_pieces(self) -> None:
        covered: dict[str, int] = {}
        for shard in self.shards:
            for pc in shard.pieces:
                covered[pc.name] = covered.get(pc.name, 0) + pc.numel
        for p in self.params if self.has_optimizer else []:
            if covered.get(p.name, 0) != p.numel:
                raise CheckpointError(
                    f"DeepSpeed checkpoint {self.tag_dir}: the optimizer shards hold {covered.get(p.name, 0)} elements "
                    f"of {p.name!r}, which has {p.numel} (shape {list(p.shape)}); shards are missing or mismatched"
                )
        names = {p.name for p in self.params}
        for alias, src in self.shared.items():
            if src not in names and src not in self.module:
                raise CheckpointError(f"{self.model_file}: shared parameter {alias!r} points at unknown {src!r}")

    # ------------------------------------------------------------------------------------ info
    @property
    def module_dtype(self) -> Any:
        """dtype of the module's floating-point parameters at save (torch.dtype)."""
        import torch

        for p in self.params:
            t = self.module.get(p.name)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return t.dtype
        return torch.float32

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (tag, stage, world size, files, parameters, steps)."""
        return {
            "format": "deepspeed",
            "dir": self.save_dir,
            "tag": self.tag,
            "zero_stage": self.stage,
            "world_size": self.world_size,
            "global_steps": self.counters["global_steps"],
            "parameters": len(self.params),
            "elements": sum(p.numel for p in self.params),
            "files": sorted({os.path.basename(s.path) for s in self.shards} | {os.path.basename(self.model_file)}),
            "ds_version": self.model_state.get("ds_version"),
        }

    def __repr__(self) -> str:
        return f"DeepSpeedCheckpoint({json.dumps(self.describe())})"


def ordered(d: dict[str, Any]) -> OrderedDict[str, Any]:
    """An ``OrderedDict`` copy (helper for callers building state dicts)."""
    return OrderedDict(d)
