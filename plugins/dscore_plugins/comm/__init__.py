"""The built-in comm-backend plugin: gloo, nccl, ccl, xccl, hccl and mpi for torch.distributed."""
