"""A session over several hosts under ``mpiexec``: the job's MPI world (``world``), the
hosts and their agents (``hosts``, ``agent``), the lead slot of a host (``hub``), the
``mpi`` control plane (``control``), the ``mpi`` launcher (``launcher``), the ``hier``
collectives (``comm``, through a host's ``requests`` to its MPI process) and the ``mpi``
channel (``channel``)."""
