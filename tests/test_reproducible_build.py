"""Reproducible binaries: the payload built twice, from two checkouts at different paths, with
the factory's build config, the real nvcc and host compiler and no compiler cache, gives
byte-identical wheels, before and after auditwheel's repair, whose extension is stripped and
holds no path of the build machine, in its host code nor in its device code (the cubins).

To fit the CI budget both builds compile for one arch (sm_120a); they run one after the other,
so an output that depends on the clock differs. Everything else is the build a release runs.
Repair alone, cheaply: the same raw wheel (a tiny real shared object) repaired twice, seconds
apart, gives the same bytes."""

import dataclasses
import json
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from ci.stages.build import REPO, build_config
from ci.stages.resolve import resolve_toolchain
from ci.payload.interface import PAYLOAD
from ci.runtime.env import FactoryEnv
from ci.stages.repair import repair
from ci.toolchain.targets import Matrix
from ci.toolchain.tools import cache_root, cuobjdump
from conftest_publish import build_wheel

TARGET = "linux-x86_64-cu130-torch2.10-stable"
needs_nvcc = pytest.mark.skipif(not shutil.which("nvcc"), reason="needs a CUDA 13.0 toolkit")


def stage(root: Path) -> Path:
    shutil.copytree(PAYLOAD, root, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so",
                                                                  "_build_record.json"))
    return root


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repro")
    matrix = Matrix.load()
    target = dataclasses.replace(matrix.target(TARGET), archs=("sm_120a",))
    tc = dataclasses.replace(resolve_toolchain(target, matrix), launcher=())  # every object compiled, none cached
    checkouts = [stage(tmp / "a" / "sageattn3"), stage(tmp / "somewhere" / "much" / "deeper" / "src")]
    wheels = []
    for root in checkouts:  # one after the other: side by side, a clock-dependent output would agree
        cfg = root.parent / "build-config.json"
        cfg.write_text(json.dumps(build_config(tc, matrix, root / "build" / "include-overlay", jobs=2)))
        env = {**os.environ, "SAGEATTN3_BUILD_CONFIG": str(cfg), "CUDA_HOME": str(tc.cuda.home),
               "PATH": f"{tc.cuda.home / 'bin'}{os.pathsep}{os.environ['PATH']}"}
        env.pop("SOURCE_DATE_EPOCH", None)  # the payload's own default makes the zip times
        with (root.parent / "build.log").open("w") as log:
            rc = subprocess.run([str(tc.env.python), "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                                 "-w", str(root.parent / "wheel"), str(root)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, timeout=3000).returncode
        text = (root.parent / "build.log").read_text()
        assert rc == 0, text[-4000:]
        (wheel,) = (root.parent / "wheel").glob("*.whl")
        wheels.append(wheel)
    # and what ships: each repaired by auditwheel (which re-zips it), a moment apart
    repaired = []
    for wheel in wheels:
        repaired.append(repair(wheel, wheel.parent.parent / "repaired", "linux", settings=FactoryEnv.from_environ(),
                               log=lambda *_: None))
        time.sleep(2)
    return tmp, tc, checkouts, wheels, repaired, text


def differences(a: Path, b: Path) -> list[str]:
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        return [i.filename for i, j in zip(za.infolist(), zb.infolist())
                if (i.filename, i.date_time, i.external_attr, za.read(i)) != (j.filename, j.date_time, j.external_attr, zb.read(j))]


@needs_nvcc
def test_two_checkouts_give_byte_identical_wheels(two_builds):
    _, _, checkouts, wheels, repaired, log = two_builds
    for pair in (wheels, repaired):  # as built, and as shipped
        assert pair[0].name == pair[1].name and "manylinux" in repaired[0].name
        digests = [hashlib.sha256(w.read_bytes()).hexdigest() for w in pair]
        assert digests[0] == digests[1], f"{pair[0].name} differs between the checkouts: {differences(*pair)}"
    # what made that so: relative include roots and sources, no compiler cache
    assert "-Ibuild/roots/torch/include" in log and "-Xcudafe --orig_src_path_name=csrc/attn/attn_launch.cu" in log
    assert str(checkouts[1]) not in " ".join(ln for ln in log.splitlines() if ln.startswith(("/", "c++", "g++")))


def strings(path: Path) -> str:
    return subprocess.run(["strings", "-a", "-n", "6", str(path)], capture_output=True, text=True, check=True).stdout


def device_code(so: Path, out: Path) -> list[Path]:
    """The cubins (and any PTX) of an extension, decompressed: nvcc stores them compressed
    (--compress-mode=size), where strings cannot read them."""
    out.mkdir()
    for what in ("-xelf", "-xptx"):
        subprocess.run([str(cuobjdump()), what, "all", str(so)], cwd=out, capture_output=True, text=True, check=True)
    return sorted(p for p in out.iterdir() if p.stat().st_size)


@needs_nvcc
def test_extension_is_stripped_and_names_no_build_machine_path(two_builds):
    tmp, tc, checkouts, _, repaired, _ = two_builds
    with zipfile.ZipFile(repaired[0]) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".so")]
        so = tmp / "_C.so"
        so.write_bytes(z.read(name))
    sections = subprocess.run(["readelf", "-S", "-W", str(so)], capture_output=True, text=True, check=True).stdout
    assert ".symtab" not in sections and ".debug_" not in sections  # stripped
    host = strings(so)
    machine_paths = {str(p).rstrip("/") + "/" for p in (tmp, *checkouts, REPO, cache_root(), Path.home(), tc.cuda.home,
                                                        tc.env.root, tc.cutlass, os.environ.get("TMPDIR", "/tmp"))}
    leaks = sorted({ln for ln in host.splitlines() for p in machine_paths if p in ln + "/"})
    assert not leaks, leaks
    # sources and headers are named relative to the build dir, if at all (__FILE__ in torch's)
    # (path-like strings only: a run of random bytes in a cubin can read like "Kdf^5.h")
    named = re.findall(r"^[\w.+-]*/[\w./+-]*\.(?:cu|cuh|h|hpp|cpp)$|^/\S*\.(?:cu|cuh|h|hpp|cpp)$", host, re.M)
    assert named and all(n.startswith(("csrc/", "build/roots/")) for n in named), named
    # device code: every cubin, decompressed, read as text (its compiler banner shows it is)
    cubins = device_code(so, tmp / "device")
    assert [p for p in cubins if p.suffix == ".cubin"] and all(p.read_bytes()[:4] == b"\x7fELF" for p in cubins
                                                                 if p.suffix == ".cubin")
    device = {p.name: strings(p) for p in cubins}
    assert all("cuda_13" in text for name, text in device.items() if name.endswith(".cubin")), sorted(device)
    leaks = sorted({f"{name}: {ln}" for name, text in device.items() for ln in text.splitlines()
                    for p in machine_paths if p in ln + "/"})
    assert not leaks, leaks


def _tiny_raw_wheel(tmp: Path) -> Path:
    """A raw wheel as the build leaves it (linux_x86_64), whose extension is a real shared
    object from the host compiler: what auditwheel repairs, without nvcc."""
    src = tmp / "tiny.c"
    src.write_text("int sageattn3_tiny(void) { return 3; }\n")
    so = tmp / "_C.abi3.so"
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True, timeout=120)
    return build_wheel(tmp / "raw", "sageattn3", "0.1.0+cu130.torch2.10.stable", "cp310-abi3-linux_x86_64",
                       files={"sageattn3/__init__.py": b"", "sageattn3/_C.abi3.so": so.read_bytes()})


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"
                         and (shutil.which("cc") or shutil.which("gcc"))),
                    reason="auditwheel repairs Linux x86_64 wheels; needs a C compiler for the tiny extension")
def test_repairing_the_same_raw_wheel_twice_gives_the_same_bytes(tmp_path, monkeypatch):
    """auditwheel re-zips what it repairs; with the factory's SOURCE_DATE_EPOCH default (the
    one setup.py uses) the zip times are fixed, so what ships is as reproducible as the build."""
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)  # the factory's own default, as in a release
    raw = _tiny_raw_wheel(tmp_path)
    first = repair(raw, tmp_path / "r1", "linux", settings=FactoryEnv.from_environ(), log=lambda *_: None)
    time.sleep(2.5)  # zip times have 2-second steps: a re-zip that reads the clock would differ
    second = repair(raw, tmp_path / "r2", "linux", settings=FactoryEnv.from_environ(), log=lambda *_: None)
    assert first.name == second.name and "manylinux" in first.name
    assert hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(second.read_bytes()).digest(), \
        differences(first, second)
    with zipfile.ZipFile(first) as z:
        assert {i.date_time for i in z.infolist()} == {(1980, 1, 1, 0, 0, 0)}
