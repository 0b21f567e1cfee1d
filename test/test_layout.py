"""The package's layout stays what docs/architecture.rst draws: folders by concern, whose
imports between each other never run in a circle, and ``__init__`` files that import only
what they expose."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from test.conftest import ROOT

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

PACKAGE = ROOT / "horovod_ray"
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def _room(module: str) -> str:
    """``horovod_ray.job.static`` -> ``job``; a top-level module is a room of its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path) -> set[str]:
    """The horovod_ray modules ``path`` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "horovod_ray":
                found |= {f"horovod_ray.{alias.name}" for alias in node.names}
            elif node.module.startswith("horovod_ray."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("horovod_ray.")}
    return found


def room_graph() -> dict[str, set[str]]:
    """Which folder (or top-level module) imports which, the package's own __init__ aside."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative == Path("__init__.py"):
            continue
        room = relative.parts[0].removesuffix(".py")
        targets = {_room(m.removeprefix("horovod_ray.")) for m in _imports(path)}
        graph.setdefault(room, set()).update(targets - {room})
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports in ``graph``, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target, [*path, target])):
                return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_the_cycle_finder_finds_a_circle_and_clears_a_line():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_folders_import_each_other_one_way_only():
    assert cycle(room_graph()) is None


def test_every_folder_is_drawn_on_the_architecture_page():
    page = (ROOT / "docs" / "architecture.rst").read_text()
    for folder in FOLDERS:
        assert f"{folder}/" in page, folder


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_folders_init_says_what_it_owns_and_loads_nothing_else(folder):
    """A rank's process loads ``rank/__init__`` on its way to the actor's class: an
    __init__ that imported its modules would load them all there."""
    init = PACKAGE / folder / "__init__.py"
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"{folder}/__init__.py needs a docstring"
    exposed = {f"horovod_ray.{folder}.trainable"} if folder == "tune" else set()
    assert _imports(init) <= exposed, folder


def test_the_top_holds_the_public_surface_and_few_modules():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 12, modules
