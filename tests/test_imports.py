"""The package's imports, read from its source with ``ast``: no module imports one that imports it back
(no circle, not even through an import inside a function), so that every module stands on a floor above
all it imports; and the paper's model and search import neither the speed wing nor the config machinery."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import aiayn

PACKAGE = Path(aiayn.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (at the top, in a function, under
    TYPE_CHECKING): ``from aiayn import schema`` counts as aiayn.schema."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {module for module in found if module in MODULES and module != name and module != "aiayn"}


GRAPH = {name: imports(name) for name in MODULES}


def floors() -> dict[str, int]:
    """Each module's floor: 1 for one that imports none of the package, else one above the highest it
    imports (a module in a circle has none and is left out)."""
    floor: dict[str, int] = {}
    while True:
        ready = {name: 1 + max((floor[other] for other in GRAPH[name]), default=0)
                 for name in GRAPH if name not in floor and GRAPH[name] <= set(floor)}
        if not ready:
            return floor
        floor.update(ready)


def circle_through(start: str) -> list[str]:
    """A shortest import circle from ``start`` back to it, or [] if none."""
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop(0)
        for other in sorted(GRAPH[path[-1]]):
            if other == start:
                return path + [start]
            if other not in seen:
                seen.add(other)
                paths.append(path + [other])
    return []


def test_the_package_has_no_import_circles():
    circles = {" -> ".join(circle) for name in GRAPH if (circle := circle_through(name))}
    assert not circles


def test_every_module_stands_above_all_it_imports():
    floor = floors()
    assert set(floor) == set(GRAPH)  # every module has a floor: none is left in a circle
    assert not [(name, other) for name in GRAPH for other in GRAPH[name] if floor[other] >= floor[name]]


@pytest.mark.parametrize("paper, wing", [
    ("aiayn.model", "aiayn.speed"), ("aiayn.model", "aiayn.config"), ("aiayn.model", "aiayn.schema"),
    ("aiayn.search", "aiayn.speed"), ("aiayn.search", "aiayn.config"),
    ("aiayn.search_contract", "aiayn.speed"), ("aiayn.search_contract", "aiayn.config"),
])
def test_the_papers_modules_import_no_wing(paper, wing):
    assert not {name for name in GRAPH[paper] if name == wing or name.startswith(wing + ".")}


def test_the_model_and_the_config_check_heads_by_the_same_rule():
    from aiayn.config import check_heads as config_rule
    from aiayn.errors import UserError
    from aiayn.model import check_heads as model_rule

    for n_heads, d_model, d_head in [(8, 512, None), (12, 1024, None), (3, 30, None), (7, 30, 4), (5, 36, None)]:
        messages = []
        for rule in (config_rule, model_rule):
            try:
                rule(n_heads, d_model, d_head)
                messages.append(None)
            except UserError as error:
                messages.append(str(error))
        assert messages[0] == messages[1]


# --- sizes: a class does one job, a function one step ---------------------------------------------

MAX_CLASS_LINES, MAX_FUNCTION_LINES = 200, 60


def oversized() -> list[str]:
    """Every class over MAX_CLASS_LINES and function over MAX_FUNCTION_LINES lines in the package, by ``ast``."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                found.append(f"{name}.{node.name}: class of {lines} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                found.append(f"{name}.{node.name}: function of {lines} lines")
    return found


def test_no_class_over_200_lines_and_no_function_over_60():
    assert oversized() == []


def test_benchmarks_and_tests_reach_bench_as_a_package_never_through_sys_path():
    import re

    repo = PACKAGE.parents[1]
    edit = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\s*=")
    found = [f"{path.relative_to(repo)}:{number}" for folder in ("bench", "tests")
             for path in sorted((repo / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if edit.search(line) and (folder == "bench" or "bench" in line)]
    assert found == []
