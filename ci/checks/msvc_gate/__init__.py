"""The Windows compile gate, with the real compilers: MSVC 14.44's ``cl.exe`` and CUDA's
``nvcc.exe`` under wine (``ci.toolchain.windows_toolchain``), against each Windows torch line's own headers (PyPI's
``win_amd64`` torch wheel of the line's build version).

Three checks, each a real compile whose output decides:

- **units** (every Windows torch line): the torch-facing unit the line's Windows wheels use
  (classic for 2.7-2.9, stable from the floor) compiled by ``cl.exe`` with the Windows target's
  flag profile. The classic unit needs ``c10/cuda/impl/cuda_cmake_macros.h``, which only CUDA
  builds of torch generate and PyPI's Windows torch is a CPU build: that one header is taken
  from the same release's Linux CUDA wheel (a ``#define`` or two, no platform content).
- **C2719** (the MSVC pointer-param patch): ``csrc/attn/attn_launch.cu`` through ``nvcc.exe``
  with ``cl.exe`` as host compiler and the Windows profile; unpatched it must fail with
  ``error C2719`` (the 128-aligned TMA descriptor passed by value), patched it must compile.
- **C2872** (the torch header problem reported from ``compiled_autograd.h``): a ``.cu`` that
  includes that header, through ``nvcc.exe``, per line, with the profile's flags and without
  ``USE_CUDA``/``/Zc:preprocessor``: whether ``error C2872`` occurs, from the compiler's output.

``--ptx-only`` compiles device code to PTX only (no ptxas): the host side, where C2719 lives,
is compiled in full; the suite uses it to stay within CI's time. ``--record`` writes the results
into ``ci/evidence.json`` (``windows_gate``), naming the commit they were made from.

    python -m ci.checks.msvc_gate [--line 2.9 ...] [--c2719] [--c2872] [--ptx-only] [--record]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ci.runtime.log import default_log
from ci.toolchain import patches as patchmod
from ci.toolchain import wine as winemod
from ci.toolchain import windows_toolchain as wintc
from ci.toolchain.compile_gate import CMAKE_MACROS, cmake_macros_overlay
from ci.payload.interface import PAYLOAD
from ci.toolchain.flags import profile_for
from ci.toolchain.targets import Matrix, Target
from ci.toolchain.tools import cutlass_include
from ci.runtime.errors import InputError

ATTN_UNIT = "csrc/attn/attn_launch.cu"
PATCH = "msvc-pointer-params"
CUDA = "13.0"  # the CUDA of the Windows toolkit on PyPI that compiles the gate (12.x has no nvcc.exe there)
# What the C2872 reports compile: torch's whole C++ API (torch/extension.h) in a .cu, and the
# header named in them.
C2872_PROBE = ("#include <torch/extension.h>\n#include <torch/csrc/dynamo/compiled_autograd.h>\n"
               "__global__ void sageattn3_probe() {}\n")


class MsvcGateError(InputError, RuntimeError):
    pass


@dataclass
class CompileResult:
    what: str
    ok: bool
    seconds: float
    errors: list[str]  # the compiler's error lines (codes and messages), at most 10
    notes: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _bc():
    from ci.payload.interface import build_commands

    return build_commands()


def _ws(p) -> str:
    return str(winemod.z_path(p))


def windows_targets(matrix: Matrix, line: str) -> list[Target]:
    return [t for t in matrix.targets if t.os.key == "windows-amd64" and line in t.torch_lines]


def _line_python(matrix: Matrix, line: str) -> str:
    return matrix.line(line).python[0]


def _tools(tc: wintc.WindowsToolchain, bc):
    return bc.tools("msvc", _ws(tc.cuda.home), cxx=_ws(tc.msvc.tool("cl.exe")), linker=_ws(tc.msvc.tool("link.exe")))


def _includes(tc: wintc.WindowsToolchain, bc, csrc: Path, torch_dir: Path, overlay: Path | None,
              torch_subdirs: tuple[str, ...] = ("include",)) -> list:
    return bc.include_dirs("msvc", csrc=_ws(csrc), torch_dir=_ws(torch_dir), torch_subdirs=list(torch_subdirs),
                           cuda_home=_ws(tc.cuda.home), python_include=_ws(tc.python.include),
                           cutlass=_ws(cutlass_include()), overlay=_ws(overlay) if overlay else None)


def _run_compile(tc: wintc.WindowsToolchain, bc, profile: dict, root: Path, unit: str, includes: list,
                 what: str) -> CompileResult:
    """One compile under wine, run once more if it fails silently (``winemod.rerun_if_silent``); a
    failure with no error line reports the output's last lines."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sageattn3-msvc-gate-") as tmp:
        cmd = bc.compile_command(_tools(tc, bc), profile, unit, _ws(Path(tmp) / "unit.obj"), includes)
        env = {**tc.msvc.environ(), **bc.build_environment(profile, _ws(tc.cuda.home))}
        proc, notes = winemod.rerun_if_silent(lambda: tc.wine.run(cmd[0], cmd[1:], env=env, cwd=root))
    out = proc.stdout + proc.stderr
    errors = winemod.error_lines(out)
    if proc.returncode != 0 and not errors:  # still nothing to show: the output's last lines
        errors = [ln.strip() for ln in out.splitlines() if ln.strip()][-5:] or [f"exit status {proc.returncode}, no output"]
    return CompileResult(what, proc.returncode == 0, round(time.monotonic() - t0, 1), errors, notes)


# -- the torch-facing units ---------------------------------------------------------------

def unit_case(matrix: Matrix, line: str) -> tuple[Target, dict, str]:
    """The Windows target standing for ``line``, its profile, and the torch it is checked against
    (the line's build version)."""
    targets = windows_targets(matrix, line)
    if not targets:
        raise MsvcGateError(f"torch {line}: no Windows target of the matrix serves it")
    target = targets[0]
    return target, profile_for(target, matrix.stable_abi_floor), matrix.line(line).build_version


def compile_torch_unit(matrix: Matrix, line: str, tc: wintc.WindowsToolchain, log=default_log) -> CompileResult:
    target, profile, version = unit_case(matrix, line)
    torch = wintc.windows_torch(version, _line_python(matrix, line))
    overlay = cmake_macros_overlay(version, log=log) if profile["torch_unit"].endswith("classic.cpp") else None
    bc = _bc()
    res = _run_compile(tc, bc, profile, PAYLOAD, profile["torch_unit"],
                       _includes(tc, bc, PAYLOAD / "csrc", torch.torch_dir, overlay),
                       f"torch {line}: {profile['torch_unit']} by cl.exe against torch {torch.version} (win_amd64) headers")
    if overlay:
        res.notes = f"{CMAKE_MACROS} from torch {version}'s Linux x86_64 CUDA wheel (PyPI); the rest from its win_amd64 wheel"
    log(f"[msvc-gate] {'ok    ' if res.ok else 'FAILED'} {res.what} ({res.seconds} s)"
        + "".join(f"\n             {e}" for e in res.errors[:3]))
    return res


# -- C2719: the attention unit with and without the patch -----------------------------------

def msvc_patch() -> patchmod.Patch:
    found = [p for p in patchmod.load_manifest() if p.name == PATCH]
    if len(found) != 1:
        raise MsvcGateError(f"patches/manifest.toml has {len(found)} patches named {PATCH!r} (expected one): the C2719 "
                            f"check proves that patch")
    return found[0]


def check_pins(payload: Path | None = None) -> patchmod.Patch:
    """The patch's pinned sources checked against ``payload`` before anything compiles: a drifted
    attention unit stops here (PatchDrift), not after a compile."""
    patch = msvc_patch()
    with tempfile.TemporaryDirectory(prefix="sageattn3-pins-") as tmp:
        _stage_attn(Path(tmp), True, payload or PAYLOAD, patch)
    return patch


def _stage_attn(dest: Path, patched: bool, payload: Path = PAYLOAD, patch: patchmod.Patch | None = None) -> None:
    shutil.copytree(payload / "csrc", dest / "csrc")
    if patched:
        patchmod.apply(patch or msvc_patch(), {"src": dest}, dest / "overlay")  # checks the pinned hash first


def c2719(matrix: Matrix, tc: wintc.WindowsToolchain, *, ptx_only: bool, log=default_log) -> dict[str, CompileResult]:
    """The attention unit through nvcc.exe + cl.exe with the Windows stable target's profile,
    unpatched and patched."""
    target = next(t for t in matrix.targets if t.os.key == "windows-amd64" and t.variant.stable and t.cuda == CUDA)
    profile = profile_for(target, matrix.stable_abi_floor)
    if ptx_only:
        profile = {**profile, "nvcc_flags": [f for f in profile["nvcc_flags"] if not f.startswith("-gencode=")]
                   + ["-gencode=arch=compute_120a,code=compute_120a"]}
    patch = check_pins(PAYLOAD)  # drift stops before the first compile
    torch = wintc.windows_torch(target.build_torch)
    bc = _bc()
    out = {}
    for patched in (False, True):
        with tempfile.TemporaryDirectory(prefix="sageattn3-c2719-") as tmp:
            root = Path(tmp)
            _stage_attn(root, patched, PAYLOAD, patch)
            res = _run_compile(tc, bc, profile, root, ATTN_UNIT,
                               _includes(tc, bc, root / "csrc", torch.torch_dir, None),
                               f"{ATTN_UNIT} {'with' if patched else 'without'} {PATCH} (nvcc.exe {tc.cuda.version}, "
                               f"{'PTX only' if ptx_only else ', '.join(profile['archs'])})")
        log(f"[msvc-gate] {'compiles' if res.ok else 'fails   '} {res.what} ({res.seconds} s)"
            + "".join(f"\n             {e}" for e in res.errors[:2]))
        out["patched" if patched else "unpatched"] = res
    return out


# -- C2872: torch's compiled_autograd.h under nvcc.exe ------------------------------------

def c2872(matrix: Matrix, line: str, tc: wintc.WindowsToolchain, log=default_log) -> dict[str, CompileResult]:
    """Whether ``error C2872`` occurs when nvcc.exe compiles a .cu including ``torch/extension.h``
    and ``compiled_autograd.h`` of ``line``'s Windows torch: with the profile's flags (USE_CUDA,
    /Zc:preprocessor), and without both."""
    target, profile, version = unit_case(matrix, line)
    torch = wintc.windows_torch(version, _line_python(matrix, line))
    overlay = cmake_macros_overlay(version, log=log)
    bc = _bc()
    base = {**profile, "nvcc_flags": [f for f in profile["nvcc_flags"] if not f.startswith("-gencode=")]
            + ["-gencode=arch=compute_120a,code=compute_120a"]}
    # As a torch extension that includes torch/extension.h is built: pybind11 needs the full C API
    # (no Py_LIMITED_API), and no stable-ABI target version.
    keep = [d for d in base["defines"] if not d.startswith(("TORCH_TARGET", "Py_LIMITED_API"))]
    plain = {**base, "defines": [d for d in keep if d != "USE_CUDA"],
             "nvcc_flags": [f for f in base["nvcc_flags"] if f != "-Xcompiler=/Zc:preprocessor"]}
    base = {**base, "defines": keep}
    out = {}
    with tempfile.TemporaryDirectory(prefix="sageattn3-c2872-") as tmp:
        root = Path(tmp)
        (root / "csrc").mkdir()
        (root / "probe.cu").write_text(C2872_PROBE)
        for name, prof in (("factory flags", base), ("without USE_CUDA and /Zc:preprocessor", plain)):
            incs = _includes(tc, bc, root / "csrc", torch.torch_dir, overlay,
                             ("include", "include/torch/csrc/api/include"))  # where torch/all.h is
            res = _run_compile(tc, bc, prof, root, "probe.cu", incs,
                               f"torch {line}: torch/extension.h + compiled_autograd.h in a .cu by nvcc.exe, {name}")
            res.notes = ("C2872 occurs" if any("C2872" in e for e in res.errors) else
                         "compiles, no C2872" if res.ok else "fails without C2872")
            log(f"[msvc-gate] {res.notes:13s} {res.what} ({res.seconds} s)")
            out[name] = res
    return out


# -- the CLI ---------------------------------------------------------------------------

def _commit() -> str:
    from ci.stages.build import source_commit

    return source_commit()[:7]


def windows_lines(matrix: Matrix) -> list[str]:
    return [tl.line for tl in matrix.torch if windows_targets(matrix, tl.line)]


def record(matrix: Matrix, entries: dict[str, dict]) -> list[str]:
    """Each line's results (``entries``: line -> what ran) into ``ci/evidence.json`` as ``msvc_unit``
    evidence of the Windows targets serving the line (CUDA 12.x targets too: the same unit, with
    CUDA 13.0's headers), one entry per line under ``lines``; lines checked before and not now
    are kept (each names the commit it was made from)."""
    from ci.checks import coverage
    from ci.stages.build import source_commit

    commit = source_commit()
    by_target: dict[str, dict] = {}
    for line, entry in entries.items():
        for t in windows_targets(matrix, line):
            by_target.setdefault(t.id, {})[line] = {**entry, "source_commit": commit}
    evidence = coverage.load_evidence()
    added = []
    for tid, lines in by_target.items():
        old = (evidence.get(tid) or {}).get("msvc_unit") or {}
        kept = dict(old.get("lines") or {})
        for line, entry in lines.items():
            kept[line] = {**kept.get(line, {}), **entry}
        stored = coverage.add_evidence(tid, "msvc_unit", {"lines": kept, "source_commit": commit}, matrix)
        added.append(f"{tid}: msvc_unit, torch {', '.join(sorted(lines, key=lambda v: tuple(map(int, v.split('.')))))} "
                     f"(from {stored['source_commit'][:7]})")
    return added
