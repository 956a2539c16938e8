"""dscore's built-in feature plugins (comm, optim, sched, precision, zero, ops, monitor), one sub-package each."""
