"""A local stand-in for the manylinux_2_28 image, so the pinned cibuildwheel runs here for real.

No image registry is reachable from this machine, so ``quay.io/pypa/manylinux_2_28_*`` cannot be
pulled. This module builds an image with the layout cibuildwheel expects of a manylinux image,
from Debian's packages and this machine's own Pythons, and imports it into podman:

    1. ``debootstrap --variant=minbase bookworm`` from the Debian mirror apt is configured with;
    2. in a chroot: python3, python3-dev, python3-venv, build-essential, ca-certificates, and this
       machine's extra CA certificates (package traffic may pass a TLS-inspecting proxy);
    3. this machine's CPython builds (pyenv) copied in at their own paths, each linked as
       ``/opt/python/cpXY-cpXY`` (cibuildwheel runs ``/opt/python/<id>/bin/python`` and checks
       that ``which python``/``which pip`` resolve there); ``/opt/python/cp39-cp39`` is also
       cibuildwheel's helper interpreter for before-all;
    4. ``/etc/pip.conf`` and the image's REQUESTS_CA_BUNDLE / SSL_CERT_FILE pointing pip and
       Python's ssl at the system CA bundle (the factory's own pip calls skip pip.conf);
    5. ``tar | podman import`` as ``localhost/sageattn3-manylinux-standin:<recipe hash>``; the
       tag changes whenever the recipe (this file) or the Pythons change, so a cached image is
       reused only while it is what this file would build.

Where it differs from manylinux_2_28 (AlmaLinux 8): glibc 2.36 instead of 2.28, so auditwheel
can only give ``manylinux_2_36`` (torch's wheels and the release's are ``manylinux_2_28``); no
``dnf`` (the before-all of a CUDA 12.x target, NVIDIA's RHEL 8 packages, cannot run: only
CUDA 13.x targets, whose toolkit comes from PyPI); its Pythons are this machine's pyenv builds,
not manylinux's (same versions' ABI, other patch releases), and free-threaded builds are absent.

``python -m ci.release.standin_image [--print-name]`` builds (or finds) the image and prints its name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from ci.runtime.errors import FactoryError
from ci.runtime.env import child_environ
from ci.runtime.log import default_log

IMAGE_REPO = "localhost/sageattn3-manylinux-standin"
SUITE = "bookworm"
DEBIAN_PACKAGES = ("python3", "python3-dev", "python3-venv", "build-essential", "ca-certificates")
# What the image needs from Debian's packages on the host (installed when missing, as root).
HOST_PACKAGES = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap"}
# The Pythons the image holds: 3.9 and 3.10 (the matrix's Python floors: cibuildwheel's build
# interpreters) and 3.12 (ci/cibuildwheel.toml's SAGEATTN3_FACTORY_PYTHON).
PYTHONS = ("3.9", "3.10", "3.12")
FALLBACK_MIRROR = "http://deb.debian.org/debian"
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")
# The image's environment: pip (and Python's ssl) trust the system bundle, which holds this
# machine's extra CAs; the factory's own pip calls ignore pip's configuration files.
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
IMAGE_ENV = {"REQUESTS_CA_BUNDLE": CA_BUNDLE, "SSL_CERT_FILE": CA_BUNDLE}
# Bump when build_image's steps change: the image's tag is a hash of this, the suite, the
# packages and the Pythons, so a cached image is reused only while it is what would be built.
RECIPE = "2"


class StandinImageError(FactoryError, RuntimeError):
    pass


def _run(cmd: list[str], log=default_log, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise StandinImageError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n"
                                + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))
    return proc


def cannot_run_here() -> str:
    """Why the pinned cibuildwheel cannot run a Linux job on this machine ("" when it can): the
    image is built with debootstrap as root, and podman, runc and debootstrap come from Debian's
    packages when missing."""
    if not sys.platform.startswith("linux"):
        return "cibuildwheel's Linux containers need a Linux machine"
    if os.geteuid() != 0:
        return "building the stand-in manylinux image (debootstrap) needs root"
    missing = [exe for exe in HOST_PACKAGES if not shutil.which(exe)]
    if missing and not shutil.which("apt-get"):
        return f"{', '.join(missing)} missing and no apt-get to install them (Debian/Ubuntu)"
    return ""


def ensure_host_tools(log=default_log) -> None:
    """podman, runc and debootstrap from Debian's packages (apt-get, as root) when missing."""
    missing = [pkg for exe, pkg in HOST_PACKAGES.items() if not shutil.which(exe)]
    if not missing:
        return
    if not shutil.which("apt-get") or os.geteuid() != 0:
        raise StandinImageError(f"{', '.join(missing)} missing: install them (Debian: apt-get install -y "
                                f"{' '.join(missing)}), or run as root on Debian so this installs them")
    log(f"[image] apt-get install {' '.join(missing)}")
    env = child_environ(DEBIAN_FRONTEND="noninteractive")
    _run(["apt-get", "update", "-qq"], env=env)
    _run(["apt-get", "install", "-y", "-qq", *missing], env=env)


def debian_mirror() -> str:
    """The first Debian mirror apt is configured with (deb822 or one-line sources)."""
    sources = [*Path("/etc/apt/sources.list.d").glob("*.sources"), Path("/etc/apt/sources.list"),
               *Path("/etc/apt/sources.list.d").glob("*.list")]
    for f in sources:
        if not f.is_file():
            continue
        for line in f.read_text(errors="replace").splitlines():
            line = line.strip()
            if line.startswith("URIs:"):
                for uri in line.split()[1:]:
                    if uri.rstrip("/").endswith("/debian"):
                        return uri
            elif line.startswith("deb ") and "security" not in line:
                uri = next((w for w in line.split()[1:] if "://" in w), "")
                if uri.rstrip("/").endswith("/debian"):
                    return uri
    return FALLBACK_MIRROR


def host_pythons(versions: tuple[str, ...] = PYTHONS) -> dict[str, Path]:
    """The installation prefix of each of this machine's CPython ``versions`` (sys.base_prefix
    of the interpreter ci.toolchain.tools finds)."""
    from ci.toolchain.tools import find_python

    out = {}
    for v in versions:
        exe = find_python(v)
        prefix = subprocess.run([str(exe), "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                                text=True, check=True).stdout.strip()
        out[v] = Path(prefix)
    return out


def image_name(pythons: dict[str, Path] | None = None) -> str:
    """The image's name: the repository plus a hash of the recipe and of the Pythons it copies."""
    pythons = pythons if pythons is not None else host_pythons()
    h = hashlib.sha256(f"{RECIPE}\n{SUITE}\n{' '.join(DEBIAN_PACKAGES)}\n".encode())
    for v, prefix in sorted(pythons.items()):
        h.update(f"{v}={prefix}\n".encode())
    return f"{IMAGE_REPO}:{h.hexdigest()[:12]}"


def image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name], capture_output=True).returncode == 0


def _chroot(root: Path, script: str) -> None:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive",
           "HOME": "/root", "LANG": "C.UTF-8"}
    _run(["chroot", str(root), "/bin/sh", "-euc", script], env=env)


def build_image(log=default_log, *, workdir: Path | None = None) -> str:
    """The stand-in image (built once per recipe; later calls find it): returns its name."""
    ensure_host_tools(log=log)
    pythons = host_pythons()
    name = image_name(pythons)
    if image_exists(name):
        return name
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sageattn3-standin-", dir=workdir) as tmp:
        root = Path(tmp) / "rootfs"
        mirror = debian_mirror()
        log(f"[image] debootstrap {SUITE} from {mirror}")
        _run(["debootstrap", "--variant=minbase", SUITE, str(root), mirror])
        for f in sorted(EXTRA_CA_DIR.glob("*.crt")) if EXTRA_CA_DIR.is_dir() else []:
            dest = root / EXTRA_CA_DIR.relative_to("/") / f.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
        for conf in ("/etc/resolv.conf",):
            if Path(conf).is_file():
                shutil.copy2(conf, root / conf.lstrip("/"))
        log(f"[image] apt-get install {' '.join(DEBIAN_PACKAGES)} (chroot)")
        _chroot(root, "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                      f"{' '.join(DEBIAN_PACKAGES)} >/dev/null && update-ca-certificates >/dev/null && "
                      "apt-get clean && rm -rf /var/lib/apt/lists/*")
        (root / "etc" / "pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
        opt = root / "opt" / "python"
        opt.mkdir(parents=True, exist_ok=True)
        for v, prefix in sorted(pythons.items()):
            dest = root / prefix.relative_to("/")
            log(f"[image] Python {v}: {prefix} -> /opt/python/cp{v.replace('.', '')}-cp{v.replace('.', '')}")
            shutil.copytree(prefix, dest, symlinks=True, dirs_exist_ok=True)
            tag = "cp" + v.replace(".", "")
            (opt / f"{tag}-{tag}").symlink_to(prefix)
            bindir = dest / "bin"
            # `python` and `pip` under bin/ (cibuildwheel runs and checks those names)
            if not (bindir / "python").exists():
                (bindir / "python").symlink_to(f"python{v}")
            if not (bindir / "pip").exists():
                (bindir / "pip").symlink_to(f"pip{v}")
        log(f"[image] podman import {name}")
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        changes = [a for k, v in IMAGE_ENV.items() for a in ("--change", f"ENV {k}={v}")]
        imp = subprocess.run(["podman", "import", *changes, "-", name], stdin=tar.stdout, capture_output=True,
                             text=True)
        tar.stdout.close()
        if tar.wait() != 0 or imp.returncode != 0:
            raise StandinImageError(f"podman import {name} failed: {imp.stderr.strip()[-2000:]}")
    log(f"[image] {name} built in {time.monotonic() - t0:.0f}s")
    return name
