"""Flag profiles: the same code for Linux and Windows, per torch and CUDA."""

import pytest

from ci.toolchain.flags import profile_for
from ci.toolchain.targets import Matrix


@pytest.fixture(scope="module")
def m():
    return Matrix.load()


def test_linux_stable_profile(m):
    p = profile_for(m.target("linux-x86_64-cu130-torch2.10-stable"), m.stable_abi_floor)
    nv = p["nvcc_flags"]
    assert "-O3" in nv and "--compress-mode=size" in nv and "-std=c++20" in nv
    assert "-lineinfo" not in nv and "-s" in p["ldflags"]  # reproducible, path-free, stripped
    assert "-gencode=arch=compute_120a,code=sm_120a" in nv and "-gencode=arch=compute_121a,code=sm_121a" in nv
    assert "--use_fast_math" not in " ".join(nv)  # the quantizer is bit-exact
    assert "NDEBUG" in p["defines"] and "TORCH_TARGET_VERSION=0x020A000000000000" in p["defines"]
    assert "Py_LIMITED_API=0x030A0000" in p["defines"]
    assert p["cxx_flags"][-1] == "-std=c++20" and "-fPIC" in p["cxx_flags"]
    assert p["link_libs"] == ["c10", "torch_cpu", "torch_cuda", "cudart"]


def test_older_torch_builds_as_cxx17_without_stable_define(m):
    p = profile_for(m.target("linux-x86_64-cu128-torch2.8"), m.stable_abi_floor)
    assert "-std=c++17" in p["nvcc_flags"]
    assert not any(d.startswith("TORCH_TARGET_VERSION") for d in p["defines"])
    assert "-gencode=arch=compute_121a,code=sm_121a" not in p["nvcc_flags"]
    assert "Py_LIMITED_API=0x03090000" in p["defines"]


def test_windows_profile_from_the_same_code(m):
    p = profile_for(m.target("windows-amd64-cu130-torch2.10-stable"), m.stable_abi_floor)
    assert p["compiler"] == "msvc"
    for f in ("/Zc:__cplusplus", "/Zc:preprocessor", "/bigobj", "/permissive-", "/std:c++20"):
        assert f in p["cxx_flags"] and f"-Xcompiler={f}" in p["nvcc_flags"]
    assert {"NOMINMAX", "USE_CUDA"} <= set(p["defines"])
    assert p["env"] == {"DISTUTILS_USE_SDK": "1"}
    assert "-fPIC" not in " ".join(p["nvcc_flags"])


def test_bad_arch_and_platform_are_refused():
    from ci.payload.interface import build_profile

    bp = build_profile()
    with pytest.raises(ValueError, match="not a GPU arch"):
        bp.gencode("ampere")
    with pytest.raises(ValueError, match="unknown platform"):
        bp.profile(platform="macos", cuda="13.0", archs=["sm_120a"], torch_version="2.14", stable_abi_floor=None)
    with pytest.raises(ValueError, match="cannot compile the sm_120 family"):
        bp.default_archs("12.6")


def test_test_flavour_adds_hopper_and_the_mma_model_define(m):
    t = m.target("linux-x86_64-cu130-torch2.10-stable")
    p = profile_for(t, m.stable_abi_floor, mma_model=True)
    assert p["archs"] == ["sm_120a", "sm_121a", "sm_90a"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in p["nvcc_flags"] and "SAGEATTN3_MMA_MODEL=1" in p["defines"]
    assert "-lineinfo" in p["nvcc_flags"]  # profiling the test flavour maps SASS to source lines
    assert "SAGEATTN3_MMA_MODEL=1" not in profile_for(t, m.stable_abi_floor)["defines"]


def test_device_flags_are_those_of_the_newest_line_the_toolkit_builds(m):
    """The kernel report's flags: the build of the newest torch line a toolkit of that CUDA
    compiles (a variant of it or older), taken from the matrix, not written down."""
    from packaging.version import Version

    from ci.payload.interface import build_profile
    from ci.toolchain.flags import device_flags, measured_line

    for cuda in sorted({c for t in m.torch for c in t.cuda}, key=Version):
        line, got = measured_line(m, cuda)
        assert got == cuda and any(Version(c) <= Version(cuda) for c in line.cuda)
        newer = [t for t in m.torch if Version(t.build_version) > Version(line.build_version)]
        assert all(min(map(Version, t.cuda)) > Version(cuda) for t in newer), (cuda, line.line)
        flags = device_flags(False, cuda)
        assert f"-std={build_profile().cxx_standard(line.build_version)}" in flags and "-DNDEBUG" in flags
        assert not [f for f in flags if f.startswith(("-gencode", "--compress-mode", "-Xcompiler", "-DPy_LIMITED"))]
        assert "-lineinfo" in device_flags(True, cuda) and "-DSAGEATTN3_MMA_MODEL=1" in device_flags(True, cuda)
    line, cuda = measured_line(m)
    assert line.build_version == max((t.build_version for t in m.torch), key=Version)
    assert cuda == max(line.cuda, key=Version)
    with pytest.raises(ValueError, match="CUDA 11.8 builds no torch line of the matrix"):
        measured_line(m, "11.8")
