"""The MSVC pointer-param patch (patches/msvc-pointer-params.patch), proven on Linux since MSVC
does not run here: its manifest entry and pin, `python -m ci.toolchain.patches check`, apply/idempotence/
reverse on a copy, what it changes (and what it leaves alone), who gets it (`list --target`,
the whole matrix), and the force-patched staging copy's attention translation unit compiling
for sm_120a and sm_121a with nvcc (0 spills, pointer-taking entries, the tensormap fence in the
PTX). The GPU half is tests/gpu/test_msvc_patch_gpu.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci.toolchain import patches as patchmod
from ci.payload.interface import PAYLOAD
from ci.toolchain.flags import compiler_for
from ci.stages.record import sha256_of
from ci.toolchain.targets import Matrix

ROOT = Path(__file__).resolve().parents[1]
NAME = "msvc-pointer-params"
LAUNCH = "csrc/attn/attn_launch.cu"
WIN_TARGET = "windows-amd64-cu130-torch2.10-stable"
LINUX_TARGET = "linux-x86_64-cu130-torch2.10-stable"


@pytest.fixture(scope="module")
def patch() -> patchmod.Patch:
    (p,) = [p for p in patchmod.load_manifest() if p.name == NAME]
    return p


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ci.toolchain.patches", *args], cwd=ROOT, capture_output=True, text=True)


def test_manifest_entry(patch):
    assert patch.root == "src"
    assert [f.ref for f in patch.files] == [f"src:{LAUNCH}"]
    assert patch.files[0].sha256 == sha256_of(PAYLOAD / LAUNCH), "pin drifted: refresh the patch and its pin"
    assert patch.when.os == ("windows-amd64",) and patch.when.compiler == ("msvc",)
    assert not patch.when.cuda and not patch.when.torch
    assert "C2719" in patch.reason and "misaligned address" in patch.reason


def test_check_command_passes():
    res = _cli("check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(rf"^ok\s+{NAME}:", res.stdout, re.M), res.stdout


def test_applies_is_idempotent_and_reverses(patch, tmp_path):
    work = tmp_path / "src"
    shutil.copytree(PAYLOAD / "csrc", work / "csrc")
    pristine = (work / LAUNCH).read_bytes()
    assert patchmod.state(patch.file, work) == "applies"
    patchmod.apply(patch, {"src": work}, tmp_path / "overlay")
    patched = (work / LAUNCH).read_bytes()
    assert patched != pristine and patchmod.state(patch.file, work) == "applied"
    with pytest.raises(patchmod.PatchDrift):  # the pin is of the pristine file
        patchmod.apply(patch, {"src": work}, tmp_path / "overlay")
    res = patchmod._git_apply(patch.file, work, "--reverse")
    assert res.returncode == 0, res.stderr
    assert (work / LAUNCH).read_bytes() == pristine
    assert not (tmp_path / "overlay").exists(), "a src: patch must not write the include overlay"


def test_patch_is_small_and_leaves_the_kernel_body_alone(patch):
    text = patch.file.read_text()
    touched = re.findall(r"^\+\+\+ b/(\S+)", text, re.M)
    assert touched == [LAUNCH]
    added = [ln for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    removed = [ln for ln in text.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert len(removed) <= 4 and len(added) <= 40, (len(added), len(removed))
    body = "\n".join(ln[1:] for ln in added)
    # entry: a pointer to the params in global memory, body bound to a reference to *params
    assert re.search(r"fp4_attn_fwd_kernel\(const AttnParams\* __restrict__ \w+\)", body)
    assert "attn_fwd_body<D, kInLoopResidual, kQK8, kPV8, kQK16>(*pp)" in body
    assert "__grid_constant__" not in body
    # descriptors read from global memory: acquire fence of the tensormap proxy, 128 bytes each
    assert "fence.proxy.tensormap::generic.acquire.sys [%0], 128;" in body
    assert all(f"&pp->{m}" in body for m in ("tm_q", "tm_q_sf", "tm_k", "tm_k_sf", "tm_v"))
    # launcher: stream-ordered alloc, async copy, launch with the pointer, stream-ordered free
    order = ["cudaStreamIsCapturing(stream", "cudaMallocAsync(", "aligned(dp, 64)", "cudaMemcpyAsync(dp, &p,",
             "cudaMemcpyHostToDevice, stream)", "put_params<<<1, 64, 0, stream>>>(words,", "(dp);",
             "cudaFreeAsync(dp, stream)"]
    pos = [body.find(s) for s in order]
    assert all(p >= 0 for p in pos) and pos == sorted(pos), dict(zip(order, pos))
    # under capture the params go by value as 16-byte words (no over-aligned by-value parameter)
    assert re.search(r"struct ParamWords \{\s*uint4 w\[", body)


def _target_ids(matrix: Matrix) -> list:
    return list(matrix.targets)


def test_list_windows_target_gets_it_linux_does_not():
    win = _cli("list", "--target", WIN_TARGET)
    assert win.returncode == 0, win.stderr
    assert f"  {NAME}: " in win.stdout and "C2719" in win.stdout
    lin = _cli("list", "--target", LINUX_TARGET)
    assert lin.returncode == 0, lin.stderr
    assert NAME not in lin.stdout and "0 patch(es)" in lin.stdout


def test_matrix_gets_it_exactly_on_windows_msvc(patch):
    targets = _target_ids(Matrix.load())
    assert any(t.os.key == "windows-amd64" for t in targets) and any(t.os.key.startswith("linux") for t in targets)
    for t in targets:
        chosen = patchmod.select([patch], os_key=t.os.key, compiler=compiler_for(t), cuda=t.cuda,
                                 torch_version=t.build_torch)
        want = t.os.key == "windows-amd64" and compiler_for(t) == "msvc"
        assert bool(chosen) == want, t.id


# -- the force-patched staging copy compiles (sm_120a, sm_121a) --------------------------------

def _nvcc() -> Path:
    from test_attn_compile import _nvcc as find

    return find()[0]


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """The factory's staging copy for a Linux target with --force-patch msvc-pointer-params."""
    from ci.stages.build import stage
    from ci.stages.resolve import select_flags

    matrix = Matrix.load()
    target = matrix.target(LINUX_TARGET)
    profile, chosen = select_flags(target, matrix, force_patches=(NAME,), mma_model=False)
    root = stage(target, profile, chosen, build_root=tmp_path_factory.mktemp("b"))
    assert [p.name for p in chosen] == [NAME]
    for p in chosen:
        patchmod.apply(p, {"src": root}, root / "build" / "include-overlay")
    assert patchmod.state(chosen[0].file, root) == "applied"
    return root


@pytest.fixture(scope="module")
def compiled(staged, tmp_path_factory):
    nvcc = _nvcc()
    out = tmp_path_factory.mktemp("obj")
    csrc = staged / "csrc"
    jobs = {}
    for arch in ("120a", "121a"):
        cmd = [str(nvcc), "-c", str(csrc / "attn" / "attn_launch.cu"), "-o", str(out / f"a_{arch}.o"),
               f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3", "-std=c++20", "-Xptxas", "-v", f"-I{csrc}"]
        jobs[arch] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = {}
    for arch, p in jobs.items():
        logs[arch] = p.communicate()[0]
        assert p.returncode == 0, f"patched sm_{arch} compile failed:\n{logs[arch]}"
    ptx = out / "a_120a.ptx"
    res = subprocess.run([str(nvcc), "-ptx", str(csrc / "attn" / "attn_launch.cu"), "-o", str(ptx),
                          "-arch=sm_120a", "-O3", "-std=c++20", f"-I{csrc}"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return logs, ptx.read_text(), out


# (kInLoopResidual, kQK8, kPV8, kQK16) of the attention kernel's instantiations per head dim: delta_s
# precomputed, corrected in the loop, the precise Q·Kᵀ (MXFP8 at D 128, 16-bit at D 64), FP8 P·V,
# both; at D 128 also the raw 16-bit rows (kQK16 1 bf16, 2 fp16) with FP4 and FP8 P·V
INSTANTIATIONS = {d: ((0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, int(d == 64)), (0, 0, 1, 0), (0, 1, 1, int(d == 64)))
                  + (() if d == 64 else ((0, 1, 0, 1), (0, 1, 0, 2), (0, 1, 1, 1), (0, 1, 1, 2)))
                  for d in (64, 128)}


@pytest.mark.parametrize("arch", ["120a", "121a"])
def test_patched_sources_compile(compiled, arch):
    log = compiled[0][arch]
    entries = re.findall(r"Compiling entry function '(\S*fp4_attn_fwd_kernel\S*)'", log)
    assert sorted(entries) == sorted(f"_ZN9sageattn34attn19fp4_attn_fwd_kernelILi{d}ELb{b}ELb{f}ELb{v}ELi{x}EEEvPKNS0_10AttnParamsE"
                                     for d in (64, 128) for b, f, v, x in INSTANTIATIONS[d]), entries
    assert "Compiling entry function '_ZN9sageattn34attn10put_paramsENS0_10ParamWordsEP5uint4'" in log
    from test_attn_compile import check_spills

    check_spills(log, f"patched sm_{arch}")


@pytest.mark.parametrize("arch", ["120a", "121a"])
def test_patched_kernels_keep_the_register_split(compiled, arch):
    """The Windows wheels' kernels (this patch) split the registers by role as the Linux ones do:
    reading the params through a pointer adds no external call, which would make ptxas drop
    setmaxnreg (info C7506) and leave the consumers at the launch's 168 registers."""
    from test_attn_compile import check_register_split

    check_register_split(compiled[2] / f"a_{arch}.o", compiled[0][arch], f"patched sm_{arch}")


def test_patched_ptx_takes_a_pointer_and_fences_the_descriptors(compiled):
    ptx = compiled[1]
    for d in (64, 128):
        for b, f, v, x in INSTANTIATIONS[d]:
            m = re.search(rf"\.entry _ZN9sageattn34attn19fp4_attn_fwd_kernelILi{d}ELb{b}ELb{f}ELb{v}ELi{x}EEEvPKNS0_10AttnParamsE\(\s*"
                          r"\.param \.u64[^)]*\)", ptx)
            assert m, f"D={d} ({b}, {f}, {v}, {x}): entry with one 64-bit pointer param not found"
    # 5 descriptors x the instantiations (5 a head dim, and the raw 16-bit rows' 4 at D 128)
    n = sum(len(v) for v in INSTANTIATIONS.values())
    assert len(re.findall(r"fence\.proxy\.tensormap::generic\.acquire\.sys \[%rd\d+\], 128;", ptx)) == 5 * n
