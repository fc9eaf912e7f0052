"""The process environment is read in one place, ci/runtime/env.py: no other module of ci/ reads
or changes os.environ, each variable parses as it did where it was read, and the table in
docs/factory.md is the one generated from FactoryEnv's fields."""

from __future__ import annotations

import ast
import os
from dataclasses import fields
from pathlib import Path

import pytest

from ci.checks.coverage import generated_block
from ci.checks.layers import module_names
from ci.runtime import env as envmod
from ci.runtime.env import DOC_BLOCK, FactoryEnv, child_environ, environment_table, set_environ, setdefault_environ

REPO = Path(__file__).resolve().parent.parent
CI = REPO / "ci"
NAMES = ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")
# The PEP 517 shim runs under cibuildwheel's build Python (the target's oldest, e.g. 3.9), with
# only its own folder on the backend path: ci (Python >= 3.11, checked by ci/__init__.py) cannot
# be imported there, so it reads the two variables it needs itself.
EXEMPT = {"ci.release.cibw_project.factory_backend"}


def environment_uses(source: str) -> list[int]:
    """The lines of ``source`` that touch the process environment through ``os`` (``os.environ``,
    ``os.getenv``, ``os.putenv``..., or those names imported from ``os``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in NAMES and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in NAMES for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_runtime_layer_touches_the_environment():
    found = {m: lines for m, path in module_names(CI).items()
             if not m.startswith("ci.runtime") and m not in EXEMPT
             and (lines := environment_uses(path.read_text(encoding="utf-8")))}
    assert not found, f"read the environment through ci.runtime.env (FactoryEnv, child_environ): {found}"


@pytest.mark.parametrize("source", [
    "import os\nx = os.environ.get('SAGEATTN3_X')\n",
    "import os\nx = os.getenv('CI')\n",
    "import os\nos.environ['A'] = '1'\n",
    "import os\nenv = {**os.environ}\n",
    "import os\nos.putenv('A', '1')\n",
    "from os import environ\n",
    "def f():\n    import os\n    return os.environ.copy()\n",
])
def test_the_checker_finds_an_injected_read(source):
    assert environment_uses(source)


def test_the_checker_leaves_other_code_alone():
    assert environment_uses("import os\nfrom ci.runtime.env import FactoryEnv\nx = os.path.join('a')\n"
                            "y = FactoryEnv.from_environ().ci\nenviron = {}\n") == []


def test_the_stages_read_the_settings_frozen_with_the_toolchain():
    """The build, repair, tag and verify stages get the settings the toolchain was resolved with
    (ResolvedToolchain.settings): in ci/stages/ only the resolver reads the environment."""
    readers = {}
    for path in sorted((CI / "stages").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "from_environ":
                readers.setdefault(path.name, []).append(node.lineno)
    assert set(readers) == {"resolve.py"} and len(readers["resolve.py"]) == 1, readers


def test_the_docs_table_is_the_generated_one():
    text = (REPO / "docs" / "factory.md").read_text(encoding="utf-8")
    assert generated_block(text, DOC_BLOCK) == environment_table(), \
        "run: python -m ci environment --write-docs"


def test_every_field_names_modules_that_read_it():
    modules = module_names(CI)
    for f in fields(FactoryEnv):
        for reader in (r.strip() for r in f.metadata["readers"].split(",")):
            assert reader in modules, f"{f.name}: no module {reader}"
            if reader not in EXEMPT:
                assert f.name.removesuffix("s") in modules[reader].read_text(encoding="utf-8"), f"{reader} does not read {f.name}"


def test_defaults_and_parsing():
    e = FactoryEnv.from_environ({})
    assert (e.target, e.dist, e.ci_cleanup, e.no_ccache, e.max_jobs, e.write_interval, e.publish_log) == \
        (None, None, False, False, None, 1.0, "WARNING")
    assert e.source_date_epoch == "315532800" and e.program_files == "C:\\Program Files" and e.localappdata == ""
    e = FactoryEnv.from_environ({"SAGEATTN3_CI_CLEANUP": "yes", "SAGEATTN3_NO_CCACHE": "yes", "SAGEATTN3_DIST": "/d",
                                 "MAX_JOBS": "0", "SAGEATTN3_VERIFY_PYTHONS": "3.10 3.12", "GITHUB_REPOSITORY": " o/n ",
                                 "SAGEATTN3_PYTHON_3_12": "/py", "CUDA_PATH_V12_8": "a", "CUDA_PATH_V13_0": "b"})
    assert (e.ci_cleanup, e.no_ccache, e.dist, e.max_jobs) == (False, True, Path("/d"), 0)
    assert e.verify_pythons == ("3.10", "3.12") and e.github_repository == "o/n"
    assert e.python_override("3.12") == "/py" and e.python_override("3.11") is None
    assert e.cuda_path_versions == ("b", "a")


@pytest.mark.parametrize("var, attr, message", [
    ("MAX_JOBS", "max_jobs", "invalid literal for int() with base 10: 'x'"),
    ("SAGEATTN3_WRITE_INTERVAL", "write_interval", "could not convert string to float: 'x'"),
])
def test_a_bad_value_fails_where_it_is_read_only(var, attr, message):
    e = FactoryEnv.from_environ({var: "x"})
    assert e.ci is False  # the other fields read as ever
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        getattr(e, attr)


def test_child_environ_and_changes(monkeypatch):
    monkeypatch.setenv("CIBW_X", "1")
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("KEEP", "k")
    env = child_environ({"A": "1"}, None, drop_prefixes=("CIBW_",), drop=("FORCE_COLOR",), B="2")
    assert "CIBW_X" not in env and "FORCE_COLOR" not in env and (env["KEEP"], env["A"], env["B"]) == ("k", "1", "2")
    assert child_environ() == dict(os.environ)
    monkeypatch.delenv("SAGEATTN3_TEST_SET", raising=False)
    set_environ("SAGEATTN3_TEST_SET", "1")
    setdefault_environ("SAGEATTN3_TEST_SET", "2")
    assert FactoryEnv.from_environ().python_overrides == FactoryEnv.from_environ(os.environ).python_overrides
    assert os.environ["SAGEATTN3_TEST_SET"] == "1"
    set_environ("SAGEATTN3_TEST_SET", None)
    assert "SAGEATTN3_TEST_SET" not in os.environ
    monkeypatch.setenv("CI", "true")  # read anew on every call, as monkeypatched tests need
    assert envmod.FactoryEnv.from_environ().ci is True
