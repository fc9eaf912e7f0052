"""The emulated verify's wheelhouse (ci.stages.emulate.wheelhouse): the host's pip resolves for the
target machine's wheel tags but evaluates markers for the host, so an aarch64 torch < 2.14 pulled
in its ``nvidia-*-cu12; platform_machine == "x86_64"`` wheels (~3 GB) that the emulated pip never
installs. Only what the target's markers select may be downloaded.

The packages here mimic that shape on a local package source (no network): a root whose
requirements hold on x86_64 only, on aarch64 only, and through an extra."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ci.stages import emulate
from ci.runtime.pip_env import pip_environ

X86_ONLY = 'platform_system == "Linux" and platform_machine == "x86_64"'
ARM_ONLY = 'platform_machine == "aarch64"'
PACKAGES = {  # name -> (wheel tag, requirements)
    "s3root": ("py3-none-any", [f"s3-cuda-cu12==1.0; {X86_ONLY}", f"s3-arm-extra==1.0; {ARM_ONLY}",
                                "s3-toolkit[rt]==1.0; platform_system == \"Linux\"", "s3-common>=1"]),
    # like nvidia-*-cu12: published for aarch64 too, required by the root only on x86_64
    "s3-cuda-cu12": ("py3-none-manylinux2014_aarch64", []),
    "s3-arm-extra": ("py3-none-manylinux_2_17_aarch64", []),
    "s3-toolkit": ("py3-none-any", ['s3-rt==1.0; extra == "rt"', 's3-blas==1.0; extra == "blas"']),
    "s3-rt": ("py3-none-manylinux_2_28_aarch64", []),
    "s3-blas": ("py3-none-manylinux_2_28_aarch64", []),
    "s3-common": ("py3-none-any", []),
}
WANTED = ["s3-arm-extra==1.0", "s3-common==1.0", "s3-rt==1.0", "s3-toolkit==1.0", "s3root==1.0"]


def _wheel(where: Path, name: str, tag: str, requires: list[str]) -> None:
    dist = name.replace("-", "_")
    extras = sorted({r.split('extra == "')[1].split('"')[0] for r in requires if 'extra == "' in r})
    files = {
        f"{dist}/__init__.py": b"",
        f"{dist}-1.0.dist-info/METADATA": "\n".join(
            ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0",
             *[f"Provides-Extra: {e}" for e in extras], *[f"Requires-Dist: {r}" for r in requires], ""]).encode(),
        f"{dist}-1.0.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n".encode(),
    }
    rows = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
            for n, b in files.items()]
    files[f"{dist}-1.0.dist-info/RECORD"] = ("\n".join(rows) + f"\n{dist}-1.0.dist-info/RECORD,,\n").encode()
    with zipfile.ZipFile(where / f"{dist}-1.0-{tag}.whl", "w") as z:
        for n, b in files.items():
            z.writestr(n, b)


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGEATTN3_CACHE", str(tmp_path / "cache"))
    links = tmp_path / "links"
    links.mkdir()
    for name, (tag, requires) in PACKAGES.items():
        _wheel(links, name, tag, requires)
    return ("--no-index", "--find-links", str(links))


def test_the_wheelhouse_holds_what_the_target_markers_select(source):
    """The download is what the emulated pip installs: no x86_64-marker wheel, the aarch64-only
    requirement (which the host's resolution lacks) fetched, extras followed."""
    house = emulate.wheelhouse("aarch64", "s3root==1.0", "3.11.2", log=lambda *_: None, index_args=source)
    assert sorted(p.name.split("-")[0].replace("_", "-") + "==1.0" for p in house.glob("*.whl")) == WANTED
    assert json.loads((house / ".complete").read_text())["pins"] == WANTED



def test_plain_pip_download_takes_the_x86_marker_wheels(source, tmp_path):
    """What the wheelhouse did before (``pip download`` with dependencies and the target's tags):
    the host's markers select the x86_64-only wheel and miss the aarch64-only one."""
    dest = tmp_path / "plain"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", *emulate._pip_target_args("aarch64"),
                           *source, "--dest", str(dest), "s3root==1.0"], capture_output=True, text=True,
                          env=pip_environ())
    assert proc.returncode == 0, proc.stderr
    got = sorted(p.name.split("-")[0] for p in dest.glob("*.whl"))
    assert "s3_cuda_cu12" in got and "s3_arm_extra" not in got, got


def test_a_wheelhouse_filled_by_the_host_markers_is_made_again(source):
    house = emulate.wheelhouse("aarch64", "s3root==1.0", "3.11.2", log=lambda *_: None, index_args=source)
    (house / ".complete").write_text("s3root==1.0")  # the marker of the old, host-marker download
    (house / "s3_cuda_cu12-1.0-py3-none-manylinux2014_aarch64.whl").write_bytes(b"stale")
    said = []
    again = emulate.wheelhouse("aarch64", "s3root==1.0", "3.11.2", log=said.append, index_args=source)
    assert again == house and not (house / "s3_cuda_cu12-1.0-py3-none-manylinux2014_aarch64.whl").exists()
    assert any("filled by the host's markers" in s for s in said)


def test_needed_on_target_follows_markers_and_extras():
    """The selection itself, on the shape of torch 2.9.1's aarch64 metadata."""
    report = {"install": [
        {"metadata": {"name": "torch", "version": "2.9.1", "requires_dist": [
            "filelock", f"nvidia-cublas-cu12==12.8.4.1; {X86_ONLY}", f"triton==3.5.1; {X86_ONLY}",
            'optree>=0.13.0; extra == "optree"', 'setuptools; python_version >= "3.12"']}},
        {"metadata": {"name": "filelock", "version": "4.3.1"}},
        {"metadata": {"name": "nvidia-cublas-cu12", "version": "12.8.4.1"}},
        {"metadata": {"name": "triton", "version": "3.5.1"}},
    ]}
    markers = emulate.target_markers("aarch64", "3.11.2")
    assert emulate.needed_on_target(report, ["torch==2.9.1"], markers) == (["filelock==4.3.1", "torch==2.9.1"], [])
    on_host = emulate.target_markers("x86_64", "3.11.2")
    assert emulate.needed_on_target(report, ["torch==2.9.1"], on_host)[0] == [
        "filelock==4.3.1", "nvidia-cublas-cu12==12.8.4.1", "torch==2.9.1", "triton==3.5.1"]
    # an extra asked for is followed; a requirement the report lacks is named
    assert emulate.needed_on_target(report, ["torch[optree]==2.9.1"], markers) == (
        ["filelock==4.3.1", "torch==2.9.1"], ["optree>=0.13.0"])
