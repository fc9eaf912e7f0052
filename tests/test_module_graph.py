"""The import graph of ci/: the arrows run one way, down the layers of ci.checks.layers, and the
stages receive resolved values.

A target's toolchain is resolved once (ci.stages.resolve -> the frozen values of ci.toolchain.resolved); the
build, repair, tag and verify stages take those values and never reach back into the modules
that find or install things (ci.toolchain.tools, ci.toolchain.torch_source) or into the resolver itself.

And the sizes: no module of ci/ or of the payload (sageattn3/) over 500 lines, no function of
them over 100.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ci.checks.coverage import generated_block
from ci.checks.layers import DOC, LAYERS, ROOT, layer_of, layer_table, module_names, upward_arrows

CI = Path(__file__).resolve().parent.parent / "ci"
STAGES = ("ci.stages.build", "ci.stages.repair", "ci.stages.tag", "ci.stages.verify")
LOOKUPS = {"ci.toolchain.tools", "ci.toolchain.torch_source", "ci.stages.resolve"}  # each with its submodules
MAX_LINES = 500
MAX_FUNCTION_LINES = 100


MODULES = module_names(CI)


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
    injected = {**GRAPH, "ci.toolchain.targets": GRAPH["ci.toolchain.targets"] | {"ci.stages.pipeline"}}
    cycle = find_cycle(injected)
    assert cycle and "ci.toolchain.targets" in cycle and "ci.stages.pipeline" in cycle, cycle


def test_the_import_reader_sees_imports_inside_functions_and_main():
    source = (
        "from __future__ import annotations\n"
        "import typing\n"
        "from ci.toolchain import targets\n"
        "if typing.TYPE_CHECKING:\n"
        "    from ci.stages.pipeline import TargetRun\n"
        "def helper():\n"
        "    from ci.stages.build import build_wheel\n"
        "class K:\n"
        "    def m(self):\n"
        "        import ci.stages.repair\n"
        "def main():\n"
        "    from .stages.tag import retag\n"
        "    from .stages import verify\n"
    )
    names = imported_names(source, "ci.__main__")
    assert {"ci.toolchain.targets", "ci.stages.build", "ci.stages.repair", "ci.stages.tag", "ci.stages.verify"} <= names
    assert "ci.stages.pipeline" not in names and "ci.stages.pipeline.TargetRun" not in names
    without_cli = imported_names(source, "ci.__main__", cli=False)
    assert "ci.stages.build" in without_cli and not {"ci.stages.tag", "ci.stages.verify"} & without_cli


def test_every_module_of_ci_is_in_one_layer():
    for m in MODULES:
        layer_of(m)  # raises, naming the module, when no layer declares it
    assert not GRAPH[ROOT], f"the package root imports {sorted(GRAPH[ROOT])}: it sits below every layer"


def test_each_layer_is_a_folder_named_after_it():
    for layer in LAYERS:
        assert layer.packages[0] == f"ci.{layer.name}" and (CI / layer.name / "__init__.py").is_file(), layer.name


def test_no_import_goes_from_a_lower_layer_to_a_higher_one():
    """Counting every import (module level, functions, ``main``), as the cycle check does."""
    names = [layer.name for layer in LAYERS]
    up = [f"{m} ({names[layer_of(m)]}) -> {d} ({names[layer_of(d)]})" for m, d in upward_arrows(GRAPH)]
    assert not up, "imports up the layers of ci/checks/layers.py:\n" + "\n".join(up)


def test_the_layer_check_finds_an_injected_upward_arrow():
    # one arrow up the real graph: an error class importing the pipeline; one within a layer is fine
    injected = {**GRAPH, "ci.runtime.errors": GRAPH["ci.runtime.errors"] | {"ci.stages.pipeline"}}
    assert upward_arrows(injected) == [("ci.runtime.errors", "ci.stages.pipeline")]
    sideways = {**GRAPH, "ci.stages.tag": GRAPH["ci.stages.tag"] | {"ci.stages.verify", "ci.index.layout"}}
    assert upward_arrows(sideways) == []
    assert upward_arrows({"ci.toolchain.targets": {"ci.release.publish.github"}}) == [
        ("ci.toolchain.targets", "ci.release.publish.github")]
    with pytest.raises(ValueError, match="ci.elsewhere"):
        layer_of("ci.elsewhere")


def test_the_architecture_doc_holds_the_generated_layer_table():
    table = generated_block(DOC.read_text(), "layers")
    assert table == layer_table(), "docs/architecture.md's layer table is not the generated one: " \
                                   "python -m ci architecture --write-docs"


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
    assert not _loads_from_tests("from ci.toolchain.targets import Matrix\nspec_from_file_location('x', PAYLOAD / 'b.py')\n")


def lookups(modules: set[str]) -> set[str]:
    """The modules of ``modules`` that find or install things: one of LOOKUPS or a submodule of one."""
    return {m for m in modules if any(m == p or m.startswith(p + ".") for p in LOOKUPS)}


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_never_imports_what_finds_or_installs_tools(stage):
    direct = lookups(imports(stage))
    assert not direct, f"{stage} imports {sorted(direct)}: it should receive resolved values (ci.toolchain.resolved)"
    # nor through what it imports, at module level or inside a function (a call made at run time);
    # the modules it reaches are followed but for their command lines, which a stage never runs
    # (ci.toolchain.patches' `check` command finds CUTLASS through ci.toolchain.tools; its own __main__ ends that)
    seen, todo = set(), [stage]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports(m, cli=m == stage))
    assert not lookups(seen), f"{stage} reaches {sorted(lookups(seen))} through its imports"


def test_the_resolved_values_are_frozen_and_lookup_free():
    import dataclasses

    from ci.toolchain import resolved

    assert not lookups(imports("ci.toolchain.resolved"))
    for cls in (resolved.CudaToolkit, resolved.TorchEnv, resolved.ResolvedToolchain, resolved.VerifyEnvs):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls.__name__


def test_the_resolver_is_what_the_orchestrators_call():
    """pipeline and the cibuildwheel hooks resolve the toolchain and hand it to the build."""
    for entry in ("ci.stages.pipeline", "ci.release.cibw"):
        assert "ci.stages.resolve" in imports(entry), entry
    assert "ci.stages.build" not in imports("ci.toolchain.resolved")


# -- sizes: the modules of ci/ and of the payload (sageattn3/), and each function of them ---------------

REPO = CI.parent
# What a local build leaves inside the payload (setup.py's build/ folder) is no source of it.
SIZED = sorted(p.relative_to(REPO).as_posix() for root in ("ci", "sageattn3") for p in (REPO / root).rglob("*.py")
               if not {"build", "__pycache__"} & set(p.relative_to(REPO).parts))


@pytest.mark.parametrize("path", SIZED)
def test_no_module_is_over_500_lines(path):
    lines = len((REPO / path).read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path}: {lines} lines (split it by concern)"


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """Each function or method of ``source`` (nested ones too) longer than ``limit`` lines, from
    its ``def`` line to its last line, as (qualified name, lines)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > limit:
                    found.append((name, n))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_function_is_over_100_lines():
    long = [f"{path}: {name} ({n} lines)" for path in SIZED
            for name, n in long_functions((REPO / path).read_text(encoding="utf-8"))]
    assert not long, "functions over 100 lines (split them along their steps):\n" + "\n".join(long)


def test_the_function_check_finds_a_long_function_and_method():
    body = "".join(f"    x{i} = {i}\n" for i in range(100))
    source = f"def short():\n    pass\n\ndef long():\n{body}\nclass K:\n    def m(self):\n" + body.replace("    ", "        ")
    assert long_functions(source) == [("long", 101), ("K.m", 101)]
    assert long_functions("async def f():\n" + body[: -len("    x99 = 99\n")]) == []
