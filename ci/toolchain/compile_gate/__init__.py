"""The compile gate: every torch line of the matrix, with the torch-facing unit its wheels use,
compiles against that torch's real headers with the target's defines and language standard.

Only ``csrc/torch/*.cpp`` sees torch (the ``.cu`` files are torch-free and compile the same for
every line), so this is what can break when a torch line is added: the gate catches it in
``nox -s tests`` and in the release plan instead of in 15 failed release jobs.

The headers come from the line's x86_64 wheel on PyPI (a CUDA build: it carries the
``c10/cuda`` headers; headers are the same on every platform for what we include), unpacked
into the factory cache, headers only. The compiler is the host g++ in syntax-only mode; CUDA's
runtime headers come from the local toolkit (the unit includes only ``cuda_runtime_api.h``).

    python -m ci.toolchain.compile_gate [--line 2.8 ...] [--jobs N]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ci.payload.interface import PAYLOAD

from ci.runtime.log import default_log
from ci.toolchain.flags import profile_for
from ci.runtime.pip_env import pip_environ
from ci.toolchain.targets import Matrix, Target
from ci.toolchain.tools import ToolchainError, cache_root, find_cuda
from ci.runtime.errors import InputError
from ci.runtime.env import FactoryEnv

# The parts of torch/include the torch-facing units reach (ATen, c10, torch, and what they pull in).
HEADER_DIRS = ("ATen", "c10", "torch", "caffe2", "fmt")
# The headers do not depend on the Python: the wheel of the release's oldest Python in the
# matrix is downloaded (3.10 where the release is not in the matrix).
WHEEL_PYTHON = "3.10"
WHEEL_PLATFORM = "manylinux_2_28_x86_64"
# What a Windows (CPU) torch wheel lacks that the classic unit includes.
CMAKE_MACROS = "c10/cuda/impl/cuda_cmake_macros.h"


class GateError(InputError, RuntimeError):
    pass


def headers_dir(version: str) -> Path:
    return cache_root() / "torch-headers" / version


def _wheel_python(version: str) -> str:
    from ci.toolchain.variant import torch_line

    for line in Matrix.load().torch:
        if line.line == torch_line(version):
            return line.python[0]
    return WHEEL_PYTHON


def torch_headers(version: str, log=default_log) -> Path:
    """``torch/include`` of torch ``version`` (headers only), downloaded once into the cache."""
    dest = headers_dir(version)
    include = dest / "include"
    if (dest / ".complete").exists():
        return include
    shutil.rmtree(dest, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="sageattn3-torch-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", _wheel_python(version), "--implementation", "cp", "--platform", WHEEL_PLATFORM,
               "--dest", tmp, f"torch=={version}"]
        log(f"[gate] downloading torch {version}'s headers (its x86_64 wheel from PyPI)")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_environ())
        wheels = list(Path(tmp).glob("torch-*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise ToolchainError(
                f"could not download torch {version} from PyPI for its headers (pip exited {proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
            )
        prefixes = tuple(f"torch/include/{d}/" for d in HEADER_DIRS)
        with zipfile.ZipFile(wheels[0]) as z:
            members = [n for n in z.namelist() if n.startswith(prefixes) and not n.endswith("/")]
            for name in members:
                out = include / name.removeprefix("torch/include/")
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(name))
    (dest / ".complete").write_text(version)
    return include


def cmake_macros_overlay(version: str, log=default_log) -> Path:
    """A folder holding only ``c10/cuda/impl/cuda_cmake_macros.h`` of torch ``version``, taken
    from its Linux x86_64 CUDA wheel on PyPI (what the classic unit needs that a CPU build lacks: the
    Windows build and ``ci.checks.msvc_gate`` overlay it on the win_amd64 wheel's headers)."""
    from ci.toolchain import wine as winemod

    dest = winemod.windows_root() / "overlays" / f"torch-{version}"
    header = dest / CMAKE_MACROS
    if not header.exists():
        src = torch_headers(version, log=log) / CMAKE_MACROS
        if not src.exists():
            raise GateError(f"torch {version}'s Linux CUDA wheel has no {CMAKE_MACROS}")
        header.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, header)
    return dest


@dataclass(frozen=True)
class GateCase:
    """One compile: a torch line's unit against its build torch, with one target's profile."""

    line: str
    torch_version: str
    unit: str
    defines: tuple[str, ...]
    std: str
    targets: tuple[str, ...]  # the targets whose wheels this compile stands for

    @property
    def name(self) -> str:
        return f"torch {self.line} ({Path(self.unit).name} against torch {self.torch_version} headers, -std={self.std})"


def _linux_twin(target: Target, matrix: Matrix) -> Target:
    """The linux-x86_64 target of the same variant (its profile holds the defines the unit sees
    on every OS but the MSVC ones, which g++ cannot judge; torch_msvc covers Windows)."""
    for t in matrix.targets:
        if t.os.key == "linux-x86_64" and t.variant == target.variant:
            return t
    return target


def cases(matrix: Matrix, lines: list[str] | None = None) -> list[GateCase]:
    """One case per torch line: the unit the line's wheels use, compiled against the line's own
    build_version headers (stable lines too: the stable unit must compile against every torch it
    claims to serve, from the floor up)."""
    out = []
    for tl in matrix.torch:
        if lines and tl.line not in lines:
            continue
        serving = [t for t in matrix.targets if tl.line in t.torch_lines]
        if not serving:
            continue
        twin = _linux_twin(serving[0], matrix)
        prof = profile_for(twin, matrix.stable_abi_floor)
        from ci.payload.interface import build_profile

        std = build_profile().cxx_standard(tl.build_version)
        out.append(GateCase(tl.line, tl.build_version, prof["torch_unit"], tuple(prof["defines"]), std,
                            tuple(t.id for t in serving)))
    if lines:
        unknown = sorted(set(lines) - {c.line for c in out})
        if unknown:
            raise GateError(f"torch line(s) {unknown} are not in the matrix (or no target serves them)")
    return out


def _cuda_include() -> Path:
    try:
        return find_cuda("13.0", provision=True).home / "include"
    except ToolchainError:
        nvcc = shutil.which("nvcc")
        if not nvcc:
            raise
        return Path(nvcc).resolve().parent.parent / "include"


def compile_case(case: GateCase, *, cxx: str | None = None, log=default_log) -> str | None:
    """None when the unit compiles; else the first compiler error (with the line naming it)."""
    include = torch_headers(case.torch_version, log=log)
    cxx = cxx or FactoryEnv.from_environ().cxx or "g++"
    cmd = [cxx, "-fsyntax-only", f"-std={case.std}", *[f"-D{d}" for d in case.defines],
           f"-I{PAYLOAD / 'csrc'}", f"-I{include}", f"-I{_cuda_include()}",
           f"-I{sysconfig.get_paths()['include']}", str(PAYLOAD / case.unit)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).splitlines()
    first = next((ln for ln in lines if ": error:" in ln or "fatal error:" in ln),
                 lines[0] if lines else f"{cxx} exited {proc.returncode}")
    return first.replace(str(include) + "/", "torch/include/").replace(str(PAYLOAD) + "/", "sageattn3/")


def run_gate(matrix: Matrix, lines: list[str] | None = None, jobs: int | None = None, log=default_log) -> dict[str, str | None]:
    """Compile every case; returns {line: None | first error}. Headers are fetched first, one at
    a time (network), then the compiles run in parallel."""
    todo = cases(matrix, lines)
    for c in todo:
        torch_headers(c.torch_version, log=log)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        results = dict(zip([c.line for c in todo], pool.map(lambda c: compile_case(c, log=log), todo)))
    for c in todo:
        err = results[c.line]
        log(f"[gate] {'ok    ' if err is None else 'FAILED'} {c.name}" + (f"\n         {err}" if err else ""))
    return results


def failures_message(matrix: Matrix, results: dict[str, str | None]) -> str | None:
    bad = {line: err for line, err in results.items() if err}
    if not bad:
        return None
    by_line = {c.line: c for c in cases(matrix, list(bad))}
    return "; ".join(
        f"torch {line} ({Path(by_line[line].unit).name}, targets {', '.join(by_line[line].targets)}) does not compile: {err}"
        for line, err in bad.items()
    )
