"""A target's toolchain, resolved once: the flag profile and patches (ci.toolchain.flags, ci.toolchain.patches), the
CUDA toolkit, the torch build environment (from the target's torch source), CUTLASS, the host
compiler and the compiler cache, found or provisioned (ci.toolchain.tools, ci.toolchain.torch_source, ci.toolchain.cross)
and frozen into one ``ResolvedToolchain`` (ci.toolchain.resolved), as cibuildwheel resolves its options
before it builds. Also what decides whether a target can be built here at all."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

from ci.runtime.log import default_log
from ci.toolchain import cross as crossmod
from ci.toolchain.cross_spec import is_cross
from ci.toolchain import patches as patchmod
from ci.toolchain import torch_source as torch_sources
from ci.stages.build import BuildError
from ci.toolchain.flags import compiler_for, profile_for
from ci.stages.record import BuildRecord
from ci.toolchain.resolved import CudaToolkit, PROOF_CUDA, PROOF_FLAVOUR_LABEL, TEST_FLAVOUR_LABEL, ResolvedToolchain, TorchEnv, VerifyEnvs
from ci.toolchain.targets import Matrix, Target
from ci.toolchain.torch_source import TorchSource
from ci.toolchain.tools import (
    ToolchainError,
    compiler_launcher,
    cutlass_include,
    find_cuda,
    find_python,
    host_compiler_version,
    sccache_env,
    torch_env,
)
from ci.toolchain.variant import torch_line
from ci.stages.verify import NoCpuTorch, VerifyError
from ci.runtime.env import FactoryEnv


def host_os_key() -> str:
    import platform

    machine = platform.machine().lower()
    if sys.platform.startswith("linux"):
        return f"linux-{'aarch64' if machine in ('aarch64', 'arm64') else machine}"
    if sys.platform == "win32":
        return "windows-amd64"
    return f"{sys.platform}-{machine}"


def torch_pip_would_install(python: str = sys.executable) -> str:
    """The torch release `pip install torch` resolves to here (honours pip's config/caps)."""
    proc = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
         "--report", "-", "torch"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise ToolchainError(f"could not ask pip which torch it would install:\n{proc.stderr[-2000:]}")
    report = json.loads(proc.stdout)
    return report["install"][0]["metadata"]["version"]


def default_target(matrix: Matrix, torch_version: str | None = None) -> Target:
    """This machine's target: the running Python, the torch pip would give it, that torch's
    PyPI CUDA variant."""
    version = torch_version or torch_pip_would_install()
    wanted = torch_line(version)
    newest = max(matrix.torch, key=lambda t: Version(t.line))
    if all(t.line != wanted for t in matrix.torch) and Version(wanted) > Version(newest.line):
        # A torch newer than the matrix (PyPI moved on): its nearest line's target is the
        # sensible default (a stable-ABI wheel of it also loads into the newer torch).
        print(f"note: pip would install torch {version}, newer than the matrix's newest line {newest.line}; "
              f"building the default target of torch {newest.line} (add the new line to ci/targets.toml)",
              file=sys.stderr)
        wanted = newest.line
    line = matrix.line(wanted)
    py = "%d.%d" % sys.version_info[:2]
    return matrix.target_for_torch(host_os_key(), py, version, line.pypi_default)


def local_blockers(target: Target, *, cross: bool = False, pytorch_index: str | None = None) -> list[str]:
    """Why this target cannot be built on this machine (empty: it can). ``cross``: a Linux target
    of another machine counts as buildable when it can be cross-compiled here (``ci.toolchain.cross``);
    asked for by name (``--target``), never picked up by ``--all-local`` or the release rehearsal.
    ``pytorch_index``: the PyTorch index torch would come from (default: ``$SAGEATTN3_PYTORCH_INDEX``,
    else PyTorch's own)."""
    reasons = []
    if is_cross(target.os):
        if cross:
            return crossmod.cross_blockers(target)
        how = "" if crossmod.cross_blockers(target) else f"; or cross-build it here with --target {target.id}"
        return [f"needs a {target.os.key} machine (this is {host_os_key()}); the release pipeline builds it{how}"]
    if is_windows_on_linux(target.os):
        from ci.stages.windows_build import windows_blockers

        if cross:
            return windows_blockers(target)
        how = "" if windows_blockers(target) else f"; or build it here under wine with --target {target.id}"
        return [f"needs a {target.os.key} machine (this is {host_os_key()}); the release pipeline builds it{how}"]
    if target.os.key != host_os_key():
        reasons.append(f"needs a {target.os.key} machine (this is {host_os_key()}); the release pipeline builds it")
    unreachable = torch_sources.unreachable_reason(target, pytorch_index)
    if unreachable:
        reasons.append(unreachable)
    if Version(target.cuda).major < 13:
        try:
            find_cuda(target.cuda, provision=False)
        except ToolchainError:
            reasons.append(f"needs a CUDA {target.cuda} toolkit (NVIDIA's installer; not on PyPI): set CUDA_HOME")
    from ci.toolchain.flags import CUDA12_GCC_TOOLSET, cuda_host_compiler

    cxx = cuda_host_compiler(target)
    if cxx and not os.path.exists(cxx):
        reasons.append(f"needs {cxx}, nvcc's host compiler for CUDA {target.cuda} (gcc-toolset-{CUDA12_GCC_TOOLSET}; "
                       f"RHEL 8 likes: dnf install gcc-toolset-{CUDA12_GCC_TOOLSET}-gcc-c++)")
    return reasons


def is_windows_on_linux(target_os) -> bool:
    """A Windows target asked of this Linux machine: built here under wine (``ci.stages.windows_build``)."""
    return target_os.platform == "windows" and sys.platform.startswith("linux")


def build_python(target: Target, settings: FactoryEnv) -> str:
    """The interpreter that compiles: the running one when it qualifies (abi3 wheels are
    the same for every Python from target.python on), else the target's own.
    ``$SAGEATTN3_BUILD_PYTHON`` (X.Y) chooses it: the release's cibuildwheel shim sets its own,
    the target's oldest, so that verify reuses the build's torch environment."""
    chosen = settings.build_python
    if chosen:
        if Version(chosen) < Version(target.python):
            raise BuildError(f"{target.id}: SAGEATTN3_BUILD_PYTHON={chosen} is older than the target's Python {target.python}")
        find_python(chosen)
        return chosen
    here = "%d.%d" % sys.version_info[:2]
    if Version(here) >= Version(target.python):
        return here
    find_python(target.python)
    return target.python


def torch_spec(target: Target) -> torch_sources.TorchSource:
    """Where the build torch comes from (the same source verify and the release use)."""
    return torch_sources.torch_source(target)


def select_flags(target: Target, matrix: Matrix, *, force_patches: tuple[str, ...] = (), mma_model: bool = False,
                 proof: bool = False) -> tuple[dict, tuple[patchmod.Patch, ...]]:
    """The flag profile and the patches of a build (pure: nothing is installed)."""
    if mma_model and proof:
        raise BuildError("the test flavour and the proof flavour are exclusive")
    if proof and target.variant.stable:
        raise BuildError(f"{target.id}: the proof flavour is for per-torch targets (below the stable-ABI floor)")
    profile = profile_for(target, matrix.stable_abi_floor, mma_model=mma_model,
                          cuda=PROOF_CUDA if proof else None, static_cudart=proof)
    chosen = patchmod.select(
        patchmod.load_manifest(), os_key=target.os.key, compiler=compiler_for(target),
        cuda=target.cuda, torch_version=target.build_torch, force=force_patches,
    )
    return profile, tuple(chosen)


def resolve_toolchain(target: Target, matrix: Matrix, *, force_patches: tuple[str, ...] = (),
                      mma_model: bool = False, proof: bool = False,
                      settings: FactoryEnv | None = None) -> ResolvedToolchain:
    """Find or provision the CUDA toolkit, the torch build environment, CUTLASS, the host
    compiler and the compiler cache for ``target``, and choose its flags and patches.
    ``settings``: the environment's settings (default: read now, once); the result carries them,
    so the stages after this never read the process environment."""
    settings = settings if settings is not None else FactoryEnv.from_environ()
    profile, chosen = select_flags(target, matrix, force_patches=force_patches, mma_model=mma_model, proof=proof)
    cuda = find_cuda(PROOF_CUDA if proof else target.cuda)
    if is_cross(target.os):
        if proof:
            raise BuildError(f"{target.id}: the proof flavour is for this machine's own targets")
        cross = crossmod.resolve_cross(target.os.machine, target.cuda, target.build_torch)
        env = crossmod.build_env(build_python(target, settings), cross)
        flavour = TEST_FLAVOUR_LABEL if mma_model else "release"
        return ResolvedToolchain(target, profile, chosen, cuda, env, cross.compiler.banner,
                                 tuple(compiler_launcher()), cutlass_include(), flavour, cross,
                                 tuple(sccache_env().items()), settings)
    if is_windows_on_linux(target.os):
        from ci.stages.windows_build import resolve_windows_cross

        if proof:
            raise BuildError(f"{target.id}: the proof flavour is for this machine's own targets")
        win = resolve_windows_cross(target, profile)
        cuda = CudaToolkit(win.tc.cuda.version, win.tc.cuda.home, "pypi (win_amd64 wheels)", platform="windows")
        env = crossmod.build_env(build_python(target, settings), win)
        flavour = TEST_FLAVOUR_LABEL if mma_model else "release"
        return ResolvedToolchain(target, profile, chosen, cuda, env, win.tc.msvc.banner, (), cutlass_include(),
                                 flavour, win, settings=settings)
    env = torch_sources.torch_env_for(build_python(target, settings), torch_spec(target))
    if env.torch_cuda != target.cuda:
        raise ToolchainError(
            f"{target.id}: the build torch is {env.torch_version} (CUDA {env.torch_cuda}); the target "
            f"needs torch {target.build_torch} built for CUDA {target.cuda}"
        )
    flavour = TEST_FLAVOUR_LABEL if mma_model else PROOF_FLAVOUR_LABEL if proof else "release"
    return ResolvedToolchain(target, profile, chosen, cuda, env, host_compiler_version(cxx=profile.get("host_compiler")),
                             tuple(compiler_launcher()), cutlass_include(), flavour,
                             compiler_env=tuple(sccache_env().items()), settings=settings)


# -- the verify stage's environments ---------------------------------------------------

# The local default foreign torch (``nox -s build-wheels``): the CPU build of ci.toolchain.cpu_torch, from
# pip's configured index, else PyTorch's CPU index. The release jobs pass
# ci.toolchain.torch_source.foreign_torch_source instead: a CPU build from PyTorch's CPU index.
LOCAL_FOREIGN_TORCH = "cpu"


def local_foreign_env(python: str, log=default_log) -> TorchEnv:
    """The environment with ci.toolchain.cpu_torch's CPU build for ``python``, from the first index that
    has it, checked to be a CPU build (no nvidia-* requirements, a CPU build's size)."""
    from ci.toolchain import cpu_torch

    problems = []
    for index in cpu_torch.CPU_TORCH_INDEXES:
        source = TorchSource(cpu_torch.CPU_TORCH, index, None, why="the ABI guard's foreign torch")
        try:
            env = torch_sources.torch_env_for(python, source, extra=())
        except ToolchainError as e:
            problems.append(f"{index or 'the configured index'}: {str(e).splitlines()[0]}")
            continue
        check = subprocess.run([str(env.python), "-m", "ci.toolchain.cpu_torch", "check"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parents[2])
        if check.returncode != 0:
            raise VerifyError(f"the foreign torch in {env.root}: {check.stderr.strip()}")
        return env
    raise NoCpuTorch(f"no {cpu_torch.CPU_TORCH} for Python {python} could be installed ("
                     + "; ".join(problems) + f"): make {cpu_torch.PYTORCH_CPU_INDEX} reachable, or put that "
                     f"wheel where pip finds it (PIP_FIND_LINKS)")


def verify_envs(rec: BuildRecord, pythons: list[str], *, torch_spec: TorchSource | None = None,
                foreign_torch: TorchSource | str | None = LOCAL_FOREIGN_TORCH, log=default_log) -> VerifyEnvs:
    """The torch environments the verify stage installs ``rec``'s wheel into, resolved (found,
    or made and cached) before it runs. ``torch_spec``: where the torch to verify against comes
    from (the build's: the same source and Python give the build's cached environment back, no
    second install); default ``torch==<the record's torch>`` from pip's default index.
    ``foreign_torch``: the torch the ABI guard must refuse (a TorchSource; LOCAL_FOREIGN_TORCH,
    the CPU build of ci.toolchain.cpu_torch; or a plain requirement from pip's default index), in the
    first of ``pythons``."""
    source = torch_spec or TorchSource(f"torch=={rec.torch_build.split('+')[0]}", None, rec.cuda)
    bases = []
    for py in pythons:
        try:
            base = torch_sources.torch_env_for(py, source)
        except ToolchainError as e:
            raise VerifyError(f"the verify torch for Python {py}: {e}") from e
        if base.torch_cuda != rec.cuda:
            raise VerifyError(f"the verify torch for Python {py} is {base.torch_version}, not a CUDA {rec.cuda} build")
        bases.append((py, base))
    envs = VerifyEnvs(source.describe(), tuple(bases))
    if not foreign_torch:
        return envs
    py = pythons[0]
    if isinstance(foreign_torch, TorchSource):
        foreign = torch_sources.torch_env_for(py, foreign_torch, extra=())
    elif foreign_torch == LOCAL_FOREIGN_TORCH:
        try:
            foreign = local_foreign_env(py, log=log)
        except NoCpuTorch as e:
            return dataclasses.replace(envs, foreign_unchecked=str(e))
    else:
        foreign = torch_env(py, foreign_torch)
    return dataclasses.replace(envs, foreign=foreign)
