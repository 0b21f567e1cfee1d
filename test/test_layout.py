"""The package's layout stays what docs/architecture.rst draws: folders by concern, whose
imports between each other never run in a circle, and ``__init__`` files that import only
what they expose."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test.conftest import ROOT

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

PACKAGE = ROOT / "horovod_ray"
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def _room(module: str) -> str:
    """``horovod_ray.job.static`` -> ``job``; a top-level module is a room of its own:
    ``horovod_ray.run`` -> ``run``."""
    return module.split(".")[1]


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
        targets = {_room(module) for module in _imports(path)}
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


def test_a_module_is_in_its_folders_room():
    assert _room("horovod_ray.job.static") == "job"
    assert _room("horovod_ray.job") == "job"
    assert _room("horovod_ray.run") == "run"


def test_the_cycle_finder_finds_a_circle_and_clears_a_line():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_folders_import_each_other_one_way_only():
    assert cycle(room_graph()) is None


# The arrows between folders, as docs/architecture.rst lists them ("X uses Y, Z").
DRAWN = {
    "cli": {
        "checkpoints",
        "executor",
        "errors",
        "failures",
        "local_ray",
        "observe",
        "rank",
        "settings",
    },
    "trainer": {"checkpoints", "config", "errors", "rank", "run", "tune"},
    "tune": {"checkpoints", "data", "executor", "errors", "job", "rank", "settings"},
    "run": {"config", "data", "executor", "errors", "failures", "local_ray", "rank", "settings"},
    "executor": {"config", "data", "errors", "job", "rank", "settings"},
    "config": {"errors", "settings"},
    "job": {
        "checkpoints",
        "data",
        "errors",
        "failures",
        "observe",
        "rank",
        "rendezvous",
        "settings",
        "stack",
    },  # fmt: skip
    "rendezvous": {"errors", "rank"},
    "rank": {"checkpoints", "data", "errors", "observe", "stack"},
    "data": {"errors", "local_ray"},
    "settings": {"checkpoints", "errors"},
    "checkpoints": {"errors"},
    "observe": {"errors"},
    "failures": {"errors"},
    "stack": {"errors"},
    "local_ray": {"errors", "worker_output"},
    "discovery": {"errors", "job", "settings"},
}


def test_the_folders_import_what_the_architecture_page_draws():
    graph = room_graph()
    for room, drawn in DRAWN.items():
        assert graph[room] == drawn, (room, graph[room] ^ drawn)
    page = " ".join((ROOT / "docs" / "architecture.rst").read_text().split())
    for room, drawn in DRAWN.items():
        listed = ", ".join(f"``{target}``" for target in sorted(drawn))
        assert f"``{room}`` uses {listed}" in page, room


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
    at_import = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    loaded = [ast.unparse(node) for node in at_import if "horovod_ray" in ast.unparse(node)]
    assert loaded == [], folder


def test_the_top_holds_the_public_surface_and_few_modules():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 12, modules


def test_a_tune_ranks_session_loads_no_executor():
    """A trial's ranks unpickle ``tune.session.rank_main``, which imports ``tune`` first."""
    code = (
        "import sys, horovod_ray.tune.session; "
        "print([m for m in ('horovod_ray.executor', 'horovod_ray.job.kinds') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_module_the_architecture_page_names_exists():
    page = (ROOT / "docs" / "architecture.rst").read_text()
    named = set(re.findall(r"``(\w+/\w+)(?:\.\w+)?``", page))
    assert named, "the page names no modules"
    missing = [n for n in sorted(named) if not (ROOT / "horovod_ray" / f"{n}.py").exists()]
    missing = [n for n in missing if not (ROOT / f"{n}.py").exists()]  # test/..., bench/...
    assert missing == []


def _private_reaches(path: Path) -> list[str]:
    """Where ``path`` uses a private name (``_x``) of another horovod_ray module: imported
    by name, or read off a horovod_ray module or name it imported."""
    tree = ast.parse(path.read_text(), str(path))
    imported: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("horovod_ray"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.name}:{node.lineno} imports {alias.name}")
                    imported.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_into_another_ones_private_names():
    """A module's private names are its own: another one asks through a function."""
    found = [reach for path in PACKAGE.rglob("*.py") for reach in _private_reaches(path)]
    assert found == []
