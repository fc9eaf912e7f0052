"""The import graph of ci/: the arrows run one way, and the stages receive resolved values.

A target's toolchain is resolved once (ci.resolve -> the frozen values of ci.resolved); the
build, repair, tag and verify stages take those values and never reach back into the modules
that find or install things (ci.toolchain, ci.torch_source) or into the resolver itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parent.parent / "ci"
STAGES = ("ci.build", "ci.repair", "ci.tag", "ci.verify")
LOOKUPS = {"ci.toolchain", "ci.torch_source", "ci.resolve"}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(CI.rglob("*.py")):
        parts = f.relative_to(CI.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def _type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


TESTS = Path(__file__).resolve().parent
# what tests/ holds as importable names (its modules and packages, as conftest puts tests/ on sys.path)
TEST_NAMES = {"tests"} | {p.stem for p in TESTS.glob("*.py")} | {p.name for p in TESTS.iterdir() if p.is_dir()}
LOADERS = ("spec_from_file_location", "run_path", "SourceFileLoader")


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``import from`` names, relative ones resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")[: None if is_package else -1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(source: str, module: str = "", *, is_package: bool = False, cli: bool = True) -> set[str]:
    """Every module name an import in ``source`` names, wherever it stands (module level,
    functions, ``main``, methods), with ``from m import x`` giving ``m`` and ``m.x``. Only the
    imports under ``if TYPE_CHECKING:`` are set aside: they never run. ``cli=False`` leaves out
    the module's own ``main`` (what runs only as ``python -m``)."""
    found: set[str] = set()
    tree = ast.parse(source)

    def visit(nodes) -> None:
        for n in nodes:
            if isinstance(n, ast.If) and _type_checking(n):
                visit(n.orelse)
                continue
            if not cli and isinstance(n, ast.FunctionDef) and n.name == "main" and n in tree.body:
                continue
            if isinstance(n, ast.ImportFrom):
                mod = _absolute(module, is_package, n)
                found.update([mod, *(f"{mod}.{a.name}" if mod else a.name for a in n.names)])
            elif isinstance(n, ast.Import):
                found.update(a.name for a in n.names)
            visit(ast.iter_child_nodes(n))

    visit(tree.body)
    return found


def imports(module: str, *, cli: bool = True) -> set[str]:
    """The ci modules ``module`` imports, function-level imports included (``cli=False``: but
    those of its ``main``)."""
    path = MODULES[module]
    names = imported_names(path.read_text(), module, is_package=path.name == "__init__.py", cli=cli)
    return {x for x in names if x in MODULES and x != module}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> the modules it imports) as a path that ends
    where it starts, or None."""
    done: set[str] = set()

    def walk(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for n in sorted(graph.get(m, ())):
            if cycle := walk(n, path + [m]):
                return cycle
        done.add(m)
        return None

    for m in sorted(graph):
        if cycle := walk(m, []):
            return cycle
    return None


GRAPH = {m: imports(m) for m in MODULES}


def test_no_import_cycle_in_ci_counting_every_import():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_an_injected_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    # one arrow back up the real graph: the lowest module importing the highest one
    injected = {**GRAPH, "ci.targets": GRAPH["ci.targets"] | {"ci.pipeline"}}
    cycle = find_cycle(injected)
    assert cycle and "ci.targets" in cycle and "ci.pipeline" in cycle, cycle


def test_the_import_reader_sees_imports_inside_functions_and_main():
    source = (
        "from __future__ import annotations\n"
        "import typing\n"
        "from ci import targets\n"
        "if typing.TYPE_CHECKING:\n"
        "    from ci.pipeline import TargetRun\n"
        "def helper():\n"
        "    from ci.build import build_wheel\n"
        "class K:\n"
        "    def m(self):\n"
        "        import ci.repair\n"
        "def main():\n"
        "    from .tag import retag\n"
        "    from . import verify\n"
    )
    names = imported_names(source, "ci.cli")
    assert {"ci.targets", "ci.build", "ci.repair", "ci.tag", "ci.verify"} <= names
    assert "ci.pipeline" not in names and "ci.pipeline.TargetRun" not in names
    without_cli = imported_names(source, "ci.cli", cli=False)
    assert "ci.build" in without_cli and not {"ci.tag", "ci.verify"} & without_cli


def _loads_from_tests(source: str) -> list[str]:
    """Imports of what tests/ holds, and files loaded from tests/ by path."""
    bad = sorted(x for x in imported_names(source) if x.split(".")[0] in TEST_NAMES)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] in LOADERS:
            if any(isinstance(c, ast.Constant) and str(c.value).split("/")[0] == "tests" for c in ast.walk(node)):
                bad.append(ast.unparse(node))
    return bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_production_module_imports_from_tests(module):
    bad = _loads_from_tests(MODULES[module].read_text())
    assert not bad, f"{module} takes code from tests/: {bad}"


def test_the_tests_check_catches_an_import_and_a_load_by_path():
    assert _loads_from_tests("def f():\n    from conftest_publish import sage_wheel\n") == [
        "conftest_publish", "conftest_publish.sage_wheel"]
    assert _loads_from_tests("import importlib.util\nspec = importlib.util.spec_from_file_location("
                             "'x', REPO / 'tests' / 'x.py')\n")
    assert not _loads_from_tests("from ci.targets import Matrix\nspec_from_file_location('x', PAYLOAD / 'b.py')\n")


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_never_imports_what_finds_or_installs_tools(stage):
    direct = imports(stage) & LOOKUPS
    assert not direct, f"{stage} imports {sorted(direct)}: it should receive resolved values (ci.resolved)"
    # nor through what it imports, at module level or inside a function (a call made at run time);
    # the modules it reaches are followed but for their command lines, which a stage never runs
    # (ci.patches' `check` command finds CUTLASS through ci.toolchain; its own __main__ ends that)
    seen, todo = set(), [stage]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports(m, cli=m == stage))
    assert not (seen & LOOKUPS), f"{stage} reaches {sorted(seen & LOOKUPS)} through its imports"


def test_the_resolved_values_are_frozen_and_lookup_free():
    import dataclasses

    from ci import resolved

    assert not imports("ci.resolved") & LOOKUPS
    for cls in (resolved.CudaToolkit, resolved.TorchEnv, resolved.ResolvedToolchain, resolved.VerifyEnvs):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls.__name__


def test_the_resolver_is_what_the_orchestrators_call():
    """pipeline and the cibuildwheel hooks resolve the toolchain and hand it to the build."""
    for entry in ("ci.pipeline", "ci.cibw"):
        assert "ci.resolve" in imports(entry), entry
    assert "ci.build" not in imports("ci.resolved")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_of_ci_is_over_600_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(CI.parent)}: {lines} lines (split it by concern)"
