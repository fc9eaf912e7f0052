"""Builds the two test-flavour wheels of the MSVC pointer-param comparison with plain pip (no
factory) on a machine with nvcc and torch, in parallel, and installs each into its own --target:

    python3 tests/gpu/msvc_patch_build.py WORKDIR [JOBS_EACH [PAYLOAD_DIR]]
    -> WORKDIR/plain/site, WORKDIR/patched/site (+ wheels and build logs)

Both come from copies of ./sageattn3 (or PAYLOAD_DIR, a snapshot of it); the patched copy gets patches/msvc-pointer-params.patch
through ci.toolchain.patches.apply (pin check, then `git apply`). Each build gets a build config equal to
setup.py's standalone test-flavour defaults (sm_90a, SAGEATTN3_MMA_MODEL) plus the record's
`patches` list, so sageattn3.build_info() says which wheel is which."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ci.toolchain import patches as patchmod  # noqa: E402

PATCH = "msvc-pointer-params"


def build_config(src: Path, patch_names: list[str], jobs: int) -> dict:
    import torch

    sys.path.insert(0, str(src))
    import build_profile

    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    out = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, check=True).stdout
    cuda = re.search(r"release (\d+\.\d+)", out).group(1)
    major, minor = cuda.split(".")
    archs = ["sm_90a"]
    prof = build_profile.profile(platform="linux", cuda=cuda, archs=archs, torch_version=torch.__version__,
                                 stable_abi_floor="2.10", mma_model=True)
    return {
        "profile": prof, "cuda_home": str(home), "jobs": jobs, "launcher": [],
        "local_label": f"cu{major}{minor}.torch2.10.stable.mmamodel", "requires_torch": "torch>=2.10",
        "record": {"cuda": cuda, "archs": archs, "torch_build": torch.__version__, "mma_model": True,
                   "variant": f"cu{major}{minor}.torch2.10.stable", "patches": patch_names},
    }


def prepare(work: Path, flavour: str, jobs: int, payload: Path) -> Path:
    """The flavour's source copy (patched or not) and its build config."""
    base = work / flavour
    src = base / "src"
    if base.exists():
        shutil.rmtree(base)
    shutil.copytree(payload, src, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "*.so", "_build_record.json"))
    names: list[str] = []
    if flavour == "patched":
        (p,) = [p for p in patchmod.load_manifest() if p.name == PATCH]
        patchmod.apply(p, {"src": src}, base / "overlay")
        names = [p.name]
    cfg = base / "build-config.json"
    cfg.write_text(json.dumps(build_config(src, names, jobs), indent=1))
    return base


def build(base: Path) -> Path:
    src, cfg = base / "src", base / "build-config.json"
    env = {**os.environ, "SAGEATTN3_BUILD_CONFIG": str(cfg), "SAGEATTN3_MMA_MODEL": "1"}
    log = base / "build.log"
    with log.open("w") as fh:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v", str(src),
                        "-w", str(base / "wheel")], env=env, stdout=fh, stderr=subprocess.STDOUT, check=True)
        (whl,) = (base / "wheel").glob("sageattn3-*.whl")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                        str(base / "site"), str(whl)], stdout=fh, stderr=subprocess.STDOUT, check=True)
    return base / "site"


def build_flavours(args: list[str], flavours: tuple[str, ...], prepare_one) -> None:
    """`WORK [JOBS_EACH [PAYLOAD_DIR]]`: prepare each flavour's copy (prepare_one(work, flavour,
    jobs, payload) -> its base dir) and build them in parallel; prints each --target site."""
    work = Path(args[0]).resolve()
    jobs = int(args[1]) if len(args) > 1 else max(1, (os.cpu_count() or 2) // len(flavours))
    work.mkdir(parents=True, exist_ok=True)
    payload = Path(args[2]).resolve() if len(args) > 2 else ROOT / "sageattn3"
    bases = [prepare_one(work, f, jobs, payload) for f in flavours]
    with ThreadPoolExecutor(len(bases)) as pool:
        for site in pool.map(build, bases):
            print(site)


def main() -> None:
    build_flavours(sys.argv[1:], ("plain", "patched"), prepare)


if __name__ == "__main__":
    main()
