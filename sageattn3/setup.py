"""Build sageattn3's extension: nvcc for csrc/**/*.cu, the host compiler for csrc/**/*.cpp,
compiled in parallel, linked into one ``sageattn3/_C.abi3.so`` (LibTorch stable ABI +
Python limited API: one binary for every CPython >= 3.10 and torch >= the floor).

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
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
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


class CudaBuildExt(build_ext):
    """Compiles each translation unit in its own process (parallel), then links once."""

    def build_extension(self, ext: Extension) -> None:
        import torch

        prof = cfg["profile"]
        cuda_home = Path(cfg["cuda_home"])
        torch_dir = Path(torch.__file__).parent
        includes = [
            # Patched copies of third-party headers (torch, CUTLASS) shadow the originals.
            *([Path(cfg["include_overlay"])] if cfg.get("include_overlay") else []),
            HERE / "csrc",
            torch_dir / "include",
            cuda_home / "include",
            *([Path(cfg["cutlass_include"])] if cfg.get("cutlass_include") else []),
            Path(sysconfig.get_paths()["include"]),
        ]
        tgt_inc = cuda_home / "targets" / "x86_64-linux" / "include"
        if tgt_inc.is_dir():
            includes.append(tgt_inc)
        inc_flags = [f"-I{p}" for p in includes]
        def_flags = [f"-D{d}" for d in prof["defines"]]
        launcher = list(cfg.get("launcher") or [])
        nvcc = str(cuda_home / "bin" / "nvcc")
        cxx = os.environ.get("CXX", "c++")
        objdir = Path(self.build_temp) / "obj"
        jobs = int(cfg.get("jobs") or os.environ.get("MAX_JOBS") or os.cpu_count() or 1)

        def compile_one(src: str) -> str:
            rel = Path(src)
            obj = objdir / rel.with_suffix(rel.suffix + ".o")
            obj.parent.mkdir(parents=True, exist_ok=True)
            if src.endswith(".cu"):
                cmd = [*launcher, nvcc, "-c", str(rel), "-o", str(obj), *prof["nvcc_flags"], *def_flags, *inc_flags]
            else:
                cmd = [*launcher, cxx, "-c", str(rel), "-o", str(obj), *prof["cxx_flags"], *def_flags, *inc_flags]
            print(" ".join(cmd), flush=True)
            res = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"compiling {rel} failed ({res.returncode}):\n{res.stdout}{res.stderr}")
            if res.stderr.strip():
                print(res.stderr, file=sys.stderr, flush=True)
            return str(obj)

        # Longest first: the .cu files with the most templates dominate the wall time.
        sources = sorted(ext.sources, key=lambda s: (HERE / s).stat().st_size, reverse=True)
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = list(pool.map(compile_one, sources))

        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        lib_dirs = [torch_dir / "lib", cuda_home / "lib64", cuda_home / "lib", cuda_home / "targets" / "x86_64-linux" / "lib"]
        link = [cxx, *objects, "-o", str(out), *prof["ldflags"]]
        link += [f"-L{d}" for d in lib_dirs if d.is_dir()]
        link += [f"-l{lib}" for lib in prof["link_libs"]]
        print(" ".join(link), flush=True)
        subprocess.run(link, check=True)


cfg = load_config()
# Every kernel (.cu, torch-free) plus the one torch-facing unit the profile chose.
sources = sorted(p.relative_to(HERE).as_posix() for p in (HERE / "csrc").rglob("*.cu"))
sources.append(cfg["profile"].get("torch_unit", build_profile.STABLE_UNIT))
version = BASE_VERSION + (f"+{cfg['local_label']}" if cfg.get("local_label") else "")

# The build record travels inside the wheel (sageattn3.build_info() reads it).
record = dict(cfg.get("record") or {})
record.update(version=version, requires_torch=cfg["requires_torch"])
(HERE / "sageattn3" / "_build_record.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")

setup(
    version=version,
    install_requires=[cfg["requires_torch"]],
    ext_modules=[Extension("sageattn3._C", sources=sources, py_limited_api=True)],
    cmdclass={"build_ext": CudaBuildExt},
    options={"bdist_wheel": {"py_limited_api": cfg.get("limited_api", "cp310")}},
    package_data={"sageattn3": ["_build_record.json"]},
)
