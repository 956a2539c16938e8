"""dscore's native checkpoint layout (unit ``checkpoint_layout:dscore``): pickle-free and world-size independent.

Files of one tag (names in :mod:`dscore.persistence.savedir`)::

    model_states.safetensors       full module state dict (rank 0; a plain, HF-loadable file)
    optim_states.safetensors       ZeroStage.state_dict(): full tensors keyed by name (rank 0)
    engine_states.safetensors      counters, LR scheduler, loss scaler, client_state apart (rank 0)
    rank_<r:05d>_states.safetensors  per rank: RNG states, data-loader position

Everything is safetensors plus JSON metadata (:mod:`dscore.persistence.tree`): nothing is unpickled at load.
:data:`NATIVE_LAYOUT` is the :class:`dscore.protocols.CheckpointLayout` object the built-in ``checkpoint``
plugin registers; it is also the fallback :func:`dscore.persistence.layouts.layout_for_load` ends on.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore.persistence import savedir as S
from dscore.persistence.tensorfile import read_tensor_file, write_tensor_file
from dscore.persistence.tree import decode, encode
from dscore.protocols.checkpoint import CheckpointLoadRequest, CheckpointSaveState, LoadedCheckpoint

__all__ = ["NATIVE_LAYOUT", "NativeLayout", "meta_json"]


def meta_json(meta: dict[str, str], key: str, path: str) -> Any:
    """The JSON value stored under ``key`` in a tensor file's metadata.

    Raises:
        CheckpointError: absent or not JSON (the file was not written by dscore's checkpointer).
    """
    try:
        return json.loads(meta[key])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(
            f"{path} has no valid {key!r} metadata; it was not written by dscore's checkpointer"
        ) from exc


def _meta(**extra: str) -> dict[str, str]:
    return {"format": S.FORMAT, "format_version": str(S.FORMAT_VERSION), **extra}


class NativeLayout:
    """The ``dscore`` layout (module docs); stateless, one instance :data:`NATIVE_LAYOUT`."""

    name = "dscore"

    def detect(self, save_dir: str, tag: str | None) -> bool:
        """True when the tag (given or ``latest``) holds a dscore manifest that names no other layout."""
        name = tag if tag is not None else S.read_latest(save_dir)
        if not name or "/" in name:
            return False
        manifest = S.read_manifest(os.path.join(save_dir, name))
        return manifest is not None and str(manifest.get("layout") or self.name) == self.name

    def resolve_tag(self, save_dir: str, tag: str | None, *, universal: bool = False) -> str | None:
        """dscore's load-path rules (:func:`dscore.persistence.savedir.resolve_tag`)."""
        return S.resolve_tag(save_dir, tag)

    def tags_present(self, save_dir: str) -> str:
        """The tags of ``save_dir`` with their completeness."""
        return S.tags_present_text(save_dir)

    def write(self, state: CheckpointSaveState, tmp_dir: str) -> dict[str, int]:
        """Rank 0 writes the model, optimizer and engine files; every rank its own rank file."""
        written: dict[str, int] = {}
        durable = state.durable
        if state.rank == 0:
            written[S.MODEL_FILE] = write_tensor_file(
                os.path.join(tmp_dir, S.MODEL_FILE), state.module_state, _meta(content="module"), fsync=durable
            )
            o_tensors: dict[str, torch.Tensor] = {}
            o_tree = encode(state.optimizer_state, root="optimizer state", tensor_prefix="optim/", tensors=o_tensors)
            written[S.OPTIM_FILE] = write_tensor_file(
                os.path.join(tmp_dir, S.OPTIM_FILE), o_tensors, _meta(optim=json.dumps(o_tree)), fsync=durable
            )
            e_tensors: dict[str, torch.Tensor] = {}
            e_tree = encode(state.engine_state, root="engine state", tensor_prefix="engine/", tensors=e_tensors)
            c_tree = encode(state.client_state, root="client_state", tensor_prefix="client/", tensors=e_tensors)
            written[S.ENGINE_FILE] = write_tensor_file(
                os.path.join(tmp_dir, S.ENGINE_FILE),
                e_tensors,
                _meta(engine=json.dumps(e_tree), client=json.dumps(c_tree), config=state.config_json),
                fsync=durable,
            )
        r_tensors = dict(state.rank_tensors)
        r_tree = encode(state.rank_state, root=f"rank {state.rank} state", tensor_prefix="rank/", tensors=r_tensors)
        name = S.rank_file(state.rank)
        written[name] = write_tensor_file(
            os.path.join(tmp_dir, name), r_tensors, _meta(rank=json.dumps(r_tree)), fsync=durable
        )
        return written

    def read(self, request: CheckpointLoadRequest) -> LoadedCheckpoint:
        """Read the files this rank needs (its own rank file, or rank 0's when it did not exist at save)."""
        tag_dir = request.tag_dir
        manifest = S.read_manifest(tag_dir)
        if manifest is None:
            raise CheckpointNotFoundError(f"checkpoint {tag_dir} lost its {S.COMPLETE_FILE} marker during the load")
        if int(manifest.get("format_version", 0)) > S.FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {tag_dir} has format version {manifest['format_version']}; this dscore reads up to "
                f"{S.FORMAT_VERSION}"
            )
        saved_world = int(manifest["world_size"])
        own = S.rank_file(request.rank) if request.rank < saved_world else None
        needed = [S.MODEL_FILE, S.ENGINE_FILE]
        if not request.load_module_only:
            needed.append(S.OPTIM_FILE)
            needed.append(own if own is not None else S.rank_file(0))
        S.check_files(tag_dir, manifest, needed)
        model_path = os.path.join(tag_dir, S.MODEL_FILE)
        module, _ = read_tensor_file(model_path)
        e_path = os.path.join(tag_dir, S.ENGINE_FILE)
        e_tensors, e_meta = read_tensor_file(e_path)
        out = LoadedCheckpoint(
            saved_world_size=saved_world,
            module=module,
            engine_state=decode(meta_json(e_meta, "engine", e_path), e_tensors, source=e_path),
            client_state=decode(meta_json(e_meta, "client", e_path), e_tensors, source=e_path),
            load_path=model_path,
        )
        if not request.load_module_only:
            o_path = os.path.join(tag_dir, S.OPTIM_FILE)
            o_tensors, o_meta = read_tensor_file(o_path)
            out.optimizer_state = decode(meta_json(o_meta, "optim", o_path), o_tensors, source=o_path)
            r_path = os.path.join(tag_dir, own if own is not None else S.rank_file(0))
            r_tensors, r_meta = read_tensor_file(r_path)
            out.rank_tensors = r_tensors
            out.rank_state = decode(meta_json(r_meta, "rank", r_path), r_tensors, source=r_path)
            out.own_rank = own is not None
        return out

    def fp32_state_dict(self, save_dir: str, tag: str | None) -> dict[str, torch.Tensor]:
        """The module state with floating-point tensors in fp32: the fp32 masters when the run kept them
        (``fp32_params`` of the optimizer state), else the module's tensors cast."""
        resolved = S.resolve_tag(save_dir, tag, what="dscore checkpoint export")
        if resolved is None:
            raise CheckpointNotFoundError(
                f"{save_dir} has no '{S.LATEST_FILE}' file; pass a tag (tags present: {S.tags_present_text(save_dir)})"
            )
        tag_dir = os.path.join(save_dir, resolved)
        module, _ = read_tensor_file(os.path.join(tag_dir, S.MODEL_FILE))
        masters: dict[str, Any] = {}
        o_path = os.path.join(tag_dir, S.OPTIM_FILE)
        if os.path.exists(o_path):
            o_tensors, o_meta = read_tensor_file(o_path)
            if "optim" in o_meta:
                optim = decode(json.loads(o_meta["optim"]), o_tensors, source=o_path)
                if isinstance(optim, dict) and isinstance(optim.get("fp32_params"), dict):
                    masters = optim["fp32_params"]
        out: dict[str, torch.Tensor] = {}
        for name, t in module.items():
            if not t.is_floating_point():
                out[name] = t
                continue
            master = masters.get(name)
            if isinstance(master, torch.Tensor):
                if tuple(master.shape) != tuple(t.shape):
                    raise CheckpointError(
                        f"{o_path}: fp32 master of {name!r} has shape {tuple(master.shape)} but the module tensor in "
                        f"{S.MODEL_FILE} has {tuple(t.shape)}"
                    )
                out[name] = master.to(torch.float32)
            else:
                out[name] = t.to(torch.float32)
        return out


#: the registered object (``dscore.persistence.native:NATIVE_LAYOUT``).
NATIVE_LAYOUT = NativeLayout()
