"""The compile gate: each torch line of ci/targets.toml, with the torch-facing unit its wheels use,
compiles against that torch's real headers (its PyPI x86_64 wheel's, cached headers-only), with the
target's defines and language standard; a line whose unit does not compile fails with the line and
the first compiler error. Also the Windows side of the classic unit: what ci.toolchain.torch_msvc decides for
the real headers of torch 2.7.1, 2.8.0 and 2.9.1, and that the Windows flag profile never reaches
the C2872 code path."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig

import pytest

from ci.toolchain import compile_gate as gate
from ci.toolchain import torch_msvc
from ci.payload.interface import PAYLOAD
from ci.toolchain.flags import profile_for
from ci.toolchain.targets import Matrix

MATRIX = Matrix.load()
CASES = {c.line: c for c in gate.cases(MATRIX)}


@pytest.fixture(scope="module")
def gate_results():
    """The whole gate once (headers fetched one at a time, compiles in parallel)."""
    return gate.run_gate(MATRIX)


@pytest.mark.parametrize("line", sorted(CASES, key=lambda s: tuple(map(int, s.split(".")))))
def test_every_torch_line_compiles(gate_results, line):
    err = gate_results[line]
    case = CASES[line]
    assert err is None, f"torch {line} ({case.unit} against torch {case.torch_version}): {err}"


def test_gate_covers_both_units_and_the_release_lines():
    units = {c.line: c.unit for c in CASES.values()}
    for line in ("2.7", "2.8", "2.9"):
        assert units[line].endswith("classic.cpp"), units
    for line in ("2.10", "2.14"):
        assert units[line].endswith("stable.cpp"), units
    assert CASES["2.14"].std == "c++20" and CASES["2.8"].std == "c++17"
    assert any(d.startswith("TORCH_TARGET_VERSION=") for d in CASES["2.14"].defines)
    assert not any(d.startswith("TORCH_TARGET_VERSION=") for d in CASES["2.8"].defines)


def test_a_line_whose_unit_does_not_compile_fails_with_line_and_first_error():
    """Moving the stable-ABI floor down to 2.8 makes lines 2.8 and 2.9 use the stable unit, which
    their real headers cannot compile (FACTS: Exception.h from 2.9.1, TORCH_BOX from 2.10)."""
    data = {
        "package": {"name": "sageattn3", "stable_abi_floor": "2.8", "limited_api_python": "3.9"},
        "os": {"linux-x86_64": {"platform": "linux", "machine": "x86_64"}},
        "cuda": {"12.8": {"archs": ["sm_120a"]}},
        "torch": [{"line": "2.8", "build_version": "2.8.0", "pypi_default": "12.8", "published": ["12.8"],
                   "cuda": ["12.8"], "python": ["3.9"], "os": ["linux-x86_64"]}],
    }
    broken = Matrix.from_data(data, source="test")
    results = gate.run_gate(broken)
    assert results["2.8"] is not None
    msg = gate.failures_message(broken, results)
    assert msg.startswith("torch 2.8 (stable.cpp, targets linux-x86_64-cu128-torch2.8-stable) does not compile: ")
    assert re.search(r"error: .*(No such file|not declared|TORCH_BOX)", msg), msg
    assert str(gate.headers_dir("2.8.0")) not in msg  # paths shown relative to torch/include


def test_cli_exit_status_and_message(tmp_path, monkeypatch):
    toml = (MATRIX_FILE := PAYLOAD.parent / "ci" / "targets.toml").read_text()
    bad = toml.replace('stable_abi_floor = "2.10"', 'stable_abi_floor = "2.8"')
    assert bad != toml
    f = tmp_path / "targets.toml"
    f.write_text(bad)
    proc = subprocess.run([sys.executable, "-m", "ci.toolchain.compile_gate", "--line", "2.8"], cwd=PAYLOAD.parent,
                          capture_output=True, text=True, env={**__import__("os").environ, "SAGEATTN3_TARGETS_FILE": str(f)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: torch 2.8 (stable.cpp"), proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ci.toolchain.compile_gate", "--line", "9.9"], cwd=PAYLOAD.parent,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "9.9" in proc.stderr


def test_headers_cache_holds_headers_only(gate_results):
    for case in CASES.values():
        root = gate.headers_dir(case.torch_version)
        files = [p for p in root.rglob("*") if p.is_file()]
        assert files, root
        odd = [p for p in files if p.suffix not in (".h", ".hpp", ".cuh", ".inc", ".def", ".in", "") and p.name != ".complete"]
        assert len(odd) <= 5, odd[:10]
        size = sum(p.stat().st_size for p in files)
        assert size < 80e6, (case.torch_version, size)


# -- Windows: the C2872 header (torch/csrc/dynamo/compiled_autograd.h) and the classic unit ---------

PER_TORCH = {"2.7.1": "guarded", "2.8.0": "guarded", "2.9.1": "guarded"}


@pytest.mark.parametrize("version", sorted(PER_TORCH))
def test_torch_msvc_status_on_real_headers(version):
    include = gate.torch_headers(version)
    assert torch_msvc.status(include) == PER_TORCH[version]


def _windows_classic_profile(line: str) -> dict:
    (t,) = [t for t in MATRIX.targets if t.os.key == "windows-amd64" and t.torch_lines == (line,) and t.cuda == "12.8"]
    prof = profile_for(t, MATRIX.stable_abi_floor)
    assert prof["torch_unit"].endswith("classic.cpp") and prof["compiler"] == "msvc"
    return prof


@pytest.mark.parametrize("version", sorted(PER_TORCH))
def test_windows_profile_takes_the_safe_branch_of_the_real_guard(version, tmp_path):
    """The real header's own guard, evaluated by the preprocessor with _WIN32 and the Windows
    profile's defines: the `if constexpr` chain MSVC trips on must be switched off."""
    include = gate.torch_headers(version)
    text = (include / torch_msvc.HEADER).read_text()
    guard = torch_msvc.GUARD.search(text).group(0)
    prof = _windows_classic_profile(version.rsplit(".", 1)[0])
    probe = tmp_path / "guard.h"
    probe.write_text("#define _WIN32 1\n" + "".join(
        f"#define {d.split('=')[0]} {d.split('=', 1)[1] if '=' in d else 1}\n" for d in prof["defines"])
        + f"{guard}\nWINDOWS_BRANCH\n#else\nCONSTEXPR_CHAIN\n#endif\n")
    out = subprocess.run(["cpp", "-P", str(probe)], capture_output=True, text=True, check=True).stdout
    assert "WINDOWS_BRANCH" in out and "CONSTEXPR_CHAIN" not in out
    # ... and the branch really is the one MSVC has no trouble with: the constexpr chain sits
    # in the #else part (so an undefined USE_CUDA would have selected it on 2.9.1).
    after = text[text.index(guard):]
    assert after.index("#else") < after.index("if constexpr")


@pytest.mark.parametrize("version", sorted(PER_TORCH))
def test_classic_unit_never_includes_the_c2872_header(version):
    """With the Windows profile's defines, the classic unit's whole include closure (as g++ sees
    it) does not contain compiled_autograd.h: the unit includes ATen's Tensor, c10's CUDA stream
    and torch/library.h, not torch/extension.h."""
    include = gate.torch_headers(version)
    prof = _windows_classic_profile(version.rsplit(".", 1)[0])
    cmd = ["g++", "-M", f"-std={prof['cxx_std']}", *[f"-D{d}" for d in prof["defines"]], f"-I{PAYLOAD / 'csrc'}",
           f"-I{include}", f"-I{gate._cuda_include()}", f"-I{sysconfig.get_paths()['include']}",
           str(PAYLOAD / prof["torch_unit"])]
    deps = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "torch/library.h" in deps and "c10/cuda/CUDAStream.h" in deps
    assert "compiled_autograd.h" not in deps


def test_release_plan_refuses_a_matrix_whose_unit_does_not_compile(tmp_path):
    """The release workflow's plan step (`nox -s release -- plan`) runs the gate: a targets file
    whose floor makes torch 2.8's wheels use the stable unit is refused, naming the line."""
    import json
    import os

    toml = (PAYLOAD.parent / "ci" / "targets.toml").read_text()
    f = tmp_path / "targets.toml"
    f.write_text(toml.replace('stable_abi_floor = "2.10"', 'stable_abi_floor = "2.8"'))
    env = {**os.environ, "SAGEATTN3_TARGETS_FILE": str(f)}
    m = subprocess.run([sys.executable, "-m", "ci", "matrix", "--compact"], cwd=PAYLOAD.parent, env=env,
                       capture_output=True, text=True, check=True).stdout
    (tmp_path / "m.json").write_text(m)
    assert json.loads(m)["include"]
    proc = subprocess.run([sys.executable, "-m", "ci.release", "plan", "--matrix", f"@{tmp_path / 'm.json'}",
                           "--targets", ""], cwd=PAYLOAD.parent, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "refusing the matrix: torch 2.8 (stable.cpp" in proc.stderr, proc.stderr[-2000:]


def test_kernel_sources_stay_torch_free():
    """Only csrc/torch/ sees torch (the gate compiles just those units): no kernel source or
    header includes torch, ATen, c10 or Python, so every torch line compiles the same kernels."""
    import re

    csrc = PAYLOAD / "csrc"
    offenders = []
    for f in sorted(csrc.rglob("*")):
        if f.suffix not in (".cu", ".cuh", ".h", ".hpp", ".cpp") or (csrc / "torch") in f.parents:
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            m = re.match(r"\s*#\s*include\s*[<\"]([^>\"]+)", line)
            if m and re.match(r"(torch|ATen|c10|caffe2|Python\.h|pybind11)", m.group(1)):
                offenders.append(f"{f.relative_to(PAYLOAD)}:{n}: {m.group(1)}")
    assert not offenders, offenders
