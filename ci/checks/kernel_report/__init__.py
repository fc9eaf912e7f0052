"""Registers, shared memory and spills of every sageattn3 kernel, per arch (CPU only, no GPU).

    python -m ci.checks.kernel_report                  # compile sageattn3/csrc/**/*.cu to cubins (ptxas -v)
    python -m ci.checks.kernel_report --wheel W.whl    # read a built wheel's cubins (cuobjdump -res-usage)
    python -m ci.checks.kernel_report --upstream CHECKOUT --cutlass INCLUDE   # + upstream's kernel in the budget

Compile mode: each .cu under sageattn3/csrc is compiled to a cubin for sm_120a and sm_121a (the
shipped archs) and for sm_90a with SAGEATTN3_MMA_MODEL=1 (the test flavour that runs on an
H100), in parallel; ptxas -v gives registers, stack, spill stores/loads and static shared memory
per kernel. The attention kernel's dynamic shared memory (its TMA ring) is not visible to ptxas:
a tiny host program compiled from the same headers prints ``SmemLayout<D>::kTotal``. Wheel mode:
cuobjdump -res-usage on the wheel's extension (REG, STACK, SHARED, LOCAL per function and arch;
LOCAL is per-thread local memory, where spills would go). Exit status 1 when an attention kernel
spills more than its allowance (``spill_allowance``, shared with the compile test) or a compile
fails.

Compile mode also prints the per-tile budget of the attention kernel from its sm_120a SASS
(ci.checks.sass_budget): a consumer warp's steady key-tile loop by pipe, the producer's share per key
tile, the busiest warp, the pre-passes (delta_s, the Q·Kᵀ precision rule, MXFP8: ci.checks.sass_prepass)
per attention tile, shared-memory, L2 and DRAM bytes, the bound per SM per tile (issue, tensor, memory
...; which binds) and the TOPS ceiling it implies on an RTX 5090, an RTX PRO 6000 and a GB10.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ci.toolchain.flags import device_flags
from ci.runtime.env import FactoryEnv

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "sageattn3" / "csrc"
# (arch, extra defines, label)
ARCHS = (
    ("sm_120a", (), "sm_120a"),
    ("sm_121a", (), "sm_121a"),
    ("sm_90a", ("SAGEATTN3_MMA_MODEL=1",), "sm_90a (MMA model, test flavour)"),
)
SMEM_PER_SM = {"sm_120a": 100 * 1024, "sm_121a": 100 * 1024, "sm_90a": 228 * 1024}  # bytes per SM


@dataclass
class Kernel:
    name: str
    arch: str
    source: str = ""
    registers: int | None = None
    stack: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    smem_static: int | None = None
    local: int | None = None  # wheel mode
    extra: dict = field(default_factory=dict)


def nvcc_path() -> Path | None:
    home = FactoryEnv.from_environ().cuda_home
    if home and (Path(home) / "bin" / "nvcc").exists():
        return Path(home) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found) if found else None


def hopper_gpu(prog: str) -> str | None:
    """The name of this machine's first GPU when it is a Hopper (sm_90) one, which the sm_90a
    stand-in benchmarks run on; else None, after saying why the benchmark is skipped."""
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                       text=True) if shutil.which("nvidia-smi") else None
    if q is None or q.returncode or not q.stdout.strip():
        print(f"{prog}: no CUDA GPU, skipped")
        return None
    name, cap = (x.strip() for x in q.stdout.splitlines()[0].rsplit(",", 1))
    if cap != "9.0":
        print(f"{prog}: {name} is compute capability {cap}; this is built for sm_90a (H100/H200), skipped")
        return None
    return name


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> readable (c++filt when present, else the names as they are), shortened."""
    out = {n: n for n in names}
    cxxfilt = shutil.which("c++filt")
    if cxxfilt and names:
        r = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
        if r.returncode == 0:
            out = dict(zip(names, r.stdout.splitlines()))
    short = {}
    for k, v in out.items():
        v = re.sub(r"^void ", "", v)
        v = v.replace("(anonymous namespace)::", "").replace("sageattn3::", "")
        v = re.sub(r"\(.*\)$", "", v)  # parameter list
        v = re.sub(r"\b(unsigned|signed) ", "", v).replace("::", ":").replace(", ", ",")
        short[k] = v
    return short


# What an attention instantiation may spill (bytes of stores and of loads each), the one allowance
# this report and tests/test_attn_compile.py share. The bounded-memory instantiations
# (kInLoopResidual, mangled ...ILi<D>ELb1E): at D 128 ptxas kept per-lane shared-memory offsets
# on the stack (12 bytes as shipped, 24 with the MSVC pointer-params patch; none as shipped since
# V's tile exponents), stored once per CTA and loaded once per query tile, outside the key-tile
# loop. The FP8 Q·Kᵀ instantiations (kQK8, ...ILi<D>ELb0ELb1E) hold twice the Q fragments (16
# registers at D 128): at 255 registers ptxas spills 20 bytes as shipped (60/68 with the MSVC
# patch since V's tile exponents, 56/64 before), again outside the key-tile loop in the shipped
# build (tests/test_sass_budget.py checks that its loop reloads nothing). The default ones: none.
# The FP8 P·V instantiations (kPV8, ...ELb1E after those two flags) hold P's E4M3 codes (four
# registers per 32-key chunk): with FP8 Q·Kᵀ too at D 128, 20 bytes as shipped and 24/28 with the
# MSVC patch (within the FP8 Q·Kᵀ allowance, whose pattern it matches); with FP4 Q·Kᵀ none as
# shipped and 32/48 with the MSVC patch at D 128; outside the key-tile loop in the shipped build.
BOUNDED_SPILL_BYTES = 32
QK8_SPILL_BYTES = 72
PV8_SPILL_BYTES = 48


def spill_allowance(kernel: str) -> int:
    """The bytes an attention kernel (by its mangled name) may spill: see above."""
    if re.search(r"ILi\d+ELb0ELb0ELb1E", kernel):
        return PV8_SPILL_BYTES
    if re.search(r"ILi\d+ELb1E", kernel):
        return BOUNDED_SPILL_BYTES
    if re.search(r"ILi\d+ELb0ELb1E", kernel):
        return QK8_SPILL_BYTES
    return 0


def spill_failures(kernels: list[Kernel]) -> list[Kernel]:
    """The attention kernels that spill more than ``spill_allowance`` (stores or loads): exactly
    those tests/test_attn_compile.py fails on; the report's exit status is 1 when there is one."""
    return [k for k in kernels
            if _head_dim(k.name) and max(k.spill_stores or 0, k.spill_loads or 0) > spill_allowance(k.name)]


def parse_ptxas(log: str, source: str) -> list[Kernel]:
    """ptxas -v output -> one Kernel per entry function."""
    kernels: list[Kernel] = []
    cur: Kernel | None = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\S+)'", line)
        if m:
            cur = Kernel(m.group(1), m.group(2), source)
            kernels.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.stack, cur.spill_stores, cur.spill_loads = (int(x) for x in m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur.smem_static = int(s.group(1)) if s else 0
    return kernels


def parse_res_usage(text: str) -> list[Kernel]:
    """cuobjdump -res-usage output -> one Kernel per (arch, function)."""
    kernels, arch, name = [], "?", None
    for line in text.splitlines():
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            vals = dict(re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line))
            kernels.append(Kernel(name, arch, registers=int(vals.get("REG", 0)), stack=int(vals.get("STACK", 0)),
                                  smem_static=int(vals.get("SHARED", 0)), local=int(vals.get("LOCAL", 0))))
            name = None
    return kernels


def toolkit_cuda(nvcc: Path) -> str | None:
    """The CUDA release (major.minor) ``nvcc --version`` names, None when it names none."""
    ver = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", ver)
    return m.group(1) if m else None


def compile_one(nvcc: Path, src: Path, arch: str, defines: tuple[str, ...], out_dir: Path,
                cuda: str | None = None) -> tuple[str, int, str]:
    """``cuda``: the release of ``nvcc`` (its device flags are those of the build it makes)."""
    cubin = out_dir / f"{src.parent.name}_{src.stem}_{arch}.cubin"
    flags = device_flags(mma_model=any(d.startswith("SAGEATTN3_MMA_MODEL") for d in defines), cuda=cuda)
    # -lineinfo for the SASS budget (ci.checks.sass_budget reads source lines); the machine code is the same
    lineinfo = ["-lineinfo"] if "-lineinfo" not in flags else []
    cmd = [str(nvcc), "-cubin", str(src), "-o", str(cubin), f"-gencode=arch=compute_{arch[3:]},code={arch}",
           *flags, *lineinfo, "-Xptxas", "-v", f"-I{CSRC}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return " ".join(cmd), r.returncode, r.stdout + r.stderr


def attention_smem(nvcc: Path, out_dir: Path, cuda: str | None = None) -> dict[int, int]:
    """Dynamic shared memory of the attention kernel per head dim, from the kernel's own
    SmemLayout (a host program; it touches no GPU)."""
    src = out_dir / "smem_probe.cu"
    src.write_text(
        '#include <cstdio>\n#include "attn/attn_fwd_kernel.cuh"\n'
        "int main() {\n"
        '  std::printf("64 %d\\n128 %d\\n", (int)sageattn3::attn::SmemLayout<64>::kTotal,\n'
        "              (int)sageattn3::attn::SmemLayout<128>::kTotal);\n  return 0;\n}\n"
    )
    exe = out_dir / "smem_probe"
    r = subprocess.run([str(nvcc), str(src), "-o", str(exe), *device_flags(False, cuda), f"-I{CSRC}",
                        "-gencode=arch=compute_120a,code=sm_120a"], capture_output=True, text=True)
    if r.returncode != 0:
        return {}
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    return {int(a): int(b) for a, b in (line.split() for line in r.stdout.splitlines() if line.strip())}


def _head_dim(name: str) -> int | None:
    m = re.search(r"fp4_attn_fwd_kernel<(\d+)>", name) or re.search(r"fp4_attn_fwd_kernelILi(\d+)E", name)
    return int(m.group(1)) if m else None


def print_table(kernels: list[Kernel], dyn: dict[int, int], wheel: bool) -> None:
    names = demangle(sorted({k.name for k in kernels}))
    for arch in dict.fromkeys(k.arch for k in kernels):
        label = next((lab for a, _, lab in ARCHS if a == arch), arch)
        print(f"\n== {label}")
        if wheel:
            print(f"  {'kernel':52s} {'regs':>5s} {'stack':>6s} {'local':>6s} {'smem static':>11s} {'smem dyn':>9s}")
        else:
            print(f"  {'kernel':52s} {'regs':>5s} {'stack':>6s} {'spill st/ld':>12s} {'smem static':>11s} "
                  f"{'smem dyn':>9s}  source")
        for k in sorted((k for k in kernels if k.arch == arch), key=lambda k: (k.source, names[k.name])):
            d = _head_dim(names[k.name]) or _head_dim(k.name)
            dyn_s = f"{dyn[d]:9d}" if d in dyn else f"{'-':>9s}"
            n = names[k.name]
            n = n if len(n) <= 52 else n[:49] + "..."
            if wheel:
                print(f"  {n:52s} {k.registers:5d} {k.stack:6d} {k.local:6d} {k.smem_static:11d} {dyn_s}")
            else:
                spill = f"{k.spill_stores}/{k.spill_loads}"
                print(f"  {n:52s} {k.registers or 0:5d} {k.stack or 0:6d} {spill:>12s} {k.smem_static or 0:11d} "
                      f"{dyn_s}  {k.source}")
    if dyn:
        for d, b in sorted(dyn.items()):
            per = ", ".join(f"{a}: {SMEM_PER_SM[a] // b} CTA/SM" for a in ("sm_120a", "sm_90a"))
            src = " (from this source tree)" if wheel else ""
            print(f"\nattention D={d}: {b} bytes dynamic shared memory per CTA{src} (TMA ring + Q tile + barriers); "
                  f"by shared memory alone {per}")


def print_budget(out: Path, upstream: tuple[Path, Path] | None, nvcc: Path) -> None:
    """The per-tile SASS budget of the attention kernel and its pre-passes (ci.checks.sass_budget,
    ci.checks.sass_kernels, ci.checks.sass_prepass) from the sm_120a cubins compiled into ``out``,
    with upstream's kernel beside it (compiled when a checkout of thu-ml/SageAttention and CUTLASS
    headers are given, else as stored)."""
    from ci.checks import sass_kernels as sk
    from ci.checks.kernel_report.budget_table import print_budget as print_table_
    from ci.checks.sass_prepass import PREPASSES

    cubin = lambda src: out / f"{Path(src).parent.name}_{Path(src).stem}_sm_120a.cubin"
    missing = [src for src in ("attn/attn_launch.cu", *(p.source for p in PREPASSES.values())) if not cubin(src).exists()]
    if missing:
        print(f"\n== no per-tile budget: {', '.join(sorted(set(missing)))} did not compile for sm_120a")
        return
    budgets = sk.ours_budgets(cubin("attn/attn_launch.cu"), {p.source: cubin(p.source) for p in PREPASSES.values()})
    if upstream:
        budgets += sk.upstream_budgets(sk.compile_upstream(nvcc, upstream[0], upstream[1], out))
    else:
        budgets += sk.stored_upstream_budgets()
    print_table_(budgets, sk.UPSTREAM_CALIBRATION, None if upstream else sk.UPSTREAM_COMMIT[:7])


def report_compiled(jobs: int, upstream: tuple[Path, Path] | None = None) -> int:
    nvcc = nvcc_path()
    if nvcc is None:
        print("kernel_report: no nvcc (set CUDA_HOME), nothing to report")
        return 0
    sources = sorted(CSRC.glob("*/*.cu"))
    cuda = toolkit_cuda(nvcc)
    print(f"kernel_report: nvcc {cuda or '?'}, {len(sources)} sources x {len(ARCHS)} archs, "
          f"ptxas -v (compile mode)")
    with tempfile.TemporaryDirectory(prefix="sa3-kr-") as tmp:
        out = Path(tmp)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futs = {(src, arch): pool.submit(compile_one, nvcc, src, arch, defs, out, cuda)
                    for arch, defs, _ in ARCHS for src in sources}
            dyn_f = pool.submit(attention_smem, nvcc, out, cuda)
            kernels, failed = [], []
            for (src, arch), f in futs.items():
                cmd, rc, log = f.result()
                rel = str(src.relative_to(CSRC))
                if rc != 0:
                    failed.append(f"{rel} [{arch}]:\n{log[-3000:]}")
                    continue
                kernels += parse_ptxas(log, rel)
            dyn = dyn_f.result()
            print_table(kernels, dyn, wheel=False)
            print_budget(out, upstream, nvcc)
    bad = spill_failures(kernels)
    for k in bad:
        print(f"SPILL: {k.name} [{k.arch}] {k.spill_stores} bytes stores, {k.spill_loads} bytes loads "
              f"(allowed: {spill_allowance(k.name)})")
    for f in failed:
        print(f"COMPILE FAILED: {f}")
    return 1 if bad or failed else 0


def report_wheel(wheel: Path) -> int:
    from ci.toolchain import tools as toolchain

    with tempfile.TemporaryDirectory(prefix="sa3-kr-") as tmp, zipfile.ZipFile(wheel) as zf:
        libs = [n for n in zf.namelist() if re.search(r"sageattn3/_C[^/]*\.(so|pyd)$", n)]
        if not libs:
            print(f"kernel_report: {wheel.name} holds no sageattn3/_C extension")
            return 1
        lib = Path(zf.extract(libs[0], tmp))
        r = subprocess.run([str(toolchain.cuobjdump()), "-res-usage", str(lib)], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"kernel_report: cuobjdump failed: {r.stderr}")
            return 1
        kernels = parse_res_usage(r.stdout)
        nvcc = nvcc_path()
        dyn = attention_smem(nvcc, Path(tmp), toolkit_cuda(nvcc)) if nvcc else {}
    print(f"kernel_report: {wheel.name} ({libs[0]}), cuobjdump -res-usage")
    print_table(kernels, dyn, wheel=True)
    return 0
