"""Imports point down: no module of easytrain imports from a layer above its own, and no modules import each
other in a cycle.

    python scripts/check_imports.py [ROOT]     # exit 0 clean, 1 with each upward import or cycle as file:line

Every module belongs to a unit: a subpackage of ``easytrain/`` (``trainer``, ``workers``, ...) or a module at
its top (``main``, ``cli``). :data:`LAYERS` orders the units, top first; a unit may import itself and any unit
of a lower layer, never one of its own layer (units of a layer are independent of each other) or above. Every
import counts: at module level, inside a function (a lazy import is still a dependency), under
``TYPE_CHECKING``, absolute or relative. The same imports, module to module (the module a dotted name reaches:
``from easytrain.models.families import family_of`` reaches ``families/__init__.py``), must form no cycle, lazy
imports included: a lazy import only hides a cycle from Python, not from a reader. Only the standard library is
used (``ast``): nothing is imported.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

PACKAGE = "easytrain"
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),                      # the command line: every subcommand
    ("launch",),                   # submitting runs (Ray Jobs, KubeRay): validates as main does, runs main remotely
    ("main",),                     # one run: config, checks, Ray, the trainer
    ("trainer",),                  # the single controller: loops, roles, checkpoints, metrics
    ("workers",),                  # the Ray actors: actor, reference, rollout, rewards
    ("distributed",),              # Ray, worker groups, FSDP/DeepSpeed, checkpoint files, the token's transport
    ("memory",),                   # the planner, the watchdog, peaks, host buffers
    ("models",),                   # loading and building models; one adapter per model family (which sizes data)
    ("data",),                     # data sources, images, packing (the family's rules come in as objects)
    ("config",),                   # schema, composition, validation, facts derived from a config
    ("tools",),                    # multi-turn tools: loading, call parsing, the tool process
    ("algorithms", "rewards"),     # pure: losses, advantages, KL; reward functions
)
"""Units by layer, top first."""
ROOT_MODULE = "__init__"
"""``easytrain/__init__.py`` (the version): it runs before any module of the package, so every unit may import
it and it may import no unit."""


@dataclass(frozen=True)
class Violation:
    """One import of a unit the importing file's unit may not depend on."""

    path: Path
    line: int
    statement: str
    importer: str
    imported: str
    why: str

    def render(self, base: Optional[Path] = None) -> str:
        """``file:line: statement  (importer -> imported: why)``, the file relative to ``base`` when given."""
        path = self.path.relative_to(base) if base is not None else self.path
        return f"{path}:{self.line}: {self.statement}  ({self.importer} -> {self.imported}: {self.why})"

    def __str__(self) -> str:
        return self.render()


def layer_of(layers: Sequence[Sequence[str]]) -> dict[str, int]:
    """Unit -> its layer's index (0 = top)."""
    return {unit: i for i, units in enumerate(layers) for unit in units}


def unit_of_file(path: Path, root: Path) -> str:
    """The unit of a file under ``root`` (the ``easytrain`` folder): its first folder, or its module name."""
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def _package_of_file(path: Path, root: Path) -> list[str]:
    """The package a file's relative imports start from: ``easytrain.config`` for config/paths.py and for
    config/__init__.py."""
    parts = [PACKAGE, *path.relative_to(root).parts]
    return parts[:-1]


def _imported_modules(node: ast.Import | ast.ImportFrom, package: list[str]) -> Iterator[str]:
    """The absolute dotted names an import statement reaches (``from X import a, b`` names X.a and X.b: either
    may be a submodule)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    module = node.module or ""
    if node.level:
        base = package[:len(package) - node.level + 1]
        module = ".".join(base + ([module] if module else []))
    for alias in node.names:
        yield module if alias.name == "*" else f"{module}.{alias.name}"


def _unit_of_module(name: str) -> Optional[str]:
    """The unit a dotted name lies in; None outside easytrain, for the package itself and its dunders."""
    parts = name.split(".")
    if parts[0] != PACKAGE or len(parts) < 2 or parts[1].startswith("__"):
        return None
    return parts[1]


def _statement(source_lines: list[str], node: ast.stmt) -> str:
    end = node.end_lineno or node.lineno
    return " ".join(line.strip() for line in source_lines[node.lineno - 1:end])


def check_file(path: Path, root: Path, layers: Sequence[Sequence[str]] = LAYERS) -> list[Violation]:
    """The imports of one file that point up or sideways, or that involve a unit the table lacks."""
    units = layer_of(layers)
    importer = unit_of_file(path, root)
    source = path.read_text(encoding="utf-8")
    if importer not in units and importer != ROOT_MODULE:
        return [Violation(path, 1, "(the file itself)", importer, importer, f"{importer} is not in the layer table")]
    lines = source.splitlines()
    package = _package_of_file(path, root)
    found: list[Violation] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        reached = {_unit_of_module(name) for name in _imported_modules(node, package)}
        for imported in sorted(unit for unit in reached if unit is not None and unit != importer):
            why = _why(importer, imported, units)
            if why:
                found.append(Violation(path, node.lineno, _statement(lines, node), importer, imported, why))
    return found


def _why(importer: str, imported: str, units: dict[str, int]) -> str:
    """Why ``importer`` may not import ``imported``; empty when it may."""
    if importer == ROOT_MODULE:
        return "the package's __init__ runs before every module of it"
    if imported not in units:
        return f"{imported} is not in the layer table"
    if units[imported] < units[importer]:
        return "upward"
    if units[imported] == units[importer]:
        return "sideways, within one layer"
    return ""


def check_tree(root: Path, layers: Sequence[Sequence[str]] = LAYERS) -> list[Violation]:
    """Every violation under ``root`` (the ``easytrain`` folder), by file and line."""
    found: list[Violation] = []
    for path in sorted(root.rglob("*.py")):
        found.extend(check_file(path, root, layers))
    return sorted(found, key=lambda v: (str(v.path), v.line))


def module_of_file(path: Path, root: Path) -> str:
    """``easytrain.config.paths`` for config/paths.py, ``easytrain.config`` for config/__init__.py."""
    parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == ROOT_MODULE else parts)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> each easytrain module it imports -> the first line that does (a name resolves to the longest
    module it starts with)."""
    files = {module_of_file(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        package = _package_of_file(path, root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_modules(node, package):
                parts = name.split(".")
                target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in files),
                              None)
                if target is not None and target != module and target != PACKAGE:
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The modules of each import cycle (strongly connected components of more than one module), each listed
    from its smallest name along its imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1] / PACKAGE,
                        help="the easytrain package folder (default: this repository's)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"check_imports: {args.root} is not a folder", file=sys.stderr)
        return 2
    root = args.root.resolve()
    found = check_tree(root)
    for violation in found:
        print(violation.render(root.parent))
    graph = import_graph(root)
    loops = cycles(graph)
    for members in loops:
        inside = set(members)
        print("import cycle: " + "; ".join(f"{a} -> {b} (line {line})" for a in members
                                            for b, line in sorted(graph[a].items()) if b in inside))
    if found:
        order = " -> ".join(", ".join(units) for units in LAYERS)
        print(f"check_imports: {len(found)} import(s) against the layer order (top imports bottom): {order}",
              file=sys.stderr)
    if loops:
        print(f"check_imports: {len(loops)} import cycle(s), lazy imports included: move what both sides need "
              "below them", file=sys.stderr)
    if found or loops:
        return 1
    print(f"check_imports: every import of {args.root.name}/ points down, and none forms a cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
