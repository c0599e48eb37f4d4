"""Helpers the benchmark scripts share: timing repeated calls, and writing a benchmark's
results (JSON in ``benchmarks/results``, matplotlib for its plot).

A script imports them as ``from common import ...``: a script's own folder is on
``sys.path`` when it runs as ``python benchmarks/x.py``.  Nothing here imports synkhronos:
``bench_latency.py`` measures another checkout's synkhronos in a child process that must
import that one first."""
import json
import os
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def call_times(fn, reps, inner=1):
    """``reps`` mean times (seconds) of ``inner`` calls of ``fn`` each."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        ts.append((time.perf_counter() - t) / inner)
    return ts


def write_results(res, name, folder=RESULTS):
    """Write ``res`` as JSON to ``folder/name`` (made if missing); returns the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    return path


def pyplot(missing="(matplotlib not installed: no plot)"):
    """matplotlib's pyplot, drawing to files (the Agg backend), or None after printing
    ``missing`` where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(missing)
        return None
    return plt
