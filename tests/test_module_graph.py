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


def imports(module: str, *, top_level_only: bool) -> set[str]:
    """The ci modules ``module`` imports: at module level only, or anywhere in the file
    (functions' deferred imports too, but for a module's ``main``: its command line, run as
    ``python -m``, never called by another module). Imports under ``if TYPE_CHECKING:`` never
    run; the ``if __package__ ...`` guard of a script is skipped, its imports follow it at top
    level."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()

    def visit(nodes, top: bool) -> None:
        for n in nodes:
            if isinstance(n, ast.If) and _type_checking(n):
                continue
            if top and not top_level_only and isinstance(n, ast.FunctionDef) and n.name == "main":
                continue
            names: list[str] = []
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                names = [n.module, *(f"{n.module}.{a.name}" for a in n.names)]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            found.update(x for x in names if x in MODULES and x != module)
            if not top_level_only or not top:
                visit(ast.iter_child_nodes(n), top=False)

    visit(tree.body, top=True)
    return found


def test_the_module_level_imports_of_ci_have_no_cycle():
    graph = {m: imports(m, top_level_only=True) for m in MODULES}
    done: set[str] = set()

    def walk(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for n in sorted(graph[m]):
            walk(n, path + [m])
        done.add(m)

    for m in sorted(graph):
        walk(m, [])


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_never_imports_what_finds_or_installs_tools(stage):
    direct = imports(stage, top_level_only=False) & LOOKUPS
    assert not direct, f"{stage} imports {sorted(direct)}: it should receive resolved values (ci.resolved)"
    # nor through what it imports, at module level or inside a function (a call made at run time)
    seen, todo = set(), [stage]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports(m, top_level_only=False))
    assert not (seen & LOOKUPS), f"{stage} reaches {sorted(seen & LOOKUPS)} through its imports"


def test_the_resolved_values_are_frozen_and_lookup_free():
    import dataclasses

    from ci import resolved

    assert not imports("ci.resolved", top_level_only=False) & LOOKUPS
    for cls in (resolved.CudaToolkit, resolved.TorchEnv, resolved.ResolvedToolchain, resolved.VerifyEnvs):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls.__name__


def test_the_resolver_is_what_the_orchestrators_call():
    """pipeline and the cibuildwheel hooks resolve the toolchain and hand it to the build."""
    for entry in ("ci.pipeline", "ci.cibw"):
        assert "ci.resolve" in imports(entry, top_level_only=False), entry
    assert "ci.build" not in imports("ci.resolved", top_level_only=False)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_of_ci_is_over_600_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(CI.parent)}: {lines} lines (split it by concern)"
