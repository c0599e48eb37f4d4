"""The documentation builds with warnings as errors, and its example scripts run.

* ``test_docs_build``: ``sphinx-build -W --keep-going -n`` of ``docs/`` into a temporary
  directory (skipped, saying why, when Sphinx is not installed: ``pip install -e ".[docs]"``).
* ``test_example``: every ``docs/examples/*.py`` runs in its own Python process (its own
  synkhronos session, closed at exit) and exits 0; where a page shows the script's output
  after ``It prints::``, the output must be exactly that (synkhronos' own start-up lines
  aside), so the pages cannot drift from what the code does.
"""
import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
EXAMPLES = sorted(glob.glob(os.path.join(DOCS, "examples", "*.py")))

# Lines synkhronos itself prints (fork / distribute), which vary with the machine.
_CHATTER = re.compile(r"^(Synkhronos: |Synkhronos distributing functions|\.\.\.distribution complete)")


def test_docs_build(tmp_path):
    try:
        import sphinx  # noqa: F401
    except ImportError:
        pytest.skip('Sphinx is not installed (pip install -e ".[docs]") - docs build not checked')
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-E", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), DOCS, str(tmp_path / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"sphinx-build failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    for page in ("index", "getting-started", "program-flow", "data-patterns", "collectives",
                 "update-rules", "migration", "benchmarks", "api"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page


def _documented_outputs():
    """{example file name: expected stdout} from the pages: the ``It prints::`` literal block
    that follows a ``.. literalinclude:: examples/NAME.py``."""
    found = {}
    for rst in glob.glob(os.path.join(DOCS, "*.rst")):
        with open(rst) as fh:
            text = fh.read()
        for m in re.finditer(r"^\.\. literalinclude:: examples/(\w+\.py)\n", text, re.M):
            rest = text[m.end():]
            nxt = re.search(r"^\.\. literalinclude::", rest, re.M)
            rest = rest[:nxt.start()] if nxt else rest
            p = re.search(r"^It prints::\n\n((?:(?:   .*)?\n)+)", rest, re.M)
            if p:
                found[m.group(1)] = textwrap.dedent(p.group(1))
    return found


def _normalise(text):
    lines = [ln.rstrip() for ln in text.splitlines() if not _CHATTER.match(ln)]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


@pytest.mark.parametrize("path", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_example(path):
    name = os.path.basename(path)
    if name == "intro.py" and len(os.sched_getaffinity(0)) > 8:
        pytest.skip("intro.py forks one rank per core; covered by tests/test_intro_example.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.run([sys.executable, path], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    expected = _documented_outputs().get(name)
    if expected is not None:
        assert _normalise(proc.stdout) == _normalise(expected), (
            f"{name}: output differs from the docs\n--- docs ---\n{expected}\n--- actual ---\n{proc.stdout}")


def test_every_example_output_is_checked():
    """The pages show the output of these scripts; make sure the test found those blocks."""
    outs = _documented_outputs()
    assert {"data_patterns.py", "shared_variables.py", "collectives.py"} <= set(outs)


def test_api_page_covers_all_exports():
    """Every name in ``synkhronos.__all__`` has an autodoc entry on the API page."""
    import synkhronos
    with open(os.path.join(DOCS, "api.rst")) as fh:
        documented = set(re.findall(r"^\.\. auto\w+:: (\w+)", fh.read(), re.M))
    missing = sorted(set(synkhronos.__all__) - documented)
    assert not missing, f"docs/api.rst does not document: {missing}"
