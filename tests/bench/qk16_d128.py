"""What bf16 rows at D 128 would buy against MXFP8 rows, and how the rule could pick their heads (CPU
reference; the study behind the raw 16-bit rows, which the rule now picks by ``qk16_stat``; here
turned off for both rungs):

    python tests/bench/qk16_d128.py                      # seeds 2025 0 1 2 3, every hard case
    python tests/bench/qk16_d128.py --seeds 2025 --cases qk_massive

At D 128 the heads that leave FP4 run Q·Kᵀ in MXFP8 on rotated rows; at D 64 in bf16 rows
(``reference.qk16_rows``). For each head of each hard case (D 128, batch 1, 4 q heads over 2 kv
heads, SEQ tokens, causal or not) this prints:
- the cos-sim against float64 exact attention with every head on the precise rung
  (qk_precision="fp8"), MXFP8 rows as the kernels run them, and bf16 rows instead (the D 64 rung
  moved to D 128 for this study: ``QK16_HEAD_DIM`` patched in the reference's modules);
- the rule's estimate of the MXFP8 rung's own error (``reference.treatment_errors``, set
  rotation + FP8 Q·Kᵀ, the call's causality): a selector for the heads MXFP8 serves badly.
Then, per threshold, how many heads the selector would give bf16 rows, and how many heads below
0.98 with MXFP8 it would miss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "sageattn3"), str(ROOT / "tests")]

import attention_cases as ac  # noqa: E402
from sageattn3 import reference as ref  # noqa: E402
from sageattn3.reference import preprocessing, treatments  # noqa: E402

HARD = ("q_outliers", "k_outliers", "qk_outliers", "peaky", "rope_bias", "k_sink", "mixed_heads", "qk_massive")
ROTATED_FP8 = treatments.ROTATION | treatments.QK_FP8
THRESHOLDS = (0.16, 0.17, 0.18, 0.19, 0.2)


def precise_rung(head_dim: int) -> None:
    """The head dim whose precise rung is bf16 rows (the reference's modules hold the constant)."""
    treatments.QK16_HEAD_DIM = preprocessing.QK16_HEAD_DIM = head_dim


def heads(case: str, seed: int, causal: bool, seq: int) -> list[dict]:
    q, k, v = ac.make(case, 1, 4, 2, seq, seq, 128, seed=seed)
    exact = ref.exact_attention(q, k, v, is_causal=causal).double()
    pre = ref.preprocess(q, k, v, per_block_mean=True)
    outs = {}
    limit = ref.QK16_STAT_LIMIT
    ref.QK16_STAT_LIMIT = float("inf")  # no raw 16-bit rows: the rungs under study alone
    try:
        est = treatments.treatment_errors(q, k, v, pre, sets=[ROTATED_FP8], is_causal=causal)[0, :, ROTATED_FP8]
        for rung, head_dim in (("mxfp8", 64), ("bf16", 128)):
            precise_rung(head_dim)
            try:
                outs[rung] = ref.sageattn3(q, k, v, is_causal=causal, qk_precision="fp8")
            finally:
                precise_rung(64)
    finally:
        ref.QK16_STAT_LIMIT = limit
    return [dict(case=case, seed=seed, causal=causal, head=h, estimate=float(est[h]),
                 **{rung: ac.cos_sim(o[0, h].double(), exact[0, h]) for rung, o in outs.items()}) for h in range(4)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[2025, 0, 1, 2, 3])
    ap.add_argument("--cases", nargs="+", default=list(HARD), choices=HARD)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args(argv)
    rows = []
    print("| case | seed | causal | MXFP8 estimate per head | cos, MXFP8 rows | cos, bf16 rows |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in args.cases:
        for seed in args.seeds:
            for causal in (False, True):
                got = heads(case, seed, causal, args.seq)
                rows += got
                cell = lambda key, f: " ".join(f.format(r[key]) for r in got)  # noqa: E731
                print(f"| {case} | {seed} | {'yes' if causal else 'no'} | {cell('estimate', '{:.3f}')} | "
                      f"{cell('mxfp8', '{:.4f}')} | {cell('bf16', '{:.4f}')} |", flush=True)
    bad = [r for r in rows if r["mxfp8"] < 0.98]
    print(f"\n{len(rows)} heads; below 0.98 with MXFP8 rows: {len(bad)}; the lowest with bf16 rows: "
          f"{min(r['bf16'] for r in rows):.4f}")
    for t in THRESHOLDS:
        picked = [r for r in rows if r["estimate"] > t]
        print(f"estimate > {t}: {len(picked)} heads take bf16 rows ({', '.join(sorted({r['case'] for r in picked})) or '-'}); "
              f"heads below 0.98 it misses: {sum(r['estimate'] <= t for r in bad)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
