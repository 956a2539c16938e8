"""``dscore run``: DeepSpeed's launcher, rebuilt (hostfile, include/exclude, runners, local launch).

Modules (all torch-free; the training scripts import torch themselves):

* :mod:`~dscore.launcher.hostfile` - parse ``host slots=N`` hostfiles.
* :mod:`~dscore.launcher.resources` - apply ``--include``/``--exclude``/``--num_nodes``/``--num_gpus``.
* :mod:`~dscore.launcher.envfile` - environment exported to remote nodes (``.deepspeed_env``).
* :mod:`~dscore.launcher.accel` - what the launcher needs from the accelerator (visible-devices variable).
* :mod:`~dscore.launcher.local` - spawn and supervise one node's ranks.
* :mod:`~dscore.launcher.node` - per-node entry (``python -m dscore.launcher.node``) used by remote runners.
* :mod:`~dscore.launcher.runners` - pdsh, ssh, openmpi, mpich, impi, mvapich and slurm command builders.
* :mod:`~dscore.launcher.plan` - the launch plan (what ``--dry_run`` prints and what is executed).
* :mod:`~dscore.launcher.options` - the command-line options.
"""

from __future__ import annotations

__all__: list[str] = []
