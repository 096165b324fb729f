"""The package's layers (docs/architecture.md): no module imports a higher layer, no import cycle,
no folder imports another that imports it back, and a function-level import only where it keeps a
heavy package (torch, onnx, sympy, ...) out of its importer's import time, with a comment saying so.

Every import counts, at any depth of a module's code: a function-level import is an arrow like any other.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"pathir": "pathir", "frontends": "pathir.frontends", "passes": "pathir.passes", "backends": "pathir.backends"}

#: module prefix -> layer; a module may import its own layer and the ones below. Each folder has a
#: layer of its own, so an arrow between two folders always runs downwards.
LAYERS = {
    "pathir.errors": 0,
    "pathir.support": 1,
    "pathir.nn": 2,
    "pathir.ir": 3,
    "pathir.backends": 4,
    "pathir.analyses": 5,
    "pathir.rescaling": 6,
    "pathir.pairs": 7,
    "pathir.enorm": 8,
    "pathir.passes": 9,
    "pathir.frontends.core": 10,
    "pathir.frontends.torch": 11,
    "pathir.frontends.onnx": 12,
    "pathir.frontends": 13,
    "pathir.lifting": 14,
    "pathir.neurons": 15,
    "pathir.testing": 16,
    "pathir.pathcond": 17,
    "pathir.equalization": 17,
    "pathir.compiled": 18,
    "pathir.self_check": 19,
    "pathir.observe": 19,
    "pathir.api": 20,
    "pathir": 21,
    "pathir.integrations": 22,
    "pathir.optim": 23,
    "pathir.app": 24,
    "pathir.checks": 25,
}

#: third-party packages whose import costs seconds or pulls a large runtime: ``import pathir`` stays without them
HEAVY = frozenset({"torch", "torchvision", "onnx", "onnxruntime", "onnxscript", "sympy", "matplotlib", "sklearn",
                   "networkx", "timm"})

#: pathir's flat modules (support, app and integrations have folders)
MAX_FLAT = 8


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


def _folder(module: str) -> str:
    """The LAYERS entry a module belongs to (its room)."""
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def _targets(module: str, path: pathlib.Path, node, known) -> set[str]:
    """The modules one import statement names (pathir ones resolved to known modules, others by top package)."""
    if isinstance(node, ast.Import):
        return {a.name if a.name in known else a.name.split(".")[0] for a in node.names}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*up, base]) if base else ".".join(up)
    if not base.startswith("pathir"):
        return {base.split(".")[0]}
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}


def _statements(path: pathlib.Path):
    """(import node, at top level) for every import statement of a file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    return [(n, id(n) in top) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _imports(module: str, path: pathlib.Path, known) -> set[str]:
    """The pathir modules ``module`` imports, at any depth of its code (lazy imports count)."""
    found = set()
    for node, _ in _statements(path):
        found |= _targets(module, path, node, known)
    return {m for m in found if m in known and m != module}


def _heavy(mods) -> dict[str, frozenset]:
    """module -> the HEAVY packages importing it loads (its top-level imports, transitively,
    with its parent packages' ``__init__``)."""
    direct, third = {}, {}
    for m, path in mods.items():
        names = set().union(*[_targets(m, path, n, mods) for n, top in _statements(path) if top] or [set()])
        parents = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}
        direct[m] = {d for d in names | parents if d in mods and d != m}
        third[m] = frozenset(names & HEAVY)
    out = {}
    for m in mods:  # everything m's import reaches, by a plain search (package inits import back into their children)
        seen, todo = {m}, [m]
        while todo:
            for d in direct[todo.pop()] - seen:
                seen.add(d)
                todo.append(d)
        out[m] = frozenset().union(*(third[d] for d in seen))
    return out


def test_no_module_imports_a_higher_layer():
    mods = _modules()
    upward = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
              for m, path in mods.items() for d in _imports(m, path, mods) if _layer(d) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_no_folder_imports_a_folder_that_imports_it_back():
    mods = _modules()
    arrows = {(_folder(m), _folder(d)) for m, p in mods.items() for d in _imports(m, p, mods)
              if _folder(m) != _folder(d)}
    both = sorted(f"{a} <-> {b}" for a, b in arrows if (b, a) in arrows and a < b)
    assert not both, "\n".join(both)


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


def test_function_level_imports_only_keep_a_heavy_package_out():
    """A pathir module imported inside a function must load a heavy package its importer does not
    load at import time, and say so with a ``# lazy:`` comment on the import's first line."""
    mods = _modules()
    heavy = _heavy(mods)
    wrong = []
    for m, path in mods.items():
        lines = path.read_text().splitlines()
        for node, top in _statements(path):
            targets = {d for d in _targets(m, path, node, mods) if d in mods}
            if top or not targets:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            spared = set().union(*(heavy[d] for d in targets)) - heavy[m]
            if not spared:
                wrong.append(f"{where}: {', '.join(sorted(targets))} loads nothing heavy that {m} does not: "
                             "import it at the top")
            elif "# lazy:" not in lines[node.lineno - 1]:
                wrong.append(f"{where}: a function-level import keeping {', '.join(sorted(spared))} out of "
                             f"{m}'s import time needs a '# lazy: ...' comment saying so")
    assert not wrong, "\n".join(wrong)


def test_import_pathir_loads_no_heavy_package():
    heavy = _heavy(_modules())
    assert not heavy["pathir"], f"import pathir loads {sorted(heavy['pathir'])}"


def test_pathir_has_few_flat_modules():
    flat = sorted(p.stem for p in (ROOT / "pathir").glob("*.py") if p.stem != "__init__")
    assert len(flat) <= MAX_FLAT, flat
