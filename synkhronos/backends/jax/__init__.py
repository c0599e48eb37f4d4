"""PyTensor's JAX backend: this process's JAX (``runtime``), ``jax.distributed``
(``distributed``), host <-> device transfers (``transfers``), the ``jax`` device
(``device``), XLA's own collectives (``xla_comm``: NCCL on GPUs), the host-staged path for
device arrays (``staged_comm``) and the ops graphs compiled for JAX need (``ops``)."""
