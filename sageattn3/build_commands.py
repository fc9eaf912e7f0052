"""The exact compile and link command lines of sageattn3's extension, as pure functions of the
flag profile (``build_profile.profile``) and the toolchain's paths.

Two styles:

- ``gcc`` (Linux): ``nvcc -c src -o obj.o``, ``c++ -c src -o obj.o``, linked by ``c++ -shared``
  with ``-L``/``-l`` into ``_C.abi3.so``.
- ``msvc`` (Windows): ``nvcc -c src -o obj.obj`` (host flags through ``-Xcompiler``),
  ``cl /c src /Foobj.obj`` with ``/D`` and ``/I``, linked by ``link /DLL /OUT:..._C.pyd`` with
  ``/LIBPATH:`` and ``name.lib``; the module's ``PyInit__C`` is exported by its own
  ``PyMODINIT_FUNC`` (``__declspec(dllexport)`` under MSVC), so no ``/EXPORT`` is needed.

Nothing here but ``find_msvc_tools`` touches the file system or asks which OS it runs on: paths
are ``PurePosixPath`` or ``PureWindowsPath`` by style, so a Windows build's commands can be
computed, and tested, anywhere. MSVC's ``cl.exe`` and ``link.exe`` are always absolute paths
(``find_msvc_tools`` resolves them where the build runs): a bare ``link`` would run whichever
``link`` comes first on PATH, and in a runner's Git Bash that is GNU coreutils' ``link``.
Standard library only (it runs before anything is installed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import PurePath, PurePosixPath, PureWindowsPath
from typing import Iterable, Mapping, Sequence

STYLES = ("gcc", "msvc")
CUDA_SOURCE = ".cu"
# Where a Linux CUDA toolkit keeps its per-target headers and libraries, by machine.
LINUX_CUDA_TARGET_DIR = {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux", "arm64": "sbsa-linux"}
# MSVC link options for a Python extension DLL (what setuptools' MSVC compiler passes, minus
# link-time code generation, which would need /GL objects).
MSVC_LINK_FLAGS = ("/nologo", "/DLL", "/INCREMENTAL:NO", "/MANIFEST:EMBED,ID=2", "/MANIFESTUAC:NO")


class BuildCommandError(ValueError):
    """A profile or source list the commands cannot be made from; the message says what to fix."""


def _check_style(style: str) -> str:
    if style not in STYLES:
        raise BuildCommandError(f"unknown compiler style {style!r}: expected one of {', '.join(STYLES)}")
    return style


def style_of(profile: dict) -> str:
    """The command style of a flag profile: its ``compiler`` ('msvc' or 'gcc')."""
    return _check_style(profile.get("compiler") or ("msvc" if profile.get("platform") == "windows" else "gcc"))


def path_type(style: str) -> type[PurePath]:
    return PureWindowsPath if _check_style(style) == "msvc" else PurePosixPath


@dataclass(frozen=True)
class Tools:
    """The programs a build runs. ``launcher`` (e.g. sccache) prefixes every compile."""

    style: str
    nvcc: str
    cxx: str
    linker: str
    launcher: tuple[str, ...] = ()


def tools(style: str, cuda_home: str | PurePath, *, cxx: str | None = None, linker: str | None = None,
          launcher: Sequence[str] = ()) -> Tools:
    """nvcc of ``cuda_home``; for msvc the absolute paths of ``cl.exe`` (``cxx``) and
    ``link.exe`` (``linker``), from ``find_msvc_tools``; for gcc ``cxx`` (default ``c++``),
    which also links."""
    p = path_type(style)
    if style == "msvc":
        for name, exe, want in (("cxx", cxx, "cl.exe"), ("linker", linker, "link.exe")):
            absolute = exe and (PureWindowsPath(exe).is_absolute() or os.path.isabs(exe))
            if not absolute or PureWindowsPath(exe).name.lower() != want:
                raise BuildCommandError(
                    f"MSVC builds need the absolute path of {want} as {name} (got {exe!r}): a bare name runs "
                    f"whatever comes first on PATH; resolve it with find_msvc_tools()")
        return Tools(style, str(p(cuda_home) / "bin" / "nvcc.exe"), str(cxx), str(linker), tuple(launcher))
    compiler = cxx or "c++"
    return Tools(style, str(p(cuda_home) / "bin" / "nvcc"), compiler, linker or compiler, tuple(launcher))


# Where a Visual Studio toolset keeps the x64-hosted, x64-targeting compiler and linker, under
# its VCToolsInstallDir (what vcvars64.bat exports).
MSVC_HOST_X64 = ("bin", "Hostx64", "x64")


def _env_get(env: Mapping[str, str], key: str) -> str | None:
    """``env[key]``, case-insensitively (Windows variable names are)."""
    if key in env:
        return env[key]
    lower = key.lower()
    return next((v for k, v in env.items() if k.lower() == lower), None)


def find_msvc_tools(env: Mapping[str, str]) -> tuple[str, str]:
    """The absolute paths of MSVC's ``cl.exe`` and ``link.exe`` in the developer environment
    ``env``: from ``VCToolsInstallDir\\bin\\Hostx64\\x64`` when vcvars set it, else the first
    ``cl.exe`` on ``env``'s PATH; ``link.exe`` always from the same directory as ``cl.exe``, never
    from PATH (Git for Windows puts its ``usr\\bin``, with coreutils' ``link``, ahead of MSVC's).
    Raises BuildCommandError saying what to set up when there is none."""
    candidates = []
    vctools = _env_get(env, "VCToolsInstallDir")
    if vctools:
        candidates.append(os.path.join(vctools, *MSVC_HOST_X64))
    for d in (_env_get(env, "PATH") or "").split(os.pathsep):
        if d and os.path.isfile(os.path.join(d, "cl.exe")):
            candidates.append(d)
            break
    for d in candidates:
        cl, link = os.path.join(d, "cl.exe"), os.path.join(d, "link.exe")
        if os.path.isfile(cl):
            if not os.path.isfile(link):
                raise BuildCommandError(f"MSVC's cl.exe is at {cl} but no link.exe beside it: repair the Visual "
                                        f"Studio C++ x64 toolset")
            return os.path.abspath(cl), os.path.abspath(link)
    raise BuildCommandError(
        "MSVC's cl.exe not found (VCToolsInstallDir"
        + (f"={vctools}" if vctools else " unset") + ", none on PATH): build from a VS 2022 x64 developer "
        "environment (vcvars64.bat, or `python -m ci.release.cibw msvc-env` on a runner)")


def wine_path(path: str | PurePath) -> PureWindowsPath:
    """An absolute path of a Linux machine as programs under wine see it (wine maps ``Z:`` to
    ``/``): how a Windows build run on Linux names its files to cl.exe, nvcc.exe and link.exe."""
    posix = PurePosixPath(path)
    if not posix.is_absolute():
        raise BuildCommandError(f"wine_path needs an absolute path, got {str(path)!r}")
    return PureWindowsPath("Z:\\", *posix.parts[1:])


def host_path(path: str | PurePath) -> PurePosixPath:
    """The inverse of :func:`wine_path` (a ``Z:`` path back to the Linux one); any other path is
    taken as relative to the build's working directory."""
    win = PureWindowsPath(path)
    if win.drive.upper() == "Z:":
        return PurePosixPath("/", *win.parts[1:])
    return PurePosixPath(*win.parts)


def translation_units(profile: dict, files: Iterable[str]) -> list[str]:
    """What a build compiles, from the payload's ``csrc`` files (posix paths relative to the
    payload): every ``.cu`` (torch-free kernels) plus exactly the one torch-facing unit the
    profile names in ``torch_unit``. A profile without that key (older ones) gets the only
    ``.cpp``; several are an error rather than a guess."""
    files = sorted(set(files))
    units = [f for f in files if f.endswith(CUDA_SOURCE)]
    unit = profile.get("torch_unit")
    if unit:
        if unit not in files:
            raise BuildCommandError(
                f"the profile's torch_unit {unit!r} is not among the payload's sources "
                f"({', '.join(f for f in files if not f.endswith(CUDA_SOURCE)) or 'no .cpp files'})"
            )
        return [*units, unit]
    cpp = [f for f in files if f.endswith(".cpp")]
    if len(cpp) != 1:
        raise BuildCommandError(
            f"the profile names no torch_unit and the payload has {len(cpp)} .cpp files "
            f"({', '.join(cpp) or 'none'}): set profile['torch_unit'] to the one to compile"
        )
    return [*units, cpp[0]]


def object_path(style: str, objdir: str | PurePath, source: str) -> PurePath:
    """``objdir/<source>.o`` (gcc) or ``objdir\\<source>.obj`` (msvc): one object per source."""
    p = path_type(style)
    rel = p(source)
    return p(objdir) / rel.with_name(rel.name + (".obj" if style == "msvc" else ".o"))


def include_dirs(style: str, *, csrc: str | PurePath, torch_dir: str | PurePath,
                 torch_subdirs: Sequence[str] | None, cuda_home: str | PurePath,
                 python_include: str | PurePath, cutlass: str | PurePath | None = None,
                 overlay: str | PurePath | None = None, machine: str = "x86_64") -> list[PurePath]:
    """The include search path, in order: the patch overlay (patched copies of third-party
    headers shadow the originals), the payload's csrc, torch's include dirs (the profile's
    ``torch_include_subdirs`` under torch's package dir), CUDA's, CUTLASS/CuTe, Python's."""
    p = path_type(style)
    dirs = [p(overlay)] if overlay else []
    dirs.append(p(csrc))
    dirs += [p(torch_dir).joinpath(*PurePosixPath(sub).parts) for sub in (torch_subdirs or ["include"])]
    dirs.append(p(cuda_home) / "include")
    if style == "gcc":
        dirs.append(p(cuda_home) / "targets" / LINUX_CUDA_TARGET_DIR.get(machine, f"{machine}-linux") / "include")
    if cutlass:
        dirs.append(p(cutlass))
    dirs.append(p(python_include))
    return dirs


def library_dirs(style: str, *, torch_dir: str | PurePath, cuda_home: str | PurePath,
                 python_prefix: str | PurePath | None = None, machine: str = "x86_64") -> list[PurePath]:
    """Where the linker finds torch's, CUDA's and (Windows) Python's import libraries.
    Windows: ``torch\\lib``, CUDA's ``lib\\x64`` and ``<python base prefix>\\libs``
    (``python3.lib``). Linux: ``torch/lib`` and each place a toolkit may keep libcudart
    (callers drop those that do not exist)."""
    p = path_type(style)
    torch_lib = p(torch_dir) / "lib"
    home = p(cuda_home)
    if style == "msvc":
        if python_prefix is None:
            raise BuildCommandError("an MSVC link needs Python's base prefix (its libs\\python3.lib)")
        return [torch_lib, home / "lib" / "x64", p(python_prefix) / "libs"]
    target = LINUX_CUDA_TARGET_DIR.get(machine, f"{machine}-linux")
    return [torch_lib, home / "lib64", home / "lib", home / "targets" / target / "lib"]


def _limited_api(profile: dict) -> bool:
    return any(d.split("=")[0] == "Py_LIMITED_API" for d in profile["defines"])


def link_libraries(profile: dict) -> list[str]:
    """The profile's ``link_libs``; MSVC also names Python's import library (``python3`` for the
    limited API), which gcc-style links leave unresolved for the interpreter to provide."""
    libs = list(profile["link_libs"])
    if style_of(profile) == "msvc" and _limited_api(profile) and "python3" not in libs:
        libs.append("python3")
    return libs


def reproducible_nvcc_flags(source: str) -> list[str]:
    """nvcc names the kernels and device functions of anonymous namespaces (and other internal
    linkage) after a hash of the source's absolute path, which cudafe++ computes once and cicc
    reuses: two checkouts at different paths would give different symbol names, in the host
    code and in every cubin. Naming the source by its payload-relative path instead makes the
    names, and the binary, the same wherever it is built (the path is only hashed)."""
    return ["-Xcudafe", f"--orig_src_path_name={PurePosixPath(source).as_posix()}"]


def compile_command(t: Tools, profile: dict, source: str, obj: str | PurePath,
                    includes: Sequence[str | PurePath], *, host_flags: Sequence[str] = ()) -> list[str]:
    """The argv that compiles one source into ``obj``. ``.cu`` goes to nvcc (host flags as
    ``-Xcompiler``), anything else to the host compiler. ``host_flags``: extra host-compiler
    flags of this build (not of the profile), e.g. path maps for reproducible objects."""
    src = str(path_type(t.style)(source))
    defines, incs = profile["defines"], [str(i) for i in includes]
    if source.endswith(CUDA_SOURCE):
        extra = [f"-Xcompiler={f}" for f in host_flags]
        if t.style == "gcc":
            extra += reproducible_nvcc_flags(source)
        return [*t.launcher, t.nvcc, "-c", src, "-o", str(obj), *profile["nvcc_flags"], *extra,
                *(f"-D{d}" for d in defines), *(f"-I{i}" for i in incs)]
    if t.style == "msvc":
        return [*t.launcher, t.cxx, "/nologo", "/c", src, f"/Fo{obj}", *profile["cxx_flags"], *host_flags,
                *(f"/D{d}" for d in defines), *(f"/I{i}" for i in incs)]
    return [*t.launcher, t.cxx, "-c", src, "-o", str(obj), *profile["cxx_flags"], *host_flags,
            *(f"-D{d}" for d in defines), *(f"-I{i}" for i in incs)]


def link_command(t: Tools, profile: dict, objects: Sequence[str | PurePath], output: str | PurePath,
                 lib_dirs: Sequence[str | PurePath], *, implib_dir: str | PurePath | None = None) -> list[str]:
    """The argv that links the objects into the extension module ``output`` (``_C.abi3.so`` or
    ``_C.pyd``, as setuptools names it). MSVC's import library and export file go to
    ``implib_dir`` (the build's temp dir) so they never land beside the module in the wheel."""
    libs = link_libraries(profile)
    objs = [str(o) for o in objects]
    if t.style == "msvc":
        out = path_type("msvc")(output)
        implib = path_type("msvc")(implib_dir or out.parent) / (out.name.split(".")[0] + ".lib")
        return [t.linker, *MSVC_LINK_FLAGS, f"/OUT:{out}", f"/IMPLIB:{implib}", *profile["ldflags"], *objs,
                *(f"/LIBPATH:{d}" for d in lib_dirs), *(f"{lib}.lib" for lib in libs)]
    return [t.linker, *objs, "-o", str(output), *profile["ldflags"],
            *(f"-L{d}" for d in lib_dirs), *(f"-l{lib}" for lib in libs)]


def build_environment(profile: dict, cuda_home: str | PurePath) -> dict[str, str]:
    """Variables every compile and link runs with: the profile's (``DISTUTILS_USE_SDK=1`` under
    MSVC: use the developer prompt's cl/link as they are) and the toolkit's root under both
    names torch and NVIDIA's tools read (``CUDA_HOME``, ``CUDA_PATH``), never guessed from PATH."""
    home = str(path_type(style_of(profile))(cuda_home))
    return {**profile.get("env", {}), "CUDA_HOME": home, "CUDA_PATH": home}


def python_requires(cfg: dict) -> str:
    """The wheel's Requires-Python, as setup.py writes it from the build config: the target's
    Python floor from the build record (the factory writes '>=3.9' for its cp39-abi3 targets),
    else the floor of the abi3 tag ('>=3.10' standalone). The two must agree: a cp39-abi3 wheel
    that says '>=3.10' is refused by 3.9 (BuildCommandError)."""
    tag = cfg.get("limited_api", "cp310")
    floor = f">={tag[2]}.{tag[3:]}"
    declared = (cfg.get("record") or {}).get("requires_python") or floor
    if declared != floor:
        raise BuildCommandError(f"the build record's requires_python {declared!r} disagrees with the wheel's "
                                f"{tag}-abi3 tag (expected {floor!r}): fix the build config")
    return declared
