"""The payload's build commands per compiler style, computed on this Linux machine through the
pure functions setup.py runs (sageattn3/build_commands.py): the exact MSVC compile and link
command lines and environment of Windows targets (paths as PureWindowsPath), the GCC-style ones
of a Linux target, and the wheel's Requires-Python for every target of the matrix, read from
metadata that setuptools really builds from the factory's build config."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest
from packaging.requirements import Requirement

from ci.stages.build import build_config
from ci.payload.interface import PAYLOAD, build_commands
from ci.stages.resolve import select_flags
from ci.toolchain.resolved import ResolvedToolchain
from ci.toolchain.resolved import CudaToolkit, TorchEnv
from ci.toolchain.targets import Matrix


bc = build_commands()
W = PureWindowsPath
CUDA_WIN = W(r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v13.0")
TORCH_WIN = W(r"C:\factory\envs\py3.10\Lib\site-packages\torch")
PY_WIN = W(r"C:\hostedtoolcache\windows\Python\3.10.11\x64")
CUTLASS_WIN = W(r"C:\factory\cutlass\4.2.0.0\cutlass_library\source\include")
STAGE_WIN = W(r"D:\a\sageattn3\sageattn3\build\stage\0123456789ab")
OBJ_WIN = W(r"build\temp.win-amd64-cpython-310\Release\obj")
PYD = W(r"build\lib.win-amd64-cpython-310\sageattn3\_C.pyd")
MSVC_BIN = W(r"C:\Program Files\Microsoft Visual Studio\2022\Enterprise\VC\Tools\MSVC\14.44.35207\bin\Hostx64\x64")
CL_WIN, LINK_WIN = MSVC_BIN / "cl.exe", MSVC_BIN / "link.exe"


@pytest.fixture(scope="module")
def matrix():
    return Matrix.load()


def payload_sources() -> list[str]:
    return [p.relative_to(PAYLOAD).as_posix() for p in (PAYLOAD / "csrc").rglob("*")]


def windows_build(matrix, target_id):
    target = matrix.target(target_id)
    profile, _ = select_flags(target, matrix)
    tools = bc.tools(bc.style_of(profile), CUDA_WIN, cxx=str(CL_WIN), linker=str(LINK_WIN),
                     launcher=[r"C:\tools\sccache.exe"])
    includes = bc.include_dirs("msvc", csrc=STAGE_WIN / "csrc", torch_dir=TORCH_WIN,
                               torch_subdirs=profile["torch_include_subdirs"], cuda_home=CUDA_WIN,
                               python_include=PY_WIN / "Include", cutlass=CUTLASS_WIN)
    return target, profile, tools, includes


WIN_INCLUDES = [
    r"/ID:\a\sageattn3\sageattn3\build\stage\0123456789ab\csrc",
    r"/IC:\factory\envs\py3.10\Lib\site-packages\torch\include",
    r"/IC:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v13.0\include",
    r"/IC:\factory\cutlass\4.2.0.0\cutlass_library\source\include",
    r"/IC:\hostedtoolcache\windows\Python\3.10.11\x64\Include",
]


@pytest.mark.parametrize("target_id, unit, std, defines, libs", [
    ("windows-amd64-cu130-torch2.10-stable", "stable", "c++20",
     ["NDEBUG", "USE_CUDA", "Py_LIMITED_API=0x030A0000", "TORCH_TARGET_VERSION=0x020A000000000000",
      "NOMINMAX", "WIN32_LEAN_AND_MEAN"],
     ["c10.lib", "torch_cpu.lib", "torch_cuda.lib", "cudart.lib", "python3.lib"]),
    ("windows-amd64-cu128-torch2.8", "classic", "c++17",
     ["NDEBUG", "USE_CUDA", "Py_LIMITED_API=0x03090000", "NOMINMAX", "WIN32_LEAN_AND_MEAN"],
     ["c10.lib", "c10_cuda.lib", "torch_cpu.lib", "torch_cuda.lib", "cudart.lib", "python3.lib"]),
])
def test_windows_commands_are_msvc_style(matrix, target_id, unit, std, defines, libs):
    target, profile, tools, includes = windows_build(matrix, target_id)
    assert bc.style_of(profile) == "msvc" and profile["defines"] == defines

    units = bc.translation_units(profile, payload_sources())
    assert units[-1] == f"csrc/torch/{unit}.cpp" and all(u.endswith(".cu") for u in units[:-1])
    assert "csrc/attn/attn_launch.cu" in units and not any(u.endswith(".cpp") for u in units[:-1])

    # A kernel: nvcc.exe, an .obj, the MSVC host flags through -Xcompiler.
    cu = "csrc/attn/attn_launch.cu"
    cmd = bc.compile_command(tools, profile, cu, bc.object_path("msvc", OBJ_WIN, cu), includes)
    assert cmd == [
        r"C:\tools\sccache.exe", r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v13.0\bin\nvcc.exe",
        "-c", r"csrc\attn\attn_launch.cu", "-o", r"build\temp.win-amd64-cpython-310\Release\obj\csrc\attn\attn_launch.cu.obj",
        *profile["nvcc_flags"], *(f"-D{d}" for d in defines), *(f"-I{i[2:]}" for i in WIN_INCLUDES),
    ]
    for flag in ("/Zc:__cplusplus", "/Zc:preprocessor", "/bigobj", "/permissive-", "/EHsc", "/MD", f"/std:{std}"):
        assert f"-Xcompiler={flag}" in cmd

    # The torch-facing unit: cl /c /Fo, /D and /I, the profile's MSVC flags.
    src = f"csrc/torch/{unit}.cpp"
    cmd = bc.compile_command(tools, profile, src, bc.object_path("msvc", OBJ_WIN, src), includes)
    assert cmd == [
        r"C:\tools\sccache.exe", str(CL_WIN), "/nologo", "/c", rf"csrc\torch\{unit}.cpp",
        rf"/Fobuild\temp.win-amd64-cpython-310\Release\obj\csrc\torch\{unit}.cpp.obj",
        "/O2", f"/std:{std}", "/Zc:__cplusplus", "/Zc:preprocessor", "/bigobj", "/permissive-", "/EHsc", "/MD",
        *(f"/D{d}" for d in defines), *WIN_INCLUDES,
    ]

    # The link: one DLL named by setuptools (_C.pyd), CUDA's lib\x64, Python's libs, .lib names.
    objs = [bc.object_path("msvc", OBJ_WIN, u) for u in units]
    lib_dirs = bc.library_dirs("msvc", torch_dir=TORCH_WIN, cuda_home=CUDA_WIN, python_prefix=PY_WIN)
    link = bc.link_command(tools, profile, objs, PYD, lib_dirs, implib_dir=OBJ_WIN)
    assert link == [
        str(LINK_WIN), "/nologo", "/DLL", "/INCREMENTAL:NO", "/MANIFEST:EMBED,ID=2", "/MANIFESTUAC:NO",
        r"/OUT:build\lib.win-amd64-cpython-310\sageattn3\_C.pyd",
        r"/IMPLIB:build\temp.win-amd64-cpython-310\Release\obj\_C.lib",
        *(str(o) for o in objs),
        r"/LIBPATH:C:\factory\envs\py3.10\Lib\site-packages\torch\lib",
        r"/LIBPATH:C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v13.0\lib\x64",
        r"/LIBPATH:C:\hostedtoolcache\windows\Python\3.10.11\x64\libs",
        *libs,
    ]
    assert all(str(o).endswith(".obj") and "/" not in str(o) for o in objs)

    # Nothing GCC-style anywhere: no -fPIC, no -o/-L/-l for cl or link, no .so/.o.
    cl_cmd = bc.compile_command(tools, profile, src, bc.object_path("msvc", OBJ_WIN, src), includes)
    everything = [*cmd, *cl_cmd, *link]
    assert not [a for a in everything if "-fPIC" in a or "-fvisibility" in a or a.endswith((".so", ".o"))]
    assert not [a for a in [*cl_cmd, *link] if a == "-o" or a.startswith(("-L", "-l", "-I", "-D"))]


def test_windows_build_environment(matrix):
    _, profile, _, _ = windows_build(matrix, "windows-amd64-cu130-torch2.10-stable")
    assert bc.build_environment(profile, CUDA_WIN) == {
        "DISTUTILS_USE_SDK": "1",
        "CUDA_HOME": r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v13.0",
        "CUDA_PATH": r"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v13.0",
    }


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"MZ")
    path.chmod(0o755)
    return path


def test_msvc_link_is_the_linker_beside_cl_never_a_link_on_path(tmp_path):
    """A runner's Git Bash puts Git's usr/bin (GNU coreutils' `link`, also as link.exe) ahead of
    vcvars' directories on PATH: the build links with the link.exe beside cl.exe, by absolute
    path, found from VCToolsInstallDir or from cl.exe on PATH (real files here)."""
    vc = tmp_path / "VS" / "VC" / "Tools" / "MSVC" / "14.44.35207"
    msvc_bin = vc.joinpath(*bc.MSVC_HOST_X64)
    cl, link = _exe(msvc_bin / "cl.exe"), _exe(msvc_bin / "link.exe")
    git_bin = tmp_path / "Git" / "usr" / "bin"
    _exe(git_bin / "link.exe"), _exe(git_bin / "link")
    path = os.pathsep.join([str(git_bin), str(tmp_path / "elsewhere"), str(msvc_bin)])
    for env in ({"PATH": path, "VCToolsInstallDir": str(vc) + os.sep},  # vcvars' variables
                {"Path": path, "VCTOOLSINSTALLDIR": str(vc)},  # names as Windows spells them
                {"PATH": path}):  # cl.exe on PATH only
        assert bc.find_msvc_tools(env) == (str(cl), str(link)), env
    target, profile, _, _ = windows_build(Matrix.load(), "windows-amd64-cu130-torch2.10-stable")
    found_cl, found_link = bc.find_msvc_tools({"PATH": path})
    tools = bc.tools("msvc", CUDA_WIN, cxx=found_cl, linker=found_link)
    argv = bc.link_command(tools, profile, [OBJ_WIN / "a.obj"], PYD, [])
    assert Path(argv[0]).is_absolute() and argv[0].endswith("link.exe")
    assert Path(argv[0]).parent == Path(found_cl).parent and not argv[0].startswith(str(git_bin))

    # bare names (what used to run the first `link` on PATH) are refused
    for cxx, linker in (("cl", str(LINK_WIN)), (str(CL_WIN), "link"), (str(CL_WIN), None),
                        (str(CL_WIN), r"C:\Program Files\Git\usr\bin\link")):
        with pytest.raises(bc.BuildCommandError, match="absolute path of (cl|link).exe"):
            bc.tools("msvc", CUDA_WIN, cxx=cxx, linker=linker)
    # no MSVC: a clear refusal; cl.exe without its link.exe: named
    with pytest.raises(bc.BuildCommandError, match="cl.exe not found .*vcvars64.bat"):
        bc.find_msvc_tools({"PATH": str(git_bin)})
    link.unlink()
    with pytest.raises(bc.BuildCommandError, match="no link.exe beside it"):
        bc.find_msvc_tools({"PATH": path})


def test_windows_toolkit_layout():
    tk = CudaToolkit("13.0.2", CUDA_WIN, "env", platform="windows")
    assert tk.lib_dir == CUDA_WIN / "lib" / "x64" and tk.nvcc == CUDA_WIN / "bin" / "nvcc.exe"
    assert tk.include_dirs == [CUDA_WIN / "include"]
    assert bc.library_dirs("msvc", torch_dir=TORCH_WIN, cuda_home=CUDA_WIN, python_prefix=PY_WIN)[1] == tk.lib_dir


def test_linux_commands_are_gcc_style(matrix):
    """The Linux build keeps its commands: the launcher, nvcc/c++ -c -o, -fPIC and hidden
    visibility from the profile, -D/-I, a c++ -shared link with -L/-l into _C.abi3.so."""
    target = matrix.target("linux-x86_64-cu130-torch2.10-stable")
    profile, _ = select_flags(target, matrix)
    cuda, stage = PurePosixPath("/usr/local/cuda-13.0"), PurePosixPath("/w/build/stage/abc")
    torch_dir = PurePosixPath("/c/envs/py3.10/lib/python3.10/site-packages/torch")
    tools = bc.tools("gcc", cuda, cxx="g++", launcher=["/v/bin/sccache"])
    includes = bc.include_dirs("gcc", csrc=stage / "csrc", torch_dir=torch_dir, torch_subdirs=None, cuda_home=cuda,
                               python_include="/usr/include/python3.10", cutlass="/c/cutlass/include",
                               overlay=stage / "build" / "include-overlay", machine="x86_64")
    incs = ["-I/w/build/stage/abc/build/include-overlay", "-I/w/build/stage/abc/csrc", f"-I{torch_dir}/include",
            "-I/usr/local/cuda-13.0/include", "-I/usr/local/cuda-13.0/targets/x86_64-linux/include",
            "-I/c/cutlass/include", "-I/usr/include/python3.10"]
    defs = [f"-D{d}" for d in profile["defines"]]
    obj = bc.object_path("gcc", "build/temp/obj", "csrc/quant/quant_rows.cu")
    assert bc.compile_command(tools, profile, "csrc/quant/quant_rows.cu", obj, includes) == [
        "/v/bin/sccache", "/usr/local/cuda-13.0/bin/nvcc", "-c", "csrc/quant/quant_rows.cu",
        "-o", "build/temp/obj/csrc/quant/quant_rows.cu.o", *profile["nvcc_flags"],
        # kernels in anonymous namespaces are named after a hash of this path: relative, so the
        # same wherever the payload is staged
        "-Xcudafe", "--orig_src_path_name=csrc/quant/quant_rows.cu", *defs, *incs]
    assert "-Xcompiler=-O3,-fPIC,-fvisibility=hidden" in profile["nvcc_flags"]
    unit = "csrc/torch/stable.cpp"
    assert bc.compile_command(tools, profile, unit, bc.object_path("gcc", "o", unit), includes) == [
        "/v/bin/sccache", "g++", "-c", unit, "-o", "o/csrc/torch/stable.cpp.o", *profile["cxx_flags"], *defs, *incs]
    assert {"-fPIC", "-fvisibility=hidden", "-std=c++20"} <= set(profile["cxx_flags"])
    lib_dirs = bc.library_dirs("gcc", torch_dir=torch_dir, cuda_home=cuda, machine="x86_64")
    assert bc.link_command(tools, profile, ["a.o", "b.o"], "build/lib/sageattn3/_C.abi3.so", lib_dirs[:2]) == [
        "g++", "a.o", "b.o", "-o", "build/lib/sageattn3/_C.abi3.so", *profile["ldflags"],
        f"-L{torch_dir}/lib", "-L/usr/local/cuda-13.0/lib64", "-lc10", "-ltorch_cpu", "-ltorch_cuda", "-lcudart"]
    assert "-shared" in profile["ldflags"]
    assert bc.build_environment(profile, cuda) == {"CUDA_HOME": "/usr/local/cuda-13.0", "CUDA_PATH": "/usr/local/cuda-13.0"}
    # aarch64 toolkits keep their per-target files under sbsa-linux
    arm = bc.include_dirs("gcc", csrc="c", torch_dir="t", torch_subdirs=["include", "include/torch/csrc/api/include"],
                          cuda_home=cuda, python_include="p", machine="aarch64")
    assert PurePosixPath("t/include/torch/csrc/api/include") in arm and cuda / "targets/sbsa-linux/include" in arm


def test_torch_unit_comes_from_the_profile():
    files = ["csrc/a.cu", "csrc/b.cu", "csrc/torch/stable.cpp", "csrc/torch/classic.cpp", "csrc/torch/ops.h"]
    assert bc.translation_units({"torch_unit": "csrc/torch/classic.cpp"}, files) == [
        "csrc/a.cu", "csrc/b.cu", "csrc/torch/classic.cpp"]
    # before the split: the only .cpp
    assert bc.translation_units({}, ["csrc/a.cu", "csrc/bindings.cpp"]) == ["csrc/a.cu", "csrc/bindings.cpp"]
    with pytest.raises(bc.BuildCommandError, match="set profile\\['torch_unit'\\]"):
        bc.translation_units({}, files)
    with pytest.raises(bc.BuildCommandError, match="'csrc/torch/nope.cpp' is not among"):
        bc.translation_units({"torch_unit": "csrc/torch/nope.cpp"}, files)
    with pytest.raises(bc.BuildCommandError, match="unknown compiler style 'clang'"):
        bc.path_type("clang")


# -- Requires-Python --------------------------------------------------------------------

def factory_config(target, matrix) -> dict:
    """The build config the factory writes for ``target`` (ci.stages.build.build_config), with the
    toolchain's machine-dependent parts filled in by hand: nothing is installed."""
    profile, patches = select_flags(target, matrix)
    tc = ResolvedToolchain(
        target=target, profile=profile, patches=patches,
        cuda=CudaToolkit(f"{target.cuda}.0", Path("/opt/cuda"), "system"),
        env=TorchEnv(Path("/opt/env"), target.python, target.build_torch, target.cuda),
        host_compiler="c++ (test)", launcher=(), cutlass=Path("/opt/cutlass"), flavour="release",
    )
    return build_config(tc, matrix, Path("/nonexistent-overlay"))


METADATA_DRIVER = """
import json, os, sys
from setuptools import build_meta
out = {}
for tid, cfg in json.loads(sys.stdin.read()).items():
    os.environ["SAGEATTN3_BUILD_CONFIG"] = cfg
    d = os.path.join("meta", tid)
    os.makedirs(d)
    info = build_meta.prepare_metadata_for_build_wheel(d)
    out[tid] = open(os.path.join(d, info, "METADATA")).read()
print(json.dumps(out))
"""


def test_requires_python_is_the_targets_floor_for_every_target(matrix, tmp_path):
    """For every target: the factory's build record says '>=' + the target's Python (cp39-abi3
    for the torch 2.7/2.8 lines), and setuptools' real metadata build of the payload with that
    config writes exactly that Requires-Python (no torch import, nothing compiled)."""
    import setuptools
    from packaging.version import Version

    if Version(setuptools.__version__) < Version("77"):
        pytest.fail(f"setuptools {setuptools.__version__} runs these tests, but the payload's metadata needs "
                    f"setuptools >= 77 (its SPDX license and license-files, pyproject build-system.requires): "
                    f"install the test requirements (ci/requirements-test.txt) or `pip install 'setuptools>=77'`")
    src = tmp_path / "payload"
    shutil.copytree(PAYLOAD, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so",
                                                                "_build_record.json"))
    configs = {}
    for t in matrix.targets:
        cfg = factory_config(t, matrix)
        assert cfg["record"]["requires_python"] == f">={t.floor_python}", t.id
        assert cfg["limited_api"] == "cp" + t.floor_python.replace(".", ""), t.id
        path = tmp_path / f"{t.id}.json"
        path.write_text(json.dumps(cfg))
        configs[t.id] = str(path)
    assert {t.python for t in matrix.targets} >= {"3.9", "3.10"}  # both floors are exercised
    proc = subprocess.run([sys.executable, "-c", METADATA_DRIVER], cwd=src, input=json.dumps(configs),
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    metadata = json.loads(proc.stdout.strip().splitlines()[-1])
    for t in matrix.targets:
        lines = metadata[t.id].splitlines()
        assert f"Requires-Python: >={t.floor_python}" in lines, (t.id, [ln for ln in lines if "Python" in ln])
        assert f"Version: 0.1.0+{t.variant.label}" in lines, (t.id, lines)
        deps = [Requirement(ln.split(": ", 1)[1]) for ln in lines if ln.startswith("Requires-Dist: ")]
        assert deps == [Requirement(t.requires_torch)], t.id


def test_mismatched_python_floor_is_refused(matrix, tmp_path):
    src = tmp_path / "payload"
    shutil.copytree(PAYLOAD, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so",
                                                                "_build_record.json"))
    cfg = factory_config(matrix.target("linux-x86_64-cu128-torch2.8"), matrix)
    cfg["record"]["requires_python"] = ">=3.10"  # but the wheel is cp39-abi3
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=src, capture_output=True, text=True,
                          env={**os.environ, "SAGEATTN3_BUILD_CONFIG": str(path)})
    assert proc.returncode != 0
    assert "requires_python '>=3.10' disagrees with the wheel's cp39-abi3 tag (expected '>=3.9')" in proc.stderr
