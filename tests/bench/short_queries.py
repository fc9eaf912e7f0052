"""Short queries against longer keys: what "auto" gives with the rule's limit on every call (before
``AUTO_SHORT_QUERY_ROWS``) and with today's defaults (a call of 2 to 127 query rows gives every head
FP8 Q·Kᵀ: ``reference.rule_limit``), per head, against float64 exact attention (the reference, CPU):

    python tests/bench/short_queries.py                       # the summary and every head below 0.98
    python tests/bench/short_queries.py --sqs 8 --sks 2048 --cases qk_outliers --seeds 5
    python tests/bench/short_queries.py --mean-term   # why: the estimate with Q's mean in its scores
    python tests/bench/short_queries.py --mean-study  # that estimate (every key) against the rule's, per head

Cases: tests/attention_cases.py's hard ones (``HARD_CASES`` and ``TREATMENT_CASES``) and the ones
that need no help (``EASY_CASES``), 4 q heads over 2, each in its own dtype, not causal.

Per head dim, query rows and keys: the heads below 0.98 and the lowest head with the rule's limit
on every call ("rule") and with the defaults; then each head below 0.98 either way, with the
rule's estimate (``qk_fp4_error``): with few rows the estimate misses heads whose FP4 Q·Kᵀ error is
large (Q's mean, a large part of every score there, is not in the scores it compares).
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

CASES = ac.HARD_CASES + ac.TREATMENT_CASES + ac.EASY_CASES


def head_cos(out: torch.Tensor, exact: torch.Tensor) -> list[float]:
    """Cos-sim of each q head of a batch-1 output against exact attention (``ac.cos_sim``)."""
    return [ac.cos_sim(out[0, h], exact[0, h]) for h in range(out.shape[1])]


def defaults(q, k, v, short_rows: int) -> torch.Tensor:
    """``ref.sageattn3`` with the defaults and ``AUTO_SHORT_QUERY_ROWS`` set to ``short_rows`` (0:
    the rule's limit on every call)."""
    keep = ref.AUTO_SHORT_QUERY_ROWS
    ref.AUTO_SHORT_QUERY_ROWS = short_rows
    try:
        return ref.sageattn3(q, k, v)
    finally:
        ref.AUTO_SHORT_QUERY_ROWS = keep


def heads(case: str, sq: int, sk: int, d: int, seed: int) -> list[dict]:
    """One dict per q head: where, the rule's estimate, cos-sim with the rule's limit and with the
    defaults."""
    q, k, v = ac.make(case, 1, 4, 2, sq, sk, d, seed=seed)
    exact = ref.exact_attention(q, k, v)
    est = ref.qk_fp4_error(q, k, v, ref.preprocess(q, k, v, qk_precision="fp4"))[0].tolist()
    rule = head_cos(defaults(q, k, v, 0), exact)
    now = head_cos(defaults(q, k, v, ref.AUTO_SHORT_QUERY_ROWS), exact)
    return [{"where": f"{case} D{d} {sq}x{sk} seed {seed} head {h}", "est": est[h], "rule": rule[h], "now": now[h]}
            for h in range(4)]


# The cold review's two heads: (case, sq, sk, D, seed, head)
REVIEW_HEADS = (("qk_outliers", 8, 2048, 128, 5, 3), ("qk_massive", 8, 2048, 64, 3, 2))


def mean_term(case: str, sq: int, sk: int, d: int, seed: int) -> dict:
    """The rule's estimate (defaults, not rotated) three ways, per q head: as built; with the
    correction ``mean_q · K_sᵀ`` added to both scores (the real scores' shape); and that over every
    key block, not the sampled ones. The rows are every query row (``query_stride`` is 1 here)."""
    from sageattn3.reference import precision as pr

    q, k, v = ac.make(case, 1, 4, 2, sq, sk, d, seed=seed)
    pre = ref.preprocess(q, k, v, qk_precision="fp4")
    assert pr.query_stride(sq, sk) == 1 and not pre.qk_rotation
    qs, qd = q.float() - pre.mean_q[..., :1, :], ref.dequantize_rows(pre.q_packed, pre.q_scales)[..., :sq, :]
    ks_all = k.float() - pre.mean_k
    kd_all = ref.dequantize_rows(pre.k_packed, pre.k_scales)[..., :sk, :]
    blocks = torch.cat([torch.arange(b * 128, min(sk, b * 128 + 128)) for b in ref.sample_blocks(sk)])
    scale = d ** -0.5

    def estimate(keys, with_mean: bool) -> list[float]:
        ks, kd, vs = (ref.expand_kv(x[..., keys, :], 4) for x in (ks_all, kd_all, v.float()))
        ds = pre.mean_q[..., :1, :] @ ks.transpose(-1, -2) if with_mean else 0.0
        o = torch.softmax((qs @ ks.transpose(-1, -2) + ds) * scale, -1) @ vs
        o4 = torch.softmax((qd @ kd.transpose(-1, -2) + ds) * scale, -1) @ vs
        return pr.spread_bound((o4 - o).square().sum(-1), o.square().sum(-1), sq)[0].tolist()

    return {"built": ref.qk_fp4_error(q, k, v, pre)[0].tolist(), "with mean": estimate(blocks, True),
            "with mean, every key": estimate(torch.arange(sk), True)}


def mean_study(sqs, sks, seeds, cases) -> int:
    """Over the grid (2 to 127 query rows): which heads each estimate sends to the precise Q·Kᵀ
    (above ``AUTO_ERROR_LIMIT``), the rule's as built and one with Q's mean in both scores over
    every key (``mean_term``), against what the heads need: a head "needs it" where FP4 Q·Kᵀ is
    below 0.98 and FP8 Q·Kᵀ reaches 0.98 (NVFP4 P·V in both: P's error is the P·V rule's, which
    this estimate does not replace). Missed: needs it, kept FP4; needless: FP4 reaches 0.98, sent."""
    limit = ref.AUTO_ERROR_LIMIT
    tally = {"heads": 0, "need": 0, "missed built": 0, "missed mean": 0, "needless built": 0, "needless mean": 0}
    missed = []
    for d in (64, 128):
        for sq in [s for s in sqs if 1 < s < ref.AUTO_SHORT_QUERY_ROWS]:
            for sk in sks:
                for case in cases:
                    for seed in seeds:
                        q, k, v = ac.make(case, 1, 4, 2, sq, sk, d, seed=seed)
                        exact = ref.exact_attention(q, k, v)
                        fp4, fp8 = (head_cos(ref.sageattn3(q, k, v, qk_precision=p, pv_precision="fp4"), exact)
                                    for p in ("fp4", "fp8"))
                        est = mean_term(case, sq, sk, d, seed)
                        for h in range(4):
                            b, m = est["built"][h], est["with mean, every key"][h]
                            need, fine = fp4[h] < 0.98 <= fp8[h], fp4[h] >= 0.98
                            tally["heads"] += 1
                            tally["need"] += need
                            tally["missed built"] += need and b <= limit
                            tally["missed mean"] += need and m <= limit
                            tally["needless built"] += fine and b > limit
                            tally["needless mean"] += fine and m > limit
                            if need and m <= limit:
                                missed.append(f"{case} D{d} {sq}x{sk} seed {seed} head {h}: FP4 {fp4[h]:.4f}, "
                                              f"FP8 {fp8[h]:.4f}; estimate built {b:.3f}, with the mean {m:.3f}")
    print("; ".join(f"{k} {v}" for k, v in tally.items()))
    print("Missed with the mean's term:")
    for line in missed:
        print(f"  {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--sqs", nargs="+", type=int, default=[1, 2, 4, 8, 32, 64, 96, 128])
    ap.add_argument("--sks", nargs="+", type=int, default=[512, 4096])
    ap.add_argument("--mean-term", action="store_true", help="only the review's two heads' estimates, three ways")
    ap.add_argument("--mean-study", action="store_true", help="the estimate with Q's mean against the rule's")
    args = ap.parse_args(argv)
    if args.mean_study:
        return mean_study(args.sqs, args.sks, args.seeds, args.cases)
    if args.mean_term:
        for case, sq, sk, d, seed, h in REVIEW_HEADS:
            est = mean_term(case, sq, sk, d, seed)
            print(f"{case} D{d} {sq}x{sk} seed {seed} head {h}: "
                  + "; ".join(f"{name} {vals[h]:.3f}" for name, vals in est.items()))
        return 0
    print(f"AUTO_ERROR_LIMIT {ref.AUTO_ERROR_LIMIT}, AUTO_SHORT_QUERY_ROWS {ref.AUTO_SHORT_QUERY_ROWS}; "
          f"cases {len(args.cases)}, seeds {args.seeds}, 4 q heads over 2, not causal")
    print("\n| D | query rows | keys | heads | < 0.98, rule | < 0.98, defaults | lowest head: rule / defaults |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    below = []
    for d in (64, 128):
        for sq in args.sqs:
            for sk in args.sks:
                rows = [r for case in args.cases for seed in args.seeds for r in heads(case, sq, sk, d, seed)]
                n_rule = sum(r["rule"] < 0.98 for r in rows)
                n_now = sum(r["now"] < 0.98 for r in rows)
                low_rule, low_now = min(r["rule"] for r in rows), min(r["now"] for r in rows)
                print(f"| {d} | {sq} | {sk} | {len(rows)} | {n_rule} | {n_now} | {low_rule:.4f} / {low_now:.4f} |",
                      flush=True)
                below += [r for r in rows if min(r["rule"], r["now"]) < 0.98]
    print("\nHeads below 0.98 either way (estimate; rule -> defaults):")
    for r in below:
        print(f"  {r['where']}: estimate {r['est']:.3f}; {r['rule']:.4f} -> {r['now']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
