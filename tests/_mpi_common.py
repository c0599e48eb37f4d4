"""What the programs of the multi-host tests (``_mpi_scripts.py``, ``_mpi_faults.py``) share:
the session they start and report, and the checks they count."""
import os

import numpy as np

from _fault_scripts import _info


def _session(n):
    import synkhronos as synk
    synk.fork(None if n == "auto" else int(n))
    info = synk.session_info()
    ranks = [(r.rank, r.host, r.pid) for r in info.ranks]
    _info(ranks=ranks, hosts=sorted({h for _, h, _ in ranks}), prefix=info.resources["shm_prefix"],
          mpich=_mpich_mapped())
    return info


def _mpich_mapped():
    """MPICH's shared-memory files this process maps (its job's: the tests look for them
    after the job, not at every ``mpich_shm_*`` file, which other jobs may be making)."""
    with open("/proc/self/maps") as fh:
        return sorted({os.path.basename(ln.split()[5]) for ln in fh
                       if len(ln.split()) > 5 and "/mpich_shm_" in ln.split()[5]})


class Checks:
    def __init__(self):
        self.failed = []
        self.n = 0

    def close(self, name, got, want, tol=1e-9):
        self.n += 1
        try:
            np.testing.assert_allclose(np.asarray(got, dtype=float), np.asarray(want, dtype=float),
                                       rtol=tol, atol=tol)
        except AssertionError as e:
            self.failed.append(f"{name}: {str(e)[:300]}")

    def equal(self, name, got, want):
        self.n += 1
        if not (np.shape(got) == np.shape(want) and np.array_equal(got, want)):
            self.failed.append(f"{name}: got {got!r} want {want!r}"[:400])
