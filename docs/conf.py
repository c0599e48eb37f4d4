"""Sphinx configuration for the synkhronos documentation.

Plain Sphinx + the built-in alabaster theme, autodoc + napoleon; no network at build time
(no intersphinx).  Build with ``docs/build.sh`` (warnings are errors).

At build time this file also writes two small generated pieces into ``docs/_generated/``
(ignored by git, excluded from the page search):

* ``extensions_api.rst.inc``: the autodoc directives for ``synkhronos.extensions`` if that
  package imports, otherwise a note, so the build never fails on a missing module;
* ``bench_figures.rst.inc`` plus copies of ``benchmarks/results/*.png``: an image for every
  plot present, otherwise a note saying how to produce it.
"""
import glob
import importlib
import os
import shutil
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path.insert(0, ROOT)

import synkhronos  # noqa: E402

project = "synkhronos"
author = "synkhronos contributors"
copyright = "2017 Adam Stooke (original Synkhronos); synkhronos contributors"
release = synkhronos.__version__
version = ".".join(release.split(".")[:2])

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build", "_generated", "examples", "Thumbs.db", ".DS_Store"]
templates_path = []
root_doc = "index"

html_theme = "alabaster"
html_theme_options = {
    "description": "Data-parallel PyTensor functions over worker processes",
    "fixed_sidebar": True,
}
html_static_path = []
html_title = f"synkhronos {release}"

# autodoc: users never construct Function or Data themselves, so class headers carry no
# constructor signature (the internal ``rt``/``_rt`` arguments stay out of the docs).
autodoc_class_signature = "separated"
autodoc_member_order = "bysource"
autodoc_default_options = {"exclude-members": "__init__, __new__"}
napoleon_google_docstring = True
napoleon_numpy_docstring = True

nitpicky = True
# Names that appear in signatures/bases but are not documented objects of this site.
nitpick_ignore = [("py:class", "Exception"), ("py:class", "RuntimeError")]

# ---- generated pieces -----------------------------------------------------------------------
GEN = os.path.join(DOCS, "_generated")
os.makedirs(GEN, exist_ok=True)


def _write(name, text):
    """Write a generated file only when its content changes (keeps incremental builds)."""
    path = os.path.join(GEN, name)
    try:
        with open(path) as fh:
            if fh.read() == text:
                return
    except OSError:
        pass
    with open(path, "w") as fh:
        fh.write(text)


def _extensions_api():
    """autodoc directives for every public name (``__all__``) of the extensions modules."""
    lines = []
    try:
        for modname in ("synkhronos.extensions.updates", "synkhronos.extensions.train"):
            mod = importlib.import_module(modname)
            names = getattr(mod, "__all__", None) or [
                n for n, o in vars(mod).items()
                if not n.startswith("_") and getattr(o, "__module__", None) == modname]
            lines += [f".. module:: {modname}", ""]
            for n in names:
                obj = getattr(mod, n, None)
                if isinstance(obj, type):
                    lines += [f".. autoclass:: {n}", "   :members:"]
                    if "__call__" in vars(obj):
                        lines.append("   :special-members: __call__")
                    lines.append("")
                elif callable(obj):
                    lines += [f".. autofunction:: {n}", ""]
    except Exception as e:  # the extensions are optional for the build
        return (".. note::\n\n"
                "   The API reference of ``synkhronos.extensions`` is generated from its\n"
                "   docstrings, but the package could not be imported when these docs were\n"
                f"   built ({type(e).__name__}).\n")
    return "\n".join(lines)


def _bench_figures():
    results = os.path.join(ROOT, "benchmarks", "results")
    pngs = sorted(glob.glob(os.path.join(results, "*.png")))
    out_dir = os.path.join(GEN, "bench")
    os.makedirs(out_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(out_dir, "*.png")):
        if os.path.basename(stale) not in {os.path.basename(p) for p in pngs}:
            os.remove(stale)
    if not pngs:
        return (".. note::\n\n"
                "   No plots in ``benchmarks/results/`` yet: run the benchmark (above) to\n"
                "   produce them, then rebuild the docs.\n")
    parts = []
    for p in pngs:
        name = os.path.basename(p)
        shutil.copy2(p, os.path.join(out_dir, name))
        parts.append(f".. figure:: /_generated/bench/{name}\n"
                     f"   :width: 100%\n"
                     f"   :alt: benchmarks/results/{name}\n\n"
                     f"   ``benchmarks/results/{name}`` (copied in when the docs were built).\n")
    return "\n".join(parts)


_write("extensions_api.rst.inc", _extensions_api())
_write("bench_figures.rst.inc", _bench_figures())
