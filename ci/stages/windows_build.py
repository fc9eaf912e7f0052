"""Windows targets built on this Linux machine (``ci.toolchain.windows_toolchain`` provides the compilers,
run under ``ci.toolchain.wine``): the stand-in import libraries, the build config's ``cross`` block,
and the inspection of what was built.

1. **Stand-in import libraries.** PyPI's Windows torch is a CPU build: it has ``torch_cpu.lib``
   and ``c10.lib`` but no ``torch_cuda.lib``/``c10_cuda.lib``, and no Windows CPython here has a
   ``python3.lib``. The torch-facing unit is compiled (the build's own command, through wine)
   and linked alone against the real libraries; every ``__imp_`` symbol the linker cannot
   resolve is one the unit imports from a DLL we lack. Each goes into a ``.def`` file of the DLL
   that exports it (Python's stable ABI by ``PC/python3dll.c``, the rest by torch's namespaces),
   and ``lib.exe /def`` makes the import library. Nothing is hand-written; the build record
   names every stand-in and its symbols. A Windows runner links the real libraries instead.
2. **Inspection** (:func:`inspect_module`): the ``.pyd``'s PE headers — machine x64, the DLLs it
   imports exactly the expected set, the ``PyInit__C`` export, the cubin of every arch in its
   ``.nv_fatbin`` section, no path of the build machine in it.
3. **Loading under wine** (``ci.stages.windows_load``): no Windows CPython is to be had from the package
   registries here, so a small Windows program (compiled here with ``cl.exe``) does what the
   interpreter's import does first: ``LoadLibrary`` of the ``.pyd`` with the real torch DLLs
   (PyPI's) and the real CUDA runtime DLL beside it, then ``GetProcAddress(PyInit__C)``; only
   python3.dll and the CUDA-side torch DLLs are stand-ins (DLLs exporting exactly the names the
   module imports). ``PyInit__C`` is not called: that needs the interpreter.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ci.runtime.log import default_log
from ci.toolchain import pe as pemod
from ci.toolchain import wine as winemod
from ci.toolchain import windows_toolchain as wintc
from ci.toolchain.tools import ToolchainError
from ci.stages.windows_load import WindowsBuildError, load_module, python3_exports

# DLLs the module may import besides torch's, CUDA's and Python's: the MSVC runtime (/MD) and
# the OS.
# msvcp140 also as delvewheel's vendored, name-mangled copy (msvcp140-<hash>.dll, in sageattn3.libs).
MSVC_RUNTIME = re.compile(r"^(vcruntime140(_1)?|msvcp140(_\d+)?(-[0-9a-f]+)?|api-ms-win-crt-[a-z]+-l1-1-0|kernel32)\.dll$",
                          re.I)
STANDIN_NOTE = "stand-in (made here from the symbols the unit imports; a Windows runner links the real one)"


def _ws(p) -> str:
    return str(winemod.z_path(p))


# -- Python's stable ABI exports ----------------------------------------------------------

def owner_of(symbol: str, python_exports: dict[str, bool], missing_libs: list[str]) -> str | None:
    """Which missing DLL exports ``symbol`` (an MSVC-decorated or C name): python3 for the stable
    ABI, c10_cuda for ``c10::cuda`` names, torch_cuda for the rest of torch's (the AOTI shim's C
    functions included); None when no missing library can be its home."""
    if symbol in python_exports:
        return "python3" if "python3" in missing_libs else None
    if "@cuda@c10@@" in symbol and "c10_cuda" in missing_libs:
        return "c10_cuda"
    if "torch_cuda" in missing_libs and (symbol.startswith(("aoti_torch_", "?")) or "@torch@@" in symbol
                                         or "@at@@" in symbol or "@c10@@" in symbol):
        return "torch_cuda"
    return None


# The C/C++ runtime (/MD) and the OS: what the trial link resolves besides the build's own libraries.
TRIAL_SYSTEM_LIBS = ("msvcrt.lib", "vcruntime.lib", "ucrt.lib", "msvcprt.lib", "kernel32.lib")
UNRESOLVED = re.compile(r"unresolved external symbol (?:\"[^\"]*\" \()?__imp_([^\s)]+)")


@dataclass
class Standins:
    """The stand-in import libraries of one build: ``root/lib/<name>.lib`` for torch's missing
    libraries, ``root/libs/python3.lib`` (where a link looks for Python's)."""

    root: Path
    symbols: dict[str, list[str]] = field(default_factory=dict)  # library -> exported names

    @property
    def lib_dir(self) -> Path:
        return self.root / "lib"

    def record(self) -> dict:
        return {f"{lib}.lib": {"symbols": names, "what": STANDIN_NOTE} for lib, names in sorted(self.symbols.items())}


def _lib_from_def(tc: wintc.WindowsToolchain, lib: str, names: list[str], data: set[str], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    definition = out_dir / f"{lib}.def"
    definition.write_text(f"LIBRARY {lib}.dll\nEXPORTS\n" + "".join(
        f"    {n}{' DATA' if n in data else ''}\n" for n in names))
    proc = tc.wine.run(tc.msvc.tool("lib.exe"), ["/nologo", "/machine:x64", f"/def:{_ws(definition)}",
                                                  f"/out:{_ws(out_dir / (lib + '.lib'))}"], env=tc.msvc.environ())
    if proc.returncode != 0:
        raise WindowsBuildError(f"lib.exe /def:{definition.name} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")


def make_standins(tc: wintc.WindowsToolchain, unit_obj: Path, link_libs: list[str], root: Path) -> Standins:
    """Link ``unit_obj`` (the torch-facing unit, compiled) alone against the real libraries of
    ``link_libs`` that exist; write a ``.def`` and an import library for every library that does
    not exist, exporting exactly the unresolved ``__imp_`` symbols that are its."""
    real_dirs = [tc.torch.torch_dir / "lib", tc.cuda.home / "lib" / "x64"]
    present = [lib for lib in link_libs if any((d / f"{lib}.lib").exists() for d in real_dirs)]
    missing = [lib for lib in link_libs if lib not in present]
    skipped: list[str] = []  # libraries the object asks for itself (#pragma comment(lib)) and we lack
    with tempfile.TemporaryDirectory(prefix="sageattn3-trial-link-") as tmp:
        for _ in range(8):
            proc = tc.wine.run(tc.msvc.tool("link.exe"), [
                "/nologo", "/DLL", "/NOENTRY", f"/OUT:{_ws(Path(tmp) / 'trial.dll')}", _ws(unit_obj),
                *(f"/LIBPATH:{_ws(d)}" for d in real_dirs if d.is_dir()), *(f"{lib}.lib" for lib in present),
                *TRIAL_SYSTEM_LIBS,
                *(f"/NODEFAULTLIB:{lib}" for lib in skipped)], env=tc.msvc.environ())
            out = proc.stdout + proc.stderr
            absent = re.search(r"LNK1104: cannot open file '([^']+)'", out)
            if not absent:
                break
            skipped.append(absent.group(1))
    if "LNK1104" in out or not ("LNK2019" in out or "LNK2001" in out or proc.returncode == 0):
        raise WindowsBuildError(f"the trial link of {unit_obj.name} failed for another reason than unresolved "
                                f"symbols ({proc.returncode}):\n{out[-3000:]}")
    wanted = sorted(set(UNRESOLVED.findall(out)))
    exports = python3_exports(tc.python.stable_abi_exports)
    by_lib: dict[str, list[str]] = {lib: [] for lib in missing}
    orphans = []
    for sym in wanted:
        lib = owner_of(sym, exports, missing)
        (by_lib[lib] if lib else orphans).append(sym)
    if orphans:
        raise WindowsBuildError(f"the torch-facing unit imports {orphans} from no library this build links "
                                f"(present: {present}; stand-ins possible for: {missing})")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    standins = Standins(root)
    for lib, names in by_lib.items():
        if not names:
            continue
        dest = root / ("libs" if lib == "python3" else "lib")
        _lib_from_def(tc, lib, names, {n for n in names if exports.get(n)}, dest)
        standins.symbols[lib] = names
    (root / "standins.json").write_text(json.dumps(standins.symbols, indent=1, sort_keys=True))
    return standins


def compile_unit(tc: wintc.WindowsToolchain, profile: dict, staging: Path, unit: str, obj: Path,
                 includes: list, bc) -> subprocess.CompletedProcess:
    """``unit`` (relative to ``staging``) through the build's own compile command, under wine (run
    once more if it fails without an error line: ``Wine.run_compile``)."""
    tools = bc.tools("msvc", _ws(tc.cuda.home), cxx=_ws(tc.msvc.tool("cl.exe")), linker=_ws(tc.msvc.tool("link.exe")))
    cmd = bc.compile_command(tools, profile, unit, _ws(obj), includes)
    env = {**tc.msvc.environ(), **bc.build_environment(profile, _ws(tc.cuda.home))}
    return tc.wine.run_compile(cmd[0], cmd[1:], env=env, cwd=staging)[0]


# -- the build config ---------------------------------------------------------------------

def cross_config(tc: wintc.WindowsToolchain, standins: Standins | None) -> dict:
    """The build config's ``cross`` block of a Windows build on Linux (what setup.py reads)."""
    return {
        "machine": "amd64", "plat_name": "win_amd64",
        "torch_dir": str(tc.torch.torch_dir), "cuda_root": str(tc.cuda.home),
        "python_include": str(tc.python.include),
        "python_prefix": str(standins.root) if standins else None,
        "standin_lib_dirs": [str(standins.lib_dir)] if standins else [],
        "wine": {"loader": str(tc.wine.loader), "cl": _ws(tc.msvc.tool("cl.exe")), "cuda_home": _ws(tc.cuda.home),
                 "link": _ws(tc.msvc.tool("link.exe")),
                 "env": {**winemod.WINE_ENV, "WINEPREFIX": str(tc.wine.prefix), **tc.msvc.environ()}},
    }


# -- inspection ---------------------------------------------------------------------------

@dataclass
class ModuleInspection:
    module: str
    machine: str
    imports: list[str]
    unexpected_imports: list[str]
    missing_imports: list[str]
    pyinit: bool
    cubins: list[str]
    build_paths: list[str]
    cuda_runtime: str = ""

    @property
    def problems(self) -> list[str]:
        out = []
        if self.machine != "x64":
            out.append(f"machine {self.machine}, not x64")
        if self.unexpected_imports:
            out.append(f"imports DLLs outside the expected set: {self.unexpected_imports}")
        if self.missing_imports:
            out.append(f"does not import {self.missing_imports}")
        if not self.pyinit:
            out.append("exports no PyInit__C")
        if self.build_paths:
            out.append(f"names paths of the build machine: {self.build_paths[:5]}")
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def expected_dlls(link_libs: list[str], cuda_major: int) -> set[str]:
    """The DLLs a module linked with ``link_libs`` may import besides the MSVC runtime: one per
    library (``cudart`` is ``cudart64_<major>.dll``). CUDA 13's Windows ``cudart.lib`` holds the
    runtime itself (the module then loads ``nvcuda.dll``, the driver, at run time), so with it
    no CUDA runtime DLL is imported; torch's own extension builder links the same library."""
    return {f"cudart64_{cuda_major}.dll" if lib == "cudart" else f"{lib}.dll" for lib in link_libs}


FATBIN_MAGIC = b"\x50\xed\x55\xba"  # 0xBA55ED50, little-endian: a fatbinary's header


def fatbinaries(data: bytes) -> list[bytes]:
    """The fatbinaries laid end to end in ``data`` (one per CUDA unit; padding between them),
    each cut by its header's size fields (magic, version, header size, body size)."""
    out, at = [], data.find(FATBIN_MAGIC)
    while at >= 0 and at + 16 <= len(data):
        header, body = int.from_bytes(data[at + 6:at + 8], "little"), int.from_bytes(data[at + 8:at + 16], "little")
        out.append(data[at:at + header + body])
        at = data.find(FATBIN_MAGIC, at + max(header + body, 4))
    return out


def cubin_archs_of_pe(module: Path) -> list[str]:
    """The sm_* of every cubin in the module's fatbinary section (PE keeps 8 characters of its
    name: ``.nv_fatb``), each fatbinary read by CUDA's cuobjdump."""
    from ci.stages.emulate import cubin_archs_of

    pe = pemod.read_pe(module)
    name = next((s.name for s in pe.sections if s.name.startswith(".nv_fatb")), ".nv_fatbin")
    archs: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="sageattn3-fatbin-") as tmp:
        for i, fat in enumerate(fatbinaries(pe.section_bytes(name))):
            path = Path(tmp) / f"unit{i}.fatbin"
            path.write_bytes(fat)
            archs |= set(cubin_archs_of(path))
    return sorted(archs)


# Path fragments of this machine that must not reach a shipped module.
def _build_path_markers(extra: list[str]) -> list[str]:
    """This machine's home, wine's view of it (Z:), the temporary folder, and each toolchain folder
    as wine's programs name it (T:\\msvc-..., T:\\cuda-...)."""
    root = winemod.windows_root()
    tools = [str(winemod.z_path(d)) for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
    markers = [str(Path.home()), "Z:\\", "z:\\", "/tmp/", *tools, *(t.lower() for t in tools), *extra]
    return [m for m in markers if m and m != "/"]


def inspect_module(module: Path, link_libs: list[str], cuda_major: int, markers: list[str] = ()) -> ModuleInspection:
    pe = pemod.read_pe(module)
    want = {d.lower() for d in expected_dlls(link_libs, cuda_major)}
    got = [d for d in pe.imported_dlls]
    unexpected = [d for d in got if d.lower() not in want and not MSVC_RUNTIME.match(d)]
    # link.exe drops a library nothing refers to (c10.dll for the stable unit); these it must use.
    required = {"python3.dll", "torch_cpu.dll"} & want
    missing = sorted(required - {d.lower() for d in got})
    data = module.read_bytes()
    text = pemod.strings(data)
    found = sorted({s for s in text for m in _build_path_markers(list(markers)) if m in s})
    runtime = next((d for d in got if d.lower().startswith("cudart64_")), None) or (
        "linked in (CUDA's cudart.lib); the driver, nvcuda.dll, is loaded at run time" if b"nvcuda.dll" in data
        else "none found")
    return ModuleInspection(module.name, pe.machine, got, unexpected, missing, "PyInit__C" in pe.exports,
                            cubin_archs_of_pe(module), found, runtime)


def module_in_wheel(wheel: Path, dest: Path) -> Path:
    """The wheel's ``sageattn3/_C.pyd``, extracted with the DLLs delvewheel vendored beside it
    (``sageattn3.libs/``: a Windows install puts that folder on the DLL search path)."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("sageattn3/") and n.endswith(".pyd")]
        if len(names) != 1:
            raise WindowsBuildError(f"{wheel.name} holds {names or 'no'} sageattn3/*.pyd (expected one)")
        for n in z.namelist():
            if n.startswith("sageattn3.libs/") and n.lower().endswith(".dll"):
                z.extract(n, dest)
        return Path(z.extract(names[0], dest))


def vendored_dlls(module: Path) -> list[Path]:
    """The DLLs delvewheel vendored for ``module`` (extracted by :func:`module_in_wheel`)."""
    libs = module.parent.parent / "sageattn3.libs"
    return sorted(libs.glob("*.dll")) if libs.is_dir() else []


# -- one Windows build on Linux, resolved -------------------------------------------------

@dataclass
class _Banner:
    banner: str


@dataclass
class WindowsCross:
    """What ``ResolvedToolchain.cross`` holds for a Windows target built here: the toolchain, and
    (after :meth:`prepare`, which the build stage calls once the payload is staged and patched)
    the stand-in import libraries."""

    tc: wintc.WindowsToolchain
    link_libs: list[str]
    standins: Standins | None = None
    borrowed: dict[str, str] = field(default_factory=dict)  # header -> where it came from

    @property
    def torch(self) -> wintc.WindowsTorch:
        return self.tc.torch

    @property
    def compiler(self) -> _Banner:
        return _Banner(self.tc.msvc.banner)

    def prepare(self, staging: Path, profile: dict, overlay: Path, cutlass: Path, log=default_log) -> None:
        """Compile the torch-facing unit with the build's command, and make the stand-in import
        libraries for the DLLs its imports need and this machine lacks."""
        from ci.payload.interface import load

        bc = load(staging / "build_commands.py", "sageattn3_build_commands_stage")  # the staged (patched) copy
        unit = profile["torch_unit"]
        if unit.endswith("classic.cpp"):  # the one header only CUDA builds of torch generate
            from ci.toolchain.compile_gate import CMAKE_MACROS, cmake_macros_overlay

            header = overlay / CMAKE_MACROS
            header.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cmake_macros_overlay(self.tc.torch.version.split("+")[0], log=log) / CMAKE_MACROS, header)
            self.borrowed = {CMAKE_MACROS: f"torch {self.tc.torch.version.split('+')[0]}'s Linux x86_64 CUDA wheel (PyPI)"}
        includes = bc.include_dirs("msvc", csrc=_ws(staging / "csrc"), torch_dir=_ws(self.tc.torch.torch_dir),
                                   torch_subdirs=profile.get("torch_include_subdirs"), cuda_home=_ws(self.tc.cuda.home),
                                   python_include=_ws(self.tc.python.include), cutlass=_ws(cutlass),
                                   overlay=_ws(overlay) if overlay.exists() else None)
        work = staging / "build" / "standins"
        obj = work / "torch_unit.obj"
        obj.parent.mkdir(parents=True, exist_ok=True)
        log(f"[build] {unit}: compiled alone with cl.exe under wine, to find what it imports")
        proc = compile_unit(self.tc, profile, staging, unit, obj, includes, bc)
        if proc.returncode != 0:
            raise WindowsBuildError(f"cl.exe could not compile {unit} ({proc.returncode}):\n"
                                    f"{(proc.stdout + proc.stderr)[-4000:]}")
        self.standins = make_standins(self.tc, obj, list(bc.link_libraries(profile)), work / "libs")
        log("[build] stand-in import libraries: " + ", ".join(
            f"{lib}.lib ({len(n)} symbols)" for lib, n in sorted(self.standins.symbols.items())))

    def config(self) -> dict:
        return cross_config(self.tc, self.standins)

    def record(self) -> dict:
        rec = self.tc.record()
        if self.standins:
            rec["standin_import_libraries"] = self.standins.record()
        if self.borrowed:
            rec["headers_from_elsewhere"] = dict(self.borrowed)
        return rec


def windows_blockers(target) -> list[str]:
    """Why ``target`` (a Windows target) cannot be built on this Linux machine under wine; empty:
    it can. Cheap: nothing is downloaded."""
    import sys

    from packaging.version import Version

    if not sys.platform.startswith("linux"):
        return [f"needs a {target.os.key} machine; Windows targets are built under wine on Linux only"]
    reasons = []
    if Version(target.cuda).major < 13:
        reasons.append(f"CUDA {target.cuda} for Windows is not on PyPI in full (its nvcc wheel holds only "
                       f"ptxas.exe): release pipeline only")
    try:
        winemod.find_wine_loader()
    except ToolchainError as e:
        reasons.append(str(e))
    return reasons


def resolve_windows_cross(target, profile: dict) -> WindowsCross:
    tc = wintc.resolve_windows(target.cuda, target.build_torch)
    return WindowsCross(tc, list(profile["link_libs"]))


def _link_libraries(profile: dict) -> list[str]:
    """What the build linked: the payload's own rule (the profile's libraries, plus python3)."""
    from ci.payload.interface import build_commands

    return list(build_commands().link_libraries(profile))


def verify_windows(rec, target, wheel: Path, dist: Path, log=default_log):
    """The verify stage of a Windows wheel built here: the PE inspection of its module and its load
    under wine (see the module's docstring), kept as ``dist/verify/<target>.verify.json``. The
    ABI guard needs a Windows CPython, which the registries here do not have: reported as not
    checked, with why."""
    from ci.stages.verify import VerifyReport

    tc = wintc.resolve_windows(target.cuda, target.build_torch)
    made = (rec.extra.get("cross") or {}).get("standin_import_libraries") or {}
    symbols = {lib.removesuffix(".lib"): entry["symbols"] for lib, entry in made.items()}
    with tempfile.TemporaryDirectory(prefix="sageattn3-winverify-") as tmp:
        module = module_in_wheel(wheel, Path(tmp))
        from packaging.version import Version

        report = inspect_module(module, _link_libraries(rec.flags), Version(target.cuda).major)
        log(f"[verify] {module.name}: machine {report.machine}; imports {', '.join(report.imports)}; "
            f"PyInit__C {'exported' if report.pyinit else 'MISSING'}; cubins {' '.join(report.cubins) or 'none'}")
        missing = sorted(set(rec.archs) - set(report.cubins))
        problems = report.problems + ([f"no cubin for {missing}"] if missing else [])
        if problems:
            raise WindowsBuildError(f"{wheel.name}: {'; '.join(problems)}")
        log(f"[verify] loading {module.name} under wine (LoadLibrary + GetProcAddress(PyInit__C)) with PyPI's "
            f"torch {tc.torch.version} DLLs")
        load = load_module(tc, module, symbols, vendored=vendored_dlls(module))
    log(f"[verify] {load.output}")
    if not load.ok:
        raise WindowsBuildError(f"{wheel.name}: its module does not load under wine: {load.output}")
    out = dist / "verify"
    out.mkdir(parents=True, exist_ok=True)
    guard = ("not checked: no Windows CPython on these package registries (the wheel's Python code and its guard "
             "are the same as on Linux, where they are checked)")
    (out / f"{target.id}.verify.json").write_text(json.dumps(
        {"target": target.id, "wheel": rec.wheel, "inspection": report.to_dict(), "load": load.to_dict(), "abi_guard": guard,
         "wine": tc.wine.version}, indent=2) + "\n")
    return VerifyReport(rec.wheel, [f"wine {tc.wine.version} (LoadLibrary of the module; no Windows CPython here)"],
                        guard, [f"imports {', '.join(report.imports)}; cubins {' '.join(report.cubins)}"])
