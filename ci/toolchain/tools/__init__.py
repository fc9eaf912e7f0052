"""Locate or provision what a build needs: a Python interpreter (:mod:`.pythons`), a CUDA
toolkit whose major.minor matches the target, its binary tools and the pinned CUTLASS/CuTe
headers (:mod:`.cuda`), the compiler cache and the host compiler (:mod:`.compilers`), and an
isolated build environment holding the target's torch (:mod:`.build_env`); what they share
(the error, the cache folder, running a child command) is in :mod:`.base`.

Nothing here looks at a GPU. Every failure is a :class:`ToolchainError` that says what to
install or set. The names below are the package's interface: callers import them from
``ci.toolchain.tools``.
"""

from __future__ import annotations

from ci.toolchain.tools.base import (CACHE_MARKER, CommandFailed, ToolchainError, cache_path, cache_root, run,
                                     run_pip)
from ci.toolchain.tools.build_env import BUILD_ENV_PACKAGES, EXTRA_MARKER, ensure_packages, torch_env
from ci.toolchain.tools.compilers import (compiler_launcher, host_compiler_version, sccache_env,
                                          sccache_server_running, sccache_server_scope, stop_sccache_server)
from ci.toolchain.tools.cuda import (CUDA_PYPI_PACKAGES, CUOBJDUMP_PIN, CUTLASS_PIN, CUTLASS_VERSION, cuda_tool, cuobjdump,
                                     cutlass_include, find_cuda, nvcc_version, provision_cuda_from_pypi)
from ci.toolchain.tools.pythons import find_python, provision_python

__all__ = [
    "BUILD_ENV_PACKAGES", "CACHE_MARKER", "CUDA_PYPI_PACKAGES", "CUOBJDUMP_PIN", "CUTLASS_PIN", "CUTLASS_VERSION", "EXTRA_MARKER",
    "CommandFailed", "ToolchainError", "cache_path", "cache_root", "compiler_launcher", "cuda_tool", "cuobjdump",
    "cutlass_include", "ensure_packages", "find_cuda", "find_python", "host_compiler_version", "nvcc_version",
    "provision_cuda_from_pypi", "provision_python", "run", "run_pip", "sccache_env", "sccache_server_running",
    "sccache_server_scope", "stop_sccache_server", "torch_env",
]
