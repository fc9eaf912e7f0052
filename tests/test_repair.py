"""Repair: excludes keep torch/CUDA out; the check refuses vendored libraries and bad tags."""

import zipfile
from pathlib import Path

import pytest

from ci.stages.repair import LINUX_EXCLUDES, RepairError, auditwheel_command, check_repaired, delvewheel_command


def fake_wheel(path: Path, members: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for m in members:
            z.writestr(m, b"x")
    return path


def test_auditwheel_excludes_every_torch_and_cuda_library(tmp_path):
    cmd = auditwheel_command(tmp_path / "w.whl", tmp_path / "out")
    excludes = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--exclude"]
    assert excludes == list(LINUX_EXCLUDES)
    assert {"libtorch*.so*", "libc10*.so*", "libcudart.so*", "libcuda.so*"} <= set(excludes)


def test_delvewheel_command_repeats_excludes_and_paths():
    """One option per pattern and path: delvewheel splits a value at the running machine's path
    separator (':' on Linux), so a ';'-joined list excluded nothing on Linux."""
    cmd = delvewheel_command(Path("w.whl"), Path("out"), [Path("C:/cuda/bin"), Path("C:/x")])
    assert cmd[:2] == ["delvewheel", "repair"]
    excludes = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--exclude"]
    assert excludes == ["torch*.dll", "c10*.dll", "cudart64_*.dll", "nvcuda.dll", "shm.dll"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--add-path"] == [str(Path("C:/cuda/bin")), str(Path("C:/x"))]


def test_check_refuses_vendored_torch_or_cuda(tmp_path):
    name = "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-manylinux_2_34_x86_64.whl"
    ok = fake_wheel(tmp_path / name, ["sageattn3/_C.abi3.so"])
    check_repaired(ok, "linux")
    (tmp_path / "bad").mkdir()
    bad = fake_wheel(tmp_path / "bad" / name, ["sageattn3/_C.abi3.so", "sageattn3.libs/libcudart-1234.so.13"])
    with pytest.raises(RepairError, match="vendors torch/CUDA"):
        check_repaired(bad, "linux")


def test_check_refuses_non_manylinux_tags(tmp_path):
    w = fake_wheel(tmp_path / "sageattn3-0.1.0+cu130.torch2.10.stable-cp310-abi3-linux_x86_64.whl", ["a"])
    with pytest.raises(RepairError, match="not manylinux"):
        check_repaired(w, "linux")
