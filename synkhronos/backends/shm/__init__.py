"""POSIX shared memory among the ranks of one host: named segments and semaphores
(``segments``), the ``shm`` control plane (``control``, with its mailboxes in
``mailbox``), the ``shm`` collectives (``comm``, over ``slots`` and the reduction
``chunks``), the ``shm`` channel (``channel``) and the reaper of dead sessions
(``reaper``)."""
