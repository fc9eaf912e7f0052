"""linux-aarch64 from this x86_64 machine (ci.toolchain.cross): the profile of an aarch64 target names the
cross g++, and the torch-facing unit and a kernel unit cross-compile and link for aarch64 against
the target machine's real torch 2.14.1 and CUDA 13.0 runtime (PyPI's aarch64 wheels), with the
payload's own command builder; the linked module carries the cubins of both archs. Then Debian's
arm64 CPython, run by qemu-user, loads the kernel unit with the aarch64 CUDA runtime.

Needs Debian's g++-aarch64-linux-gnu and qemu-user and the arm64 package lists (.ci/run installs
them); the sysroot is provisioned into the factory cache on first use (~0.5 GB download)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ci.toolchain import cross, cross_spec
from ci.payload.interface import PAYLOAD
from ci.toolchain.flags import profile_for
from ci.toolchain.targets import Matrix
from ci.toolchain.tools import ToolchainError, cutlass_include, find_cuda

MATRIX = Matrix.load()
STABLE = MATRIX.target("linux-aarch64-cu130-torch2.10-stable")
KERNEL_UNIT = "csrc/quant/quant_rows.cu"  # the smallest kernel unit

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and cross_spec.host_machine() == "x86_64"),
    reason="cross-compiling linux-aarch64 is checked from linux x86_64 machines")


def _bc():
    from ci.payload.interface import build_commands

    return build_commands()


def test_the_profile_chooses_the_cross_compiler():
    prof = profile_for(STABLE, MATRIX.stable_abi_floor)
    assert prof["host_compiler"] == "aarch64-linux-gnu-g++" and prof["machine"] == "aarch64"
    assert "-ccbin=aarch64-linux-gnu-g++" in prof["nvcc_flags"]
    native = profile_for(MATRIX.target("linux-x86_64-cu130-torch2.10-stable"), MATRIX.stable_abi_floor)
    assert "host_compiler" not in native and not any(f.startswith("-ccbin") for f in native["nvcc_flags"])
    # Everything else is the native profile: same device code, flags and libraries.
    same = {k: v for k, v in prof.items() if k not in ("host_compiler", "machine", "nvcc_flags")}
    assert same == {k: v for k, v in native.items() if k != "nvcc_flags"}
    assert [f for f in prof["nvcc_flags"] if not f.startswith("-ccbin")] == native["nvcc_flags"]


def test_what_cannot_be_cross_built_here_says_why():
    assert cross.cross_blockers(STABLE) == []
    cu128 = cross.cross_blockers(MATRIX.target("linux-aarch64-cu128-torch2.10-stable"))
    assert "CUDA 12.8 for linux-aarch64 is not on PyPI" in cu128[0]
    assert "PyPI's torch 2.11.0 for linux-aarch64 is a CPU build" in cu128[1] and "link-classic" not in cu128[1]
    [cpu] = cross.cross_blockers(MATRIX.target("linux-aarch64-cu130-torch2.9"))
    assert "is a CPU build" in cpu and "link-classic" in cpu


def test_a_missing_cross_compiler_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolchainError, match=r"apt-get install -y g\+\+-aarch64-linux-gnu"):
        cross.find_cross_compiler("aarch64")
    assert any("g++-aarch64-linux-gnu" in r for r in cross.cross_blockers(STABLE))


@pytest.fixture(scope="module")
def sysroot():
    return cross.resolve_cross("aarch64", "13.0", "2.14.1")


def test_the_sysroot_is_the_target_machines(sysroot):
    assert int(sysroot.compiler.version.split(".")[0]) >= 11
    assert (sysroot.torch.version, sysroot.torch.cuda) == ("2.14.1+cu130", "13.0")
    for lib in (sysroot.torch.torch_dir / "lib" / "libtorch_cpu.so", sysroot.cuda_root / "lib" / "libcudart.so"):
        assert cross.elf_machine(lib.resolve()) == "aarch64", lib
    assert cross.elf_machine(sysroot.python.python) == "aarch64"
    # The headers' pyconfig.h is the aarch64 one (Debian's generic one only dispatches per triple).
    own = sysroot.python.root / "usr" / "include" / "aarch64-linux-gnu" / "python3.11" / "pyconfig.h"
    assert (sysroot.python.include / "pyconfig.h").read_bytes() == own.read_bytes()


@pytest.fixture(scope="module")
def linked(sysroot, tmp_path_factory):
    """The torch-facing unit and one kernel unit, compiled with the payload's command builder
    and the aarch64 target's profile, linked into one module for aarch64."""
    bc = _bc()
    prof = profile_for(STABLE, MATRIX.stable_abi_floor)
    nvcc_home = find_cuda("13.0").home
    tools = bc.tools("gcc", nvcc_home, cxx=prof["host_compiler"])
    includes = bc.include_dirs("gcc", csrc=PAYLOAD / "csrc", torch_dir=sysroot.torch.torch_dir,
                               torch_subdirs=prof["torch_include_subdirs"], cuda_home=sysroot.cuda_root,
                               python_include=sysroot.python.include, cutlass=cutlass_include(), machine="aarch64")
    includes = [d for d in includes if Path(d).is_dir()] + [sysroot.cuda_root / "include" / "cccl",
                                                           Path(nvcc_home) / "include"]
    out = tmp_path_factory.mktemp("aarch64")
    units = [prof["torch_unit"], KERNEL_UNIT]
    env = {**os.environ, **bc.build_environment(prof, nvcc_home)}

    def compile_one(unit: str) -> Path:
        obj = out / (Path(unit).name + ".o")
        proc = subprocess.run(bc.compile_command(tools, prof, unit, obj, includes), cwd=PAYLOAD, env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{unit}:\n{proc.stderr[-3000:]}"
        return obj

    with ThreadPoolExecutor(max_workers=2) as pool:
        objects = list(pool.map(compile_one, units))
    module = out / "_C.abi3.so"
    link = bc.link_command(tools, prof, objects, module, [sysroot.torch.torch_dir / "lib", sysroot.cuda_root / "lib"])
    proc = subprocess.run(link, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return objects, module


def test_torch_unit_and_a_kernel_unit_cross_compile_and_link(linked):
    objects, module = linked
    assert [cross.elf_machine(o) for o in objects] == ["aarch64", "aarch64"]
    assert cross.elf_machine(module) == "aarch64"
    needed = subprocess.run(["aarch64-linux-gnu-readelf", "-d", str(module)], capture_output=True, text=True,
                            check=True).stdout
    for lib in ("libtorch_cpu.so", "libcudart.so.13", "libstdc++.so.6"):
        assert f"[{lib}]" in needed, needed


def test_the_module_holds_both_archs_cubins(linked):
    from ci.stages.emulate import cubin_archs_of

    assert cubin_archs_of(linked[1]) == ["sm_120a", "sm_121a"]


def test_the_emulated_python_loads_the_kernel_unit_with_the_aarch64_cuda_runtime(linked, sysroot, tmp_path):
    """qemu-user runs Debian's arm64 CPython; its dynamic loader maps the kernel unit (linked alone
    against the aarch64 libcudart, whose fat-binary registration runs at load) and the runtime
    answers. The torch-facing module itself needs the aarch64 libtorch_cuda and its CUDA libraries
    (cuBLAS, cuDNN, NCCL: ~2.5 GB), so its emulated import is the documented session's
    (docs/factory.md, "Linux aarch64 from an x86_64 machine"), not every test run's."""
    from ci.stages.emulate import Emulator

    bc = _bc()
    prof = profile_for(STABLE, MATRIX.stable_abi_floor)
    kernel = tmp_path / "libquant_rows.so"
    link = bc.link_command(bc.tools("gcc", "nvcc", cxx=prof["host_compiler"]), {**prof, "link_libs": ["cudart"]},
                           [linked[0][1]], kernel, [sysroot.cuda_root / "lib"])
    proc = subprocess.run(link, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    emu = Emulator.for_machine("aarch64")
    probe = ("import ctypes, sys; k = ctypes.CDLL(sys.argv[1]); rt = ctypes.CDLL('libcudart.so.13');"
             "v = ctypes.c_int(); rc = rt.cudaRuntimeGetVersion(ctypes.byref(v)); print(rc, v.value)")
    env = {**os.environ, "LD_LIBRARY_PATH": str(sysroot.cuda_root / "lib")}
    proc = emu.run(emu.python.python, "-c", probe, str(kernel), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "13000"]
    # Without the aarch64 runtime on the loader's path, the load fails naming it.
    proc = emu.run(emu.python.python, "-c", probe, str(kernel), timeout=600)
    assert proc.returncode != 0 and "libcudart.so.13" in proc.stderr, proc.stderr[-2000:]


def test_a_cross_build_config_reads_the_sysroot(sysroot):
    from ci.stages.build import build_config
    from ci.stages.resolve import resolve_toolchain

    tc = resolve_toolchain(STABLE, MATRIX)
    assert tc.cross is not None and tc.torch_include == sysroot.torch.torch_dir / "include"
    cfg = build_config(tc, MATRIX, Path("no-overlay"))
    assert cfg["cross"]["plat_name"] == "linux_aarch64"
    assert cfg["cross"]["torch_dir"] == str(sysroot.torch.torch_dir)
    assert cfg["record"]["os"] == "linux-aarch64"
    assert cfg["record"]["extra"]["cross"]["built_on"] == "linux-x86_64"
    assert cfg["record"]["toolchain"]["host_compiler"].startswith("aarch64-linux-gnu-g++")
    assert shutil.which("aarch64-linux-gnu-g++")
