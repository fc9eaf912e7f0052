"""The load check of a Windows module built here: what CPython's import does first with an
extension module, done under wine by a small Windows program (compiled here with ``cl.exe``):
``LoadLibrary`` of the ``.pyd`` with the real torch DLLs (PyPI's), the CUDA runtime DLL and
Microsoft's VC++ runtime DLLs beside it, then ``GetProcAddress(PyInit__C)``. No Windows CPython is
to be had from the package registries here, so ``python3.dll`` and the CUDA-side torch DLLs are
stand-ins: DLLs exporting exactly the names the module imports. ``PyInit__C`` is not called."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ci.toolchain import pe as pemod
from ci.toolchain import wine as winemod
from ci.toolchain import windows_toolchain as wintc
from ci.runtime.errors import FactoryError


class WindowsBuildError(FactoryError, RuntimeError):
    pass


def python3_exports(python3dll_c: Path) -> dict[str, bool]:
    """name -> is data, from CPython's ``PC/python3dll.c`` (``EXPORT_FUNC(x)``/``EXPORT_DATA(x)``)."""
    text = python3dll_c.read_text(errors="replace")
    out = {m.group(2): m.group(1) == "DATA" for m in re.finditer(r"EXPORT_(FUNC|DATA)\((\w+)\)", text)}
    if not out:
        raise WindowsBuildError(f"{python3dll_c} lists no EXPORT_FUNC/EXPORT_DATA: not CPython's PC/python3dll.c")
    return out


LOADER_SOURCE = r"""
#include <windows.h>
#include <stdio.h>
/* What CPython's import does first with an extension module: load the DLL (resolving every
   import against the DLLs beside it and on the search path), then find PyInit_<name>. */
int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: loadcheck MODULE.pyd INIT_NAME\n"); return 2; }
    SetDllDirectoryA(NULL);
    HMODULE m = LoadLibraryExA(argv[1], NULL, LOAD_WITH_ALTERED_SEARCH_PATH);
    if (!m) { printf("LoadLibrary failed: error %lu\n", GetLastError()); return 1; }
    FARPROC init = GetProcAddress(m, argv[2]);
    if (!init) { printf("loaded; GetProcAddress(%s) failed: error %lu\n", argv[2], GetLastError()); return 1; }
    printf("loaded; %s found\n", argv[2]);
    return 0;
}
"""


def _loader_exe(tc: wintc.WindowsToolchain) -> Path:
    root = winemod.windows_root() / "loadcheck"
    exe = root / "loadcheck.exe"
    digest = hashlib.sha256(LOADER_SOURCE.encode()).hexdigest()[:12]
    if (root / f".{digest}").exists():
        return exe
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    (root / "loadcheck.c").write_text(LOADER_SOURCE)
    proc = tc.wine.run(tc.msvc.tool("cl.exe"), ["/nologo", "/O1", "/MD", "loadcheck.c", "/Feloadcheck.exe"],
                       env=tc.msvc.environ(), cwd=root)
    if proc.returncode != 0 or not exe.exists():
        raise WindowsBuildError(f"cl.exe could not build the load check ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    (root / f".{digest}").write_text("")
    return exe


def _standin_dll(tc: wintc.WindowsToolchain, lib: str, names: list[str], data: set[str], out_dir: Path) -> Path:
    """A DLL named ``lib``.dll exporting exactly ``names`` (each bound to one stub), for the load
    check: it stands in for a DLL this machine does not have."""
    src = out_dir / f"{lib}_standin.c"
    src.write_text("__declspec(dllexport) int sageattn3_standin_stub(void) { return 0; }\n"
                   "int sageattn3_standin_data[64];\n")
    definition = out_dir / f"{lib}_standin.def"
    definition.write_text(f"LIBRARY {lib}.dll\nEXPORTS\n" + "".join(
        f"    {n}={'sageattn3_standin_data DATA' if n in data else 'sageattn3_standin_stub'}\n" for n in names))
    proc = tc.wine.run(tc.msvc.tool("cl.exe"), ["/nologo", "/LD", "/MD", src.name, f"/Fe{lib}.dll", "/link",
                                                 f"/DEF:{definition.name}", "/NOENTRY"],
                       env=tc.msvc.environ(), cwd=out_dir)
    if proc.returncode != 0:
        raise WindowsBuildError(f"could not build the stand-in {lib}.dll ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return out_dir / f"{lib}.dll"


@dataclass
class LoadReport:
    ok: bool
    output: str
    real_dlls: list[str]
    standin_dlls: list[str]
    unresolved: list[str] = field(default_factory=list)  # "dll!name" the DLL beside it does not export

    def to_dict(self) -> dict:
        return asdict(self)


def load_module(tc: wintc.WindowsToolchain, module: Path, standin_symbols: dict[str, list[str]],
                vendored: list[Path] = ()) -> LoadReport:
    """LoadLibrary of ``module`` under wine with the real torch DLLs (PyPI's Windows torch) and
    CUDA runtime DLL beside it, and stand-in DLLs for the ones this machine lacks."""
    exports = python3_exports(tc.python.stable_abi_exports)
    loader = _loader_exe(tc)
    with tempfile.TemporaryDirectory(prefix="sageattn3-load-", dir=winemod.windows_root()) as tmp:
        work = Path(tmp)
        shutil.copy2(module, work / module.name)
        for dll in vendored:  # what delvewheel put into the wheel for it (sageattn3.libs)
            shutil.copy2(dll, work / dll.name)
        real = []
        for d in (tc.torch.torch_dir / "lib", tc.cuda.runtime_dll_dir, wintc.vc_runtime()):
            for dll in d.glob("*.dll"):
                if not (work / dll.name).exists():  # torch's own copy of a runtime DLL comes first
                    (work / dll.name).symlink_to(dll)
                    real.append(dll.name)
        standins = []
        for lib, names in standin_symbols.items():
            _standin_dll(tc, lib, names, {n for n in names if exports.get(n)}, work)
            standins.append(f"{lib}.dll")
        # Windows refuses a module whose import a DLL does not export; wine binds a stub instead
        # and says so on its module channel ("No implementation for DLL.name"): both count.
        try:
            proc = tc.wine.run(loader, [module.name, "PyInit__C"], cwd=work, timeout=900,
                               env={"WINEDLLOVERRIDES": f"{winemod.WINE_ENV['WINEDLLOVERRIDES']};"
                                                        f"{wintc.VC_RUNTIME_OVERRIDES}",
                                    "WINEDEBUG": "-all,warn+module"})
        except subprocess.TimeoutExpired:
            raise WindowsBuildError(f"loading {module.name} under wine did not finish in 900 s (wine hung): "
                                    f"run `wineserver -k` with WINEPREFIX={tc.wine.prefix} and try again") from None
        unresolved = unresolved_imports(work / module.name, work)
    stubbed = re.findall(r"No implementation for (\S+?\.dll)\.(\S+) imported from", proc.stderr, re.I)
    unresolved = sorted(set(unresolved) | {f"{dll}!{name}" for dll, name in stubbed})
    out = proc.stdout.strip() + (f"; unresolved imports: {', '.join(unresolved)}" if unresolved else "")
    return LoadReport(proc.returncode == 0 and "found" in proc.stdout and not unresolved, out, sorted(real), standins,
                      unresolved)


def unresolved_imports(module: Path, dll_dir: Path) -> list[str]:
    """``dll!name`` for every name ``module`` imports from a DLL in ``dll_dir`` that the DLL
    does not export (read from both PE files); DLLs not in ``dll_dir`` (the OS's) are not judged."""
    have = {p.name.lower(): p for p in dll_dir.iterdir() if p.suffix.lower() == ".dll"}
    missing = []
    for dll, names in pemod.read_pe(module).imports.items():
        path = have.get(dll.lower())
        if path is None:
            continue
        exports = set(pemod.read_pe(path.resolve()).exports)
        missing += [f"{dll}!{n}" for n in names if not n.startswith("#") and n not in exports]
    return missing
