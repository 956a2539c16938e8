"""Turning a parsed DeepSpeed checkpoint into dscore's world-size independent state, in memory or streamed.

* :func:`full_state` assembles full (unpartitioned) tensors: the module state dict, fp32 master weights,
  optimizer moments and steps by parameter name, plus counters, scheduler, loss scaler and client_state,
  in exactly the structure dscore's own checkpoints decode to, so the engine loads it through the same
  resharding path (any world size, any ZeRO stage).
* :func:`import_checkpoint` writes that structure as a dscore checkpoint directory, and
  :func:`export_consolidated` one consolidated safetensors file (``zero_to_fp32``), both *streaming*: the
  output file's header is computed from the shapes first, then each DeepSpeed file is opened (memory-mapped)
  one at a time and its slices written straight to their final byte offsets, so memory stays near one
  shard, never the whole model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from dscore.comm.objects import tensor_bytes
from dscore.errors import CheckpointError
from dscore.persistence import savedir as L
from dscore.persistence.tensorfile import DTYPE_CODES
from dscore.persistence.tree import encode
from dscore_plugins.checkpoint_ds._layout import DeepSpeedCheckpoint, Shard
from dscore_plugins.checkpoint_ds._unpickle import safe_load

__all__ = ["export_consolidated", "full_state", "import_checkpoint", "to_dscore_optim"]

logger = logging.getLogger("dscore.checkpoint")

FP32 = "fp32"  # the key of master weights among a shard's flat tensors

Sink = Callable[[str, str, int, torch.Tensor], None]  # (kind, name, dst element offset, 1-D data)


# ------------------------------------------------------------------------------------ shard reading


def _is_moment(v: Any, numel: int, padded: int | None = None) -> bool:
    """A per-element optimizer state of a ``numel``-element partition: exactly ``numel`` elements, or
    ``padded`` (the partition plus DeepSpeed's trailing ``group_paddings``: the last rank of an uneven
    split keeps its moments at the padded size while its fp32 partition is saved without the padding)."""
    if not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_floating_point()):
        return False
    return v.numel() == numel or (padded is not None and padded > numel and v.numel() == padded)


def _shard_data(
    ck: DeepSpeedCheckpoint, shard: Shard
) -> tuple[dict[str, dict[int, torch.Tensor]], dict[int, dict[str, Any]]]:
    """``({kind: {slot: 1-D tensor}}, {slot: {scalar state}})`` of one shard (tensors memory-mapped)."""
    flats: dict[str, dict[int, torch.Tensor]] = {FP32: {}}
    scalars: dict[int, dict[str, Any]] = {}

    def take_state(slot: int, state: dict[str, Any] | None, numel: int, padded: int | None = None) -> None:
        for k, v in (state or {}).items():
            if _is_moment(v, numel, padded):
                flats.setdefault(str(k), {})[slot] = v.reshape(-1)[:numel]
            elif not isinstance(v, torch.Tensor) or v.dim() == 0:
                scalars.setdefault(slot, {})[str(k)] = v.item() if isinstance(v, torch.Tensor) else v
            else:  # a per-element state dscore cannot place: refuse rather than drop it
                raise CheckpointError(
                    f"{shard.path}: optimizer state {k!r} of group {slot} has {v.numel()} elements, but the "
                    f"rank's fp32 partition has {numel}" + (f" ({padded} with padding)" if padded else "")
                )

    if shard.kind in ("zero12", "zero3"):
        obj = safe_load(shard.path)
        osd = obj["optimizer_state_dict"]
        parts = osd["single_partition_of_fp32_groups" if shard.kind == "zero12" else "fp32_flat_groups"]
        base = osd.get("base_optimizer_state", osd.get("optimizer_state_dict", {}))
        states = base.get("state", {}) if isinstance(base, dict) else dict(enumerate(base or []))
        paddings = osd.get("group_paddings") or []
        for slot, part in enumerate(parts):
            flats[FP32][slot] = part.reshape(-1)
            pad = paddings[slot] if slot < len(paddings) and isinstance(paddings[slot], int) else 0
            take_state(slot, states.get(slot), part.numel(), part.numel() + pad)
    elif shard.kind == "flat0":
        opt = ck.model_state["optimizer"]
        states = opt["optimizer_state_dict"].get("state", {})
        for slot, part in enumerate(opt["fp32_groups_flat"]):
            flats[FP32][slot] = part.reshape(-1)
            take_state(slot, states.get(slot), part.numel())
    elif shard.kind == "torch0":
        opt = ck.model_state["optimizer"]
        inner = opt.get("optimizer_state_dict", opt)
        states = inner.get("state", {})
        masters = [t for grp in opt["fp32_groups"] for t in grp] if "fp32_groups" in opt else None
        for pc in shard.pieces:
            src = masters[pc.slot] if masters is not None else ck.module[pc.name]
            flats[FP32][pc.slot] = src.reshape(-1)
            take_state(pc.slot, states.get(pc.slot), pc.numel)
    elif shard.kind == "frozen3":
        obj = ck.model_state if shard.rank == 0 else safe_load(shard.path)
        frags = obj.get("frozen_param_fragments") or {}
        for i, name in enumerate(ck.frozen_shapes):
            flats[FP32][i] = frags[name].reshape(-1)
    else:  # pragma: no cover - kinds are fixed in _layout
        raise CheckpointError(f"unknown shard kind {shard.kind!r}")
    return flats, scalars


def _feed(ck: DeepSpeedCheckpoint, shard: Shard, sink: Sink, *, kinds: set[str] | None, steps: dict[str, Any]) -> None:
    flats, scalars = _shard_data(ck, shard)
    for kind, by_slot in flats.items():
        if kinds is not None and kind not in kinds:
            continue
        for i, pc in enumerate(shard.pieces):
            slot = i if shard.kind == "frozen3" else pc.slot
            src = by_slot.get(slot)
            if src is None:
                raise CheckpointError(f"{shard.path}: no {kind!r} tensor for the slice of {pc.name!r} (slot {slot})")
            if pc.numel:
                sink(kind, pc.name, pc.dst, src[pc.src : pc.src + pc.numel])
    for pc in shard.pieces:
        sc = scalars.get(pc.slot)
        if sc:
            steps.setdefault(pc.name, {}).update(sc)


def _moment_kinds(ck: DeepSpeedCheckpoint) -> list[str]:
    """The moment names (``exp_avg``, ``exp_avg_sq``, ...) of the first shard."""
    if not ck.shards:
        return []
    flats, _ = _shard_data(ck, ck.shards[0])
    return sorted(k for k in flats if k != FP32)


def _scalar_states(ck: DeepSpeedCheckpoint, per_name: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-name scalar optimizer state; a stage-0 FusedAdam group's step is the largest of its params'
    (DeepSpeed's FusedAdam advances only the last parameter's ``step`` and uses it for the whole group)."""
    if ck.shards and ck.shards[0].kind == "torch0":
        best: dict[int, Any] = {}
        for p in ck.params:
            s = per_name.get(p.name, {}).get("step")
            if isinstance(s, (int, float)) and (p.group not in best or s > best[p.group]):
                best[p.group] = s
        for p in ck.params:
            if p.group in best and p.name in per_name:
                per_name[p.name]["step"] = best[p.group]
    return per_name


# ------------------------------------------------------------------------------------ in memory


def full_state(ck: DeepSpeedCheckpoint, *, optimizer: bool = True) -> dict[str, Any]:
    """Full tensors of a DeepSpeed checkpoint (CPU), one shard file open at a time.

    Args:
        ck: the parsed checkpoint.
        optimizer: also assemble the moments (else only fp32 masters, needed for weights).

    Returns:
        ``{"module": OrderedDict name -> tensor (module state dict; parameters carry the fp32 master
        values, so any target dtype rounds from fp32), "fp32": {name: fp32 tensor}, "moments": {name:
        {kind: fp32 tensor}}, "scalars": {name: {"step": ..., ...}}}``.
    """
    buffers: dict[str, dict[str, torch.Tensor]] = {}
    shapes = {p.name: p.shape for p in ck.params}
    shapes.update(ck.frozen_shapes)

    def sink(kind: str, name: str, dst: int, data: torch.Tensor) -> None:
        out = buffers.setdefault(kind, {})
        t = out.get(name)
        if t is None:
            t = out[name] = torch.empty(shapes[name], dtype=torch.float32)
        t.view(-1)[dst : dst + data.numel()].copy_(data)

    per_name: dict[str, dict[str, Any]] = {}
    kinds = None if optimizer else {FP32}
    for shard in ck.frozen_pieces + ck.shards:
        _feed(ck, shard, sink, kinds=kinds, steps=per_name)
    fp32 = buffers.pop(FP32, {})
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key in ck.module_keys:
        src = ck.shared.get(key, key)
        if src in fp32:
            module[key] = fp32[src]
        else:
            t = ck.module[src]
            if t.numel() == 0 and src in shapes and math.prod(shapes[src]) > 0:
                raise CheckpointError(f"{ck.model_file}: no values for {key!r} (a ZeRO-3 placeholder without a slice)")
            module[key] = t.clone()
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for kind, by_name in buffers.items():
        for name, t in by_name.items():
            moments.setdefault(name, {})[kind] = t
    trainable = {p.name for p in ck.params}
    return {
        "module": module,
        "fp32": {n: t for n, t in fp32.items() if n in trainable},
        "moments": moments,
        "scalars": _scalar_states(ck, per_name),
    }


_IMPL_FLAGS = frozenset(
    {"params", "param_names", "fused", "foreach", "capturable", "differentiable", "maximize", "amsgrad", "initial_lr"}
)


def _hyper_for(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> dict[str, Any]:
    """DeepSpeed group hyper-parameters the engine's group also has (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ...); DeepSpeed-only keys (``bias_correction``, FusedAdam's ``step``) and
    implementation flags are left out. Without ``current`` every numeric key is kept."""
    out: dict[str, Any] = {}
    for k, v in (saved or {}).items():
        if k in _IMPL_FLAGS or (current is not None and k not in current):
            continue
        if isinstance(v, list):
            v = tuple(v)
        if current is None and k in ("bias_correction", "step"):
            continue
        if isinstance(v, (bool, int, float, tuple)) or v is None:
            out[k] = v
    return out


def to_dscore_optim(
    ck: DeepSpeedCheckpoint,
    full: dict[str, Any],
    *,
    step_as_tensor: bool = True,
    current_groups: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ``ZeroStage.state_dict()`` structure (see :mod:`dscore.protocols.zero`) for ``full``.

    Args:
        step_as_tensor: store ``step`` as a 0-dim fp32 tensor (torch optimizers) instead of a number.
        current_groups: the engine optimizer's ``param_groups`` (hyper-parameters are kept only where the
            engine's group has the key); None keeps all numeric keys.

    Raises:
        CheckpointError: the engine has a different number of parameter groups than the checkpoint.
    """
    ngroups = max((p.group for p in ck.params), default=-1) + 1
    hypers: list[dict[str, Any] | None] = list(ck.group_hypers or []) or [None] * ngroups
    if current_groups is not None and len(current_groups) != max(ngroups, len(hypers) if ck.group_hypers else 0):
        raise CheckpointError(
            f"DeepSpeed checkpoint {ck.tag_dir} has {ngroups} optimizer parameter group(s) but the engine's optimizer "
            f"has {len(current_groups)}; build the optimizer with the same groups as the DeepSpeed run"
        )
    groups = []
    for g in range(ngroups):
        hyper = _hyper_for(hypers[g] if g < len(hypers) else None, current_groups[g] if current_groups else None)
        hyper["param_names"] = [p.name for p in ck.params if p.group == g]
        groups.append(hyper)
    state: dict[str, Any] = {}
    for p in ck.params:
        entry: dict[str, Any] = dict(full["moments"].get(p.name, {}))
        for k, v in full["scalars"].get(p.name, {}).items():
            if k == "step" and isinstance(v, (int, float)):
                entry[k] = torch.tensor(float(v), dtype=torch.float32) if step_as_tensor else int(v)
            elif isinstance(v, (bool, int, float)):
                entry[k] = v
        if entry:
            state[p.name] = entry
    return {
        "param_names": [p.name for p in ck.params],
        "state": state,
        "param_groups": groups,
        "fp32_params": dict(full["fp32"]),
    }


def engine_state(ck: DeepSpeedCheckpoint, gas: int) -> dict[str, Any]:
    """dscore's engine-state dict: counters (``micro_steps = global_steps * gas``), scheduler, loss scaler."""
    return {
        **ck.counters,
        "micro_steps": ck.counters["global_steps"] * max(1, int(gas)),
        "lr_scheduler": ck.lr_scheduler if isinstance(ck.lr_scheduler, dict) else None,
        "loss_scaler": ck.loss_scaler,
    }


# ------------------------------------------------------------------------------------ streaming


class _StreamFile:
    """A safetensors file whose header is fixed first and whose tensors are filled by offset (pwrite).

    Same layout rules as :func:`dscore.persistence.tensorfile.write_tensor_file` (ordered by element size
    then name; 8-byte aligned data section), so dscore's reader and ``safetensors`` read it.
    """

    def __init__(
        self, path: str, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
    ):
        order = sorted(specs, key=lambda n: (-torch.empty((), dtype=specs[n][0]).element_size(), n))
        header: dict[str, Any] = {}
        self.offsets: dict[str, tuple[int, torch.dtype, int]] = {}
        offset = 0
        for name in order:
            dtype, shape = specs[name]
            if dtype not in DTYPE_CODES:
                raise CheckpointError(f"cannot write {name!r} to {path}: dtype {dtype} is not storable in safetensors")
            item = torch.empty((), dtype=dtype).element_size()
            nbytes = int(math.prod(shape)) * item
            header[name] = {
                "dtype": DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self.offsets[name] = (offset, dtype, nbytes)
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(len(raw) + 8) % 8)
        self.data_start = 8 + len(raw)
        self.size = self.data_start + offset
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self.fd, self.size)
        self.written: dict[str, int] = {n: 0 for n in specs}

    def write(self, name: str, elem_offset: int, data: torch.Tensor) -> None:
        """Write 1-D ``data`` (cast to the tensor's dtype) at element ``elem_offset`` of tensor ``name``."""
        base, dtype, nbytes = self.offsets[name]
        t = data.detach().to(dtype=dtype).contiguous()
        raw = tensor_bytes(t)  # not .numpy(): numpy is optional (and has no bfloat16)
        start = base + elem_offset * t.element_size()
        if start + len(raw) > base + nbytes:
            raise CheckpointError(
                f"{self.path}: slice of {name!r} overruns the tensor ({start + len(raw)} > {base + nbytes})"
            )
        view = memoryview(raw)
        pos = self.data_start + start
        while view:
            n = os.pwrite(self.fd, view, pos)
            view = view[n:]
            pos += n
        self.written[name] += t.numel()

    def close(self, *, check: bool = True) -> int:
        """Flush and close; with ``check`` raise when any tensor was not completely written."""
        try:
            if check:
                for name, (_, dtype, nbytes) in self.offsets.items():
                    want = nbytes // torch.empty((), dtype=dtype).element_size()
                    if self.written[name] != want:
                        raise CheckpointError(
                            f"{self.path}: {self.written[name]} of {want} elements of {name!r} were written; the "
                            "DeepSpeed shards do not cover it"
                        )
            if L.durable():
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
        return self.size


def _stream(
    ck: DeepSpeedCheckpoint,
    route: Callable[[str, str], list[str]],
    out: _StreamFile | dict[str, _StreamFile],
    *,
    kinds: set[str] | None,
) -> dict[str, dict[str, Any]]:
    """Feed every shard (one open at a time) into the output file(s); returns per-name scalar state."""
    files = out if isinstance(out, dict) else None

    def sink(kind: str, name: str, dst: int, data: torch.Tensor) -> None:
        for key in route(kind, name):
            f = files[key.split("\0", 1)[0]] if files is not None else out  # type: ignore[index]
            f.write(key.split("\0", 1)[-1], dst, data)  # type: ignore[union-attr]

    from tqdm import tqdm

    scalars: dict[str, dict[str, Any]] = {}
    # the long part of `dscore checkpoint import/export`: a progress bar on a terminal only
    shards = tqdm(ck.frozen_pieces + ck.shards, desc="checkpoint shards", unit="shard",
                  disable=not sys.stderr.isatty(), leave=False)
    for shard in shards:
        _feed(ck, shard, sink, kinds=kinds, steps=scalars)
    return _scalar_states(ck, scalars)


def _module_plan(
    ck: DeepSpeedCheckpoint, dtype_of: Callable[[str, torch.Tensor], torch.dtype]
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, list[str]], dict[str, torch.Tensor]]:
    """Module keys to write: ``(specs, master-source -> keys fed from it, keys copied from the model file)``."""
    shapes = {p.name: p.shape for p in ck.params}
    shapes.update(ck.frozen_shapes)
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    fed: dict[str, list[str]] = {}
    direct: dict[str, torch.Tensor] = {}
    streamed = set(shapes) if ck.has_optimizer else set(ck.frozen_shapes)
    for key in ck.module_keys:
        src = ck.shared.get(key, key)
        t = ck.module[src]
        if src in streamed:
            specs[key] = (dtype_of(key, t), shapes[src])
            fed.setdefault(src, []).append(key)
        else:
            specs[key] = (dtype_of(key, t), tuple(t.shape))
            direct[key] = t
    return specs, fed, direct


def export_consolidated(
    ck: DeepSpeedCheckpoint,
    output: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Write the consolidated model of a DeepSpeed checkpoint to one safetensors file (``zero_to_fp32``).

    Parameters come from the fp32 master weights (cast to ``dtype``), buffers and frozen parameters from
    the model-states file(s); tied names each get the shared values. Shards are read one at a time
    (memory-mapped), so peak memory is about one shard plus one slice, not the model.

    Returns:
        The path written (atomically: temporary name, then rename). An existing directory receives
        ``model.safetensors``.
    """
    out = os.path.abspath(os.fspath(output))
    if os.path.isdir(out):
        out = os.path.join(out, "model.safetensors")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    specs, fed, direct = _module_plan(ck, lambda k, t: dtype if t.is_floating_point() else t.dtype)
    tmp = f"{out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    f = _StreamFile(tmp, specs, {"format": "pt"})
    try:
        for key, t in direct.items():
            f.write(key, 0, t.reshape(-1))
        _stream(ck, lambda kind, name: fed.get(name, []), f, kinds={FP32})
        f.close()
        os.replace(tmp, out)
    except BaseException:
        try:
            os.close(f.fd)
        except OSError:
            pass
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    L.fsync_dir(os.path.dirname(out))
    logger.info("wrote %d tensors of DeepSpeed checkpoint %s to %s", len(specs), ck.tag_dir, out)
    return out


def import_checkpoint(ck: DeepSpeedCheckpoint, out_dir: str | os.PathLike[str], *, tag: str | None = None) -> str:
    """Convert a DeepSpeed checkpoint into a dscore checkpoint directory (streamed; no pickle at load).

    Writes ``<out_dir>/<tag>`` (default: the DeepSpeed tag) with dscore's layout and points
    ``<out_dir>/latest`` at it; the module is stored in the saved module dtype, masters and moments in
    fp32, ``step`` as a 0-dim fp32 tensor (torch's optimizers), ``micro_steps`` as ``global_steps *
    gradient_accumulation_steps`` of the DeepSpeed config. No RNG state is recorded (DeepSpeed saves
    none), so loading it leaves the RNGs alone.

    Returns:
        The tag directory written.

    Raises:
        CheckpointError: ``out_dir`` is the DeepSpeed directory itself, or a write fails.
    """
    save_dir = os.path.abspath(os.fspath(out_dir))
    if save_dir == ck.save_dir:
        raise CheckpointError(f"import into {save_dir} would mix dscore and DeepSpeed files; choose another OUT_DIR")
    tag_text = L.validate_tag(tag if tag is not None else ck.tag)
    os.makedirs(save_dir, exist_ok=True)
    L.remove_stale(save_dir, tag_text)
    tmp_dir = os.path.join(save_dir, f".{tag_text}.tmp-{uuid.uuid4().hex}")
    os.mkdir(tmp_dir)
    try:
        files = _write_import(ck, tmp_dir, tag_text)
        manifest = {
            "format": L.FORMAT,
            "format_version": L.FORMAT_VERSION,
            "tag": tag_text,
            "world_size": ck.world_size,
            "zero_stage": ck.stage,
            "global_steps": ck.counters["global_steps"],
            "created_unix_s": time.time(),
            "torch_version": torch.__version__,
            "imported_from": {"deepspeed_dir": ck.tag_dir, "ds_version": ck.model_state.get("ds_version")},
            "files": {name: {"rank": 0, "bytes": n} for name, n in files.items()},
        }
        L.atomic_write_bytes(os.path.join(tmp_dir, L.COMPLETE_FILE), json.dumps(manifest, indent=1).encode())
        tag_dir = os.path.join(save_dir, tag_text)
        old = L.exchange_or_rename(tmp_dir, tag_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        L.atomic_write_bytes(os.path.join(save_dir, L.LATEST_FILE), tag_text.encode("utf-8"))
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("imported DeepSpeed checkpoint %s into %s", ck.tag_dir, tag_dir)
    return tag_dir


def _write_import(ck: DeepSpeedCheckpoint, tmp_dir: str, tag_text: str) -> dict[str, int]:
    from dscore.persistence.tensorfile import write_tensor_file

    meta_base = {"format": L.FORMAT, "format_version": str(L.FORMAT_VERSION)}
    written: dict[str, int] = {}
    # module file: parameters rounded from the fp32 masters to the saved module dtype
    mspecs, fed, direct = _module_plan(ck, lambda k, t: t.dtype)
    # optimizer file: a skeleton of the dscore structure with meta tensors, encoded to get keys
    kinds = _moment_kinds(ck) if ck.has_optimizer else []
    skeleton_full = {
        "fp32": {p.name: torch.empty(p.shape, dtype=torch.float32, device="meta") for p in ck.params}
        if ck.has_optimizer
        else {},
        "moments": {
            p.name: {k: torch.empty(p.shape, dtype=torch.float32, device="meta") for k in kinds} for p in ck.params
        },
        "scalars": {},
    }
    # scalar state (steps) is tiny: read it before writing (one shard at a time, no tensors touched)
    scalars: dict[str, dict[str, Any]] = {}
    for shard in ck.shards:
        _, sc = _shard_data(ck, shard)
        for pc in shard.pieces:
            if sc.get(pc.slot):
                scalars.setdefault(pc.name, {}).update(sc[pc.slot])
    skeleton_full["scalars"] = _scalar_states(ck, scalars)
    optim = to_dscore_optim(ck, skeleton_full, step_as_tensor=True)
    o_tensors: dict[str, torch.Tensor] = {}
    o_tree = encode(optim, root="optimizer state", tensor_prefix="optim/", tensors=o_tensors)
    key_of = {id(t): k for k, t in o_tensors.items()}
    route_opt: dict[tuple[str, str], str] = {}
    for p in ck.params:
        if p.name in optim["fp32_params"]:
            route_opt[(FP32, p.name)] = key_of[id(optim["fp32_params"][p.name])]
        for k in kinds:
            route_opt[(k, p.name)] = key_of[id(optim["state"][p.name][k])]
    real_opt = {k: t for k, t in o_tensors.items() if t.device.type != "meta"}
    ospecs = {k: (t.dtype, tuple(t.shape)) for k, t in o_tensors.items()}
    model_f = _StreamFile(os.path.join(tmp_dir, L.MODEL_FILE), mspecs, {**meta_base, "content": "module"})
    optim_f = _StreamFile(os.path.join(tmp_dir, L.OPTIM_FILE), ospecs, {**meta_base, "optim": json.dumps(o_tree)})
    try:
        for key, t in direct.items():
            model_f.write(key, 0, t.reshape(-1))
        for key, t in real_opt.items():
            optim_f.write(key, 0, t.reshape(-1))

        def route(kind: str, name: str) -> list[str]:
            keys = []
            if kind == FP32:
                keys += [f"model\0{k}" for k in fed.get(name, [])]
            if (kind, name) in route_opt:
                keys.append(f"optim\0{route_opt[(kind, name)]}")
            return keys

        _stream(ck, route, {"model": model_f, "optim": optim_f}, kinds=None)
        written[L.MODEL_FILE] = model_f.close()
        written[L.OPTIM_FILE] = optim_f.close()
    except BaseException:
        for f in (model_f, optim_f):
            try:
                os.close(f.fd)
            except OSError:
                pass
        raise
    gas = int((ck.ds_config or {}).get("gradient_accumulation_steps", 1) or 1)
    e_tensors: dict[str, torch.Tensor] = {}
    e_tree = encode(engine_state(ck, gas), root="engine state", tensor_prefix="engine/", tensors=e_tensors)
    c_tree = encode(client_state(ck), root="client_state", tensor_prefix="client/", tensors=e_tensors)
    written[L.ENGINE_FILE] = write_tensor_file(
        os.path.join(tmp_dir, L.ENGINE_FILE),
        e_tensors,
        {
            **meta_base,
            "engine": json.dumps(e_tree),
            "client": json.dumps(c_tree),
            "config": json.dumps(ck.ds_config, default=str),
        },
        fsync=L.durable(),
    )
    for r in range(ck.world_size):
        r_tensors: dict[str, torch.Tensor] = {}
        r_tree = encode(
            {"rank": r, "world_size": ck.world_size, "rng": None, "data_sampler": None},
            root=f"rank {r} state",
            tensor_prefix="rank/",
            tensors=r_tensors,
        )
        name = L.rank_file(r)
        written[name] = write_tensor_file(
            os.path.join(tmp_dir, name), r_tensors, {**meta_base, "rank": json.dumps(r_tree)}, fsync=L.durable()
        )
    return written


def client_state(ck: DeepSpeedCheckpoint) -> dict[str, Any]:
    """The user's ``client_state`` keys of the model-states file (DeepSpeed's own keys removed)."""
    return dict(ck.client_state)
