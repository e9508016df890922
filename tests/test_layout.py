"""The tree shows the architecture (docs/architecture.md): no import circle among its
modules."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tpunb"


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
