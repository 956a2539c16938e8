"""The collective, atomic save protocol and the load-path rules, for checkpoint writers outside this package.

SDK for an engine or a layout in a plugin that saves its own files the way :mod:`dscore.checkpoint` saves
the standard engine's (the pipeline engine plugin's per-layer checkpoints use it): validate and agree on
the tag (:func:`validate_tag`, :func:`choose_tag`), write every rank's files into a private temporary
folder (:func:`tmp_dir_path`, :func:`prepare_tmp_dir`, :func:`atomic_write`), agree on every rank's outcome
(:func:`capture`, :func:`agree`: an error on one rank is raised on all, naming it), then publish the folder
under its tag in one rename with ``_COMPLETE`` written and ``latest`` moved last (:func:`publish`). Loading
applies the same rules as the standard engine (:func:`resolve_tag` with the writer's manifest ``kind``,
:func:`read_manifest`, :func:`check_files`). :func:`encode` is how ``client_state`` is checked to be
storable without pickle (it raises :class:`~dscore.errors.CheckpointError` naming the key path).

These are the functions of the core's own layout, re-exported under one public name; their behaviour
(and the ``DSCORE_CHECKPOINT_FSYNC`` durability switch) is documented on each.
"""

from __future__ import annotations

from dscore.checkpoint._layout import (
    COMPLETE_FILE,
    LATEST_FILE,
    agree,
    atomic_write,
    capture,
    check_files,
    choose_tag,
    prepare_tmp_dir,
    publish,
    read_manifest,
    resolve_tag,
    tmp_dir_path,
    validate_tag,
)
from dscore.checkpoint._tree import encode

__all__ = [
    "COMPLETE_FILE",
    "LATEST_FILE",
    "agree",
    "atomic_write",
    "capture",
    "check_files",
    "choose_tag",
    "encode",
    "prepare_tmp_dir",
    "publish",
    "read_manifest",
    "resolve_tag",
    "tmp_dir_path",
    "validate_tag",
]
