"""Windows builds proven by the real compilers on this Linux machine: MSVC 14.44's cl.exe,
link.exe and lib.exe and CUDA's nvcc.exe under wine (ci.toolchain.wine, ci.toolchain.windows_toolchain), every part from the package
registries. What runs here on every `nox -s tests`:

- the torch-facing unit of a Windows target compiled by cl.exe against its torch line's real
  win_amd64 headers, a kernel unit through nvcc.exe (real SASS for sm_120a and sm_121a), and
  every kernel unit's host side by cl.exe (device code to PTX);
- the MSVC pointer-param patch proven by the compiler: the attention unit without it fails with
  C2719, with it compiles; a drifted source stops before any compile;
- the stand-in import libraries: exactly the symbols the unit imports that PyPI's CPU torch and
  this machine lack, each given to the DLL that exports it;
- the load check: a DLL is loaded under wine against the real torch DLLs, and one importing a
  name torch does not export is refused;
- no wine: a clear error (exit 2) naming the package.

The whole Windows wheel (build, delvewheel repair, PE inspection, load) is a documented session
(docs/factory.md, "Windows wheels built on Linux"). Without wine these tests skip, unless
SAGEATTN3_REQUIRE_WINE=1 (CI's .ci/run sets it), where its absence fails them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest

from ci.checks import msvc_gate

from ci.toolchain import patches as patchmod, pe as pemod, wine as winemod
from ci.toolchain import windows_toolchain as wintc
from ci.stages import windows_build as wb, windows_load
from ci.payload.interface import PAYLOAD
from ci.toolchain.targets import Matrix
from ci.toolchain.tools import ToolchainError

ROOT = Path(__file__).resolve().parents[1]
TARGET = "windows-amd64-cu130-torch2.10-stable"


def _have_wine() -> bool:
    try:
        winemod.find_wine_loader()
        return True
    except ToolchainError:
        return False


need_wine = pytest.mark.skipif(not _have_wine() and os.environ.get("SAGEATTN3_REQUIRE_WINE") != "1",
                               reason="no wine64 here (apt-get install -y wine64); CI requires it")


@pytest.fixture(scope="module")
def matrix() -> Matrix:
    return Matrix.load()


@pytest.fixture(scope="module")
def toolchain(matrix):
    """The Windows toolchain, provisioned into the factory's cache (first time: about 2 minutes)."""
    return wintc.resolve_windows(msvc_gate.CUDA, matrix.target(TARGET).build_torch)


# -- without wine, and the pure parts ------------------------------------------------------

def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ci", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_no_wine_is_exit_2_naming_the_package(tmp_path):
    proc = _cli("build-wheels", "--target", TARGET, "--dist", str(tmp_path),
                env={"SAGEATTN3_WINE": str(tmp_path / "no-wine64-here")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "apt-get install -y wine64" in proc.stderr and TARGET in proc.stderr
    assert not (tmp_path / "raw").exists(), "nothing may be built or staged"


def test_windows_cuda12_targets_are_release_pipeline_only(matrix, tmp_path):
    cu12 = next(t for t in matrix.targets if t.os.key == "windows-amd64" and t.cuda.startswith("12."))
    proc = _cli("build-wheels", "--target", cu12.id, "--dist", str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not on PyPI in full" in proc.stderr and "release pipeline only" in proc.stderr


def test_wine_paths():
    from ci.payload.interface import build_commands

    bc = build_commands()
    assert bc.wine_path("/a b/.cache/x.obj") == PureWindowsPath(r"Z:\a b\.cache\x.obj")
    assert bc.host_path(r"Z:\a b\.cache\x.obj") == PurePosixPath("/a b/.cache/x.obj")
    assert bc.host_path(r"build\roots\torch") == PurePosixPath("build/roots/torch")
    with pytest.raises(bc.BuildCommandError, match="absolute"):
        bc.wine_path("relative/path")
    # The toolchain lives on its own drive: cl.exe started from a dot-folder path misreads its input.
    inside = winemod.windows_root() / "msvc" / "cl.exe"
    assert str(winemod.z_path(inside)).startswith("T:\\msvc\\")


def test_standin_owners():
    exports = {"PyModule_Create2": False, "PyExc_TypeError": True}
    assert wb.owner_of("PyModule_Create2", exports, ["torch_cuda", "python3"]) == "python3"
    assert wb.owner_of("aoti_torch_get_current_cuda_stream", exports, ["torch_cuda", "python3"]) == "torch_cuda"
    assert wb.owner_of("?getCurrentCUDAStream@cuda@c10@@YA?AVCUDAStream@12@C@Z", exports,
                       ["c10_cuda", "torch_cuda"]) == "c10_cuda"
    assert wb.owner_of("CreateFileW", exports, ["torch_cuda", "python3"]) is None


def test_expected_dlls_and_runtime():
    assert wb.expected_dlls(["c10", "torch_cpu", "torch_cuda", "cudart", "python3"], 13) == {
        "c10.dll", "torch_cpu.dll", "torch_cuda.dll", "cudart64_13.dll", "python3.dll"}
    for ok in ("VCRUNTIME140.dll", "vcruntime140_1.dll", "MSVCP140.dll", "api-ms-win-crt-heap-l1-1-0.dll", "KERNEL32.dll"):
        assert wb.MSVC_RUNTIME.match(ok), ok
    assert not wb.MSVC_RUNTIME.match("libiomp5md.dll")


def test_pe_reader_refuses_what_is_not_pe(tmp_path):
    (tmp_path / "x.pyd").write_bytes(b"\x7fELF" + b"\0" * 100)
    with pytest.raises(pemod.PeError, match="not a PE file"):
        pemod.read_pe(tmp_path / "x.pyd")


# -- the real compilers ---------------------------------------------------------------------

@need_wine
def test_cl_compiles_the_torch_unit_against_the_lines_windows_headers(matrix, toolchain):
    line = matrix.line(matrix.target(TARGET).torch_lines[-1]).line
    res = msvc_gate.compile_torch_unit(matrix, line, toolchain)
    assert res.ok, res.errors
    assert "Version 19.44." in toolchain.msvc.banner


@need_wine
def test_nvcc_exe_compiles_a_kernel_unit_to_sm_120a_and_sm_121a(matrix, toolchain, tmp_path):
    from ci.payload.interface import build_commands
    from ci.stages.emulate import cubin_archs_of
    from ci.toolchain.flags import profile_for

    bc = build_commands()
    profile = profile_for(matrix.target(TARGET), matrix.stable_abi_floor)
    torch = wintc.windows_torch(matrix.target(TARGET).build_torch)
    obj = tmp_path / "quant_rows.obj"
    cmd = bc.compile_command(msvc_gate._tools(toolchain, bc), profile, "csrc/quant/quant_rows.cu", str(winemod.z_path(obj)),
                             msvc_gate._includes(toolchain, bc, PAYLOAD / "csrc", torch.torch_dir, None))
    # nvcc.exe's steps under wine: a silent failure (cmd.exe not starting cl.exe) is run once more
    proc, _ = toolchain.wine.run_compile(cmd[0], cmd[1:], env={**toolchain.msvc.environ(),
                                                               **bc.build_environment(profile, str(winemod.z_path(toolchain.cuda.home)))},
                                         cwd=PAYLOAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = obj.read_bytes()
    # /bigobj objects start with the big-object header (0x0000, 0xFFFF, version), machine at 6.
    machine = data[6:8] if data[:4] == b"\x00\x00\xff\xff" else data[:2]
    assert machine == b"\x64\x86", "an x64 COFF object"
    fats = wb.fatbinaries(data)
    assert fats, "no embedded fatbinary"
    archs = set()
    for i, fat in enumerate(fats):
        (tmp_path / f"unit{i}.fatbin").write_bytes(fat)
        archs |= set(cubin_archs_of(tmp_path / f"unit{i}.fatbin"))
    assert archs >= {"sm_120a", "sm_121a"}


# Every kernel unit but the attention one (the C2719 test compiles that, patched and not).
KERNEL_UNITS = sorted(p.relative_to(PAYLOAD).as_posix() for p in (PAYLOAD / "csrc").rglob("*.cu")
                      if p.relative_to(PAYLOAD).as_posix() != msvc_gate.ATTN_UNIT)


@need_wine
@pytest.mark.parametrize("unit", KERNEL_UNITS)
def test_every_kernel_unit_compiles_under_msvc(matrix, toolchain, unit):
    """Device code to PTX only (ptxas is the same on every host); the host side in full, by cl.exe:
    where MSVC differs (a constexpr local in nested lambdas was one, C3861), this fails."""
    from ci.payload.interface import build_commands
    from ci.toolchain.flags import profile_for

    bc = build_commands()
    profile = profile_for(matrix.target(TARGET), matrix.stable_abi_floor)
    profile = {**profile, "nvcc_flags": [f for f in profile["nvcc_flags"] if not f.startswith("-gencode=")]
               + ["-gencode=arch=compute_120a,code=compute_120a"]}
    res = msvc_gate._run_compile(toolchain, bc, profile, PAYLOAD, unit,
                                 msvc_gate._includes(toolchain, bc, PAYLOAD / "csrc", toolchain.torch.torch_dir, None), unit)
    assert res.ok, res.errors


@need_wine
def test_c2719_without_the_patch_and_a_compile_with_it(matrix, toolchain):
    both = msvc_gate.c2719(matrix, toolchain, ptx_only=True)
    assert not both["unpatched"].ok
    assert any("C2719" in e for e in both["unpatched"].errors), both["unpatched"].errors
    assert both["patched"].ok, both["patched"].errors


def test_a_drifted_attention_unit_stops_before_any_compile(tmp_path, monkeypatch, matrix):
    """The patch's pinned hash is checked before the first compile of the C2719 check: a changed
    attention unit never reaches the compiler (and the untouched one passes the same check)."""
    msvc_gate.check_pins()
    payload = tmp_path / "payload"
    shutil.copytree(PAYLOAD / "csrc", payload / "csrc")
    unit = payload / msvc_gate.ATTN_UNIT
    unit.write_text(unit.read_text() + "\n// drift\n")
    ran = []
    monkeypatch.setattr(msvc_gate, "PAYLOAD", payload)
    monkeypatch.setattr(msvc_gate, "_run_compile", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(wintc, "windows_torch", lambda *a, **k: ran.append("torch download"))
    with pytest.raises(patchmod.PatchDrift, match="has changed"):
        msvc_gate.c2719(matrix, None, ptx_only=True)
    assert not ran


class _Runs:
    """A wine stand-in for the rerun rule of ``msvc_gate._run_compile`` alone (the compiles
    themselves are the real ones above): answers with the given (exit status, output) in turn."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    def run(self, exe, args, env=None, cwd=None):
        import subprocess

        self.calls += 1
        rc, out = self.answers.pop(0)
        return subprocess.CompletedProcess([exe, *args], rc, out, "")


@pytest.mark.parametrize("answers, ok, calls, note", [
    ([(1, "Can't recognize 'ptxas -arch=sm_121a' as an internal or external command"), (0, "")], True, 2, "rerun once"),
    ([(2, "unit.cu(3): error C2719: 'x': formal parameter won't be aligned"), (0, "")], False, 1, ""),
    ([(1, "no words of note"), (1, "still nothing")], False, 2, "rerun once"),
    ([(0, "")], True, 1, ""),
])
def test_a_silent_failure_under_wine_is_run_once_more(monkeypatch, answers, ok, calls, note):
    """A failed compile with no error line (wine's cmd.exe failing to start a step) is run a second
    time and the second result stands, noted; one with compiler errors is reported at once; a
    failure that stays silent reports its last output lines instead of nothing."""
    from types import SimpleNamespace

    runs = _Runs(*answers)
    tc = SimpleNamespace(wine=runs, msvc=SimpleNamespace(environ=dict), cuda=SimpleNamespace(home=Path("/cuda")))
    bc = SimpleNamespace(compile_command=lambda tools, profile, unit, obj, inc: ["nvcc.exe", unit, obj],
                         build_environment=lambda profile, home: {})
    monkeypatch.setattr(msvc_gate, "_tools", lambda tc, bc: {})
    res = msvc_gate._run_compile(tc, bc, {}, PAYLOAD, "csrc/x.cu", [], "csrc/x.cu")
    assert (res.ok, runs.calls) == (ok, calls)
    assert res.notes.startswith(note) if note else res.notes == ""
    if not ok:
        assert res.errors and all(res.errors)  # never an empty list for a failure


def test_wine_run_compile_reruns_a_silent_failure_only(monkeypatch):
    """Wine.run_compile (the build's lone unit and the gate's compiles go through it): a failure
    with no error line is run once more and the second result stands; one with an error line is not."""
    wine = winemod.Wine(Path("/wine64"), "wine-8.0", Path("/prefix"))
    for answers, rc, calls, note in (([(1, "Can't recognize 'cl.exe /std:c++20' as an internal or external command"), (0, "")], 0, 2, True),
                                     ([(2, "x.cu(3): error C2719: 'p': formal parameter won't be aligned"), (0, "")], 2, 1, False)):
        runs = _Runs(*answers)
        monkeypatch.setattr(winemod.Wine, "run", lambda self, exe, args, **kw: runs.run(exe, args))
        proc, notes = wine.run_compile("nvcc.exe", ["-c", "x.cu"])
        assert (proc.returncode, runs.calls, notes.startswith("rerun once")) == (rc, calls, note)


@need_wine
def test_standins_are_exactly_what_the_unit_imports_and_lacks(matrix, toolchain, tmp_path):
    from ci.payload.interface import build_commands
    from ci.toolchain.flags import profile_for

    bc = build_commands()
    profile = profile_for(matrix.target(TARGET), matrix.stable_abi_floor)
    obj = tmp_path / "unit.obj"
    proc = wb.compile_unit(toolchain, profile, PAYLOAD, profile["torch_unit"], obj,
                           msvc_gate._includes(toolchain, bc, PAYLOAD / "csrc", toolchain.torch.torch_dir, None), bc)
    assert proc.returncode == 0, proc.stdout[-2000:]
    st = wb.make_standins(toolchain, obj, list(bc.link_libraries(profile)), tmp_path / "standins")
    exports = wb.python3_exports(toolchain.python.stable_abi_exports)
    assert set(st.symbols) == {"torch_cuda", "python3"}
    assert "aoti_torch_get_current_cuda_stream" in st.symbols["torch_cuda"]
    assert st.symbols["python3"] and set(st.symbols["python3"]) <= set(exports)
    assert (st.lib_dir / "torch_cuda.lib").exists() and (st.root / "libs" / "python3.lib").exists()
    # Nothing the real libraries export is stood in for.
    assert not set(st.symbols["torch_cuda"]) & {"aoti_torch_empty_strided", "aoti_torch_get_device_index"}


LOAD_PROBE = r"""
__declspec(dllimport) int aoti_torch_grad_mode_is_enabled(void);  /* exported by torch_cpu.dll */
__declspec(dllimport) void* PyModule_Create2(void*, int);          /* python3.dll: a stand-in here */
__declspec(dllexport) void* PyInit__C(void) { aoti_torch_grad_mode_is_enabled(); return PyModule_Create2(0, 3); }
"""


@need_wine
@pytest.mark.parametrize("torch_symbol, loads", [("aoti_torch_grad_mode_is_enabled", True),
                                                 ("sageattn3_no_such_torch_export", False)])
def test_the_load_check_resolves_against_the_real_torch_dlls(toolchain, tmp_path, torch_symbol, loads):
    """A module importing a name torch_cpu.dll exports loads; one importing a name it does not
    export is refused, as Windows would refuse it."""
    src = tmp_path / "probe.c"
    src.write_text(LOAD_PROBE.replace("aoti_torch_grad_mode_is_enabled", torch_symbol))
    (tmp_path / "torch_cpu.def").write_text(f"LIBRARY torch_cpu.dll\nEXPORTS\n    {torch_symbol}\n")
    (tmp_path / "python3.def").write_text("LIBRARY python3.dll\nEXPORTS\n    PyModule_Create2\n")
    env = toolchain.msvc.environ()
    for lib in ("torch_cpu", "python3"):
        p = toolchain.wine.run(toolchain.msvc.tool("lib.exe"), ["/nologo", "/machine:x64", f"/def:{lib}.def",
                                                                 f"/out:{lib}.lib"], env=env, cwd=tmp_path)
        assert p.returncode == 0, p.stdout
    p = toolchain.wine.run(toolchain.msvc.tool("cl.exe"), ["/nologo", "/LD", "/MD", "probe.c", "/Fe_C.pyd", "/link",
                                                            "torch_cpu.lib", "python3.lib"], env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout
    module = tmp_path / "_C.pyd"
    assert set(d.lower() for d in pemod.read_pe(module).imported_dlls) >= {"torch_cpu.dll", "python3.dll"}
    report = windows_load.load_module(toolchain, module, {"python3": ["PyModule_Create2"]})
    assert report.ok is loads, report.output
    if not loads:
        assert report.unresolved == [f"torch_cpu.dll!{torch_symbol}"], report.unresolved
    assert "torch_cpu.dll" in report.real_dlls and report.standin_dlls == ["python3.dll"]
