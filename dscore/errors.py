"""The dscore error hierarchy.

Every error dscore raises on purpose derives from :class:`DscoreError`, so callers (and the CLI) can
catch one type and print a clean message instead of a traceback. Errors are plain exceptions with a
readable ``str()``; the subclasses add the structured fields a caller may want to inspect.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "DscoreError",
    "PluginError",
    "PluginLoadError",
    "PluginConflictError",
    "PluginValidationError",
    "ComponentNotFoundError",
    "ConfigError",
    "DistributedError",
    "AcceleratorError",
    "LauncherError",
    "HostfileError",
    "LauncherArgumentError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointArgumentError",
    "CheckpointTagMismatchError",
    "OpBuildError",
    "FragmentAccessError",
    "PartitionedParameterError",
    "RolloutError",
    "WeightSyncError",
    "did_you_mean",
]


def did_you_mean(word: str, choices: Iterable[str], *, n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Return up to ``n`` entries of ``choices`` close to ``word`` (case-insensitive, difflib ratio).

    The original spelling of each choice is returned, best match first.
    """
    by_lower: dict[str, str] = {}
    for choice in choices:
        by_lower.setdefault(choice.lower(), choice)
    matches = difflib.get_close_matches(word.lower(), list(by_lower), n=n, cutoff=cutoff)
    return [by_lower[m] for m in matches]


class DscoreError(Exception):
    """Base class of every error dscore raises deliberately."""


class PluginError(DscoreError):
    """Something is wrong with an installed plugin or with how plugins were selected."""


class PluginLoadError(PluginError):
    """A plugin could not be imported or registered.

    Raised when a component that is needed comes from a plugin whose status is ``broken``.
    ``plugin``, ``distribution`` and ``version`` name the offender.
    """

    def __init__(self, message: str, *, plugin: str = "", distribution: str = "", version: str = "") -> None:
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution
        self.version = version


class PluginValidationError(PluginError):
    """A plugin implements a hook that does not exist (misspelled) or with a wrong signature."""


class PluginConflictError(PluginError):
    """Two or more plugins register a component of the same kind under the same name (or alias)."""


class ComponentNotFoundError(PluginError, LookupError):
    """No installed plugin provides the requested component.

    ``kind`` is the component kind (``"optimizer"``), ``name`` what was asked for, ``available`` what
    is installed, ``suggestions`` close matches.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        name: str,
        available: list[str],
        suggestions: list[str],
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.name = name
        self.available = available
        self.suggestions = suggestions


class ConfigError(DscoreError, ValueError):
    """A ds_config value is invalid.

    ``path`` is the dotted key path (``zero_optimization.stage``) or ``""`` for the whole config;
    ``source`` is the file name (or ``"<dict>"``) the config came from. ``errors`` holds one
    ``(path, message)`` pair per problem when several were found at once.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        source: str = "",
        errors: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.source = source
        self.errors = list(errors) if errors else [(path, message)]


class DistributedError(DscoreError, RuntimeError):
    """The process group could not be set up consistently (bad environment, mismatched ranks)."""


class AcceleratorError(DscoreError, RuntimeError):
    """An accelerator was requested that is not installed or not usable here."""


class LauncherError(DscoreError):
    """``dscore run`` was given options it cannot act on."""


class LauncherArgumentError(LauncherError, ValueError):
    """A launcher option or resource filter has an invalid or conflicting value (``--include``/``--exclude``,
    ``--num_nodes``/``--num_gpus``); a ``ValueError`` as DeepSpeed's launcher raises for the same input."""


class HostfileError(LauncherError, ValueError):
    """A hostfile is missing or malformed. ``path`` and ``line`` (1-based, 0 if none) locate it."""

    def __init__(self, message: str, *, path: str = "", line: int = 0) -> None:
        super().__init__(message)
        self.path = path
        self.line = line


class CheckpointError(DscoreError):
    """A checkpoint cannot be saved or loaded as asked."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, tag or shard file does not exist."""


class CheckpointArgumentError(CheckpointError, ValueError):
    """``save_checkpoint`` was given a ``save_dir`` or tag that cannot name a checkpoint (empty, None, a path
    separator, ...). A ``ValueError`` too, as DeepSpeed raises for an empty ``save_dir``."""


class CheckpointTagMismatchError(CheckpointError, AssertionError):
    """The ranks passed different checkpoint tags under ``checkpoint.tag_validation: FAIL``. An
    ``AssertionError`` too, as DeepSpeed asserts the tags match."""


class OpBuildError(DscoreError, RuntimeError):
    """A C++/CUDA op cannot be built or loaded (missing compiler, CUDA mismatch, build failure)."""


class FragmentAccessError(DscoreError, ValueError):
    """A per-parameter accessor into ZeRO state (:mod:`dscore.zero.fragments`, ``deepspeed.utils.safe_*``)
    cannot answer: the ZeRO stage does not provide it, the parameter belongs to no engine, no reduced
    gradient exists now, the optimizer has no such state key, or a value has the wrong number of elements.
    The message names the parameter and what would be valid."""


class PartitionedParameterError(DscoreError, RuntimeError):
    """A torch call read or wrote a ZeRO-3 partitioned parameter while it is released (only this rank's
    partition exists). ``name`` is the parameter's name (qualified when known), ``call`` the torch call."""

    def __init__(self, message: str, *, name: str = "", call: str = "") -> None:
        super().__init__(message)
        self.name = name
        self.call = call


class RolloutError(DscoreError, ValueError):
    """A rollout request, sampling setting or rollout batch is invalid (:mod:`dscore.rollout`); the message names
    the argument. A ``ValueError`` too, as DeepSpeed raises for the same inputs."""


class WeightSyncError(DscoreError, RuntimeError):
    """A weight sync to a generation process failed (:mod:`dscore.rollout.weight_sync`): a bad argument (named),
    a parameter the receiver cannot load (``name`` is it), or a peer that died, aborted or stopped answering
    (``peer`` names it: role, sync rank, pid and host). ``step`` is the sync's training step when known."""

    def __init__(self, message: str, *, peer: str = "", name: str = "", step: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.name = name
        self.step = step
