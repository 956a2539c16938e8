"""The ``deepspeed`` checkpoint layout (:class:`dscore.protocols.CheckpointLayout`): DeepSpeed 0.19.8's files.

* **detect**: a DeepSpeed save directory (``latest`` naming a tag with ``mp_rank_00_model_states.pt`` /
  ``[bf16_]zero_pp_rank_<r>_mp_rank_00_*_states.pt``), or one of its tag directories given as the save
  directory (so the tag rules can say how to load it); a dscore save in this layout records it in its manifest.
* **resolve_tag / read**: DeepSpeed's tag rules; every file read by the restricted unpickler, the whole
  checkpoint validated against the engine before anything is applied; any saved world size and ZeRO stage.
* **write** (``engine.checkpoint_layout = "deepspeed"``): DeepSpeed's files, ZeRO stages 1-3, fp32/bf16
  (MoE models: DeepSpeed's per-expert files, stages 1-2), through dscore's atomic protocol. RNG states and the data-loader position are not part of the layout.
* ``dscore checkpoint export / import / list``: :meth:`DeepSpeedLayout.export_weights`,
  :meth:`~DeepSpeedLayout.import_checkpoint`, :meth:`~DeepSpeedLayout.describe`.
"""

from __future__ import annotations

import os
from typing import Any

from dscore.persistence import savedir
from dscore.protocols.checkpoint import CheckpointLoadRequest, CheckpointSaveState, LoadedCheckpoint
from dscore_plugins.checkpoint_ds import api
from dscore_plugins.checkpoint_ds._detect import (
    is_deepspeed_checkpoint,
    looks_like_deepspeed_tag_dir,
    resolve_deepspeed_tag,
)

__all__ = ["DEEPSPEED_LAYOUT", "DeepSpeedLayout"]


class DeepSpeedLayout:
    """DeepSpeed 0.19.8's checkpoint layout (module docs); stateless, one instance :data:`DEEPSPEED_LAYOUT`."""

    name = "deepspeed"

    def detect(self, save_dir: str, tag: str | None) -> bool:
        """True for a DeepSpeed save directory or one of its tag directories (listings and ``latest`` only)."""
        return looks_like_deepspeed_tag_dir(save_dir) or is_deepspeed_checkpoint(save_dir, tag)

    def resolve_tag(self, save_dir: str, tag: str | None, *, universal: bool = False) -> str | None:
        """DeepSpeed's tag rules (:func:`~dscore_plugins.checkpoint_ds._detect.resolve_deepspeed_tag`); None
        when there is no ``latest`` (nothing to resume)."""
        return resolve_deepspeed_tag(save_dir, tag, universal=universal, missing_ok=True)

    def tags_present(self, save_dir: str) -> str:
        """The sub-directories of ``save_dir``."""
        names = sorted(n for n in os.listdir(save_dir) if os.path.isdir(os.path.join(save_dir, n)))
        return ", ".join(repr(n) for n in names) or "no tags"

    def check_save(self, engine: Any, zero_stage: int) -> None:
        """Refuse what DeepSpeed's files cannot hold (fp16, no optimizer, MoE at stage 0/3, bf16 or frozen
        parameters at stage 0), naming the way out."""
        import torch

        from dscore_plugins.checkpoint_ds.writer import check_supported

        config = getattr(engine, "config", None)
        zero = getattr(engine, "zero_stage_impl", None)
        check_supported(
            zero_stage,
            bool(getattr(config, "fp16_enabled", False)),
            getattr(zero, "optimizer", None) is not None,
            moe=bool(getattr(engine, "has_moe_layers", False)),
            bf16=bool(getattr(config, "bf16_enabled", False)),
            frozen=any(not p.requires_grad for p in getattr(engine, "module", torch.nn.Module()).parameters()),
        )

    def write(self, state: CheckpointSaveState, tmp_dir: str) -> dict[str, int]:
        """This rank's DeepSpeed files (``torch.save`` of plain containers and tensors), each written atomically."""
        import torch

        from dscore.moe.layer import MoE
        from dscore_plugins.checkpoint_ds.writer import ExpertLayer, deepspeed_files

        engine = state.engine
        experts = [  # DeepSpeed numbers MoE layers in named_modules order (AutoEP layers are MoE layers)
            ExpertLayer(f"{name}.deepspeed_moe.experts.deepspeed_experts." if name else
                        "deepspeed_moe.experts.deepspeed_experts.", int(m.num_experts), int(m.ep_size))
            for name, m in engine.module.named_modules()
            if isinstance(m, MoE)
        ]  # fmt: skip
        raw = getattr(getattr(engine, "config", None), "raw", None)
        es = state.engine_state
        files = deepspeed_files(
            module=engine.module,
            module_sd=state.module_state,
            optim_sd=state.optimizer_state,
            stage=state.zero_stage,
            rank=state.rank,
            world=state.world_size,
            counters={k: int(es.get(k, 0)) for k in ("global_steps", "global_samples", "skipped_steps")},
            lr_scheduler_state=es.get("lr_scheduler"),
            ds_config=dict(raw) if isinstance(raw, dict) else {},
            client_state=dict(state.client_state),
            experts=experts,
        )
        written: dict[str, int] = {}
        for name, obj in files.items():
            path = os.path.join(tmp_dir, name)

            def save(tmp: str, obj: dict[str, Any] = obj) -> None:
                torch.save(obj, tmp)

            savedir.atomic_write(path, save, fsync=state.durable)
            written[name] = os.path.getsize(path)
        return written

    def read(self, request: CheckpointLoadRequest) -> LoadedCheckpoint:
        """Read and validate the DeepSpeed checkpoint for the engine (:func:`api.read_for_engine`)."""
        out = api.read_for_engine(
            request.engine,
            request.save_dir,
            request.tag,
            load_module_strict=request.load_module_strict,
            load_optimizer_states=request.load_optimizer_states,
            load_lr_scheduler_states=request.load_lr_scheduler_states,
            load_module_only=request.load_module_only,
        )
        return LoadedCheckpoint(
            saved_world_size=int(out["manifest"]["world_size"]),
            module=out["module"],
            engine_state=out["engine"],
            client_state=out["client"],
            load_path=out["load_path"],
            optimizer_state=out.get("optim"),
            rank_state=None,  # DeepSpeed stores no RNG state or data position
        )

    def fp32_state_dict(self, save_dir: str, tag: str | None) -> dict[str, Any]:
        """The consolidated fp32 weights (DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``)."""
        return api.get_fp32_state_dict_from_deepspeed(save_dir, tag)

    def export_weights(self, save_dir: str, output: str | os.PathLike[str], tag: str | None, dtype: str) -> str:
        """One consolidated safetensors file, streamed one shard at a time."""
        return api.export_fp32(save_dir, output, tag=tag, dtype=dtype)

    def import_checkpoint(self, src_dir: str, out_dir: str, tag: str | None) -> str:
        """Convert into dscore's native layout under ``out_dir`` (streamed); returns the tag directory."""
        return api.import_checkpoint(src_dir, out_dir, tag=tag)

    def describe(self, save_dir: str) -> dict[str, Any]:
        """The latest tag's stage, world size, step, parameter count and files."""
        return api.DeepSpeedCheckpoint(save_dir).describe()

    def format_description(self, info: dict[str, Any]) -> str:
        """:meth:`describe`'s dict as ``dscore checkpoint list`` prints it."""
        return (
            f"{info['dir']}  (DeepSpeed {info['ds_version'] or '?'} checkpoint, latest: {info['tag']})\n"
            f"  {info['tag']:<24} zero={info['zero_stage']} ranks={info['world_size']} "
            f"step={info['global_steps']} params={info['parameters']} files={', '.join(info['files'])}"
        )


#: the registered object (``dscore_plugins.checkpoint_ds.layout:DEEPSPEED_LAYOUT``).
DEEPSPEED_LAYOUT = DeepSpeedLayout()
