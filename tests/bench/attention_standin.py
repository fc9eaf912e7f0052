"""The FP4 attention kernel timed on an H100 through a timing stand-in:
python tests/bench/attention_standin.py [--quick] [--precision-only] [--heads H] [--json FILE] [--baseline TREE]

The H100 has no block-scaled FP4 MMA; the test flavour runs it as a software model, which makes
the kernel's time meaningless. This builds tests/bench/attention_standin.cu against the kernel's
sources for sm_90a with two test-flavour-only defines (an #error anywhere else):
- SAGEATTN3_TIMING_STANDIN_MMA=N: each FP4 MMA becomes N fp16 mma.sync m16n8k16 on the same
  registers (N = 4: the same 8192 multiply-adds; N = 2: half, to see how much of the time the
  MMAs decide);
- SAGEATTN3_TIMING_STANDIN_E2M1: P's E2M1 conversion at the issue cost of sm_120's instruction.
Everything else runs as shipped: the TMA ring, delta_s (precomputed per query block and key by its
own kernel, inside the timed call; or corrected in the loop: "bounded"), the online softmax, P's
two-level quantization, the epilogue. The values are wrong by design.

It prints the sm_90 mma.sync rate it measured (the calibration against sm_120's FP4 rate), then
for D 64/128, causal or not, 4k-32k tokens and GQA: the kernel's time with the defaults (per-block
Q means, delta_s precomputed), the bounded-memory mode (per-block Q means, corrected in the loop)
and with one Q mean (no block residuals), next to torch SDPA (bf16; FlashAttention too
when installed) on the same GPU. TOPS = 4 x heads x S^2 x D (half that when causal) / time. --baseline TREE: also the kernel of
another source tree (its sageattn3/csrc, e.g. `git worktree add` of an earlier commit) in the same
run, the "before" of a change (in the precision tables too: its all-FP8 Q·Kᵀ and FP8 P·V runs).
--heads H: the first table alone, with H heads (no GQA rows): few heads, few CTAs. The last
table: D 128's raw 16-bit rows (every head), beside FP4 and MXFP8 Q·Kᵀ (``raw16_table``).
Needs nvcc (CUDA_HOME or PATH) and a GPU of compute capability 9.0; torch only for SDPA."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "sageattn3" / "csrc"
sys.path.insert(0, str(ROOT))

from ci.toolchain.flags import device_flags  # noqa: E402  (a real build's device flags)
from ci.checks.kernel_report import hopper_gpu, nvcc_path  # noqa: E402

SEQS = (4096, 8192, 16384, 32768)
HEADS = 16
GQA = ((32, 8),)  # (q heads, kv heads)
MODES = ("defaults", "bounded", "one-mean")
BASE_MODES = ("defaults", "one-mean")
QK_MODES = ("defaults", "auto-fp4", "fp8")  # a baseline tree from before the workspace: no bounded mode
PV_MODES = ("defaults", "pv8", "fp8", "qk8-pv8")  # FP8 P·V (opt-in) beside FP4 and FP8 Q·Kᵀ


def build(nvcc: Path, out: Path, n_mma: int, csrc: Path = CSRC, tag: str = "") -> Path:
    exe = out / f"standin_mma{n_mma}{tag}"
    cmd = [str(nvcc), "-gencode=arch=compute_90a,code=sm_90a", *device_flags(mma_model=True), f"-I{csrc}",
           f"-DSAGEATTN3_TIMING_STANDIN_MMA={n_mma}", "-DSAGEATTN3_TIMING_STANDIN_E2M1",
           str(ROOT / "tests" / "bench" / "attention_standin.cu"), str(csrc / "attn" / "attn_launch.cu"), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"attention_standin: build failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return exe


def parse(line: str) -> dict:
    return {k: (float(v) if k in ("ms", "tflops", "flop_per_clk_sm") else v)
            for k, v in (kv.split("=", 1) for kv in line.split()[1:])}


def run(exe: Path, *args) -> dict:
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"attention_standin: {exe.name} {' '.join(map(str, args))} failed:\n{r.stdout}{r.stderr}")
    return parse(r.stdout.strip().splitlines()[-1])


def flops(d: int, s: int, hq: int, causal: int) -> float:
    return 4.0 * hq * s * s * d / (2 if causal else 1)


def sdpa_ms(d: int, s: int, hq: int, hkv: int, causal: int) -> dict[str, float]:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}
    import statistics

    q = torch.randn(1, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def t(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        return statistics.median(out)

    res = {"sdpa": t(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), enable_gqa=hq != hkv))}
    try:
        from flash_attn import flash_attn_func

        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        res["flash_attn"] = t(lambda: flash_attn_func(qt, kt, vt, causal=bool(causal)))
    except ImportError:
        pass
    return res


def raw16_table(exe: Path, quick: bool, results: dict) -> None:
    """D 128's raw 16-bit rows (the heads the rule's second statistic picks): every head on them,
    with FP4 and FP8 P·V, beside FP4 and MXFP8 Q·Kᵀ. Their bf16 MMAs are the H200's own instruction
    and the FP4 ones x4 fp16 stand-ins: Hopper's cost of the extra MMAs, not sm_120's rate."""
    print("\nraw 16-bit rows at D 128 (x4 stand-in; bf16 MMAs native)")
    print(f"{'tokens':>6} {'causal':>6} | {'fp4 ms':>8} {'fp8 ms':>8} {'raw16 ms':>8} {'qk8+pv8 ms':>10} "
          f"{'raw16+pv8 ms':>12} | {'raw16/fp4':>9} {'raw16/fp8':>9} {'raw16+pv8/qk8+pv8':>17}")
    for s, c in [(s, c) for c in (0, 1) for s in ((8192, 32768) if not quick else (32768,))]:
        row = {"D": 128, "S": s, "hq": HEADS, "hkv": HEADS, "causal": c, "raw16": True}
        for m in ("defaults", "fp8", "raw16", "qk8-pv8", "raw16-pv8"):
            row[m] = run(exe, 128, s, HEADS, HEADS, c, m)["ms"]
        print(f"{s:>6} {c:>6} | {row['defaults']:8.3f} {row['fp8']:8.3f} {row['raw16']:8.3f} {row['qk8-pv8']:10.3f} "
              f"{row['raw16-pv8']:12.3f} | {row['raw16'] / row['defaults']:9.3f} {row['raw16'] / row['fp8']:9.3f} "
              f"{row['raw16-pv8'] / row['qk8-pv8']:17.3f}")
        results["rows"].append({**row, "D": 128})


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    json_out = Path(argv[argv.index("--json") + 1]) if "--json" in argv else None
    baseline = Path(argv[argv.index("--baseline") + 1]).resolve() / "sageattn3" / "csrc" if "--baseline" in argv else None
    if baseline is not None and not (baseline / "attn" / "attn_launch.cu").exists():
        sys.exit(f"attention_standin: --baseline needs a source tree with sageattn3/csrc/attn/attn_launch.cu ({baseline})")
    nvcc = nvcc_path()
    if nvcc is None:
        print("attention_standin: no nvcc (set CUDA_HOME), skipped")
        return 0
    name = hopper_gpu("attention_standin")
    if name is None:
        return 0
    print(f"device: {name}; building the stand-in kernel (fp16 mma.sync x4 and x2 per FP4 MMA)")
    results: dict = {"device": name, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(4, CSRC, ""), (2, CSRC, "")] + ([(4, baseline, "_baseline")] if baseline else [])
        with ThreadPoolExecutor(len(jobs)) as pool:
            exe4, exe2, *base = pool.map(lambda j: build(nvcc, Path(tmp), *j), jobs)
        rate = run(exe4, "mma")
        results["mma_rate"] = rate
        sm120 = 4096.0  # FP4 FLOP/clk/SM of the sm_120 family (docs/performance.md)
        print(f"sm_90 fp16 mma.sync: {rate['tflops']:.0f} TFLOP/s = {rate['flop_per_clk_sm']:.0f} FLOP/clk/SM at the "
              f"{rate['clock_mhz']} MHz nominal clock ({rate['sms']} SMs); the sm_120 FP4 MMA: {sm120:.0f} FLOP/clk/SM, "
              f"so x4 runs the MMAs {sm120 / rate['flop_per_clk_sm']:.2f}x slower per clock than sm_120 would")
        seqs = (4096, 32768) if quick else SEQS
        heads = int(argv[argv.index("--heads") + 1]) if "--heads" in argv else HEADS
        configs = [(d, s, heads, heads, c) for d in (128, 64) for c in (0, 1) for s in seqs]
        if "--heads" not in argv:
            configs += [(128, s, hq, hkv, c) for hq, hkv in GQA for c in (0, 1) for s in (8192, 32768)]
        if "--precision-only" in argv:  # only the tables of the per-head Q·Kᵀ precision and of FP8 P·V
            configs = []
        hdr = (f"{'D':>4} {'tokens':>6} {'heads':>6} {'causal':>6} | {'SDPA ms':>8} {'TOPS':>5} | "
               + (f"{'before: defaults ms':>19} {'one-mean ms':>11} | " if base else "") + f"{'defaults ms':>11} "
               f"{'TOPS':>5} {'/SDPA':>6} | {'bounded ms':>10} | {'one-mean ms':>11} {'TOPS':>5} | {'defaults/one-mean':>17} | "
               f"{'x2 defaults':>11} {'x2 one-mean':>11}")
        print(hdr)
        for d, s, hq, hkv, c in configs:
            row = {"D": d, "S": s, "hq": hq, "hkv": hkv, "causal": c}
            for m in MODES:
                row[m] = run(exe4, d, s, hq, hkv, c, m)["ms"]
                if base and m in BASE_MODES:
                    row[f"before {m}"] = run(base[0], d, s, hq, hkv, c, m)["ms"]
            if s == seqs[-1]:
                for m in BASE_MODES:
                    row[f"x2 {m}"] = run(exe2, d, s, hq, hkv, c, m)["ms"]
            row.update(sdpa_ms(d, s, hq, hkv, c))
            f = flops(d, s, hq, c)
            tops = lambda ms: f / (ms * 1e-3) / 1e12 if ms else float("nan")  # noqa: E731
            sd = row.get("sdpa")
            print(f"{d:>4} {s:>6} {f'{hq}/{hkv}':>6} {c:>6} | {sd or float('nan'):8.3f} {tops(sd):5.0f} | "
                  + (f"{row['before defaults']:19.3f} {row['before one-mean']:11.3f} | " if base else "")
                  + f"{row['defaults']:11.3f} {tops(row['defaults']):5.0f} {(row['defaults'] / sd) if sd else float('nan'):6.2f} | "
                  f"{row['bounded']:10.3f} | {row['one-mean']:11.3f} {tops(row['one-mean']):5.0f} | {row['defaults'] / row['one-mean']:17.3f} | "
                  f"{row.get('x2 defaults', float('nan')):11.3f} {row.get('x2 one-mean', float('nan')):11.3f}"
                  + (f" | flash_attn {row['flash_attn']:.3f} ms" if "flash_attn" in row else ""))
            results["rows"].append(row)
        if "--heads" not in argv:
            # the per-head Q·Kᵀ precision: today's FP4 path, "auto" where no head needs help (the FP8
            # kernel launched and skipping every tile), every head in FP8
            print("\nper-head Q·Kᵀ precision (x4 stand-in; FP8 MMAs issued as FP4's: half the work at half the rate)")
            print(f"{'D':>4} {'tokens':>6} {'heads':>6} {'causal':>6} | {'fp4 ms':>8} {'auto, no FP8 head ms':>20} "
                  f"{'all FP8 ms':>10} | {'auto/fp4':>8} {'fp8/fp4':>7}" + (" | before: fp4 ms  all FP8 ms  fp8/fp4" if base else ""))
            for d, s in [(d, s) for d in (128, 64) for s in ((8192, 32768) if not quick else (32768,))]:
                row = {"D": d, "S": s, "hq": HEADS, "hkv": HEADS, "causal": 0, "qk": True}
                for m in QK_MODES:
                    row[m] = run(exe4, d, s, HEADS, HEADS, 0, m)["ms"]
                    if base and m != "auto-fp4":
                        row[f"before {m}"] = run(base[0], d, s, HEADS, HEADS, 0, m)["ms"]
                print(f"{d:>4} {s:>6} {f'{HEADS}/{HEADS}':>6} {0:>6} | {row['defaults']:8.3f} {row['auto-fp4']:20.3f} "
                      f"{row['fp8']:10.3f} | {row['auto-fp4'] / row['defaults']:8.3f} {row['fp8'] / row['defaults']:7.3f}"
                      + (f" | {row['before defaults']:14.3f} {row['before fp8']:11.3f} "
                         f"{row['before fp8'] / row['before defaults']:7.3f}" if base else ""))
                results["rows"].append(row)
            # FP8 P·V (pv_precision="fp8", opt-in): every head, with FP4 or FP8 Q·Kᵀ
            print("\nFP8 P·V (x4 stand-in; FP8 MMAs issued as FP4's: half the work at half the rate)")
            print(f"{'D':>4} {'tokens':>6} {'heads':>6} {'causal':>6} | {'fp4 ms':>8} {'pv8 ms':>8} {'qk8 ms':>8} "
                  f"{'qk8+pv8 ms':>10} | {'pv8/fp4':>7} {'qk8+pv8/qk8':>11}"
                  + (" | before: pv8 ms  qk8+pv8 ms" if base else ""))
            for d, s, c in [(d, s, c) for d in (128, 64) for c in (0, 1) for s in ((8192, 32768) if not quick else (32768,))]:
                row = {"D": d, "S": s, "hq": HEADS, "hkv": HEADS, "causal": c, "pv": True}
                for m in PV_MODES:
                    row[m] = run(exe4, d, s, HEADS, HEADS, c, m)["ms"]
                    if base and m in ("pv8", "qk8-pv8"):
                        row[f"before {m}"] = run(base[0], d, s, HEADS, HEADS, c, m)["ms"]
                print(f"{d:>4} {s:>6} {f'{HEADS}/{HEADS}':>6} {c:>6} | {row['defaults']:8.3f} {row['pv8']:8.3f} "
                      f"{row['fp8']:8.3f} {row['qk8-pv8']:10.3f} | {row['pv8'] / row['defaults']:7.3f} "
                      f"{row['qk8-pv8'] / row['fp8']:11.3f}"
                      + (f" | {row['before pv8']:14.3f} {row['before qk8-pv8']:11.3f}" if base else ""))
                results["rows"].append(row)
            raw16_table(exe4, quick, results)
    if json_out:
        json_out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
