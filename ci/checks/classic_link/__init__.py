"""The classic unit of a per-torch Linux target of another machine (its target-machine torch
on PyPI is a CPU build), cross-compiled with its flag profile and linked against that machine's
torch and CUDA runtime: which libraries that torch lacks, and which symbols are left for whom.
The results go to ``ci/evidence.json`` (``--record``)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from ci.runtime.log import default_log
from ci.toolchain.cross import _run, cuda_sysroot, elf_machine, find_cross_compiler, python_root, torch_sysroot
from ci.toolchain.cross_spec import CROSS_SPECS, is_cross, spec_for
from ci.toolchain.tools import ToolchainError


@dataclass
class ClassicLink:
    """The classic unit of a per-torch target, cross-compiled and linked for the target machine."""

    target: str
    torch_libraries: str  # "2.9.1+cpu (PyPI, linux-aarch64)"
    torch_headers: str  # "2.9.1 (PyPI's linux-x86_64 CUDA wheel)"
    objects: list[str]
    needed: list[str]  # DT_NEEDED of the linked module
    absent_libraries: list[str]  # the profile's link libraries that the target machine's torch lacks
    unresolved: dict[str, list[str]]  # who would provide them -> demangled symbols
    elf_machine: str
    seconds: float = 0.0
    source_commit: str = ""  # the checkout's commit (``ci.stages.build.source_commit``): the evidence names it

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _dynamic_symbols(nm: str, lib: Path, undefined: bool) -> set[str]:
    """Dynamic symbols of ``lib``: its undefined strong ones (weak ones may stay unresolved), or
    those it defines."""
    flag = "--undefined-only" if undefined else "--defined-only"
    out = _run([nm, "-D", flag, "--format=posix", str(lib)], check=True).stdout
    rows = [ln.split() for ln in out.splitlines() if ln.strip()]
    return {r[0].split("@")[0] for r in rows if not (undefined and len(r) > 1 and r[1] in "wv")}


def _provider(symbol: str, demangled: str) -> str:
    if symbol.startswith(("Py", "_Py")):
        return "the Python interpreter (resolved when it imports the module)"
    if "c10::cuda::" in demangled:
        return "libc10_cuda.so"
    if "at::cuda::" in demangled or "torch::cuda::" in demangled:
        return "libtorch_cuda.so"
    if demangled.startswith("sageattn3::"):
        return "the kernel units (csrc/**/*.cu; not linked here)"
    return "other"


def link_classic(target, matrix, work: Path, *, kernel_objects: list[Path] = (), log=default_log) -> ClassicLink:
    """Cross-compile the classic unit of ``target`` (a per-torch Linux target of another machine)
    with its flag profile, against its torch's headers (PyPI's x86_64 CUDA wheel of the same
    release: the headers are the same on every machine, and the target machine's CPU wheel lacks
    ``c10/cuda/impl/cuda_cmake_macros.h``), then link it (with ``kernel_objects``) against the
    target machine's torch libraries from PyPI and its CUDA runtime, and say which of the
    profile's libraries that torch lacks and which symbols are left for whom."""
    import time

    from ci.stages.build import source_commit
    from ci.toolchain.compile_gate import torch_headers
    from ci.toolchain.flags import profile_for
    from ci.payload.interface import build_commands

    t0 = time.monotonic()
    spec = spec_for(target.os.machine)
    compiler = find_cross_compiler(spec.machine)
    prof = profile_for(target, matrix.stable_abi_floor)
    if not prof["torch_unit"].endswith("classic.cpp"):
        raise ToolchainError(f"{target.id} is a stable-ABI target: cross-build its wheel instead")
    bc = build_commands()
    from ci.payload.interface import PAYLOAD

    headers = torch_headers(target.build_torch, log=log)
    torch = torch_sysroot(spec.machine, target.build_torch)
    cuda_major_minor = target.cuda if Version(target.cuda).major >= 13 else "13.0"
    cuda_root = cuda_sysroot(spec.machine, cuda_major_minor)
    pyroot = python_root(spec.machine)
    tools = bc.tools("gcc", "/nonexistent-nvcc", cxx=str(compiler.cxx))
    includes = [PAYLOAD / "csrc", headers, headers / "torch" / "csrc" / "api" / "include", cuda_root / "include",
                pyroot.include]
    work = work.resolve()  # the compiler runs in the payload
    work.mkdir(parents=True, exist_ok=True)
    # Targets of one torch release share the object when their commands are the same.
    key = hashlib.sha256(json.dumps(bc.compile_command(tools, prof, prof["torch_unit"], "o", includes),
                                    default=str).encode() + (PAYLOAD / prof["torch_unit"]).read_bytes()).hexdigest()[:12]
    obj = work.parent / f"classic-{target.build_torch}-{key}.o"
    cmd = bc.compile_command(tools, prof, prof["torch_unit"], obj, includes)
    if not obj.exists():
        log(f"[cross] {target.id}: compiling {prof['torch_unit']} for {spec.machine} against torch {target.build_torch} headers")
        proc = _run(cmd, cwd=PAYLOAD)
        if proc.returncode != 0:
            raise ToolchainError(f"{target.id}: {prof['torch_unit']} does not cross-compile:\n{proc.stderr[-3000:]}")
    lib_dirs = [torch.torch_dir / "lib", cuda_root / "lib"]
    libs = list(bc.link_libraries(prof))
    present = [lib for lib in libs if any((d / f"lib{lib}.so").exists() for d in lib_dirs)]
    absent = [f"lib{lib}.so" for lib in libs if lib not in present]
    out = work / f"_C-{target.build_torch}.so"
    link = bc.link_command(tools, {**prof, "link_libs": present}, [obj, *kernel_objects], out, lib_dirs)
    proc = _run(link)
    if proc.returncode != 0:
        raise ToolchainError(f"{target.id}: linking for {spec.machine} failed:\n{proc.stderr[-3000:]}")
    nm = shutil.which(f"{spec.triple}-nm") or "nm"
    undefined = _dynamic_symbols(nm, out, undefined=True)
    needed = re.findall(r"\(NEEDED\).*\[(.+?)\]", _run([shutil.which(f"{spec.triple}-readelf") or "readelf", "-d",
                                                           str(out)], check=True).stdout)
    libc_dir = Path(f"/usr/{spec.triple}/lib")
    providers = [d / n for d in lib_dirs for n in (f"lib{lib}.so" for lib in present)]
    providers += [p for p in libc_dir.glob("lib*.so.*") if p.is_file()]
    defined: set[str] = set()
    for p in providers:
        if p.exists():
            defined |= _dynamic_symbols(nm, p, undefined=False)
    left = sorted(undefined - defined)
    filt = shutil.which(f"{spec.triple}-c++filt") or "c++filt"
    demangled = _run([filt], input="\n".join(left), check=True).stdout.splitlines() if left else []
    unresolved: dict[str, list[str]] = {}
    for sym, name in zip(left, demangled):
        unresolved.setdefault(_provider(sym, name), []).append(name)
    return ClassicLink(
        target=target.id,
        torch_libraries=f"{torch.version} (PyPI, linux-{spec.machine}, {'CUDA ' + torch.cuda if torch.cuda else 'CPU build'})",
        torch_headers=f"{target.build_torch} (PyPI's linux-x86_64 CUDA wheel)",
        objects=[o.name for o in [obj, *kernel_objects]], needed=needed, absent_libraries=absent,
        unresolved=unresolved, elf_machine=elf_machine(out), seconds=round(time.monotonic() - t0, 1),
        source_commit=source_commit())


def _classic_targets(matrix, ids: list[str] | None) -> list:
    """The per-torch Linux targets of another machine (default: all of them in the matrix)."""
    chosen = [matrix.target(i) for i in ids] if ids else [
        t for t in matrix.targets if is_cross(t.os) and not t.variant.stable and t.os.machine in CROSS_SPECS]
    for t in chosen:
        if not is_cross(t.os) or t.variant.stable:
            raise ToolchainError(f"{t.id}: link-classic is for per-torch targets of another machine than this one")
    return chosen
