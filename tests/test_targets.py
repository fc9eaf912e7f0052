"""The matrix: validity rules, derived targets, GitHub matrix, docs table, variant names."""

import copy
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ci.toolchain.targets import TARGETS_FILE, Matrix, MatrixError
from ci.toolchain.variant import Variant

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data():
    return tomllib.loads(TARGETS_FILE.read_text())


def bad(data, mutate):
    d = copy.deepcopy(data)
    mutate(d)
    with pytest.raises(MatrixError) as e:
        Matrix.from_data(d, source="targets.toml")
    return str(e.value)


def line(d, name):
    return next(t for t in d["torch"] if t["line"] == name)


def test_matrix_loads_and_ids_are_unique():
    m = Matrix.load()
    ids = [t.id for t in m.targets]
    assert len(ids) == len(set(ids)) == 23
    assert "linux-x86_64-cu130-torch2.10-stable" in ids
    t = m.target("linux-x86_64-cu130-torch2.10-stable")
    assert t.archs == ("sm_120a", "sm_121a")
    assert t.torch_lines == ("2.10", "2.11", "2.12", "2.13", "2.14")
    assert t.build_torch == "2.14.1" and t.abi3 and t.python_tag == "cp310"
    assert m.target("linux-x86_64-cu128-torch2.8").archs == ("sm_120a",)


def test_unpublished_combination_is_rejected_naming_the_entry(data):
    msg = bad(data, lambda d: line(d, "2.8")["cuda"].append("13.0"))
    assert "torch 2.8 + CUDA 13.0" in msg and "never published" in msg and "12.6, 12.8, 12.9" in msg


def test_unknown_cuda_is_rejected(data):
    def mutate(d):
        line(d, "2.14")["published"].append("13.9")
        line(d, "2.14")["cuda"].append("13.9")
    assert "unknown CUDA toolkit" in bad(data, mutate)


def test_cuda_below_12_8_cannot_compile_sm120(data):
    msg = bad(data, lambda d: d["cuda"].update({"12.6": {"archs": ["sm_120a"]}}))
    assert "CUDA 12.6 cannot compile the sm_120 family" in msg


def test_arch_too_new_for_its_cuda(data):
    msg = bad(data, lambda d: d["cuda"]["12.8"].update(archs=["sm_120a", "sm_121a"]))
    assert "sm_121a needs CUDA >= 12.9" in msg


def test_unknown_os_and_bad_python_and_build_version(data):
    assert "unknown os 'macos-arm64'" in bad(data, lambda d: line(d, "2.9")["os"].append("macos-arm64"))
    assert "python '3.x'" in bad(data, lambda d: line(d, "2.9")["python"].append("3.x"))
    assert "not a 2.9.x release" in bad(data, lambda d: line(d, "2.9").update(build_version="2.10.0"))


def test_gha_matrix_has_one_job_per_target():
    m = Matrix.load()
    jobs = m.gha_matrix()["include"]
    assert [j["id"] for j in jobs] == [t.id for t in m.targets]
    assert {j["runner"] for j in jobs} == {"ubuntu-24.04", "ubuntu-24.04-arm", "windows-2022"}


def test_nox_matrix_session_prints_the_same_json():
    out = subprocess.run([sys.executable, "-m", "ci", "matrix", "--compact"], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == Matrix.load().gha_matrix()


@pytest.mark.parametrize("label", ["cu130.torch2.10.stable", "cu128.torch2.8", "cu132.torch2.10.stable", "cu129.torch2.8"])
def test_variant_round_trip(label):
    v = Variant.parse(label)
    assert v.label == label and Variant.of_version(f"0.1.0+{label}") == v


def test_variant_rejects_garbage_and_serves():
    with pytest.raises(ValueError, match="expected e.g."):
        Variant.parse("cu130-torch2.10")
    s = Variant("13.0", "2.10", True)
    assert s.serves("2.14.1+cu130", "13.0") and s.serves("2.11.0", "13.2")
    assert not s.serves("2.9.1", "13.0") and not s.serves("2.14.1", "12.8") and not s.serves("2.13.0+cpu", None)
    p = Variant("12.8", "2.8", False)
    assert p.requires_torch == "torch>=2.8,<2.9" and s.requires_torch == "torch>=2.10"
    assert p.serves("2.8.0", "12.9") and not p.serves("2.9.0", "12.8")


def test_target_for_torch_explains_rejections():
    m = Matrix.load()
    assert m.target_for_torch("linux-x86_64", "3.11", "2.14.1+cu130", "13.0").id == "linux-x86_64-cu130-torch2.10-stable"
    assert m.target_for_torch("linux-x86_64", "3.12", "2.9.1", "13.0").id == "linux-x86_64-cu130-torch2.9"
    with pytest.raises(MatrixError, match="needs Python >= 3.10"):
        m.target_for_torch("linux-x86_64", "3.9", "2.9.1", "13.0")
    with pytest.raises(MatrixError, match="no target serves torch 2.14.1"):
        m.target_for_torch("linux-x86_64", "3.11", "2.14.1", "12.6")


def test_no_job_for_a_torch_pytorch_never_published_on_that_os():
    """torch 2.8 has no CUDA 12.8 build for Linux aarch64 (only 12.9): no such target, no
    such job; x86_64 and Windows keep theirs, and 2.8 on arm stays covered by cu129."""
    m = Matrix.load()
    ids = {t.id for t in m.targets}
    jobs = {j["id"] for j in m.gha_matrix()["include"]}
    assert ids == jobs
    assert "linux-aarch64-cu128-torch2.8" not in ids and "linux-aarch64-cu129-torch2.8" in ids
    assert {"linux-x86_64-cu128-torch2.8", "windows-amd64-cu128-torch2.8"} <= ids
    for t in m.targets:
        for ln in t.torch_lines:
            assert t.cuda in m.line(ln).published_on(t.os.key), (t.id, ln)


def test_per_os_variants_must_be_published_and_name_a_known_os(data):
    msg = bad(data, lambda d: line(d, "2.8").update(published_by_os={"linux-aarch64": ["13.0"]}))
    assert "torch 2.8 on linux-aarch64: CUDA 13.0 is not among the line's published variants" in msg
    msg = bad(data, lambda d: line(d, "2.8").update(published_by_os={"macos-arm64": ["12.9"]}))
    assert "published_by_os names 'macos-arm64'" in msg
    msg = bad(data, lambda d: line(d, "2.8").update(publishd=["12.8"]))
    assert "unknown keys ['publishd']" in msg


def test_the_newest_line_is_served_and_built_by_a_python_its_torch_has():
    """torch 2.15 has no Python 3.10 wheel: the cu132 stable-ABI wheel is compiled against
    torch 2.15.0 by Python 3.11, still tagged cp310-abi3 (it serves torch 2.12-2.14 on 3.10)."""
    m = Matrix.load()
    t = m.target("linux-x86_64-cu132-torch2.10-stable")
    assert t.build_torch == "2.15.0" and t.python == "3.11" and t.python_tag == "cp310" and t.floor_python == "3.10"
    assert t.torch_lines == ("2.12", "2.13", "2.14", "2.15") and t.build_torch_pypi_cuda == "13.2"
    # a fresh machine's `pip install torch` (2.15.0, PyPI's CUDA 13.2 build) maps to it
    assert m.target_for_torch("linux-x86_64", "3.11", "2.15.0", "13.2") == t
    assert m.target_for_torch("linux-x86_64", "3.10", "2.13.0", "13.2") == t
    assert "python '3.15'" not in str(m.line("2.14").python) and "3.15" not in m.line("2.14").python
    assert m.line("2.15").python[0] == "3.11"
