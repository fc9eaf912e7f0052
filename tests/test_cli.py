"""Every command line of ci/ (each ``__main__.py``) ends through ci.runtime.errors.run_main: its
``main`` returns what run_main returns, and bad input gets exit status 2 and one line on stderr
that names what to change, never a traceback. Each command is run for real, in a subprocess,
with one bad input that is cheap for it (an unknown target, a missing file, a bad value, a
Python it cannot find); nothing is built or fetched."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci.checks.layers import module_names

REPO = Path(__file__).resolve().parent.parent
CI = REPO / "ci"
MODULES = module_names(CI)
COMMANDS = sorted(m.removesuffix(".__main__") for m in MODULES if m == "ci.__main__" or m.endswith(".__main__"))
COMMANDS = ["ci" if c == "ci.__main__" else c for c in COMMANDS]


def _no_python_39(tmp_path: Path) -> dict[str, str]:
    """An environment where no Python 3.9 can be found or provisioned: an empty PATH and pyenv root,
    an empty factory cache, provisioning off."""
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    return {"PATH": str(empty), "PYENV_ROOT": str(empty), "SAGEATTN3_CACHE": str(tmp_path / "cache"),
            "SAGEATTN3_NO_PROVISION_PYTHON": "1"}


# command -> (its arguments, extra environment, what the one line must name); TMP is tmp_path
BAD_INPUT = {
    "ci": (["build-wheels", "--target", "nope"], {}, ["unknown target 'nope'", "--list-targets"]),
    "ci.checks.bench": (["nope"], {}, ["unknown target 'nope'", "--list-targets"]),
    "ci.checks.classic_link": (["toolchain", "--target", "nope"], {}, ["unknown target 'nope'"]),
    "ci.checks.clean": (["--dry-run"], {"SAGEATTN3_CACHE": "TMP/not-the-factorys"},
                        ["clean: not removing", "point SAGEATTN3_CACHE at the factory's cache"]),
    "ci.checks.kernel_report": (["--wheel", "TMP/missing.whl"], {}, ["--wheel", "missing.whl: no such file", "pass a built wheel"]),
    "ci.checks.msvc_gate": (["--line", "9.99"], {}, ["torch line(s) ['9.99']", "Windows lines:"]),
    "ci.index": (["check", "TMP/no-index"], {}, ["index check: cannot read an index", "pass the index root"]),
    "ci.release": (["gather", "--plan", '{"include": [{"id": "x"}]}', "--artifacts", "TMP", "--out", "TMP/out",
                    "--build-outputs", "not json"], {}, ["release: --build-outputs: not a JSON document or @file"]),
    "ci.release.cibw": (["env", "--target", "nope"], {"SAGEATTN3_TARGET": ""}, ["error (nope): MatrixError: unknown target 'nope'"]),
    "ci.release.cibw_local": (["--target", "nope"], {}, ["cibuildwheel: unknown target 'nope'"]),
    "ci.release.docs_site": (["--repo", "bad"], {}, ["docs: repository 'bad': expected OWNER/NAME"]),
    "ci.release.publish": (["pages", "--repo", "bad"], {}, ["publish pages: --repo 'bad'", "expected OWNER/NAME"]),
    "ci.release.standin_image": (["--print-name"], "NO_PYTHON_39", ["Python 3.9 not found", "SAGEATTN3_PYTHON_3_9"]),
    "ci.toolchain.compile_gate": (["--line", "9.99"], {}, ["torch line(s) ['9.99'] are not in the matrix"]),
    "ci.toolchain.cpu_torch": (["nope"], {}, ["usage: python -m ci.toolchain.cpu_torch check|install"]),
    "ci.toolchain.patches": (["list", "--target", "nope"], {}, ["unknown target 'nope'"]),
    "ci.toolchain.torch_msvc": (["TMP/missing.whl"], {}, ["missing.whl: no such wheel", "pass torch wheel files"]),
}


def test_every_command_line_has_a_bad_input_case():
    assert sorted(BAD_INPUT) == COMMANDS, "add the new command line to BAD_INPUT"


@pytest.mark.parametrize("command", COMMANDS)
def test_bad_input_is_exit_2_and_one_line(command, tmp_path):
    args, extra, needles = BAD_INPUT[command]
    fill = lambda s: s.replace("TMP", str(tmp_path))  # noqa: E731
    (tmp_path / "not-the-factorys").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGEATTN3_PYTHON_")}
    env.pop("CI", None)
    env.update(_no_python_39(tmp_path) if extra == "NO_PYTHON_39" else {k: fill(v) for k, v in extra.items()})
    proc = subprocess.run([sys.executable, "-m", command, *map(fill, args)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    assert "Traceback" not in said, said
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for n in map(fill, needles):
        assert n in lines[0], (n, lines[0])


# -- every main returns through run_main -------------------------------------------------------

def _returns(fn: ast.FunctionDef) -> list[ast.Return]:
    """The return statements of ``fn`` itself (not of the functions or lambdas inside it)."""
    found, todo = [], list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Return):
            found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def _delegate(tree: ast.Module, fn: ast.FunctionDef, name: str) -> str | None:
    """The module whose ``main`` ``name`` is, where ``fn`` or its module imports it as such."""
    for node in [*ast.walk(fn), *tree.body]:
        if isinstance(node, ast.ImportFrom) and node.module in MODULES:
            if any(a.name == "main" and (a.asname or a.name) == name for a in node.names):
                return node.module
    return None


def main_problems(module: str, source: str | None = None) -> list[str]:
    """How ``module``'s ``main`` fails to end through run_main: a return that is not
    ``return run_main(...)`` (or ``return <another command's main>(...)`` that does), or none."""
    tree = ast.parse(source if source is not None else MODULES[module].read_text(encoding="utf-8"))
    problems = []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"):
        returns = _returns(fn)
        if not returns:
            problems.append("main returns nothing")
        for r in returns:
            call = r.value
            callee = ast.unparse(call.func) if isinstance(call, ast.Call) else None
            if callee is not None and callee.rsplit(".", 1)[-1] == "run_main":
                continue
            target = _delegate(tree, fn, callee) if callee else None
            if target is None or main_problems(target):
                problems.append(f"line {r.lineno}: return {ast.unparse(r.value) if r.value else ''}")
    return problems


MAINS = sorted(m for m, p in MODULES.items() if any(isinstance(n, ast.FunctionDef) and n.name == "main"
                                                    for n in ast.parse(p.read_text(encoding="utf-8")).body))


def test_every_command_line_module_has_a_main():
    for c in COMMANDS:
        assert ("ci.__main__" if c == "ci" else c + ".__main__") in MAINS, c


@pytest.mark.parametrize("module", MAINS)
def test_main_returns_through_run_main(module):
    problems = main_problems(module)
    assert not problems, f"{module}.main: end it with `return run_main(lambda: ...)` (ci.runtime.errors): {problems}"


def test_the_main_check_finds_a_return_around_run_main():
    good = "from ci.runtime.errors import run_main\ndef main(argv=None):\n    a = 1\n    return run_main(lambda: _cli(a))\n"
    assert main_problems("ci.x", good) == []
    early = "def main(argv=None):\n    if not argv:\n        return 2\n    return run_main(lambda: 0)\n"
    assert main_problems("ci.x", early) == ["line 3: return 2"]
    assert main_problems("ci.x", "def main():\n    return cli()\n") == ["line 2: return cli()"]
    assert main_problems("ci.x", "def main():\n    print(1)\n") == ["main returns nothing"]
    delegating = "def main(argv=None):\n    from ci.index.__main__ import main as cli\n    return cli(argv)\n"
    assert main_problems("ci.x", delegating) == []



@pytest.mark.parametrize("matrix, says", [("not json", "not JSON (the argument)"),
                                          ("@no-such-file.json", "cannot read the JSON file no-such-file.json")])
def test_release_json_arguments_are_input_errors(matrix, says, tmp_path):
    """A JSON argument that does not parse or a file that is not there: exit 2, one line."""
    r = subprocess.run([sys.executable, "-m", "ci.release", "plan", "--matrix", matrix], capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, says", [
    (["ci.checks.kernel_report", "--wheel", "README.md"], "not a wheel"),
    (["ci.checks.kernel_report", "--upstream", "no-such-dir", "--cutlass", "no-such-dir"], "no such directory"),
    (["ci.release", "plan", "--matrix", "[1, 2]"], "no 'include' list"),
    (["ci.release", "plan", "--matrix", "{}"], "no 'include' list"),
    (["ci.release", "gather", "--plan", "{}", "--artifacts", "no-such-dir", "--out", "TMP"], "no 'include' list"),
    (["ci.release.cibw", "collect", "--wheelhouse", "TMP", "--out", "TMP/out"], "no target"),
    (["ci.release", "dry-run", "--only", "nope", "--dist", "TMP/d"], "--only nope: not a target of ci/targets.toml"),
    # jobs the stand-in container cannot run: refused before any image is built (no CUDA 12.x
    # toolkit here; a build Python the image lacks)
    (["ci.release.cibw_local", "--target", "linux-x86_64-cu128-torch2.8"], "cannot run here"),
    (["ci.release.cibw_local", "--target", "linux-x86_64-cu132-torch2.10-stable"], "cannot run here"),
])
def test_more_bad_input_is_exit_2_and_one_line(args, says, tmp_path):
    """Bad input found by a cold review: each exits 2 with one line that says what to pass."""
    env = {k: v for k, v in os.environ.items() if k != "SAGEATTN3_TARGET"}
    r = subprocess.run([sys.executable, "-m", *(a.replace("TMP", str(tmp_path)) for a in args)], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
