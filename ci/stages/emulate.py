"""The verify stage of a cross-built wheel: the target machine's CPython (``ci.toolchain.cross.python_root``)
run by qemu-user, with real pip, in fresh virtual environments.

1. A cached environment of the target machine holding the target's torch, dependencies and all,
   installed by the emulated pip, which resolves them for the target machine itself, from a
   wheelhouse of that machine's wheels that this machine's pip downloaded from PyPI first
   (emulated TLS downloads ran at ~1.5 MB/s here; the CUDA 13 torch's dependencies are ~3 GB).
   The host's pip resolves with the target's wheel tags, but evaluates markers for the host:
   only what the target's markers select is downloaded (:func:`download_plan`).
2. A fresh venv that sees that torch through a ``.pth`` file (as ``ci.stages.verify`` does natively);
   ``pip install sageattn3==<version>`` from the generated index served over HTTP on 127.0.0.1,
   pip's own configuration disabled so nothing else can answer.
3. ``import sageattn3`` with no GPU: the build record is this wheel's, every op of the op table
   has a CUDA kernel registered (the dynamic loader resolved every symbol of ``_C`` against the
   target machine's torch and CUDA runtime).
4. The ABI guard: the wheel in an environment of a torch line it does not serve must fail to
   import with its TorchMismatchError.

The cubins of every arch of the record are read from the wheel's extension on the host
(cuobjdump reads any ELF); they do not depend on the machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ci.runtime.log import default_log
from ci.toolchain import cross as crossmod
from ci.runtime.pip_env import pip_environ
from ci.stages.record import BuildRecord
from ci.toolchain.tools import ToolchainError, cache_root
from ci.runtime.errors import FactoryError
from ci.runtime.env import child_environ

# The op probe: the package's own op lists (a test ties them to csrc/torch/ops.h).
OPS_PROBE = (
    "import json, torch, sageattn3; from sageattn3 import _kernels;"
    "has = lambda n: torch._C._dispatch_has_kernel_for_dispatch_key('sageattn3::' + n, 'CUDA');"
    "names = [*_kernels.OUTPUT_WRITING_OPS, *_kernels.ALLOCATING_OPS];"
    "import importlib.metadata as md, platform;"
    "print(json.dumps({'record': sageattn3.build_info(), 'dist': md.version('sageattn3'),"
    " 'machine': platform.machine(), 'torch': torch.__version__, 'torch_cuda': torch.version.cuda,"
    " 'ops': [n for n in names if has(n)], 'missing': [n for n in names if not has(n)]}))"
)


class EmulationError(FactoryError, RuntimeError):
    pass


# The CPU qemu emulates, and what the guest reads about it. qemu-user passes the host's
# /proc/cpuinfo (x86's) and has no MIDR_EL1 sysfs entry; torch 2.14's CPU-feature detection
# (cpuinfo, oneDNN's xbyak_aarch64) crashes the import on those. Under ``-L root`` a path that
# exists in the root is the guest's, so the root gets an aarch64 description of that CPU.
EMULATED_CPU = {"aarch64": ("neoverse-n1", "0x41", "0x3", "0xd0c", "0x1",
                            "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc "
                            "dcpop asimddp")}


def describe_cpu(root: Path, machine: str, cpus: int = 64) -> None:
    """``root/proc/cpuinfo`` and ``root/sys/.../midr_el1`` for the emulated CPU (idempotent)."""
    _, implementer, variant, part, revision, features = EMULATED_CPU[machine]
    blocks = [f"processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: {features}\nCPU implementer\t: {implementer}\n"
              f"CPU architecture: 8\nCPU variant\t: {variant}\nCPU part\t: {part}\nCPU revision\t: {int(revision, 16)}\n"
              for i in range(cpus)]
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc" / "cpuinfo").write_text("\n".join(blocks))
    midr = (int(implementer, 16) << 24) | (int(variant, 16) << 20) | (0xF << 16) | (int(part, 16) << 4) | int(revision, 16)
    for i in range(cpus):
        d = root / "sys" / "devices" / "system" / "cpu" / f"cpu{i}" / "regs" / "identification"
        d.mkdir(parents=True, exist_ok=True)
        (d / "midr_el1").write_text(f"0x{midr:016x}\n")


@dataclass(frozen=True)
class Emulator:
    """qemu-user running the target machine's CPython unpacked in ``python.root``."""

    qemu: Path
    python: crossmod.PythonRoot

    @classmethod
    def for_machine(cls, machine: str) -> "Emulator":
        root = crossmod.python_root(machine)
        describe_cpu(root.root, machine, max(64, os.cpu_count() or 1))
        return cls(crossmod.find_emulator(machine), root)

    def argv(self, interpreter: Path, *args: str) -> list[str]:
        cpu = EMULATED_CPU[self.python.machine][0]
        return [str(self.qemu), "-cpu", cpu, "-L", str(self.python.root), str(interpreter), *args]

    def run(self, interpreter: Path, *args: str, env: dict | None = None, check: bool = False,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.argv(interpreter, *args), capture_output=True, text=True,
                              env=env or child_environ(), timeout=timeout)
        if check and proc.returncode != 0:
            raise EmulationError(f"{' '.join(args[:4])} under {self.qemu.name} exited {proc.returncode}:\n"
                                 f"{(proc.stdout + proc.stderr)[-3000:]}")
        return proc

    def venv(self, where: Path) -> Path:
        """A fresh venv of the emulated Python, without pip (ensurepip would start a second
        emulated process by its path, which the host cannot execute); returns its python."""
        self.run(self.python.python, "-m", "venv", "--without-pip", str(where), check=True)
        return where / "bin" / "python"

    def site_packages(self, interpreter: Path) -> str:
        out = self.run(interpreter, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", check=True)
        return out.stdout.strip()


def pip_wheel() -> Path:
    """A pip wheel to bootstrap environments with (pip runs from its own wheel file)."""
    dest = cache_root() / "cross" / "pip"
    found = sorted(dest.glob("pip-*.whl"))
    if found:
        return found[-1]
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           "--dest", str(dest), "pip"], capture_output=True, text=True, env=pip_environ())
    found = sorted(dest.glob("pip-*.whl"))
    if proc.returncode != 0 or not found:
        raise ToolchainError(f"could not download a pip wheel from PyPI: {proc.stderr.strip()[-500:]}")
    return found[-1]


@dataclass(frozen=True)
class EmulatedTorchEnv:
    root: Path
    torch_version: str
    torch_cuda: str | None

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"


# pip matches each --platform exactly: every manylinux tag a glibc 2.36 aarch64 machine accepts.
def _download_platforms(machine: str) -> list[str]:
    return [f"manylinux_2_{n}_{machine}" for n in range(36, 16, -1)] + [f"manylinux2014_{machine}", f"linux_{machine}"]


def target_markers(machine: str, python_full: str) -> dict[str, str]:
    """The PEP 508 environment markers of CPython ``python_full`` on linux-``machine``: what the
    emulated pip evaluates requirements' markers against."""
    return {"os_name": "posix", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": machine,
            "platform_release": "", "platform_version": "", "platform_python_implementation": "CPython",
            "implementation_name": "cpython", "implementation_version": python_full,
            "python_version": ".".join(python_full.split(".")[:2]), "python_full_version": python_full}


def needed_on_target(report: dict, requirements: list[str], markers: dict[str, str]) -> tuple[list[str], list[str]]:
    """What ``requirements`` need on the target machine, from the host pip's resolution ``report``
    (``pip install --dry-run --report``): the ``name==version`` pins of the packages reachable
    through requirements whose markers hold for ``markers`` (extras followed), and the
    requirements the target needs that the report lacks (markers that hold only on the target).

    The host's pip evaluates markers for the machine it runs on, whatever ``--platform`` says:
    for an aarch64 torch < 2.14 (torch 2.9.1, the ABI guard's foreign line), its
    ``nvidia-*-cu12==...; platform_machine == "x86_64"`` requirements hold on the host, and pip
    fetched their aarch64 wheels (~3 GB) that the emulated pip never installs."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in report.get("install", [])}
    extras: dict[str, set[str]] = {}
    missing: list[str] = []
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in extras and set(req.extras) <= extras[name]:
            continue
        if name not in found:
            missing.append(str(Requirement(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}"
                                           f"{req.specifier}")))
            extras[name] = set(req.extras)
            continue
        extras[name] = extras.get(name, set()) | set(req.extras)
        for spec in found[name].get("requires_dist") or []:
            dep = Requirement(spec)
            if dep.marker is None or any(dep.marker.evaluate({**markers, "extra": e}) for e in ("", *extras[name])):
                todo.append(dep)
    pins = sorted(f"{found[n]['name']}=={found[n]['version']}" for n in extras if n in found)
    return pins, sorted(missing)


def _pip_target_args(machine: str) -> list[str]:
    py = crossmod.TARGET_PYTHON.replace(".", "")
    plats = [a for p in _download_platforms(machine) for a in ("--platform", p)]
    return ["--only-binary=:all:", *plats, "--python-version", crossmod.TARGET_PYTHON, "--implementation", "cp",
            "--abi", f"cp{py}", "--abi", "abi3", "--abi", "none"]


def download_plan(machine: str, requirement: str, python_full: str, *, index_args: tuple[str, ...] = ()) -> list[str]:
    """The ``name==version`` pins :func:`wheelhouse` downloads for ``requirement`` on
    linux-``machine``: the host pip resolves (``--dry-run --report``: metadata only) for the
    target's wheel tags, and :func:`needed_on_target` keeps what the target's markers select. A
    requirement only the target's markers select joins the next resolution (at most 3)."""
    markers = target_markers(machine, python_full)
    asked = [requirement]
    for _ in range(3):
        with tempfile.TemporaryDirectory(prefix="sageattn3-resolve-") as tmp:
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                   "--target", str(Path(tmp) / "unused"), "--report", str(Path(tmp) / "report.json"),
                   *_pip_target_args(machine), *index_args, *asked]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_environ())
            if proc.returncode != 0:
                raise ToolchainError(f"pip could not resolve {' '.join(asked)} for linux-{machine} "
                                     f"(cp{crossmod.TARGET_PYTHON.replace('.', '')}):\n{proc.stderr[-2000:]}")
            report = json.loads((Path(tmp) / "report.json").read_text())
        pins, missing = needed_on_target(report, [requirement], markers)
        if not missing:
            return pins
        asked = [requirement, *missing]
    raise ToolchainError(f"the resolution of {requirement} for linux-{machine} still lacks {missing}, which its "
                         f"markers select on linux-{machine}")


# What a wheelhouse's ``.complete`` marker says about how it was filled; a wheelhouse filled
# otherwise (before the target's markers were applied: ~3 GB of unused wheels) is made again.
WHEELHOUSE_FORMAT = "pins resolved with the target machine's markers"


def wheelhouse(machine: str, requirement: str, python_full: str, log=default_log, *,
               index_args: tuple[str, ...] = ()) -> Path:
    """``requirement`` and what it needs on linux-``machine`` (CPython ``python_full``), as wheels
    downloaded from the configured index (PyPI) by this machine's pip into the cache: exactly
    :func:`download_plan`'s pins, ``--no-deps``. ``index_args``: pip options naming another
    package source (the tests' local one)."""
    dest = cache_root() / "cross" / machine / "wheelhouse" / requirement.replace("==", "-")
    marker = dest / ".complete"
    if marker.exists():
        try:
            if json.loads(marker.read_text()).get("format") == WHEELHOUSE_FORMAT:
                return dest
        except ValueError:
            pass
        log(f"[emulate] {dest} was filled by the host's markers: downloading it again")
    shutil.rmtree(dest, ignore_errors=True)
    log(f"[emulate] resolving {requirement} for linux-{machine} (cp{crossmod.TARGET_PYTHON.replace('.', '')})")
    pins = download_plan(machine, requirement, python_full, index_args=index_args)
    log(f"[emulate] downloading {len(pins)} wheels for linux-{machine}")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *_pip_target_args(machine),
                           *index_args, "--dest", str(dest), *pins], capture_output=True, text=True, env=pip_environ())
    if proc.returncode != 0:
        shutil.rmtree(dest, ignore_errors=True)
        raise ToolchainError(f"could not download {requirement} for linux-{machine} from PyPI:\n{proc.stderr[-2000:]}")
    marker.write_text(json.dumps({"requirement": requirement, "format": WHEELHOUSE_FORMAT, "pins": pins}, indent=1))
    return dest


def torch_env(emu: Emulator, requirement: str, log=default_log) -> EmulatedTorchEnv:
    """A cached environment of the emulated Python with ``requirement`` (``torch==2.14.1``) and
    its dependencies, installed by the emulated pip from :func:`wheelhouse` (``--no-index``: the
    emulated pip resolves the dependencies for the target machine, from those wheels only)."""
    root = cache_root() / "cross" / emu.python.machine / "envs" / requirement.replace("==", "-")
    marker = root / ".complete"
    if marker.exists():
        version, cuda = json.loads(marker.read_text())
        return EmulatedTorchEnv(root, version, cuda)
    shutil.rmtree(root, ignore_errors=True)
    house = wheelhouse(emu.python.machine, requirement, emu.python.version, log=log)
    py = emu.venv(root)
    wheel = pip_wheel()
    t0 = time.monotonic()
    emu.run(py, str(wheel / "pip"), "install", "--quiet", "--no-index", str(wheel), check=True)
    log(f"[emulate] installing {requirement} for linux-{emu.python.machine} with the emulated pip "
        f"(Python {emu.python.version} under {emu.qemu.name})")
    # --no-compile: byte-compiling torch's ~10,000 modules under emulation would take longer than
    # the install; imports write the bytecode of what they load.
    proc = emu.run(py, "-m", "pip", "install", "--quiet", "--no-compile", "--only-binary=:all:", "--no-index",
                   "--find-links", str(house), requirement, env=pip_environ(sources=False))
    if proc.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise ToolchainError(f"the emulated pip could not install {requirement} for linux-{emu.python.machine}:\n"
                             f"{(proc.stdout + proc.stderr)[-2000:]}")
    out = emu.run(py, "-c", "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))",
                  env=child_environ(CUDA_VISIBLE_DEVICES=""), check=True)
    version, cuda = json.loads(out.stdout.strip().splitlines()[-1])
    marker.write_text(json.dumps([version, cuda]))
    log(f"[emulate] torch {version} installed in {time.monotonic() - t0:.0f}s")
    return EmulatedTorchEnv(root, version, cuda)


def fresh_venv_with(emu: Emulator, base: EmulatedTorchEnv, where: Path) -> Path:
    """A fresh venv that sees ``base``'s torch (and its pip) as installed, through a .pth file."""
    py = emu.venv(where)
    Path(emu.site_packages(py), "_base_torch.pth").write_text(emu.site_packages(base.python) + "\n")
    return py


def cubin_archs_of(module: Path) -> list[str]:
    """The sm_* of every cubin in an extension module (cuobjdump -lelf, on the host: it reads
    the ELF of any machine)."""
    from ci.toolchain.tools import cuobjdump

    proc = subprocess.run([str(cuobjdump()), "-lelf", str(module)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulationError(f"cuobjdump -lelf {module.name} failed: {proc.stderr[-1000:]}")
    return sorted(set(re.findall(r"\.(sm_\d+[af]?)\.cubin", proc.stdout)))


def cubin_archs(wheel: Path) -> list[str]:
    """:func:`cubin_archs_of` the wheel's ``sageattn3/_C*.so``."""
    with tempfile.TemporaryDirectory(prefix="sageattn3-cubins-") as tmp, zipfile.ZipFile(wheel) as z:
        libs = [n for n in z.namelist() if n.startswith("sageattn3/_C") and n.endswith(".so")]
        if len(libs) != 1:
            raise EmulationError(f"{wheel.name}: expected one sageattn3/_C*.so, found {libs}")
        return cubin_archs_of(Path(z.extract(libs[0], tmp)))


@dataclass
class EmulatedVerifyReport:
    wheel: str
    machine: str
    python: str
    torch: str
    ops: list[str] = field(default_factory=list)
    cubins: list[str] = field(default_factory=list)
    abi_guard: str = "not run"
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def check_import(emu: Emulator, vpy: Path, rec: BuildRecord) -> dict:
    proc = emu.run(vpy, "-c", OPS_PROBE, env=child_environ(CUDA_VISIBLE_DEVICES=""))
    if proc.returncode != 0:
        raise EmulationError(f"{rec.wheel}: `import sageattn3` failed under {emu.qemu.name}:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["machine"] != emu.python.machine:
        raise EmulationError(f"{rec.wheel}: the emulated Python reports machine {got['machine']}")
    if got["dist"] != rec.version or got["record"].get("target") != rec.target:
        raise EmulationError(f"{rec.wheel}: pip installed {got['dist']} whose record names {got['record'].get('target')}")
    if got["missing"] or not got["ops"]:
        raise EmulationError(f"{rec.wheel}: ops without a CUDA kernel after import: {got['missing']}")
    return got


def check_guard(emu: Emulator, foreign: EmulatedTorchEnv, vpy: Path, rec: BuildRecord) -> str:
    proc = emu.run(vpy, "-c", "import sageattn3", env=child_environ(CUDA_VISIBLE_DEVICES=""))
    msg = proc.stderr
    want = [rec.variant, foreign.torch_version, "pip install", "TorchMismatchError"]
    missing = [w for w in want if w not in msg]
    if proc.returncode == 0 or missing or "undefined symbol" in msg:
        raise EmulationError(f"{rec.wheel}: imported into torch {foreign.torch_version} without the ABI guard's "
                             f"message (lacks {missing}):\n{msg[-2000:]}")
    return next(ln for ln in reversed(msg.splitlines()) if "TorchMismatchError" in ln)


def verify(rec: BuildRecord, wheel: Path, index_dir: Path, machine: str, *, torch_requirement: str,
           foreign_requirement: str | None, log=default_log) -> EmulatedVerifyReport:
    """Steps 1-4 of the module docstring for ``wheel`` (of ``rec``) served from ``index_dir``."""
    from ci.stages.verify import serve
    from ci.toolchain.variant import cuda_tag, torch_line

    timings: dict[str, float] = {}

    def timed(name: str, t0: float) -> None:
        timings[name] = round(time.monotonic() - t0, 1)

    emu = Emulator.for_machine(machine)
    t0 = time.monotonic()
    base = torch_env(emu, torch_requirement, log=log)
    timed("torch env", t0)
    if base.torch_cuda != rec.cuda:
        raise EmulationError(f"the emulated verify torch is {base.torch_version} (CUDA {base.torch_cuda}), not a "
                             f"CUDA {rec.cuda} build")
    report = EmulatedVerifyReport(rec.wheel, machine, emu.python.version, base.torch_version)
    with serve(index_dir) as url, tempfile.TemporaryDirectory(prefix="sageattn3-emulated-") as tmp:
        t0 = time.monotonic()
        vpy = fresh_venv_with(emu, base, Path(tmp) / "own")
        page = f"{url}/{cuda_tag(rec.cuda)}/torch{torch_line(base.torch_version)}/"
        proc = emu.run(vpy, "-m", "pip", "install", "--no-cache-dir", f"sageattn3=={rec.version}",
                       "--index-url", page, env=pip_environ(sources=False))
        if proc.returncode != 0:
            raise EmulationError(f"{rec.wheel}: the emulated pip could not install it from {page}:\n"
                                 f"{(proc.stdout + proc.stderr)[-3000:]}")
        installed = " ".join(ln for ln in proc.stdout.splitlines() if ln.startswith("Successfully installed"))
        if "torch-" in installed or rec.version not in installed:
            raise EmulationError(f"{rec.wheel}: the emulated pip installed {installed!r}")
        timed("install", t0)
        log(f"[emulate] pip (linux-{machine}, Python {emu.python.version}): {installed}")
        t0 = time.monotonic()
        got = check_import(emu, vpy, rec)
        timed("import", t0)
        report.ops = got["ops"]
        log(f"[emulate] import sageattn3 into torch {got['torch']} on {got['machine']}: {len(got['ops'])} ops registered")
        if foreign_requirement:
            t0 = time.monotonic()
            foreign = torch_env(emu, foreign_requirement, log=log)
            if rec.variant_value.serves(foreign.torch_version, foreign.torch_cuda):
                raise EmulationError(f"{foreign_requirement} is served by {rec.variant}: choose a foreign torch line")
            fpy = fresh_venv_with(emu, foreign, Path(tmp) / "foreign")
            proc = emu.run(fpy, "-m", "pip", "install", "--no-cache-dir", "--no-deps", f"sageattn3=={rec.version}",
                           "--index-url", f"{url}/{cuda_tag(rec.cuda)}/", env=pip_environ(sources=False))
            if proc.returncode != 0:
                raise EmulationError(f"{rec.wheel}: could not install into the foreign-torch venv:\n{proc.stderr[-2000:]}")
            line = check_guard(emu, foreign, fpy, rec)
            timed("abi guard", t0)
            report.abi_guard = f"torch {foreign.torch_version}: {line}"
            log(f"[emulate] ABI guard with torch {foreign.torch_version}: {line[:200]}")
    report.cubins = cubin_archs(wheel)
    report.timings = timings
    return report
