"""Toolchain resolution: Pythons found explicitly, CUDA by version (system or PyPI), clear errors."""

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ci.toolchain import ToolchainError, find_cuda, find_python, nvcc_version

PYENV = Path(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))) / "versions"
INSTALLED = sorted({Path(p).name.rsplit(".", 1)[0] for p in glob.glob(str(PYENV / "3.*"))})


@pytest.mark.parametrize("version", INSTALLED or ["3.11"])
def test_find_python_returns_that_version(version):
    exe = find_python(version)
    out = subprocess.run([str(exe), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
    assert out.stdout.strip() == version


def test_missing_python_says_what_to_install():
    with pytest.raises(ToolchainError, match=r"pyenv install 3\.99"):
        find_python("3.99")


@pytest.mark.skipif(not shutil.which("nvcc"), reason="no CUDA toolkit on this machine")
def test_system_cuda_is_found_by_version_not_by_wrapper_location():
    v = nvcc_version(Path(shutil.which("nvcc")))
    mm = ".".join(v.split(".")[:2])
    tk = find_cuda(mm)
    assert tk.major_minor == mm and (tk.home / "bin" / "nvcc").exists()
    assert (tk.home / "include" / "cuda_runtime_api.h").exists() or any((d / "cuda_runtime_api.h").exists() for d in tk.include_dirs)


def test_cuda_12_cannot_be_provisioned_and_says_so():
    with pytest.raises(ToolchainError, match="NVIDIA's installer"):
        find_cuda("12.8", provision=False)


def test_cuda_13_2_is_provisioned_from_pypi_and_compiles_sm120(tmp_path):
    """A real toolkit from PyPI (no 13.2 on this machine): nvcc + headers + runtime of 13.2."""
    tk = find_cuda("13.2")
    assert tk.major_minor == "13.2"
    assert (tk.lib_dir / "libcudart.so").exists()  # the unversioned symlink the wheels lack
    src = tmp_path / "k.cu"
    src.write_text("#include <cuda_runtime.h>\n__global__ void k(float* x) { x[threadIdx.x] *= 2.f; }\n")
    subprocess.run([str(tk.nvcc), "-c", str(src), "-o", str(tmp_path / "k.o"),
                    "-gencode=arch=compute_120a,code=sm_120a", "-gencode=arch=compute_121a,code=sm_121a"], check=True)
    assert (tmp_path / "k.o").stat().st_size > 0
