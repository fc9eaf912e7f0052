"""Toolchain resolution: Pythons found explicitly, CUDA by version (system or PyPI), clear errors."""

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ci.toolchain.tools import ToolchainError, find_cuda, find_python, host_compiler_version, nvcc_version

PYENV = Path(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))) / "versions"
INSTALLED = sorted({Path(p).name.rsplit(".", 1)[0] for p in glob.glob(str(PYENV / "3.*"))})


@pytest.mark.parametrize("version", INSTALLED or ["3.11"])
def test_find_python_returns_that_version(version):
    exe = find_python(version)
    out = subprocess.run([str(exe), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
    assert out.stdout.strip() == version


def test_missing_python_says_what_to_install():
    """Without provisioning: how to install it. (Where provisioning was tried and failed, the fix
    offered is another way: tests/test_python_provisioning.py.)"""
    with pytest.raises(ToolchainError, match=r"uv python install 3\.99` or `pyenv install 3\.99.*SAGEATTN3_PYTHON_3_99"):
        find_python("3.99", provision=False)


@pytest.mark.skipif(not shutil.which("nvcc"), reason="no CUDA toolkit on this machine")
def test_system_cuda_is_found_by_version_not_by_wrapper_location():
    v = nvcc_version(Path(shutil.which("nvcc")))
    mm = ".".join(v.split(".")[:2])
    tk = find_cuda(mm)
    assert tk.major_minor == mm and (tk.home / "bin" / "nvcc").exists()
    assert (tk.home / "include" / "cuda_runtime_api.h").exists() or any((d / "cuda_runtime_api.h").exists() for d in tk.include_dirs)


def test_cuda_12_cannot_be_provisioned_and_says_so():
    with pytest.raises(ToolchainError, match="NVIDIA's installer"):
        find_cuda("12.8", provision=False)


def test_cuda_13_2_is_provisioned_from_pypi_and_compiles_sm120(tmp_path):
    """A real toolkit from PyPI (no 13.2 on this machine): nvcc + headers + runtime of 13.2."""
    tk = find_cuda("13.2")
    assert tk.major_minor == "13.2"
    assert (tk.lib_dir / "libcudart.so").exists()  # the unversioned symlink the wheels lack
    src = tmp_path / "k.cu"
    src.write_text("#include <cuda_runtime.h>\n__global__ void k(float* x) { x[threadIdx.x] *= 2.f; }\n")
    subprocess.run([str(tk.nvcc), "-c", str(src), "-o", str(tmp_path / "k.o"),
                    "-gencode=arch=compute_120a,code=sm_120a", "-gencode=arch=compute_121a,code=sm_121a"], check=True)
    assert (tmp_path / "k.o").stat().st_size > 0


# -- Windows discovery, exercised here with real executables in a Windows-like layout -------

def _fake_python(path: Path, version: str) -> Path:
    """An executable that answers the version question as a Python ``version`` would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def windows_machine(tmp_path, monkeypatch):
    """No Python on PATH, an empty %LOCALAPPDATA%, %ProgramFiles% and hosted tool cache. The
    versions asked for (3.97, 3.98) are ones no interpreter here has, so the running one never
    answers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "AppData" / "Local"))
    monkeypatch.setenv("ProgramFiles", str(tmp_path / "Program Files"))
    monkeypatch.setenv("RUNNER_TOOL_CACHE", str(tmp_path / "hostedtoolcache"))
    monkeypatch.delenv("AGENT_TOOLSDIRECTORY", raising=False)
    for v in ("3_97", "3_98"):
        monkeypatch.delenv(f"SAGEATTN3_PYTHON_{v}", raising=False)
    return tmp_path


def test_windows_python_from_the_py_launcher(windows_machine):
    target = _fake_python(windows_machine / "Python397" / "python.exe", "3.97")
    launcher = windows_machine / "bin" / "py"
    # the launcher is asked for `-3.97 -c 'import sys; print(sys.executable)'`
    launcher.write_text(f'#!/bin/sh\n[ "$1" = "-3.97" ] && [ "$2" = "-c" ] && echo "{target}" && exit 0\n'
                        'echo "No suitable Python runtime found" >&2\nexit 103\n')
    launcher.chmod(0o755)
    assert find_python("3.97", windows=True) == target
    with pytest.raises(ToolchainError, match="SAGEATTN3_PYTHON_3_98"):
        find_python("3.98", windows=True)


def test_windows_python_from_the_install_dirs_and_the_tool_cache(windows_machine):
    cache = windows_machine / "hostedtoolcache" / "Python"
    _fake_python(cache / "3.98.9" / "x64" / "python.exe", "3.98")
    newest = _fake_python(cache / "3.98.11" / "x64" / "python.exe", "3.98")
    assert find_python("3.98", windows=True) == newest  # newest patch first (not string order)
    per_user = _fake_python(windows_machine / "AppData" / "Local" / "Programs" / "Python" / "Python398" / "python.exe",
                            "3.98")
    assert find_python("3.98", windows=True) == per_user  # python.org's install before the tool cache
    # a directory named for 3.98 holding another version is not taken
    _fake_python(windows_machine / "Program Files" / "Python397" / "python.exe", "3.12")
    with pytest.raises(ToolchainError) as e:
        find_python("3.97", windows=True)
    msg = str(e.value)
    assert "py -3.97" in msg and "RUNNER_TOOL_CACHE" in msg and "set SAGEATTN3_PYTHON_3_97 to its python executable" in msg


def test_windows_python_from_the_environment_and_path(windows_machine, monkeypatch):
    on_path = _fake_python(windows_machine / "bin" / "python", "3.97")
    assert find_python("3.97", windows=True) == on_path  # a virtualenv's python, checked by version
    chosen = _fake_python(windows_machine / "elsewhere" / "python.exe", "3.97")
    monkeypatch.setenv("SAGEATTN3_PYTHON_3_97", str(chosen))
    assert find_python("3.97", windows=True) == chosen  # the override wins
    monkeypatch.setenv("SAGEATTN3_PYTHON_3_98", str(chosen))  # a 3.97 where 3.98 is asked for
    with pytest.raises(ToolchainError, match=r"SAGEATTN3_PYTHON_3_98=.* is not a Python 3\.98 interpreter"):
        find_python("3.98", windows=True)


def test_windows_host_compiler_is_cl(tmp_path, monkeypatch):
    """cl.exe prints its banner on stderr when run without arguments; that is what is recorded."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolchainError, match="no MSVC compiler .cl.exe. on PATH.*vcvars64"):
        host_compiler_version(windows=True)
    cl = tmp_path / "cl"
    cl.write_text("#!/bin/sh\n[ $# -eq 0 ] || exit 9\n"
                  "echo 'Microsoft (R) C/C++ Optimizing Compiler Version 19.44.35211 for x64' >&2\n"
                  "echo 'Copyright (C) Microsoft Corporation.  All rights reserved.' >&2\n"
                  "echo 'usage: cl [ option... ] filename... [ /link linkoption... ]'\n")
    cl.chmod(0o755)
    (tmp_path / "c++").write_text("#!/bin/sh\necho 'x86_64-w64-mingw32-g++ (GCC) 13.2.0'\n")
    (tmp_path / "c++").chmod(0o755)
    assert host_compiler_version(windows=True) == "Microsoft (R) C/C++ Optimizing Compiler Version 19.44.35211 for x64"
    assert host_compiler_version(windows=False) == "x86_64-w64-mingw32-g++ (GCC) 13.2.0"


# -- the build environment's packages ------------------------------------------------------

def test_build_environments_get_the_setuptools_the_payload_needs():
    """The torch environments the factory builds in (pip wheel --no-build-isolation) must hold
    what the payload's build-system.requires asks for: setuptools >= 77 for its SPDX license."""
    import tomllib

    from packaging.requirements import Requirement

    from ci.payload.interface import PAYLOAD
    from ci.toolchain.tools import BUILD_ENV_PACKAGES

    wanted = {Requirement(r).name: Requirement(r).specifier
              for r in tomllib.loads((PAYLOAD / "pyproject.toml").read_text())["build-system"]["requires"]}
    have = {Requirement(r).name: Requirement(r).specifier for r in BUILD_ENV_PACKAGES}
    assert have == wanted
    assert "76.9" not in have["setuptools"] and "77.0.3" in have["setuptools"]


def test_a_cached_environment_gets_a_raised_floor_in_place(tmp_path):
    """A cached environment made for an older set of build packages is brought up to the
    current one with one pip install (real pip, from PyPI), not re-created; then no more."""
    import json
    import sys

    from ci.toolchain.resolved import venv_python
    from ci.toolchain.tools import EXTRA_MARKER, ensure_packages

    root = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    (root / EXTRA_MARKER).write_text(json.dumps(["setuptools>=70"]))
    py = str(venv_python(root))
    subprocess.run([py, "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools"], capture_output=True)
    ensure_packages(root, ("setuptools>=77",))
    got = subprocess.run([py, "-c", "import setuptools; print(setuptools.__version__)"], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert int(got.split(".")[0]) >= 77 and json.loads((root / EXTRA_MARKER).read_text()) == ["setuptools>=77"]
    subprocess.run([py, "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools"], check=True, capture_output=True)
    ensure_packages(root, ("setuptools>=77",))  # recorded: nothing runs
    assert subprocess.run([py, "-c", "import setuptools"], capture_output=True).returncode != 0


def test_a_cached_environment_whose_interpreter_is_gone_is_made_again(tmp_path):
    """An environment made elsewhere (in cibuildwheel's container, whose /opt/python this machine
    lacks, or by a Python since removed) links to a missing interpreter: not usable, so the
    cache makes it again instead of failing on it."""
    import sys

    from ci.toolchain.resolved import venv_python
    from ci.toolchain.tools.build_env import is_complete

    root = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    assert not is_complete(root)  # not filled to the end
    (root / ".complete").write_text('["2.14.1+cu130", "13.0"]')
    assert is_complete(root)
    python = venv_python(root)
    python.unlink()
    python.symlink_to(tmp_path / "gone" / "python3.10")
    assert not is_complete(root)


def test_a_failing_child_command_shows_the_tail_of_its_stderr(tmp_path):
    """What verify prints for a broken torch environment: the child's own error, not only
    `CalledProcessError ... import torch` (ci.toolchain.tools.base._output)."""
    import subprocess
    import sys

    from ci.toolchain.tools import base as toolchain

    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text("from torch._C import *  # the extension is missing\n")
    code = "import torch, json; print(json.dumps([torch.__version__, torch.version.cuda]))"
    with pytest.raises(subprocess.CalledProcessError) as ei:  # still what callers catch
        toolchain._output([sys.executable, "-c", code], cwd=tmp_path)
    text = str(ei.value)
    assert "returned non-zero exit status 1" in text and "import torch" in text
    assert "ModuleNotFoundError: No module named 'torch._C'" in text, text
    assert text.count("\n") <= toolchain.CommandFailed.TAIL_LINES + 1
    assert toolchain._output([sys.executable, "-c", "print('ok')"]) == "ok\n"
