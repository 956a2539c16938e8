"""dscore-testdevice: a device that is not the host, for testing dscore's GPU path without a GPU.

A third-party-style distribution (entry points in the ``dscore`` group) holding:

* ``testdev``, a PyTorch out-of-tree ``PrivateUse1`` device written in C++ (:mod:`.device`);
* the ``testdev`` accelerator plugin (:mod:`.accelerator`), registered exactly as a vendor would;
* ``testnccl``, a comm backend enforcing NCCL's rules over gloo (:mod:`.comm`).

Importing this package does nothing; the device is built and registered by :func:`.device.activate`.
"""
