"""The layout rules of docs/architecture.rst, checked on the source (``ast``, no import):

* no import cycle between synkhronos' modules (imports inside functions included; an
  import of a package's module is an edge to that module, not to the package);
* no module outside ``synkhronos/backends/`` imports a backend's module: only the
  composition root ``synkhronos.backends`` (and what it re-exports);
* no file in ``synkhronos/`` is over 600 lines;
* no file reads or writes another file's private names (``obj._name`` where ``_name`` is
  not defined in the same file)."""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "synkhronos")
MAX_LINES = 600
# private names of the standard library and of libraries, not of synkhronos' classes
FOREIGN_PRIVATE = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe", "_src", "_current_frames",
                   "_run_exitfuncs"}


def _modules():
    """{module name: path} of every module of the package."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


MODULES = _modules()


def _tree(path):
    with open(path) as fh:
        return ast.parse(fh.read(), path)


def _imports(name, path):
    """The synkhronos modules ``name`` imports (anywhere in it), resolved."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_no_import_cycle():
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(GRAPH[m]):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_only_the_composition_root_is_imported_from_outside_backends():
    bad = [(m, d) for m, deps in GRAPH.items() if not m.startswith("synkhronos.backends")
           for d in deps if d.startswith("synkhronos.backends.")]
    assert not bad, "\n".join(f"{m} imports {d}" for m, d in bad)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_file_size(name):
    with open(MODULES[name]) as fh:
        lines = sum(1 for _ in fh)
    assert lines <= MAX_LINES, f"{name}: {lines} lines (at most {MAX_LINES}: split it by meaning)"


def _defined(tree):
    """Every name a file defines: functions, classes, assignments and attributes it sets."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
    return names


def test_no_private_names_of_other_files():
    bad = []
    for name, path in sorted(MODULES.items()):
        tree = _tree(path)
        own = _defined(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr in FOREIGN_PRIVATE or attr in own:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            bad.append(f"{name}:{node.lineno}: .{attr}")
    assert not bad, "\n".join(bad)
