"""The tree shows the architecture (docs/architecture.md): the public API and its entry
points directly in ``tpunb/``, the machinery in sub-packages, modules small enough to read,
and no import circle among them."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tpunb"
TOP_MODULES = 16
LINES = 320


def _modules():
    """Every module of tpunb, by dotted name, with its file."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(name, path, known):
    """The tpunb modules ``name`` imports when it is imported (its top-level imports)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if not node.level else f"{package}.{node.module}"
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
    return {module for module in found if module in known and module != name}


def test_at_most_16_modules_sit_directly_in_tpunb():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_MODULES, top


def test_no_module_is_longer_than_320_lines():
    long = {
        name: n for name, path in _modules() if (n := len(path.read_text().splitlines())) > LINES
    }
    assert long == {}


def test_no_module_imports_itself_back_through_others():
    modules = dict(_modules())
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    circles, done, path_now = [], set(), []

    def visit(module):
        if module in path_now:
            circles.append(path_now[path_now.index(module) :] + [module])
            return
        if module in done:
            return
        path_now.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path_now.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert circles == []
