"""The proof flavour's choices (the build itself runs with
`nox -s build-wheels -- --proof-flavour --target ...`; its results are in ci/evidence.json)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ci.stages import build as buildmod
from ci.stages import resolve
from ci.toolchain.targets import Matrix

MATRIX = Matrix.load()


def test_proof_profile_is_the_classic_unit_with_static_cudart_and_cuda13_flags():
    t = MATRIX.target("linux-x86_64-cu128-torch2.8")
    prof, _ = resolve.select_flags(t, MATRIX, proof=True)
    assert prof["torch_unit"] == "csrc/torch/classic.cpp"
    assert "cudart" not in prof["link_libs"] and "cudart_static" in prof["link_libs"]
    assert "c10_cuda" in prof["link_libs"]
    assert prof["archs"] == list(t.archs)
    release, _ = resolve.select_flags(t, MATRIX)
    assert "cudart" in release["link_libs"] and "cudart_static" not in release["link_libs"]
    assert release["torch_unit"] == prof["torch_unit"]


def test_proof_is_refused_for_stable_targets_and_with_the_test_flavour():
    stable = MATRIX.target("linux-x86_64-cu130-torch2.10-stable")
    with pytest.raises(buildmod.BuildError, match="per-torch"):
        resolve.select_flags(stable, MATRIX, proof=True)
    with pytest.raises(buildmod.BuildError, match="exclusive"):
        resolve.select_flags(MATRIX.target("linux-x86_64-cu128-torch2.8"), MATRIX, proof=True, mma_model=True)


def test_cli_refuses_a_target_it_cannot_prove_here():
    proc = subprocess.run([sys.executable, "-m", "ci", "build-wheels", "--proof-flavour", "--target",
                           "windows-amd64-cu128-torch2.8"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "proof flavour needs a per-torch" in proc.stderr and "linux-x86_64-cu128-torch2.8" in proc.stderr


def test_proof_and_test_flavour_records_are_never_indexed_or_published(tmp_path):
    """load_records (what index and publish read) refuses a wheel whose record says proof."""
    import json

    from ci.stages.record import RecordError, load_records
    from conftest_publish import sage_wheel

    wheel, _ = sage_wheel(tmp_path, "cu128.torch2.8")
    beside = wheel.with_name(wheel.name + ".json")
    rec = json.loads(beside.read_text())
    rec["extra"] = {**rec.get("extra", {}), "proof": "compiled with a stand-in toolkit"}
    beside.write_text(json.dumps(rec))
    with pytest.raises(RecordError, match=r"extra\.proof: a proof-flavour wheel.*never indexed or published"):
        load_records(tmp_path)


def test_cli_refuses_both_flavours_at_once():
    proc = subprocess.run([sys.executable, "-m", "ci", "build-wheels", "--proof-flavour", "--test-flavour",
                           "--target", "linux-x86_64-cu128-torch2.8"], capture_output=True, text=True)
    assert proc.returncode == 2 and "exclusive" in proc.stderr


def test_default_target_for_a_torch_newer_than_the_matrix():
    """PyPI moves on (torch 2.15 appeared): the default build takes the newest line's target
    and says so, instead of failing; an older unknown line is still an error."""
    from ci.stages.resolve import default_target
    from ci.toolchain.targets import MatrixError

    newest = max(MATRIX.torch, key=lambda t: tuple(map(int, t.line.split("."))))
    major, minor = map(int, newest.line.split("."))
    t = default_target(MATRIX, f"{major}.{minor + 1}.0")
    assert t == default_target(MATRIX, newest.build_version)
    with pytest.raises(MatrixError, match="not in the matrix"):
        default_target(MATRIX, "2.6.0")
