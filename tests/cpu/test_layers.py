"""The package's layers, read from the source: no fa4_aot module imports another's private
name, the imports form no cycle, and each layer imports only the layers below it:

    errors, variants, policy            (the base: standard library only)
    launch/                             the launch layer
    decode, then dense and varlen       the front doors (a dense decode shape takes decode's kernel)
    torch/, torch_sdpa, cli, __init__   the adapters and the public face
    src/                                the build (the base and itself)
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fa4_aot"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str):
    """(imported module, imported names) of each import statement of module ``name``,
    anywhere in it; relative imports resolved."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = tuple(a.name for a in node.names)
            submodules = [n for n in names if f"{target}.{n}" in MODULES]
            for n in submodules:
                yield f"{target}.{n}", ()
            if len(submodules) < len(names):
                yield target, tuple(n for n in names if n not in submodules)


def _edges() -> dict:
    return {name: {m for m, _ in _imports(name) if m in MODULES and m != name} for name in MODULES}


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for name in MODULES:
        for target, names in _imports(name):
            if target in MODULES:
                bad += [f"{name}: from {target} import {n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
        # fa4_aot modules bound by an import, then a private attribute of one
        bound = {}
        tree = ast.parse(MODULES[name].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bound.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
            elif isinstance(node, ast.ImportFrom):
                for target, _ in _imports_of(node, name):
                    bound.update({a.asname or a.name: target for a in node.names if target.endswith("." + a.name)})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{name}: {node.value.id}.{node.attr}")
    assert not bad, bad


def _imports_of(node, name: str):
    """_imports for one statement of module ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    for alias in node.names:
        if f"{target}.{alias.name}" in MODULES:
            yield f"{target}.{alias.name}", ()


def test_the_imports_form_no_cycle():
    edges, state, cycles = _edges(), {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def _layer(name: str) -> int:
    rest = name.split(".")[1:]
    if rest[:1] == ["src"]:
        return -1
    if not rest or rest[0] in ("torch", "torch_sdpa", "cli", "__main__"):
        return 3
    if rest[0] in ("dense", "varlen"):
        return 2.5
    if rest[0] == "decode":
        return 2
    if rest[0] == "launch":
        return 1
    assert rest[0] in ("errors", "variants", "policy"), name
    return 0


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_layer_imports_only_those_below_it(name):
    mine = _layer(name)
    for target in _edges()[name]:
        theirs = _layer(target)
        if mine == -1:  # the build: itself and the base
            assert theirs in (-1, 0), (name, target)
        elif mine < 3:  # the adapters may import anything below them, each other too
            assert theirs != -1 and (theirs < mine or (theirs == mine == 1)), (name, target)
