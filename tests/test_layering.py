"""The package's layers (docs/architecture.md): no module imports a higher layer, no import cycle."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"pathir": "pathir", "frontends": "pathir.frontends", "passes": "pathir.passes", "backends": "pathir.backends"}

#: module prefix -> layer; a module may import its own layer and the ones below
LAYERS = {
    "pathir.errors": 0, "pathir.ir": 0, "pathir.progress": 0, "pathir.files": 0, "pathir.sorted_unique": 0,
    "pathir.fast_log": 0,
    "pathir.backends": 1, "pathir.passes": 1, "pathir.frontends": 1, "pathir.rescaling": 1,
    "pathir.lifting": 2, "pathir.neurons": 2, "pathir.testing": 2,
    "pathir.pathcond": 3, "pathir.enorm": 3, "pathir.optim": 3,
    "pathir.compiled": 4, "pathir.api": 4, "pathir.checks": 4, "pathir": 4,
    "pathir.commands": 5, "pathir.cli": 5, "pathir.demo": 5, "pathir.zoo": 5,
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
    return out


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _imports(module: str, path: pathlib.Path, known) -> set[str]:
    """The pathir modules ``module`` imports, at any depth of its code (lazy imports count)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            names = [f"{base}.{a.name}" for a in node.names]
            found.update(n if n in known else base for n in names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known and m != module}


def test_no_module_imports_a_higher_layer():
    mods = _modules()
    upward = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
              for m, path in mods.items() for d in _imports(m, path, mods) if _layer(d) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle_between_modules():
    mods = _modules()
    # a package's __init__ only re-exports its modules: its arrows into itself are not cycles
    graph = {m: {d for d in _imports(m, p, mods) if not (p.name == "__init__.py" and d.startswith(m + "."))}
             for m, p in mods.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in graph[m]:
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
