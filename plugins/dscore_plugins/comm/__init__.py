"""The built-in comm plugin: the torch.distributed backends (gloo, nccl, ccl, xccl, hccl, mpi), the ``shm`` and
``p2p`` comm transports (with the ``shm_sync`` op) and the comms logger."""
