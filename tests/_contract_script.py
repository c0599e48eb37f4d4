"""The contract checks (``synkhronos.conformance``) under one wiring: ``python
_contract_script.py N`` (the wiring follows the environment: ``SYNK_MODE``,
``SYNK_JAX_COMM``; under ``mpiexec`` the session spans the MPI processes).  The master
prints ``CONTRACT {json}``."""
import json
import sys

import numpy as np


def main():
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos import conformance
    synk.fork(int(sys.argv[1]))
    a = pytensor.shared(np.ones(3, "float32"), name="a")
    b = pytensor.shared(np.zeros(2, "float32"), name="b")
    x = pt.vector("x", dtype="float32")
    synk.function([x], outputs=x.sum() + a.sum(), updates=[(b, b + 1)])
    synk.distribute()
    result = conformance.run()
    synk.close()
    print("CONTRACT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
