"""The ``sharded`` layout: every rank writes one safetensors shard, rank 0 a JSON manifest it is detected by.

Module and optimizer tensors are spread round-robin (by sorted key) over the ranks that save; loading reads
every shard and merges them, so N ranks save and M ranks load. Uses only public dscore names.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore.persistence import savedir
from dscore.persistence.tensorfile import read_tensor_file, write_tensor_file
from dscore.persistence.tree import decode, encode
from dscore.protocols.checkpoint import CheckpointLoadRequest, CheckpointSaveState, LoadedCheckpoint

__all__ = ["MANIFEST", "SHARDED_LAYOUT", "ShardedLayout", "shard_name"]

MANIFEST = "sharded_manifest.json"


def shard_name(rank: int) -> str:
    """The shard file of ``rank``."""
    return f"shard_{rank:05d}.safetensors"


class ShardedLayout:
    """One shard per rank plus :data:`MANIFEST` (module docs)."""

    name = "sharded"

    def detect(self, save_dir: str, tag: str | None) -> bool:
        """True when the tag (given or ``latest``) holds :data:`MANIFEST` naming this layout."""
        name = tag if tag is not None else savedir.read_latest(save_dir)
        if not name or "/" in name:
            return False
        try:
            with open(os.path.join(save_dir, name, MANIFEST), encoding="utf-8") as f:
                return json.load(f).get("layout") == self.name
        except (OSError, ValueError, AttributeError):
            return False

    def resolve_tag(self, save_dir: str, tag: str | None, *, universal: bool = False) -> str | None:
        """dscore's tag rules (the save went through dscore's atomic protocol)."""
        return savedir.resolve_tag(save_dir, tag)

    def write(self, state: CheckpointSaveState, tmp_dir: str) -> dict[str, int]:
        """This rank's shard (its share of the tensors, its RNG state); rank 0 also the manifest."""
        shared: dict[str, torch.Tensor] = {f"module/{k}": v for k, v in state.module_state.items()}
        o_tree = encode(state.optimizer_state, root="optimizer state", tensor_prefix="optim/", tensors=shared)
        mine = {k: v for i, (k, v) in enumerate(sorted(shared.items())) if i % state.world_size == state.rank}
        meta = {"rank": json.dumps(encode(state.rank_state, root="rank state", tensor_prefix="rank/", tensors={}))}
        extra: dict[str, torch.Tensor] = {}
        if state.rank == 0:
            e_tree = encode(state.engine_state, root="engine state", tensor_prefix="engine/", tensors=extra)
            c_tree = encode(state.client_state, root="client_state", tensor_prefix="client/", tensors=extra)
        tensors = {**mine, **extra, **state.rank_tensors}
        written = {shard_name(state.rank): write_tensor_file(os.path.join(tmp_dir, shard_name(state.rank)), tensors, meta)}
        if state.rank == 0:
            manifest = {
                "layout": self.name,
                "world_size": state.world_size,
                "module_keys": list(state.module_state),
                "optim": o_tree,
                "engine": e_tree,
                "client": c_tree,
            }
            data = json.dumps(manifest).encode()
            savedir.atomic_write_bytes(os.path.join(tmp_dir, MANIFEST), data, fsync=state.durable)
            written[MANIFEST] = len(data)
        return written

    def _read_all(self, tag_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[dict[str, str]]]:
        try:
            with open(os.path.join(tag_dir, MANIFEST), encoding="utf-8") as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{tag_dir} has no {MANIFEST}") from None
        tensors: dict[str, torch.Tensor] = {}
        metas: list[dict[str, str]] = []
        for r in range(int(manifest["world_size"])):
            path = os.path.join(tag_dir, shard_name(r))
            if not os.path.exists(path):
                raise CheckpointNotFoundError(f"{tag_dir} is missing {shard_name(r)} (written by rank {r})")
            t, meta = read_tensor_file(path)
            metas.append(meta)
            tensors.update({k: v for k, v in t.items() if not k.startswith("rng/") or r == 0})
            if r != 0:
                for k, v in t.items():
                    if k.startswith("rng/"):
                        tensors[f"shard{r}/{k}"] = v
        return manifest, tensors, metas

    def read(self, request: CheckpointLoadRequest) -> LoadedCheckpoint:
        """Every shard merged; this rank's RNG state from its own shard (rank 0's when it did not exist)."""
        manifest, tensors, metas = self._read_all(request.tag_dir)
        world = int(manifest["world_size"])
        module = {k: tensors[f"module/{k}"] for k in manifest["module_keys"]}
        source = request.tag_dir
        own = request.rank < world
        r = request.rank if own else 0
        prefix = "" if r == 0 else f"shard{r}/"
        out = LoadedCheckpoint(
            saved_world_size=world,
            module=module,
            engine_state=decode(manifest["engine"], tensors, source=source),
            client_state=decode(manifest["client"], tensors, source=source),
            load_path=os.path.join(request.tag_dir, MANIFEST),
        )
        if not request.load_module_only:
            out.optimizer_state = decode(manifest["optim"], tensors, source=source)
            out.rank_state = decode(json.loads(metas[r]["rank"]), {}, source=source)
            out.rank_tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(f"{prefix}rng/")}
            out.own_rank = own
        return out

    def fp32_state_dict(self, save_dir: str, tag: str | None) -> dict[str, torch.Tensor]:
        """The merged module state, floating-point tensors in fp32 (the fp32 masters when saved)."""
        resolved = self.resolve_tag(save_dir, tag)
        if resolved is None:
            raise CheckpointNotFoundError(f"{save_dir} has no latest file; pass a tag")
        manifest, tensors, _ = self._read_all(os.path.join(save_dir, resolved))
        optim = decode(manifest["optim"], tensors, source=save_dir)
        masters = optim.get("fp32_params") or {} if isinstance(optim, dict) else {}
        out: dict[str, torch.Tensor] = {}
        for k in manifest["module_keys"]:
            t = tensors[f"module/{k}"]
            m = masters.get(k)
            if isinstance(m, torch.Tensor) and tuple(m.shape) != tuple(t.shape):
                raise CheckpointError(f"fp32 master of {k!r} has shape {tuple(m.shape)}, the module's {tuple(t.shape)}")
            src = m if isinstance(m, torch.Tensor) else t
            out[k] = src.to(torch.float32) if src.is_floating_point() else src
        return out


#: the registered object (``dscore_example_layout.layout:SHARDED_LAYOUT``).
SHARDED_LAYOUT = ShardedLayout()
