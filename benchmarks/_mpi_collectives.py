"""MPI side of bench_collectives.py: run as ``mpiexec -n N python _mpi_collectives.py SPEC``.

SPEC is JSON ``{"sizes": [bytes, ...], "reps": [int, ...], "warmup": int}``.  For each size,
times ``Allreduce`` (MPI.IN_PLACE, float32, SUM) and ``Bcast`` (root 0) of a float32 buffer:
every repetition starts after a barrier, and its time is the slowest rank's.  Rank 0 prints
``{"allreduce": {size: [seconds, ...]}, "bcast": {...}}`` as JSON on one line."""
import json
import sys
import time

import numpy as np
from mpi4py import MPI


def main():
    spec = json.loads(sys.argv[1])
    comm = MPI.COMM_WORLD
    out = {"allreduce": {}, "bcast": {}, "n": comm.size}
    for size, reps in zip(spec["sizes"], spec["reps"]):
        buf = np.ones(size // 4, np.float32)
        for name, op in (("allreduce", lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)),
                         ("bcast", lambda: comm.Bcast(buf, root=0))):
            times = []
            for i in range(spec["warmup"] + reps):
                buf[...] = 1.0 / comm.size          # keep sums bounded (not timed)
                comm.Barrier()
                t = time.perf_counter()
                op()
                dt = time.perf_counter() - t
                dt = comm.allreduce(dt, op=MPI.MAX)
                if i >= spec["warmup"]:
                    times.append(dt)
            out[name][str(size)] = times
    if comm.rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
