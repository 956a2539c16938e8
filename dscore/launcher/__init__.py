"""``dscore run``: DeepSpeed's launcher, rebuilt (hostfile, include/exclude, runners, local launch).

Modules (all torch-free; the training scripts import torch themselves):

* :mod:`~dscore.launcher.hostfile` - parse ``host slots=N`` hostfiles.
* :mod:`~dscore.launcher.resources` - apply ``--include``/``--exclude``/``--num_nodes``/``--num_gpus``.
* :mod:`~dscore.launcher.envfile` - environment exported to remote nodes (``.deepspeed_env``).
* :mod:`~dscore.launcher.accel` - what the launcher needs from the accelerator (visible-devices variable).
* :mod:`~dscore.launcher.ranks` - one node's ranks: layout, environment, argv (:class:`ProcessSpec`).
* :mod:`~dscore.launcher.supervise` - start and supervise processes (signals, exit codes, clean-up).
* :mod:`~dscore.launcher.ports` - the single-node rendezvous port (pick a free one, check an explicit one).
* :mod:`~dscore.launcher.local` - the local launch path (re-exports the three above).
* :mod:`~dscore.launcher.node` - per-node entry (``python -m dscore.launcher.node``) used by remote runners.
* :mod:`~dscore.launcher.runners` - the multi-node back-end contract (:class:`Runner`,
  :class:`RunnerContext`) and how ``--launcher NAME`` is found in the plugin registry; the back ends
  themselves (pdsh, ssh, openmpi, mpich, impi, mvapich, slurm) are the built-in ``launch`` plugin's,
  and third parties add theirs with ``dscore_register_launchers``.
* :mod:`~dscore.launcher.plan` - the launch plan (what ``--dry_run`` prints and what is executed).
* :mod:`~dscore.launcher.options` - the command-line options.
"""

from __future__ import annotations

__all__: list[str] = []
