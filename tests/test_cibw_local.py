"""Real cibuildwheel (the release's pin) with the real ci/cibuildwheel.toml, in podman, on the
probe payload (tests/cibw_probe, with its own stages from tests/cibw_probe/cibw_stages.py, named
by $SAGEATTN3_CIBW_PAYLOAD): before-all, the build through the shim, the repair-wheel-command,
cibuildwheel's abi3 audit and the test-command with the toml's test-environment all run in the
container, each calling ci/release/cibw/__main__.py as a release job does.
Part of `nox -s tests`: the first run installs podman, runc and debootstrap (Debian, as root)
and builds the stand-in image (minutes; podman keeps it); later runs take about a minute."""

from __future__ import annotations

import os
import platform
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from ci.release import cibw, cibw_job
from ci.toolchain.targets import Matrix
from other_pythons import skip_without_python

REPO = Path(__file__).resolve().parent.parent
TARGET = Matrix.load().target("linux-x86_64-cu130-torch2.10-stable")
# The stand-in image is built with debootstrap as root (podman, runc and debootstrap from Debian's
# packages when missing): GitHub's hosted runners are not root, so there it skips.
can_provision = os.name == "posix" and os.geteuid() == 0 and bool(shutil.which("apt-get"))

pytestmark = [
    pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                       reason="cibuildwheel's Linux containers for an x86_64 target"),
    pytest.mark.skipif(not can_provision, reason="needs root on Debian/Ubuntu (podman, runc and debootstrap from "
                                                 "its packages; the stand-in image built with debootstrap)"),
]


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    from ci.release.cibw_local import run_cibuildwheel

    out = tmp_path_factory.mktemp("cibuildwheel")
    with skip_without_python("the stand-in image's /opt/python/* (copied from this machine's Pythons)"):
        run = run_cibuildwheel(TARGET.id, out, payload_dir=REPO / "tests" / "cibw_probe", jobs=2)
    return run, run.log.read_text(errors="replace")


def test_cibuildwheel_builds_repairs_audits_and_tests_the_probe_through_the_tomls_hooks(probe_run):
    run, log = probe_run
    (wheel,) = run.wheels
    # auditwheel's tag for what the probe links (the payload's would be the stand-in's glibc)
    assert re.fullmatch(r"sageattn3_cibw_probe-0\.1\.0-cp310-abi3-manylinux[\w.]*_x86_64\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        assert any(n.startswith("sageattn3_cibw_probe.abi3") and n.endswith(".so") for n in z.namelist())
    # the container: the stand-in image, podman with runc, the target's one build
    assert "localhost/sageattn3-manylinux-standin" in log and "cp310-manylinux_x86_64" in log
    # before-all: the toml's command, under the image's CPython 3.12 (SAGEATTN3_FACTORY_PYTHON)
    assert "$SAGEATTN3_FACTORY_PYTHON -m pip install -r /project/ci/requirements.txt && " \
           "$SAGEATTN3_FACTORY_PYTHON /project/ci/release/cibw/__main__.py install-cuda" in log
    assert "[cuda] probe payload: no toolkit installed" in log
    # build: cibuildwheel's pip wheel of the shim, which ran ci/release/cibw/__main__.py build in Python 3.10
    assert "[build] probe payload, Python 3.10" in log
    # repair-wheel-command: ci/release/cibw/__main__.py repair (auditwheel with the factory's excludes)
    assert "/project/ci/release/cibw/__main__.py repair --wheel /tmp/cibuildwheel/built_wheel/" in log
    assert "bin/auditwheel repair" in log and "[repair] probe payload:" in log
    assert "Auditing wheel" in log and "abi3audit" in log
    # test-command: ci/release/cibw/__main__.py verify in cibuildwheel's test venv (Python 3.10) with the toml's
    # test-environment (PIP_NO_DEPS=1 reached the hook)
    verify = [ln for ln in log.splitlines() if ln.startswith("[verify] probe payload")]
    assert verify and "Python 3.10" in verify[0] and "add(2, 3) == 5" in verify[0]
    assert "PIP_NO_DEPS=1" in verify[0]


def test_the_job_environment_is_the_release_jobs_plus_only_the_stand_ins(probe_run):
    run, _ = probe_run
    env = run.env
    # the release job's exports, but the stand-in index and the kept caches (the container reaches
    # this machine's cache through /host: a developer's toolkits and torch environments stay)
    for key, value in cibw_job.job_env(TARGET, jobs=2).items():
        if key not in ("SAGEATTN3_PYTORCH_INDEX", "SAGEATTN3_CI_CLEANUP"):
            assert env[key] == value, key
    assert cibw_job.job_env(TARGET, jobs=2)["SAGEATTN3_CI_CLEANUP"] == "1" and env["SAGEATTN3_CI_CLEANUP"] == "0"
    assert env["SAGEATTN3_PYTORCH_INDEX"].startswith("http://127.0.0.1:")
    assert env["CIBW_MANYLINUX_X86_64_IMAGE"].startswith("localhost/sageattn3-manylinux-standin:")
    assert "--runtime=runc" in env["CIBW_CONTAINER_ENGINE"] and "--network=host" in env["CIBW_CONTAINER_ENGINE"]
    passed = env["CIBW_ENVIRONMENT_PASS_LINUX"].split()
    assert passed[:3] == ["SAGEATTN3_TARGET", "SAGEATTN3_PYTORCH_INDEX", "SAGEATTN3_CACHE_HOST"]
    assert passed[-2:] == ["SAGEATTN3_FOREIGN_TORCH_DIR", cibw.PAYLOAD_ENV] and env[cibw.PAYLOAD_ENV] == "tests/cibw_probe"
    assert run.command[1:] == ["-m", "cibuildwheel", "--config-file", "ci/cibuildwheel.toml", "--output-dir",
                               str(run.output_dir / "wheelhouse"), "ci/release/cibw_project"]
