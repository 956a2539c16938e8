"""The checkpoint layout contract: how a plugin stores an engine's state on disk and reads it back.

A layout is registered as a :class:`dscore.specs.CheckpointLayoutSpec` (``dscore_register_checkpoint_layouts``)
whose ``layout`` import string names an object satisfying :class:`CheckpointLayout`. dscore keeps the
protocol around it (:mod:`dscore.persistence`): every rank calls ``engine.save_checkpoint``; the core
validates the request, gathers the full state (a collective for partitioned ZeRO stages), hands each rank a
:class:`CheckpointSaveState` to :meth:`CheckpointLayout.write` into a private temporary directory, and
publishes that directory atomically with a ``_COMPLETE`` manifest naming the layout (``"layout": name``),
then ``latest``. Loading asks, for the tag to load, the manifest's layout first, else every registered
layout's :meth:`~CheckpointLayout.detect` in descending ``detect_priority``; the chosen layout resolves the
tag and :meth:`~CheckpointLayout.read`\\ s a :class:`LoadedCheckpoint`, which the core applies to the
engine (module, ZeRO optimizer state, LR scheduler, loss scaler, counters, RNG, data position) with the
same resharding for every layout: N ranks save, M ranks load.

Building blocks a layout may use (public): :mod:`dscore.persistence.tensorfile` (safetensors without
pickle), :mod:`dscore.persistence.tree` (nested state as JSON plus tensors), :mod:`dscore.persistence.savedir`
(atomic writes, tags, ``latest``, the native file names). ``examples/plugins/dscore-example-layout`` is a
complete third-party layout.

This module imports torch only for type checking.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointLayout", "CheckpointLoadRequest", "CheckpointSaveState", "LoadedCheckpoint"]


@dataclass(frozen=True)
class CheckpointSaveState:
    """One rank's view of the engine at save time, handed to :meth:`CheckpointLayout.write`.

    Attributes:
        engine: the engine being saved (read-only use: ``engine.module`` for structure, ``engine.config``).
        rank / world_size: this process's rank and the number of ranks saving.
        zero_stage: the ZeRO stage number (0-3).
        module_state: the full module state dict (every rank holds all of it; tensors of the module's
            dtypes, possibly on the device); parameters left out by ``exclude_frozen_parameters`` are absent.
        optimizer_state: ``ZeroStage.state_dict()``: full (unpartitioned) tensors keyed by parameter name
            (``param_names``, ``state``, ``param_groups``, ``fp32_params``, ...); the same on every rank.
        engine_state: ``global_steps``, ``global_samples``, ``micro_steps``, ``skipped_steps`` (ints),
            ``excluded_frozen_parameters`` (names), ``lr_scheduler`` and ``loss_scaler`` (state dicts or None).
        client_state: rank 0's ``client_state`` (already checked storable by :func:`dscore.persistence.tree.encode`).
        rank_state: this rank's own state: ``{"rank", "world_size", "rng": {...}, "data_sampler": ...}``
            (JSON-like; Python/NumPy RNG states).
        rank_tensors: this rank's RNG tensors (``"rng/torch_cpu"``: uint8 CPU tensor; ``"rng/accelerator"``
            when the device has one).
        config_json: the validated config as JSON text (informational).
        durable: fsync files before they are published (``DSCORE_CHECKPOINT_FSYNC``).
    """

    engine: Any
    rank: int
    world_size: int
    zero_stage: int
    module_state: Mapping[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    engine_state: dict[str, Any]
    client_state: dict[str, Any]
    rank_state: dict[str, Any]
    rank_tensors: dict[str, torch.Tensor]
    config_json: str = "null"
    durable: bool = False


@dataclass(frozen=True)
class CheckpointLoadRequest:
    """What :meth:`CheckpointLayout.read` is asked to read (every rank reads; nothing is applied there).

    Attributes:
        engine: the engine being loaded into (for fit checks: ``engine.module``, ``engine.zero_stage_impl``).
        rank / world_size: this process's rank and the number of ranks loading now.
        save_dir: the absolute save directory; tag: the resolved tag; tag_dir: ``<save_dir>/<tag>``.
        load_module_strict / load_optimizer_states / load_lr_scheduler_states / load_module_only: the
            arguments of ``load_checkpoint``.
        universal: ``checkpoint.load_universal`` (the tag came from ``latest_universal``).
    """

    engine: Any
    rank: int
    world_size: int
    save_dir: str
    tag: str
    tag_dir: str
    load_module_strict: bool = True
    load_optimizer_states: bool = True
    load_lr_scheduler_states: bool = True
    load_module_only: bool = False
    universal: bool = False


@dataclass
class LoadedCheckpoint:
    """What a layout read, in the structure the core applies to an engine.

    Attributes:
        saved_world_size: the number of ranks that saved it.
        module: the full module state dict (CPU tensors).
        engine_state: the keys of :attr:`CheckpointSaveState.engine_state` (``micro_steps`` and
            ``excluded_frozen_parameters`` may be absent; ``lr_scheduler`` / ``loss_scaler`` may be None).
        client_state: the user's ``client_state`` as saved.
        optimizer_state: the ``ZeroStage.load_state_dict`` input (full tensors by name); None with
            ``load_module_only``.
        rank_state: the state of the rank whose file was read (``{"rng": ... or None, "data_sampler": ...}``);
            None when the layout records none (RNG and data position are then left as they are).
        rank_tensors: the RNG tensors of that rank (``"rng/torch_cpu"`` at least when ``rank_state["rng"]``).
        own_rank: True when ``rank_state`` is this rank's own; False when this rank did not exist at save
            (rank 0's was read; the core then derives a seed from the tag, the rank and that state).
        load_path: what ``load_checkpoint`` returns first (the model-states file).
    """

    saved_world_size: int
    module: Mapping[str, torch.Tensor]
    engine_state: dict[str, Any]
    client_state: dict[str, Any]
    load_path: str
    optimizer_state: dict[str, Any] | None = None
    rank_state: dict[str, Any] | None = None
    rank_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    own_rank: bool = True


@runtime_checkable
class CheckpointLayout(Protocol):
    """An on-disk checkpoint layout (the object a :class:`~dscore.specs.CheckpointLayoutSpec` names).

    Required members are below. Optional members, used when present (``getattr``):

    * ``check_save(engine, zero_stage: int) -> None``: refuse an engine this layout cannot store, before
      anything is written (raise :class:`~dscore.errors.CheckpointError` saying what to use instead).
    * ``tags_present(save_dir) -> str``: the tags of a save directory, for "nothing to load" warnings.
    * ``export_weights(save_dir, output, tag, dtype) -> str``: write the consolidated weights to one
      safetensors file (``dscore checkpoint export``); without it the core writes :meth:`fp32_state_dict`
      cast to ``dtype``.
    * ``import_checkpoint(src_dir, out_dir, tag) -> str``: convert a save directory of this layout into
      dscore's native layout (``dscore checkpoint import``); returns the tag directory written.
    * ``describe(save_dir) -> dict``: what ``dscore checkpoint list`` prints for a directory of this layout.
    """

    name: str

    def detect(self, save_dir: str, tag: str | None) -> bool:
        """Whether ``save_dir`` (with ``tag``, or the one ``latest`` names) holds a checkpoint of this layout.

        Cheap (directory listings, small marker files) and never raising: False when unsure.
        """
        ...

    def resolve_tag(self, save_dir: str, tag: str | None, *, universal: bool = False) -> str | None:
        """The tag to load (``tag``, else the one ``latest`` names); None when there is no ``latest`` (start
        fresh).

        Raises:
            CheckpointNotFoundError: no such directory or tag, or the tag is incomplete.
            CheckpointError: ``save_dir`` is a file or a tag directory; anything else wrong with it.
        """
        ...

    def write(self, state: CheckpointSaveState, tmp_dir: str) -> dict[str, int]:
        """Write this rank's files into ``tmp_dir`` (shared by every rank; published after all wrote).

        Returns:
            ``{file name: bytes}`` of the files this rank wrote (names unique across ranks).

        Raises:
            CheckpointError / OSError: the files cannot be written (raised on every rank by the core).
        """
        ...

    def read(self, request: CheckpointLoadRequest) -> LoadedCheckpoint:
        """Read and validate the checkpoint for ``request.engine`` (every rank; apply nothing).

        Raises:
            CheckpointNotFoundError: a file is missing (named). CheckpointError: a file is malformed or the
                state does not fit the engine.
        """
        ...

    def fp32_state_dict(self, save_dir: str, tag: str | None) -> dict[str, torch.Tensor]:
        """The consolidated module state dict with floating-point tensors in fp32 (CPU), no process group.

        Raises:
            CheckpointNotFoundError / CheckpointError: as :meth:`resolve_tag` and :meth:`read`.
        """
        ...
