"""Build sageattn3's extension: nvcc for csrc/**/*.cu, the host compiler for the one
torch-facing unit the profile names, compiled in parallel, linked into one
``sageattn3/_C.abi3.so`` (Linux, GCC style) or ``sageattn3/_C.pyd`` (Windows, MSVC: cl and link)
with the Python limited API: one binary for every CPython from the target's floor on. The
command lines come from ``build_commands`` (pure functions of the profile and the paths).

Needs torch (headers and libraries) in the build environment, so build with
``pip wheel --no-build-isolation ./sageattn3`` and a CUDA toolkit (CUDA_HOME).

Inputs, all optional:
- SAGEATTN3_BUILD_CONFIG: a JSON file (written by the factory) with the flag profile, the
  version label, the torch requirement, the compiler launcher and the build record.
- without it: CUDA_HOME (or nvcc on PATH), SAGEATTN3_ARCHS ("sm_120a;sm_121a"),
  SAGEATTN3_STABLE_ABI_FLOOR ("2.10"), MAX_JOBS.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build_commands as bc  # noqa: E402
import build_profile  # noqa: E402

BASE_VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "sageattn3" / "_version.py").read_text()).group(1)


def _cuda_home() -> Path:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return Path(home)
    nvcc = shutil.which("nvcc")
    if not nvcc:
        sys.exit("sageattn3: no CUDA toolkit: set CUDA_HOME to a CUDA >= 12.8 install (nvcc in $CUDA_HOME/bin)")
    return Path(nvcc).resolve().parent.parent


def _standalone_config() -> dict:
    """Defaults for `pip wheel ./sageattn3`: archs from the toolkit, stable ABI floor 2.10."""
    import torch

    home = _cuda_home()
    out = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, check=True).stdout
    cuda = re.search(r"release (\d+\.\d+)", out).group(1)
    mma_model = os.environ.get("SAGEATTN3_MMA_MODEL") == "1"
    archs = [a for a in os.environ.get("SAGEATTN3_ARCHS", "").split(";") if a] or (
        ["sm_90a"] if mma_model else build_profile.default_archs(cuda)
    )
    floor = os.environ.get("SAGEATTN3_STABLE_ABI_FLOOR", "2.10")
    line = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    # SAGEATTN3_BINDINGS=classic: the classic unit even where the stable one applies (to compare
    # the two builds' outputs on one torch); the wheel is then a per-torch-line one.
    stable = build_profile._mm(line) >= build_profile._mm(floor) and os.environ.get("SAGEATTN3_BINDINGS") != "classic"
    prof = build_profile.profile(
        platform="windows" if os.name == "nt" else "linux", cuda=cuda, archs=archs,
        torch_version=torch.__version__, stable_abi_floor=floor if stable else None, mma_model=mma_model,
    )
    major, minor = cuda.split(".")
    variant = f"cu{major}{minor}.torch{floor}.stable" if stable else f"cu{major}{minor}.torch{line}"
    return {
        "profile": prof,
        "cuda_home": str(home),
        "local_label": variant + (".mmamodel" if mma_model else ""),
        "requires_torch": f"torch>={floor}" if stable else f"torch>={line},<{line.split('.')[0]}.{int(line.split('.')[1]) + 1}",
        "launcher": [],
        "record": {
            "cuda": cuda, "archs": archs, "torch_build": torch.__version__,
            "variant": variant, "mma_model": mma_model,
        },
    }


def load_config() -> dict:
    path = os.environ.get("SAGEATTN3_BUILD_CONFIG")
    if path:
        return json.loads(Path(path).read_text())
    return _standalone_config()


ROOTS = Path("build") / "roots"
# Wheel file times when the caller gives none (bdist_wheel reads it): 1980-01-01, the zip
# format's earliest, so two builds of the same sources give the same bytes.
DEFAULT_SOURCE_DATE_EPOCH = "315532800"


def _relative_roots(name: str, path: Path) -> Path:
    """``path`` as the compilers see it, relative to HERE: itself when it lies inside HERE,
    else through the symlink ``build/roots/<name>`` (made here, replaced on every build)."""
    path = Path(path).resolve()
    if path.is_relative_to(HERE):
        return path.relative_to(HERE)
    link = HERE / ROOTS / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(path, target_is_directory=True)
    return ROOTS / name


def compile_units(units: list[str], command, run_prefix: list[str], env: dict[str, str], jobs: int) -> list[str]:
    """Compile each unit in its own process, ``jobs`` at a time, the longest first (the .cu files
    with the most templates dominate the wall time); ``command(unit)`` gives its object and its
    compile command. One line per finished unit, which the factory shows as progress. Returns
    the objects, longest unit first."""

    def compile_one(src: str) -> str:
        obj, cmd = command(src)
        print(" ".join(cmd), flush=True)
        res = subprocess.run([*run_prefix, *cmd], cwd=HERE, env=env, capture_output=True, text=True,
                             errors="replace")
        if res.returncode != 0:
            raise RuntimeError(f"compiling {src} failed ({res.returncode}):\n{res.stdout}{res.stderr}")
        if res.stderr.strip():
            print(res.stderr, file=sys.stderr, flush=True)
        return obj

    sources = sorted(units, key=lambda s: (HERE / s).stat().st_size, reverse=True)
    t0, done, lock = time.monotonic(), [], threading.Lock()

    def compile_counted(src: str) -> str:
        obj = compile_one(src)
        with lock:  # one line per finished unit: the factory shows these as progress
            done.append(src)
            print(f"sageattn3: compiled {len(done)}/{len(sources)} {src} ({time.monotonic() - t0:.0f} s)", flush=True)
        return obj

    print(f"sageattn3: compiling {len(sources)} units, {max(1, jobs)} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(compile_counted, sources))


class CudaBuildExt(build_ext):
    """Compiles each translation unit in its own process (parallel), then links once, with the
    commands ``build_commands`` makes for the profile's compiler: GCC-style on Linux, MSVC
    (cl, link, CUDA's lib\\x64, a .pyd) on Windows."""

    def build_extension(self, ext: Extension) -> None:
        prof = cfg["profile"]
        style = bc.style_of(prof)
        cuda_home = Path(cfg["cuda_home"])
        # A cross build (the config's "cross" block) reads the target machine's torch, CUDA runtime
        # and Python headers from its sysroot; nvcc stays this machine's, the host compiler is the
        # profile's cross g++. Everything else is the native path.
        cross = cfg.get("cross")
        # A Windows build on Linux (the cross block's "wine"): the same MSVC commands, run by the
        # wine loader, with every absolute path as wine names it (Z:\...).
        wine = (cross or {}).get("wine")
        if cross:
            torch_dir, machine = Path(cross["torch_dir"]), cross["machine"]
            cuda_root, python_include = Path(cross["cuda_root"]), Path(cross["python_include"])
        else:
            import torch

            torch_dir, machine = Path(torch.__file__).parent, platform.machine().lower()
            cuda_root, python_include = cuda_home, Path(sysconfig.get_paths()["include"])
        # Linux: every include root by a path relative to this directory (the compilers' cwd), so
        # no build-machine path reaches the binary (__FILE__ in headers) and the compile
        # commands are the same wherever the payload is staged.
        # A Windows build on Linux (wine) too: cl.exe and nvcc.exe then name no path of this machine.
        root = _relative_roots if style == "gcc" or wine else (lambda name, path: path)  # noqa: E731
        overlay = cfg.get("include_overlay")
        includes = bc.include_dirs(
            style, csrc=root("csrc", HERE / "csrc"), torch_dir=root("torch", torch_dir),
            torch_subdirs=prof.get("torch_include_subdirs"), cuda_home=root("cuda", cuda_root),
            python_include=root("python", python_include),
            cutlass=cfg.get("cutlass_include") and root("cutlass", Path(cfg["cutlass_include"])),
            overlay=overlay and root("overlay", Path(overlay)), machine=machine,
        )
        if cross:  # what nvcc adds by itself natively: CCCL, then nvcc's own (fatbinary) headers
            includes += [root("cuda", cuda_root) / "include" / "cccl", root("nvcc", cuda_home) / "include"]
        here = (lambda d: HERE / bc.host_path(d)) if wine else (lambda d: HERE / d)
        includes = [d for d in includes if here(d).is_dir()]  # e.g. targets/<arch>-linux: NVIDIA's layout only
        if wine:  # the toolkit as the Windows programs name it (the factory's drive mapping)
            cuda_home = bc.PureWindowsPath(wine["cuda_home"])
        env = {**os.environ, **bc.build_environment(prof, cuda_home)}
        run_prefix: list[str] = []
        if wine:
            env.update(wine["env"])
            run_prefix = [wine["loader"]]
            cxx, linker = wine["cl"], wine["link"]
        elif style == "msvc":  # absolute cl.exe and link.exe of the developer environment
            try:
                cxx, linker = bc.find_msvc_tools(env)
            except bc.BuildCommandError as e:
                sys.exit(f"sageattn3: {e}")
        else:
            cxx, linker = prof.get("host_compiler") or os.environ.get("CXX"), None
        tools = bc.tools(style, cuda_home, cxx=cxx, linker=linker, launcher=() if wine else cfg.get("launcher") or ())
        # Objects by paths relative to HERE, where every command runs (setup.py may run elsewhere).
        objdir = Path(os.path.relpath(Path(self.build_temp).resolve(), HERE)) / "obj"
        jobs = int(cfg.get("jobs") or os.environ.get("MAX_JOBS") or os.cpu_count() or 1)

        def command(src: str) -> tuple[str, list[str]]:
            obj = bc.object_path(style, objdir, src)
            here(obj).parent.mkdir(parents=True, exist_ok=True)
            return str(obj), bc.compile_command(tools, prof, src, obj, includes)

        objects = compile_units(ext.sources, command, run_prefix, env, jobs)

        # setuptools names the module: _C.abi3.so on Linux, _C.pyd on Windows (abi3 or not).
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        python_prefix = Path(cross["python_prefix"]) if cross and cross.get("python_prefix") else sys.base_exec_prefix
        lroot = (lambda name, path: bc.wine_path(path)) if wine else (lambda name, path: path)  # noqa: E731
        lib_dirs = bc.library_dirs(style, torch_dir=lroot("torch", torch_dir), cuda_home=lroot("cuda", cuda_root),
                                   python_prefix=lroot("python", python_prefix), machine=machine)
        # Import libraries made for DLLs the build machine lacks (a Windows build on Linux: the
        # CUDA-side torch DLLs and python3.dll; the build record names each), searched last.
        lib_dirs += [lroot("standins", Path(d)) for d in (cross or {}).get("standin_lib_dirs", [])]
        link = bc.link_command(tools, prof, objects, lroot("out", out), [d for d in lib_dirs if here(d).is_dir()],
                               implib_dir=objdir)
        print(" ".join(link), flush=True)
        res = subprocess.run([*run_prefix, *link], cwd=HERE, env=env, capture_output=True, text=True, errors="replace")
        print(res.stdout + res.stderr, flush=True)
        if res.returncode != 0:
            raise RuntimeError(f"linking {out.name} failed ({res.returncode})")

    def get_ext_filename(self, ext_name: str) -> str:
        # A Windows build on Linux: setuptools would name the module after this Python (.so).
        if (cfg.get("cross") or {}).get("wine"):
            return os.path.join(*ext_name.split(".")) + ".pyd"
        return super().get_ext_filename(ext_name)


def python_requires(cfg: dict) -> str:
    """The wheel's Requires-Python (build_commands.python_requires: the build record's floor,
    which must be the abi3 tag's)."""
    try:
        return bc.python_requires(cfg)
    except bc.BuildCommandError as e:
        sys.exit(f"sageattn3: {e}")


cfg = load_config()
os.environ.setdefault("SOURCE_DATE_EPOCH", str(cfg.get("source_date_epoch") or DEFAULT_SOURCE_DATE_EPOCH))
# Every kernel (.cu, torch-free) plus the one torch-facing unit the profile chose.
sources = bc.translation_units(cfg["profile"], (p.relative_to(HERE).as_posix() for p in (HERE / "csrc").rglob("*")))
version = BASE_VERSION + (f"+{cfg['local_label']}" if cfg.get("local_label") else "")

# The build record travels inside the wheel (sageattn3.build_info() reads it).
record = dict(cfg.get("record") or {})
record.update(version=version, requires_torch=cfg["requires_torch"], requires_python=python_requires(cfg))
(HERE / "sageattn3" / "_build_record.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")

setup(
    version=version,
    install_requires=[cfg["requires_torch"]],
    python_requires=record["requires_python"],
    ext_modules=[Extension("sageattn3._C", sources=sources, py_limited_api=True)],
    cmdclass={"build_ext": CudaBuildExt},
    options={"bdist_wheel": {"py_limited_api": cfg.get("limited_api", "cp310"),
                             **({"plat_name": cfg["cross"]["plat_name"]} if cfg.get("cross") else {})}},
    package_data={"sageattn3": ["_build_record.json"]},
)
