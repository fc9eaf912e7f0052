"""Reproducible binaries: the payload built twice, from two checkouts at different paths, with
the factory's build config, the real nvcc and host compiler and no compiler cache, gives
byte-identical wheels, before and after auditwheel's repair, whose extension is stripped and
holds no path of the build machine.

To fit the CI budget both builds compile for one arch (sm_120a) and run side by side (one
compile job each); everything else is the build a release runs."""

import dataclasses
import json
import hashlib
import os
import re
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from ci.build import REPO, build_config, resolve_toolchain
from ci.flags import PAYLOAD
from ci.repair import repair
from ci.targets import Matrix
from ci.toolchain import cache_root

TARGET = "linux-x86_64-cu130-torch2.10-stable"
pytestmark = pytest.mark.skipif(not shutil.which("nvcc"), reason="needs a CUDA 13.0 toolkit")


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
    procs = []
    for root in checkouts:
        cfg = root.parent / "build-config.json"
        cfg.write_text(json.dumps(build_config(tc, matrix, root / "build" / "include-overlay", jobs=1)))
        env = {**os.environ, "SAGEATTN3_BUILD_CONFIG": str(cfg), "CUDA_HOME": str(tc.cuda.home),
               "PATH": f"{tc.cuda.home / 'bin'}{os.pathsep}{os.environ['PATH']}"}
        env.pop("SOURCE_DATE_EPOCH", None)  # the payload's own default makes the zip times
        log = (root.parent / "build.log").open("w")
        procs.append((root, log, subprocess.Popen(
            [str(tc.env.python), "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
             "-w", str(root.parent / "wheel"), str(root)], env=env, stdout=log, stderr=subprocess.STDOUT)))
    wheels = []
    for root, log, proc in procs:
        rc = proc.wait(timeout=3000)
        log.close()
        text = (root.parent / "build.log").read_text()
        assert rc == 0, text[-4000:]
        (wheel,) = (root.parent / "wheel").glob("*.whl")
        wheels.append(wheel)
    # and what ships: each repaired by auditwheel (which re-zips it), a moment apart
    repaired = []
    for wheel in wheels:
        repaired.append(repair(wheel, wheel.parent.parent / "repaired", "linux", log=lambda *_: None))
        time.sleep(2)
    return tmp, tc, checkouts, wheels, repaired, text


def differences(a: Path, b: Path) -> list[str]:
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        return [i.filename for i, j in zip(za.infolist(), zb.infolist())
                if (i.filename, i.date_time, i.external_attr, za.read(i)) != (j.filename, j.date_time, j.external_attr, zb.read(j))]


def test_two_checkouts_give_byte_identical_wheels(two_builds):
    _, _, checkouts, wheels, repaired, log = two_builds
    for pair in (wheels, repaired):  # as built, and as shipped
        assert pair[0].name == pair[1].name and "manylinux" in repaired[0].name
        digests = [hashlib.sha256(w.read_bytes()).hexdigest() for w in pair]
        assert digests[0] == digests[1], f"{pair[0].name} differs between the checkouts: {differences(*pair)}"
    # what made that so: relative include roots and sources, no compiler cache
    assert "-Ibuild/roots/torch/include" in log and "-Xcudafe --orig_src_path_name=csrc/attn/attn_launch.cu" in log
    assert str(checkouts[1]) not in " ".join(ln for ln in log.splitlines() if ln.startswith(("/", "c++", "g++")))


def test_extension_is_stripped_and_names_no_build_machine_path(two_builds):
    tmp, tc, checkouts, _, repaired, _ = two_builds
    with zipfile.ZipFile(repaired[0]) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".so")]
        so = tmp / "_C.so"
        so.write_bytes(z.read(name))
    sections = subprocess.run(["readelf", "-S", "-W", str(so)], capture_output=True, text=True, check=True).stdout
    assert ".symtab" not in sections and ".debug_" not in sections  # stripped
    strings = subprocess.run(["strings", "-a", "-n", "6", str(so)], capture_output=True, text=True, check=True).stdout
    machine_paths = {str(p).rstrip("/") + "/" for p in (tmp, *checkouts, REPO, cache_root(), Path.home(), tc.cuda.home,
                                                        tc.env.root, tc.cutlass, os.environ.get("TMPDIR", "/tmp"))}
    leaks = sorted({ln for ln in strings.splitlines() for p in machine_paths if p in ln + "/"})
    assert not leaks, leaks
    # sources and headers are named relative to the build dir, if at all (__FILE__ in torch's)
    named = re.findall(r"^\S*\.(?:cu|cuh|h|hpp|cpp)$", strings, re.M)
    assert named and all(n.startswith(("csrc/", "build/roots/")) for n in named), named
