"""Built-in multi-node launcher back ends (``dscore run --launcher NAME``), one module per family.

* :mod:`~dscore_plugins.launch.pdsh` - ``pdsh`` (the default, as in DeepSpeed);
* :mod:`~dscore_plugins.launch.ssh` - ``ssh``, one connection per host (dscore's own);
* :mod:`~dscore_plugins.launch.mpi` - ``openmpi``, ``mpich``, ``impi``, ``mvapich`` (``mpirun``);
* :mod:`~dscore_plugins.launch.slurm` - ``slurm`` (``srun``).

Each is a :class:`dscore.launcher.runners.Runner` (the public contract) registered by the manifest
:mod:`~dscore_plugins.launch.plugin`; a single one can be disabled with
``DSCORE_DISABLE_PLUGINS=launcher:<name>``. Command shapes follow DeepSpeed's ``multinode_runner.py``
(0.19.8); differences are noted per runner.
"""

from __future__ import annotations

__all__: list[str] = []
