"""The rule's spread bound on data whose FP4 error sits on a few rows: per head, the plain ratio
of ``reference.qk_fp4_error`` (``precision.AUTO_ERROR_SPREAD`` = 0) against the bound (the default), and
where each sends the head, against float64 exact attention (the reference, CPU):

    python tests/bench/rule_spread.py                 # the summary and every head that misses 0.98
    python tests/bench/rule_spread.py --seeds 0 --seqs 768 --cases key_norm_x60
    python tests/bench/rule_spread.py --easy          # the table's easy cases: the bound moves none

Cases (none of tests/attention_cases.py; Gaussian unless said, 4 q heads over 2, bf16):
- ``key_norm_x10/x30/x60``: key 0 of every kv head scaled by 10, 30 or 60 (a sink of huge norm;
  the queries whose score on it is near their others' carry FP4's error);
- ``student_t3``, ``student_t2.5``: Q and K elements from Student's t (3 and 2.5 degrees of
  freedom: heavy tails);
- ``low_rank2/4/16``: Q and K in a shared random subspace of that rank;
- ``k_massive``: three channels of K alone scaled by 20, 40 and 60 (not the spread's case: every
  head leaves FP4 either way, and at D 128 MXFP8 is what limits it; the raw 16-bit rows' statistic
  reads 6-7 there, below its limit);
- ``zero_mean``: plain Gaussian Q, K, V, the data that needs no help (its heads must stay FP4).

Columns per case: heads below 0.98 with the plain ratio's choice and with the bound's, the lowest
head with each, the heads each sends to FP8 Q·Kᵀ, and the largest plain ratio and bound among the
heads below 0.98 that the plain ratio keeps in FP4.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "sageattn3"))  # the source tree's reference (no build needed)

import attention_cases as ac  # noqa: E402
from sageattn3 import reference as ref  # noqa: E402
from sageattn3.reference import precision  # noqa: E402

CASES = ("key_norm_x10", "key_norm_x30", "key_norm_x60", "student_t3", "student_t2.5", "low_rank2", "low_rank4",
         "low_rank16", "k_massive", "zero_mean")


def make(case: str, seq: int, d: int, seed: int, hq: int = 4, hk: int = 2):
    """q (1, hq, seq, d), k and v (1, hk, seq, d) of ``case``, bf16, on the CPU."""
    g = torch.Generator().manual_seed(1000 + seed)
    shape_q, shape_k = (1, hq, seq, d), (1, hk, seq, d)
    q, k, v = torch.randn(shape_q, generator=g), torch.randn(shape_k, generator=g), torch.randn(shape_k, generator=g)
    if case.startswith("key_norm_x"):
        k[..., 0, :] *= float(case.removeprefix("key_norm_x"))
    elif case == "k_massive":
        channels = torch.randperm(d, generator=g)[:3]
        k[..., channels] *= torch.tensor(ac.MASSIVE_SCALES)
    elif case.startswith("student_t"):
        t = torch.distributions.StudentT(float(case.removeprefix("student_t")))
        torch.manual_seed(seed)
        q, k = t.sample(shape_q), t.sample(shape_k)
    elif case.startswith("low_rank"):
        r = int(case.removeprefix("low_rank"))
        basis = torch.randn(r, d, generator=g) * (1.5 if r < 16 else 0.5)
        q = torch.randn(1, hq, seq, r, generator=g) @ basis
        k = torch.randn(1, hk, seq, r, generator=g) @ basis
    elif case != "zero_mean":
        raise ValueError(f"unknown case {case!r}: one of {', '.join(CASES)}")
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def estimates(q, k, v, pre) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.qk_fp4_error`` as the rule computes it (the bound) and without the spread (the
    plain ratio: ``precision.AUTO_ERROR_SPREAD`` 0 for the one call)."""
    bound = ref.qk_fp4_error(q, k, v, pre)
    spread, precision.AUTO_ERROR_SPREAD = precision.AUTO_ERROR_SPREAD, 0.0
    try:
        return bound, ref.qk_fp4_error(q, k, v, pre)
    finally:
        precision.AUTO_ERROR_SPREAD = spread


def heads(case: str, seq: int, d: int, seed: int) -> list[dict]:
    """Each head's plain ratio, bound, and cos-sim against exact attention with FP4 and FP8 Q·Kᵀ."""
    q, k, v = make(case, seq, d, seed)
    exact = ref.exact_attention(q, k, v)
    pre = ref.preprocess(q, k, v, qk_precision="fp4")
    bound, plain = estimates(q, k, v, pre)
    o4, o8 = ref.sageattn3(q, k, v, qk_precision="fp4"), ref.sageattn3(q, k, v, qk_precision="fp8")
    return [{"plain": float(plain[0, h]), "bound": float(bound[0, h]), "fp4": ac.cos_sim(o4[0, h], exact[0, h]),
             "fp8": ac.cos_sim(o8[0, h], exact[0, h]), "where": f"{case} D{d} {seq} seed {seed} head {h}"}
            for h in range(q.shape[1])]


def summarize(case: str, rows: list[dict], limit: float) -> str:
    def cos(r, est):
        return r["fp8"] if r[est] > limit else r["fp4"]

    short = {est: sum(cos(r, est) < 0.98 for r in rows) for est in ("plain", "bound")}
    fp8 = {est: sum(r[est] > limit for r in rows) for est in ("plain", "bound")}
    missed = [r for r in rows if r["plain"] <= limit and r["fp4"] < 0.98]
    top = (f"{max(r['plain'] for r in missed):.3f} / {max(r['bound'] for r in missed):.3f}" if missed else "-")
    low = {est: min(cos(r, est) for r in rows) for est in ("plain", "bound")}
    return (f"| {case} | {len(rows)} | {short['plain']} | {short['bound']} | {low['plain']:.4f} / {low['bound']:.4f} | "
            f"{fp8['plain']} | {fp8['bound']} | {top} |")


EASY = ("randn", "k_bias", "zero_mean_v", "q_offset_x1", "q_offset_x3", "q_offset_x8", "q_drift", "large_logits")


def easy(seqs=(128, 300, 512, 700, 1024, 2048), seeds=range(8)) -> int:
    """The accuracy table's cases that need no help (tests/attention_cases.py, each in its own
    dtype), D 64 and 128: the largest plain ratio and bound over seeds and lengths, and every
    head whose choice the bound changes (the rule only: no attention is computed)."""
    limit = ref.AUTO_ERROR_LIMIT
    print(f"\nThe table's easy cases: D 64 and 128, {list(seqs)} tokens, seeds {list(seeds)}, 4 q heads over 2\n")
    print("| case | heads | largest plain ratio | largest bound | heads the bound moves to FP8 |\n"
          "| --- | --- | --- | --- | --- |")
    moved_all = []
    for case in EASY:
        plains, bounds, moved = [], [], []
        for d in (64, 128):
            for seq in seqs:
                for seed in seeds:
                    q, k, v = ac.make(case, 1, 4, 2, seq, seq, d, seed=seed)
                    pre = ref.preprocess(q, k, v, qk_precision="fp4")
                    bound, plain = (x[0] for x in estimates(q, k, v, pre))
                    plains += plain.tolist()
                    bounds += bound.tolist()
                    moved += [f"{case} D{d} {seq} seed {seed} head {h}: {float(plain[h]):.3f} -> {float(bound[h]):.3f}"
                              for h in range(4) if plain[h] <= limit < bound[h]]
        print(f"| {case} | {len(plains)} | {max(plains):.3f} | {max(bounds):.3f} | {len(moved)} |", flush=True)
        moved_all += moved
    for m in moved_all:
        print(f"  moved: {m}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--seqs", nargs="+", type=int, default=[768, 2048])
    ap.add_argument("--easy", action="store_true", help="only the table's easy cases (the rule alone, no attention)")
    args = ap.parse_args(argv)
    if args.easy:
        return easy()
    limit = ref.AUTO_ERROR_LIMIT
    print(f"AUTO_ERROR_LIMIT {limit}, AUTO_ERROR_SPREAD {precision.AUTO_ERROR_SPREAD}; D 64 and 128, "
          f"{args.seqs} tokens, seeds {args.seeds}, 4 q heads over 2, bf16, not causal")
    print("\n| case | heads | < 0.98, plain ratio | < 0.98, bound | lowest head: plain / bound | FP8, plain | "
          "FP8, bound | missed by the plain ratio: its largest ratio / bound |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    misses = []
    for case in args.cases:
        rows = [r for d in (64, 128) for seq in args.seqs for seed in args.seeds for r in heads(case, seq, d, seed)]
        print(summarize(case, rows, limit), flush=True)
        misses += [r for r in rows if (r["fp8"] if r["bound"] > limit else r["fp4"]) < 0.98]
    print("\nHeads below 0.98 with the bound:")
    for r in misses:
        print(f"  {r['where']}: ratio {r['plain']:.3f}, bound {r['bound']:.3f}, FP4 {r['fp4']:.4f}, FP8 {r['fp8']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
