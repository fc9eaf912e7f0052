"""The release jobs' per-target environment, without a runner: where each target's torch comes
from (build, verify, ABI guard), what a job exports, and the commands its steps run on Windows
and aarch64 as well as Linux x86_64."""

from __future__ import annotations

import pytest

from ci.targets import Matrix
from ci.torch_source import (
    INDEX_ENV,
    PYTORCH_INDEX,
    TorchSource,
    foreign_torch_source,
    torch_source,
    unreachable_reason,
)
from ci.variant import cuda_tag

MATRIX = Matrix.load()
TARGETS = MATRIX.targets
BY_ID = {t.id: t for t in TARGETS}


@pytest.fixture
def no_index(monkeypatch):
    monkeypatch.delenv(INDEX_ENV, raising=False)


# -- the torch a target builds and verifies with ------------------------------------------

@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_release_takes_every_targets_torch_from_its_own_pytorch_index(target, no_index):
    src = torch_source(target, PYTORCH_INDEX)
    assert src.requirement == f"torch=={target.build_torch}"
    assert src.index_url == f"{PYTORCH_INDEX}/{cuda_tag(target.cuda)}"
    assert src.cuda == target.cuda
    # --index-url (replaces PyPI), never --extra-index-url: PyPI's CPU torch cannot win
    assert src.pip_args() == [f"torch=={target.build_torch}", "--index-url", src.index_url]
    assert "--extra-index-url" not in src.pip_args()
    assert unreachable_reason(target, PYTORCH_INDEX) is None


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_without_pytorchs_index_pypi_only_where_it_is_the_same_cuda_build(target, no_index):
    src = torch_source(target)
    pypi_is_it = target.os.key == "linux-x86_64" and target.cuda == target.build_torch_pypi_cuda
    if pypi_is_it:
        assert src.index_url is None and src.pip_args() == [f"torch=={target.build_torch}"]
        assert unreachable_reason(target) is None
    else:
        # Windows and aarch64 always (PyPI's torch is a CPU build there), x86_64 when PyPI's
        # default CUDA variant differs from the target's
        assert src.index_url == f"{PYTORCH_INDEX}/{cuda_tag(target.cuda)}"
        why = unreachable_reason(target)
        assert why and INDEX_ENV in why and src.index_url in why
        if target.os.key != "linux-x86_64":
            assert "CPU build" in why
    assert src.cuda == target.cuda


def test_windows_and_aarch64_never_use_pypi(no_index):
    others = [t for t in TARGETS if t.os.key in ("windows-amd64", "linux-aarch64")]
    assert len(others) == 16
    for t in others:
        for root in (None, "http://127.0.0.1:9/whl"):
            assert torch_source(t, root).index_url is not None, t.id


def test_the_index_root_comes_from_the_argument_or_the_environment(monkeypatch):
    t = BY_ID["linux-x86_64-cu130-torch2.10-stable"]
    monkeypatch.delenv(INDEX_ENV, raising=False)
    assert torch_source(t).index_url is None  # PyPI's 2.14.1 is the cu130 build
    monkeypatch.setenv(INDEX_ENV, "http://127.0.0.1:8123/whl/")
    assert torch_source(t).index_url == "http://127.0.0.1:8123/whl/cu130"
    assert torch_source(t, "https://mirror.example/pt").index_url == "https://mirror.example/pt/cu130"
    assert unreachable_reason(BY_ID["windows-amd64-cu128-torch2.7"]) is None  # configured


def test_a_source_accepts_only_its_own_build():
    src = TorchSource("torch==2.8.0", "https://x/cu128", "12.8")
    assert src.accepts("2.8.0+cu128", "12.8") and src.accepts("2.8.0", "12.8")
    assert not src.accepts("2.8.0+cpu", None) and not src.accepts("2.8.0", "12.6")
    assert not src.accepts("2.9.1+cu128", "12.8")
    assert "CUDA 12.8 build" in src.describe() and "https://x/cu128" in src.describe()


# -- the ABI guard's foreign torch ---------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_foreign_torch_is_a_cpu_build_of_a_line_the_wheel_does_not_serve(target):
    f = foreign_torch_source(target, MATRIX, target.python, PYTORCH_INDEX)
    assert f.index_url == f"{PYTORCH_INDEX}/cpu" and f.cuda is None
    line = MATRIX.line(".".join(f.version.split(".")[:2]))
    assert target.python in line.python  # installable in the verify Python
    assert not target.variant.serves(f.version, target.cuda)  # outside the range even as CUDA
    assert line.line not in target.torch_lines


def test_foreign_line_is_the_nearest_older_one():
    assert foreign_torch_source(BY_ID["linux-x86_64-cu130-torch2.10-stable"], MATRIX, "3.10").version == "2.9.1"
    assert foreign_torch_source(BY_ID["linux-x86_64-cu128-torch2.9"], MATRIX, "3.10").version == "2.8.0"
    assert foreign_torch_source(BY_ID["linux-x86_64-cu128-torch2.8"], MATRIX, "3.9").version == "2.7.1"
    # 2.7's nearest is 2.8 (nothing older in the matrix)
    assert foreign_torch_source(BY_ID["windows-amd64-cu128-torch2.7"], MATRIX, "3.9").version == "2.8.0"


def test_a_cuda_foreign_directory_must_still_be_refused():
    t = BY_ID["linux-x86_64-cu130-torch2.10-stable"]
    f = foreign_torch_source(t, MATRIX, "3.10", "http://127.0.0.1:1/whl", directory="cu128")
    assert f.index_url == "http://127.0.0.1:1/whl/cu128" and f.cuda == "12.8" and f.version == "2.9.1"
