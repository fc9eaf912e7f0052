"""The factory's pip and venv calls build their own environment: a caller's pip settings that
change what gets installed (cibuildwheel's test-environment sets PIP_NO_DEPS=1) never reach
them, while a mirror, proxy or certificate bundle does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci.runtime import pip_env

# What a caller (cibuildwheel's test-environment, a user's shell) may have set that changes
# what pip installs or where it puts it.
def hostile_pip_settings(tmp: Path) -> dict[str, str]:
    constraints = tmp / "constraints.txt"
    constraints.write_text("torch==0.0.1\nsetuptools==0.0.1\n")
    return {
        "PIP_NO_DEPS": "1",
        "PIP_NO_BINARY": ":all:",
        "PIP_ONLY_BINARY": "sageattn3",
        "PIP_CONSTRAINT": str(constraints),
        "PIP_TARGET": str(tmp / "pip-target"),
        "PIP_PREFIX": str(tmp / "pip-prefix"),
        "PIP_USER": "1",
        "PIP_REQUIRE_VIRTUALENV": "1",
        "PIP_NO_INDEX": "1",
        "PIP_PRE": "1",
        "PIP_IGNORE_INSTALLED": "1",
        "PYTHONPATH": str(tmp / "elsewhere"),
    }


def test_install_changing_settings_are_dropped_and_sources_kept(tmp_path):
    base = {**hostile_pip_settings(tmp_path), "PIP_CERT": "/some/ca.pem", "PIP_INDEX_URL": "https://mirror.example/simple",
            "PIP_DEFAULT_TIMEOUT": "90", "PATH": "/usr/bin", "HOME": "/home/u"}
    env = pip_env.pip_environ(base)
    for var in hostile_pip_settings(tmp_path):
        assert var not in env, var
    assert env["PIP_CERT"] == "/some/ca.pem" and env["PIP_INDEX_URL"] == "https://mirror.example/simple"
    assert env["PIP_DEFAULT_TIMEOUT"] == "90" and env["PATH"] == "/usr/bin" and env["HOME"] == "/home/u"
    assert env["PIP_CONFIG_FILE"] == os.devnull and env["PIP_NO_INPUT"] == "1"
    # verify's installs resolve against the index it names alone
    isolated = pip_env.pip_environ(base, sources=False)
    assert "PIP_INDEX_URL" not in isolated and isolated["PIP_CERT"] == "/some/ca.pem"
    # names, never values, for logs
    assert "PIP_NO_DEPS" in pip_env.dropped(base) and "PIP_CERT" not in pip_env.dropped(base)


def test_a_mirror_from_a_config_file_is_carried_over_but_not_its_constraint(tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\nno-deps = true\n"
                    f"constraint = {tmp_path / 'c.txt'}\n[install]\ntrusted-host = mirror.example\n")
    code = ("import json, os; from ci.runtime import pip_env; e = pip_env.pip_environ();"
            "print(json.dumps({k: v for k, v in e.items() if k.startswith('PIP_')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")},
                              "PIP_CONFIG_FILE": str(conf)}).stdout
    import json

    env = json.loads(out)
    assert env["PIP_INDEX_URL"] == "https://mirror.example/simple" and env["PIP_TRUSTED_HOST"] == "mirror.example"
    assert "PIP_NO_DEPS" not in env and "PIP_CONSTRAINT" not in env and env["PIP_CONFIG_FILE"] == os.devnull


def test_a_torch_environment_made_under_hostile_pip_settings_imports_torch(tmp_path, monkeypatch):
    """What broke every release job: torch installed with PIP_NO_DEPS=1 lacks typing_extensions
    and the rest, so `import torch` fails. A fresh cache makes the environment anew here."""
    from ci.toolchain.tools import ToolchainError, find_python, torch_env

    try:
        find_python("3.11")
    except ToolchainError as e:
        pytest.skip(f"needs a Python 3.11 for torch 2.13.0's local CPU build: {e}")
    monkeypatch.setenv("SAGEATTN3_CACHE", str(tmp_path / "cache"))
    for k, v in hostile_pip_settings(tmp_path).items():
        monkeypatch.setenv(k, v)
    env = torch_env("3.11", "torch==2.13.0", extra=("packaging",))
    assert env.torch_version.startswith("2.13.0")
    probe = subprocess.run([str(env.python), "-c", "import torch, typing_extensions, sympy, packaging; print(torch.__version__)"],
                           capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert not (tmp_path / "pip-target").exists() and not (tmp_path / "pip-prefix").exists()


# Functions that run pip on purpose with the caller's settings: what `pip install torch` gives
# this user (the default target), and emptying the caller's own pip cache.
CALLER_PIP = {("resolve.py", "torch_pip_would_install"), ("runner_setup.py", "cleanup_after_build"),
              # reads the configuration files themselves
              ("pip_env.py", "configured_settings")}
FACTORY_ENV = ("pip_environ", "run_pip")


def test_every_pip_and_venv_call_of_the_factory_builds_its_environment():
    """A function of ci/ that spells out a pip or venv command (``-m pip`` / ``-m venv``) runs
    it with ci.runtime.pip_env's environment (or through toolchain.run_pip)."""
    import ast

    root = Path(__file__).resolve().parent.parent / "ci"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            runs_pip = False
            for node in ast.walk(fn):
                if isinstance(node, (ast.List, ast.Tuple)):
                    vals = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                    if any(a == "-m" and b in ("pip", "venv") for a, b in zip(vals, vals[1:])):
                        runs_pip = True
            if not runs_pip or (path.name, fn.name) in CALLER_PIP:
                continue
            source = ast.get_source_segment(path.read_text(), fn) or ""
            # a plan that only describes commands (tuples of strings) runs nothing
            if "subprocess" not in source and "run(" not in source:
                continue
            if not any(name in source for name in FACTORY_ENV):
                offenders.append(f"{path.relative_to(root.parent)}:{fn.lineno} {fn.name}")
    assert not offenders, "pip/venv run without ci.runtime.pip_env's environment: " + ", ".join(offenders)
