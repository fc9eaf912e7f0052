"""CPU-side checks of the FP4 attention kernel: it compiles for sm_120a and sm_121a with 0 bytes
of spill (a few outside the key loop in the bounded-memory instantiations), and the sm_120a machine code holds the block-scaled FP4 MMA
(OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X). Skips without nvcc >= 12.9. cuobjdump/nvdisasm come from
PyPI (nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm 13.x) into a cache dir when not on PATH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ci.checks.kernel_report import spill_allowance
from ci.checks.sass_budget import NVDISASM_PIN
from ci.toolchain import tools

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "sageattn3" / "csrc"
ATTN_CU = CSRC / "attn" / "attn_launch.cu"
OMMA = "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"


def _nvcc() -> tuple[Path, tuple[int, int]]:
    home = os.environ.get("CUDA_HOME")
    nvcc = Path(home) / "bin" / "nvcc" if home else (Path(shutil.which("nvcc")) if shutil.which("nvcc") else None)
    if nvcc is None or not nvcc.exists():
        pytest.skip("no nvcc (set CUDA_HOME to a CUDA >= 12.9 toolkit)")
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    ver = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if ver < (12, 9):
        pytest.skip(f"nvcc {ver} cannot compile sm_121a (needs >= 12.9)")
    return nvcc, ver


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    """Both arch objects, compiled in parallel (one nvcc per arch), with ptxas -v output."""
    nvcc, _ = _nvcc()
    out = tmp_path_factory.mktemp("attn")
    procs = {}
    for arch in ("120a", "121a"):
        obj = out / f"attn_{arch}.o"
        cmd = [str(nvcc), "-c", str(ATTN_CU), "-o", str(obj), f"-gencode=arch=compute_{arch},code=sm_{arch}",
               "-O3", "-std=c++20", "-Xptxas", "-v", f"-I{CSRC}"]
        procs[arch] = (obj, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    res = {}
    for arch, (obj, p) in procs.items():
        log = p.communicate()[0]
        assert p.returncode == 0, f"sm_{arch} compile failed:\n{log}"
        res[arch] = (obj, log)
    return res


def _sections(text: str, header: str) -> dict[str, str]:
    """The lines after each line matching ``header`` (its group 1: a function's mangled name), up
    to the next such line, per attention kernel."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.search(header, line)
        if m:
            cur = m.group(1) if "fp4_attn_fwd_kernel" in m.group(1) else None
            if cur:
                out[cur] = ""
        elif cur:
            out[cur] += line + "\n"
    return out


def _kernel_reports(log: str) -> dict[str, str]:
    """ptxas -v lines per attention kernel entry."""
    return _sections(log, r"Compiling entry function '(\S+)'")


# The spill allowance per instantiation: ci.checks.kernel_report.spill_allowance (the report's
# exit status rests on the same numbers).


def check_spills(log: str, what: str) -> dict[str, str]:
    """ptxas -v's reports of the fourteen attention kernels (D 64/128 x delta_s precomputed,
    corrected in the loop, FP8 Q·Kᵀ, FP8 P·V, or FP8 Q·Kᵀ and P·V; at D 128 also the raw 16-bit rows,
    bf16 and fp16, with FP4 and FP8 P·V), none spilling beyond the allowance above."""
    reports = _kernel_reports(log)
    assert len(reports) == 14, f"{what}: expected 14 attention kernels (D 64/128 x 5, D 128 x 4), got {list(reports)}\n{log}"
    for name, rep in reports.items():
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
        assert m, f"{what} {name}: no spill report\n{rep}"
        allowed = spill_allowance(name)
        assert int(m.group(1)) <= allowed and int(m.group(2)) <= allowed, f"{what} {name} spills:\n{rep}"
        regs = re.search(r"Used (\d+) registers", rep)
        print(f"{what} {name}: {regs.group(1) if regs else '?'} registers, spill {m.group(1)}/{m.group(2)} B")
    return reports


@pytest.mark.parametrize("arch", ["120a", "121a"])
def test_attention_kernels_do_not_spill(cubins, arch):
    _, log = cubins[arch]
    check_spills(log, f"sm_{arch}")


def _sass(obj: Path) -> str:
    """cuobjdump -sass of an object or cubin (skips where cuobjdump/nvdisasm are not to be had)."""
    try:
        cuobjdump, nvdisasm = tools.cuobjdump(), tools.cuda_tool("nvdisasm", NVDISASM_PIN)
    except tools.ToolchainError as e:
        pytest.skip(f"cuobjdump/nvdisasm not available: {e}")
    env = dict(os.environ, PATH=f"{nvdisasm.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    sass = subprocess.run([str(cuobjdump), "-sass", str(obj)], capture_output=True, text=True, env=env)
    assert sass.returncode == 0, sass.stderr
    return sass.stdout


def test_sm120a_sass_has_block_scaled_fp4_mma(cubins):
    obj, _ = cubins["120a"]
    count = _sass(obj).count(OMMA)
    # D=128: 2 (QK^T) x 16 n-tiles + 2 (PV) x 16; D=64: 16 + 2 x 8, unless the compiler rolls loops.
    assert count >= 2, f"{OMMA} not found in the sm_120a SASS ({count} hits)"
    print(f"{count} x {OMMA} in sm_120a SASS")


def check_register_split(obj: Path, log: str, what: str) -> None:
    """Every instantiation but the bounded mode's gives its producer warpgroup 40 registers and
    its consumers 232 (setmaxnreg, attn_params.h). ptxas drops setmaxnreg without an error where the
    kernel holds an external call (info C7506: the `.shared::cluster` TMA form on sm_120a did): the
    consumers then run at the launch's 168 and spill. So, in ``obj`` (ptxas's ``log``): no C7506,
    the fourteen attention kernels, both reallocations in each warp-specialized one and no call
    through an absolute address; the bounded mode (256 threads) none."""
    assert "C7506" not in log, f"{what}:\n{log[-3000:]}"
    kernels = _sections(_sass(obj), r"Function : (\S+)")
    assert len(kernels) == 14, f"{what}: {list(kernels)}"
    for name, text in kernels.items():
        if re.search(r"ILi\d+ELb1E", name):  # the bounded mode: thread 0 the producer, 256 threads
            assert "USETMAXREG" not in text, f"{what} {name}"
            continue
        assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", text), f"{what} {name}: the producer keeps 168 registers"
        assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0xe8\b", text), f"{what} {name}: the consumers stay at 168"
        assert "CALL.ABS" not in text, f"{what} {name}: a call to an external routine (setmaxnreg would be dropped)"


@pytest.mark.parametrize("arch", ["120a", "121a"])
def test_the_warp_specialized_kernels_keep_their_register_split(cubins, arch):
    obj, log = cubins[arch]
    check_register_split(obj, log, f"sm_{arch}")


def _matrix_cuda_lines() -> list[str]:
    """The CUDA lines the build matrix compiles with (ci/targets.toml's [cuda."X.Y"] tables)."""
    text = (ROOT / "ci" / "targets.toml").read_text()
    return sorted(set(re.findall(r'^\[cuda\."(\d+\.\d+)"\]', text, re.M)), key=lambda v: tuple(map(int, v.split("."))))


def _ptxas_of(line: str) -> Path | None:
    """ptxas of CUDA ``line`` from its PyPI nvcc wheel (which holds ptxas even where it holds no
    nvcc: 12.8), never the one on PATH."""
    package = "nvidia-cuda-nvcc-cu12" if line.startswith("12.") else "nvidia-cuda-nvcc"
    try:
        return tools.cuda_tool("ptxas", f"{package}=={line}.*", from_path=False)
    except tools.ToolchainError:
        return None


@pytest.fixture(scope="module")
def attn_ptx(tmp_path_factory) -> Path:
    nvcc, _ = _nvcc()
    ptx = tmp_path_factory.mktemp("ptx") / "attn_sm_120a.ptx"
    r = subprocess.run([str(nvcc), "-ptx", str(ATTN_CU), "-o", str(ptx), "-gencode=arch=compute_120a,code=sm_120a",
                        "-O3", "-std=c++20", f"-I{CSRC}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return ptx


@pytest.mark.parametrize("line", _matrix_cuda_lines())
def test_every_cuda_lines_ptxas_keeps_the_register_split(attn_ptx, line, tmp_path):
    """The register split by role (setmaxnreg, ``check_register_split``) rests on ptxas, which
    drops it without an error (info C7506). The wheels of each CUDA line of the matrix are assembled by that line's ptxas:
    here each one assembles this nvcc's PTX for sm_120a (the PTX ISA version lowered to 8.7 for
    CUDA 12.x, whose ptxas reads no later one: the frontend is this nvcc's, not the line's own,
    which only the release's runners run). Each warp-specialized kernel keeps both reallocations
    and no external call, and no kernel spills beyond its allowance."""
    ptxas = _ptxas_of(line)
    if ptxas is None:
        pytest.skip(f"ptxas of CUDA {line} not installable here (pip nvidia-cuda-nvcc for {line})")
    text = attn_ptx.read_text()
    if line.startswith("12."):
        text = re.sub(r"^\.version \d+\.\d+", ".version 8.7", text, count=1, flags=re.M)
    ptx, cubin = tmp_path / "a.ptx", tmp_path / "a.cubin"
    ptx.write_text(text)
    r = subprocess.run([str(ptxas), "-arch=sm_120a", "-O3", "-v", "-o", str(cubin), str(ptx)], capture_output=True,
                       text=True)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    check_spills(log, f"ptxas {line}")
    check_register_split(cubin, log, f"ptxas {line}")


RULE_CU = CSRC / "preprocess" / "qk_rule.cu"


def _compile_unit(src: Path, arch: str, obj: Path, kernel: str, count: int, what: str) -> str:
    """nvcc -c of one unit for sm_<arch> with ptxas -v: it compiles, holds ``count`` entries named
    like ``kernel`` and none of them spills. Returns the compile log."""
    nvcc, _ = _nvcc()
    cmd = [str(nvcc), "-c", str(src), "-o", str(obj), f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3",
           "-std=c++20", "-Xptxas", "-v", f"-I{CSRC}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log = p.stdout + p.stderr
    assert p.returncode == 0, f"sm_{arch} compile failed:\n{log}"
    entries = re.findall(rf"Compiling entry function '(\S*{kernel}\S*)'", log)
    assert len(entries) == count, f"expected {count} kernels ({what}), got {entries}\n{log}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == count and all(s == ("0", "0") for s in spills), log
    return log


@pytest.mark.parametrize("arch", ["120a", "121a"])
def test_rule_kernel_compiles_without_spill(arch, tmp_path):
    """The fused "auto" rule kernel (preprocess/qk_rule.cu): its four instantiations (fp16/bf16 x
    D 64/128) compile for the Blackwell consumer archs without spilling, and multiply on the
    tensor cores in 16 bits (m16n8k16, fp32 accumulation: bf16, and fp16 for fp16 inputs), with
    no tf32 MMA left."""
    obj = tmp_path / f"rule_{arch}.o"
    _compile_unit(RULE_CU, arch, obj, "qk_rule_kernel", 4, "fp16/bf16 x D 64/128")
    sass = _sass(obj)  # skips past the compile and spill checks where cuobjdump/nvdisasm are missing
    # mma.m16n8k16 with fp32 accumulation is HMMA.16816.F32.BF16 (bf16) and HMMA.16816.F32 (fp16)
    assert re.search(r"HMMA\.16816\.F32\.BF16", sass), "no bf16 MMA in the rule kernel's SASS"
    assert re.search(r"HMMA\.16816\.F32 ", sass), "no fp16 MMA in the rule kernel's SASS"
    assert not re.search(r"HMMA\.\d+\.F32\.TF32", sass), "a tf32 MMA in the rule kernel's SASS"


def test_the_report_and_this_test_share_one_spill_allowance():
    """`python -m ci.checks.kernel_report` fails only where this test would: the bounded-memory
    and FP8 Q·Kᵀ instantiations within their allowance, the default ones at none."""
    base = "_ZN9sageattn34attn19fp4_attn_fwd_kernelILi128E{}EEvPKNS0_10AttnParamsE"
    assert spill_allowance(base.format("Lb0ELb0E")) == 0
    assert spill_allowance(base.format("Lb1ELb0E")) == 32
    assert spill_allowance(base.format("Lb0ELb1E")) == 72
    # FP8 P·V: with FP4 Q·Kᵀ its own allowance, with FP8 Q·Kᵀ the FP8 Q·Kᵀ one (the report's comment)
    assert spill_allowance(base.format("Lb0ELb0ELb1E")) == 48
    assert spill_allowance(base.format("Lb0ELb1ELb1E")) == 72


MXFP8_COLS_CU = CSRC / "quant" / "quant_mxfp8_cols.cu"


@pytest.mark.parametrize("arch", ["120a", "121a", "90a"])
def test_v_mxfp8_quantizer_compiles_without_spill(arch, tmp_path):
    """V's MXFP8 quantizer of the FP8 P·V path (quant/quant_mxfp8_cols.cu): its two instantiations
    (fp16/bf16) compile for the Blackwell consumer archs and the H100's (the test flavour) without
    spilling."""
    _compile_unit(MXFP8_COLS_CU, arch, tmp_path / f"mxfp8_cols_{arch}.o", "quant_mxfp8_cols_kernel", 2, "fp16/bf16")
