"""What the software E2M1 conversion costs the preprocessing on a GPU without the conversion
instruction (an H100): python tests/bench/conversion_standin.py [rounds]

Builds tests/bench/conversion_standin.cu twice against the kernels' sources for sm_90a (the
test flavour's target): as shipped, and with SAGEATTN3_TIMING_STANDIN_E2M1, which replaces the
software conversion by one hardware E4M3 conversion per two values (the issue cost of sm_100+'s
E2M1 instruction; the codes are wrong, so this is for timing only and no build defines it).
Runs the two in turns and prints, for each, the default preprocessing launches of
bench_kernels.py section 2 (24 heads x 32k tokens, D 128, bf16) timed from C++ against the same
floor (one read of Q, K, V and the FP4 write at the measured copy bandwidth). The difference is
the conversion's share; what is left is the rest of the kernels. Needs nvcc (CUDA_HOME or PATH)
and a CUDA GPU of compute capability 9.0."""

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "sageattn3" / "csrc"
sys.path.insert(0, str(ROOT))

from ci.toolchain.flags import device_flags  # noqa: E402  (a real build's device flags)
from ci.checks.kernel_report import hopper_gpu, nvcc_path  # noqa: E402


def build(nvcc: Path, out: Path, standin: bool) -> Path:
    exe = out / ("standin" if standin else "shipped")
    cmd = [str(nvcc), "-gencode=arch=compute_90a,code=sm_90a", *device_flags(mma_model=True), f"-I{CSRC}",
           *(["-DSAGEATTN3_TIMING_STANDIN_E2M1"] if standin else []),
           str(ROOT / "tests" / "bench" / "conversion_standin.cu"), str(CSRC / "quant" / "quant_cols.cu"),
           str(CSRC / "preprocess" / "smooth_quant.cu"), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"conversion_standin: build failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return exe


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    nvcc = nvcc_path()
    if nvcc is None:
        print("conversion_standin: no nvcc (set CUDA_HOME), skipped")
        return 0
    name = hopper_gpu("conversion_standin")
    if name is None:
        return 0
    print(f"device: {name}; building both variants (about a minute)")
    with tempfile.TemporaryDirectory() as tmp:
        exes = [build(nvcc, Path(tmp), standin) for standin in (False, True)]
        for _ in range(rounds):
            for exe in exes:
                r = subprocess.run([str(exe), exe.name], capture_output=True, text=True)
                if r.returncode:
                    sys.exit(f"conversion_standin: {exe.name} failed:\n{r.stdout}{r.stderr}")
                print(r.stdout.strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
