"""Persistence of training state: save/load everything an engine owns, atomically and without pickle, in a
registered checkpoint layout; fp32/16-bit export. (Not :mod:`dscore.checkpointing`, which is activation
checkpointing: recomputing activations in backward.) The user-facing names are also importable from
:mod:`dscore.checkpoint`, their historical path.

Modules: :mod:`~dscore.persistence.layouts` (choosing a layout through the registry), :mod:`~dscore.persistence.native`
(the native ``dscore`` layout), :mod:`~dscore.persistence.export` (no-process-group export, import, list,
16-bit model), and the public building blocks a layout plugin uses: :mod:`~dscore.persistence.savedir`
(file names, atomic writes, tags, ``latest``, the phases of a collective save),
:mod:`~dscore.persistence.tensorfile` (safetensors without pickle), :mod:`~dscore.persistence.tree`
(nested state as JSON plus tensors). The contract of a layout is :class:`dscore.protocols.CheckpointLayout`.

The engine's ``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` methods delegate to the
functions here with the same arguments (the engine passed first). The user-facing contract is DeepSpeed's
(``deepspeed/runtime/engine.py``); what differs is said below.

Layout of the native ``dscore`` layout (world-size independent; see :mod:`dscore.persistence.savedir`)::

    <save_dir>/latest                               the newest complete tag, written last
    <save_dir>/<tag>/_COMPLETE                      JSON manifest (files, bytes, world size), written last
    <save_dir>/<tag>/model_states.safetensors       full module state dict (a plain, HF-loadable file)
    <save_dir>/<tag>/optim_states.safetensors       ZeroStage.state_dict(): full tensors keyed by name
    <save_dir>/<tag>/engine_states.safetensors      counters, LR scheduler, loss scaler; client_state apart
    <save_dir>/<tag>/rank_<r:05d>_states.safetensors  per rank: RNG states, data-loader position

Guarantees:

* **Collective.** Every rank calls save/load. Each phase ends with an all-gather of every rank's outcome,
  so an error on any rank (bad tag, disk full, unsafe client state) is raised on every rank, naming it.
* **Tag validation before any write.** Tags are compared across ranks per ``checkpoint.tag_validation``:
  ``FAIL`` raises :class:`~dscore.errors.CheckpointError`; ``WARN`` (default) logs and ``IGNORE`` stays
  silent, and both save one checkpoint under rank 0's tag (DeepSpeed would write one per distinct tag).
  Tags must be one directory name (no separators, no leading ``.``, not ``latest``).
* **Atomic.** Files go into a private ``<save_dir>/.<tag>.tmp-<token>`` directory (fsynced, with the
  directories, when ``DSCORE_CHECKPOINT_FSYNC=1``; off by default for torch.save speed); after
  every rank finished, rank 0 writes ``_COMPLETE`` and renames the directory to ``<tag>`` (an existing tag
  is swapped in one ``renameat2(RENAME_EXCHANGE)`` on Linux), then replaces ``latest`` by rename. A save
  killed at any point leaves the previous tags and ``latest`` as they were; the next save of the same tag
  removes the leftovers and succeeds. ``save_dir`` must be on a filesystem all ranks share.
* **Safe loading.** Everything is safetensors plus JSON: nothing is unpickled. ``client_state`` may hold
  only None/bool/int/float/str/list/tuple/dict and dense tensors (:mod:`dscore.persistence.tree`);
  anything else is refused *at save* with the key path named.
* **client_state comes back exactly as saved**, keys and values, even keys such as ``"optimizer"`` or
  ``"global_steps"``: engine state lives in its own namespace. (DeepSpeed merges both, lets client keys
  overwrite engine keys, and returns its bookkeeping keys inside client_state.) Rank 0's client_state is
  the one saved; every rank gets it back.
* **World-size independent.** Module and optimizer state are full tensors, so N ranks save and M ranks
  load, any ZeRO stage to any other. Rank ``r < N`` restores its own RNG states (torch CPU, the
  accelerator's, Python ``random``, NumPy when imported) and data-loader position; a rank ``r >= N`` takes
  rank 0's data-loader position and seeds torch, the accelerator, ``random`` and NumPy with
  ``sha256("dscore-rng:<tag>:<r>:" + rank 0's saved CPU RNG state)[:8]`` (deterministic, distinct per rank).
* **Load rules.** A missing ``load_dir`` -> :class:`~dscore.errors.CheckpointNotFoundError`; no ``latest``
  and no tag -> ``(None, None)`` plus a warning listing the tags present (start fresh); a missing or
  incomplete tag -> CheckpointNotFoundError listing the complete tags; a tag directory or a file inside one
  given as ``load_dir`` -> CheckpointError suggesting ``load_checkpoint(<dir>, tag=<tag>)``; ranks asking
  for different dirs/tags -> CheckpointError; a missing or truncated file -> error naming the file and the
  rank that wrote it. ``load_path`` is the model-states file (as DeepSpeed's).
* **DeepSpeed checkpoints** load too: a DeepSpeed save directory (``latest``, ``mp_rank_00_model_states.pt``,
  ``[bf16_]zero_pp_rank_*_optim_states.pt``) is recognised and read without running pickled code, at any
  world size and ZeRO stage (the ``deepspeed`` layout of the built-in ``checkpoint`` plugin). ``checkpoint.load_universal`` reads
  the tag from ``latest_universal`` and is an error when that file is missing. ``save_checkpoint(...,
  layout="deepspeed")`` (``engine.checkpoint_layout``) *writes* DeepSpeed 0.19.8's files instead, with the
  same atomic protocol, for tools that read them.
* **Layouts** are ``checkpoint_layout`` plugin units (:mod:`dscore.persistence.layouts`): save writes the one
  ``engine.checkpoint_layout`` names (unknown: close matches; disabled: ``checkpoint_layout:<name>`` named),
  load takes the one the tag's manifest records, else asks each layout's ``detect``.
* ``load_module_only=True`` restores the weights only (no optimizer, scheduler, loss scaler, counters, RNG,
  data position). Counters restored otherwise: ``global_steps``, ``global_samples``, ``skipped_steps`` and
  also ``micro_steps`` (DeepSpeed does not), so gradient accumulation resumes in phase.

Engine attributes used (:class:`CheckpointEngine`). Read: ``module`` (not directly: through the ZeRO
stage), ``zero_stage_impl`` (:class:`~dscore.protocols.ZeroStage`: ``module_state_dict()``,
``state_dict()``, ``load_module_state_dict(sd, strict=)``, ``load_state_dict(sd, load_optimizer_states=)``,
``stage``), ``lr_scheduler`` (``state_dict``/``load_state_dict``, may be None), ``loss_scaler``
(:class:`~dscore.protocols.LossScaler` or None), ``global_steps``, ``global_samples``,
``micro_steps``, ``skipped_steps`` (ints; restored through ``load_counters_state(dict)`` when the engine
has it, else assigned), ``config`` (``checkpoint.tag_validation``,
``zero_optimization.gather_16bit_weights_on_model_save``, ``model_dump()`` stored for inspection),
``runtime.comm`` (:class:`dscore.comm.Comm`: ``get_rank()``, ``get_world_size()``,
``all_gather_object(obj) -> list``; without it ``torch.distributed``'s default group, else one process),
``runtime.accelerator`` (``device_type``, ``get_rng_state()``, ``set_rng_state()``, ``manual_seed()``),
``data_sampler_state`` (a dict or None, or a method returning it) and on load
``load_data_sampler_state(state)`` or else ``training_dataloader.load_state_dict(state)``,
``runtime.plugin_manager`` (``call("dscore_checkpoint_saved", engine=, save_dir=, tag=)`` and
``call("dscore_checkpoint_loaded", engine=, load_dir=, tag=)``, on every rank after the final agreement).

Export: :func:`save_16bit_model` (all ranks call; ZeRO-3 needs
``zero_optimization.gather_16bit_weights_on_model_save``, else CheckpointError) and
:func:`convert_checkpoint` / ``dscore checkpoint export CKPT_DIR [--tag T] OUT [--dtype fp32|bf16|fp16]``
(one consolidated safetensors file, no process group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from dscore.persistence._load import load_checkpoint
from dscore.persistence._save import save_checkpoint
from dscore.persistence.export import (
    convert_checkpoint,
    describe_checkpoints,
    get_fp32_state_dict_from_checkpoint,
    import_checkpoint,
    save_16bit_model,
)
from dscore.persistence.savedir import list_tags, read_latest

if TYPE_CHECKING:
    import torch

    from dscore.protocols.precision import LossScaler
    from dscore.protocols.zero import ZeroStage

__all__ = [
    "CheckpointEngine",
    "convert_checkpoint",
    "describe_checkpoints",
    "get_fp32_state_dict_from_checkpoint",
    "import_checkpoint",
    "list_tags",
    "load_checkpoint",
    "read_latest",
    "save_16bit_model",
    "save_checkpoint",
]


@runtime_checkable
class CheckpointEngine(Protocol):
    """What :func:`save_checkpoint` / :func:`load_checkpoint` / :func:`save_16bit_model` need of an engine.

    Optional members (read with ``getattr``): ``runtime`` (``.comm``, ``.accelerator``, ``.plugin_manager``),
    ``data_sampler_state``, ``load_data_sampler_state``, ``training_dataloader``.
    """

    module: torch.nn.Module
    zero_stage_impl: ZeroStage
    lr_scheduler: Any
    loss_scaler: LossScaler | None
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    config: Any
