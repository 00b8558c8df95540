"""Check the import graph of seedfed: no cycle between modules, no client <-> server import, no
shared -> client/server or protocol -> model import, no relative import, no torch in the protocol
layer.

Every `import` and `from ... import` is counted, wherever it stands: at module level, inside
a function (a deferred import still ties the two modules together), or under
`if TYPE_CHECKING:`. A module importing a package counts as importing that package's
`__init__`; `from pkg import name` counts an edge to `pkg.name` when that is a module, else
to `pkg`.

    python scripts/check_imports.py          # exit status 1 and one line per problem

The folders map to import names as setup.py maps them (seedfed/ -> seedfed, shared/ ->
seedfed.shared, client/ -> seedfed.client, server/ -> seedfed.server).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: folder -> import name, as in setup.py's ROOTS
PACKAGES = {"seedfed": "seedfed", "shared": "seedfed.shared", "client": "seedfed.client",
            "server": "seedfed.server"}
#: (importer, imported) pairs that must never occur: client and server never import each other,
#: shared is below both, and the protocol layer is below the model layer
FORBIDDEN = (("seedfed.client", "seedfed.server"), ("seedfed.server", "seedfed.client"),
             ("seedfed.shared", "seedfed.client"), ("seedfed.shared", "seedfed.server"),
             ("seedfed.shared.protocol", "seedfed.shared.model"))
#: package -> libraries it must never import: the protocol layer runs on numpy alone (a device
#: without torch imports it; tests/shared/protocol/test_no_torch.py runs it with torch blocked)
BANNED = {"seedfed.shared.protocol": ("torch", "transformers", "peft")}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Import name -> file of every module of the four packages."""
    found: dict[str, Path] = {}
    for folder, name in PACKAGES.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(not p.isidentifier() for p in parts):
                continue  # e.g. Alembic's versions/ files: loaded by path, never imported
            found[".".join([name, *parts])] = path
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) import in `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for each import in the file, function-level ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _known(alias.name, known, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield sub, node.lineno
                else:
                    yield from _known(target, known, node.lineno)


def _known(target: str, known: set[str], line: int) -> Iterator[tuple[str, int]]:
    # `import a.b.c` binds and runs a, a.b and a.b.c: the deepest known one is the edge
    # that matters (the packages above it are initialised on the way, below it in the graph).
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in known:
            yield head, line
            return


def graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, within the four packages."""
    mods = modules(root)
    known = set(mods)
    edges: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        out = edges.setdefault(name, {})
        for dep, line in imports_of(name, path, known):
            if dep != name:
                out.setdefault(dep, line)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def style_problems(root: Path = ROOT) -> Iterator[str]:
    """Relative imports (the packages import each other absolutely, one style everywhere) and
    imports of a library a package must not use (`BANNED`)."""
    for name, path in modules(root).items():
        banned = next((libs for pkg, libs in BANNED.items()
                       if name == pkg or name.startswith(pkg + ".")), ())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                yield f"{where}: relative import (write `from seedfed... import`)"
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for t in targets:
                if t.split(".")[0] in banned:
                    yield f"{where}: {name} imports {t} (it must run without {t.split('.')[0]})"


def problems(root: Path = ROOT) -> list[str]:
    edges = graph(root)
    mods = modules(root)
    found: list[str] = list(style_problems(root))
    for a, deps in sorted(edges.items()):
        for b, line in sorted(deps.items()):
            for x, y in FORBIDDEN:
                if (a == x or a.startswith(x + ".")) and (b == y or b.startswith(y + ".")):
                    found.append(f"{mods[a].relative_to(root)}:{line}: {a} imports {b} "
                                 f"({x.split('.')[-1]} must not import {y.split('.')[-1]})")
    for comp in cycles(edges):
        members = set(comp)
        links = [f"{a} -> {b} (line {edges[a][b]})" for a in comp for b in edges[a]
                 if b in members]
        found.append(f"import cycle between {len(comp)} modules: " + "; ".join(links))
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    if not found:
        print(f"imports ok: {len(modules())} modules, no cycle, no forbidden import, "
              "absolute imports only")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
