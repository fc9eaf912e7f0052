"""The treatments study: on every hard case of tests/attention_cases.py (HARD_CASES and
TREATMENT_CASES), D 64/128, causal or not, the cos-sim against float64 exact attention of the
reference (``sageattn3.reference``, CPU) under each treatment of the per-head rule the issue asks
for, alone and combined:

    python tests/bench/treatments.py                # the table (markdown) on stdout
    python tests/bench/treatments.py --seq 512 --cases qk_massive large_logits

Columns (every head of a call treated alike; the options on top of the defaults, as a caller
passing them gets them):
- "default": ``sageattn3`` as called with no option (qk_precision="auto": FP8 Q·Kᵀ on rotated
  rows where the rule picks it), and its FP8 heads (FP8 Q·Kᵀ in the columns below is on rotated
  rows too, unlike the chooser's set Q, which stays unrotated: ``treatment_kwargs``);
- "FP4": every head FP4 (qk_precision="fp4", today's kernels without "auto");
- "+ balance", "+ rotation", "+ scale search": the defaults plus that option alone (the rule
  runs on the rows the options make, and the defaults' rows are a floor);
- "all three": balance + rotation + scale search;
- "FP8 Q·Kᵀ + balance": qk_precision="fp8" with qk_balance;
- "FP8 P·V": pv_precision="fp8" with FP4 Q·Kᵀ; "FP8 Q·Kᵀ + P·V": both in FP8;
- "rot + FP8 Q·Kᵀ (+ P·V)": the rotation with FP8 Q·Kᵀ (``qk_fp8_rotated``; the kernels run it
  too), and with FP8 P·V too (reference only);
- "chooser": the per-head rule (``reference.treatment_errors`` with the call's causality, then
  ``choose_treatments``; opt-in, not a default), its cos-sim and each head's set (B balance,
  R rotation, S scale search, Q FP8 Q·Kᵀ, P FP8 P·V; "-" plain FP4); "chooser, all three forced":
  the same with balance, rotation and scale search as floors.
Shapes: batch 1, 4 q heads over 2 kv heads, SEQ tokens, each case's own dtype, seed 2025 (the
accuracy table's).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "sageattn3"))  # the source tree's reference (no build needed)

import attention_cases as ac  # noqa: E402
from sageattn3 import reference as ref  # noqa: E402

SEQ = 1024
SEED = 2025
CASES = (*ac.HARD_CASES, *ac.TREATMENT_CASES)
# (column, keywords of reference.sageattn3)
COLUMNS = (
    ("default", {}),
    ("FP4", {"qk_precision": "fp4"}),
    ("+ balance", {"qk_balance": True}),
    ("+ rotation", {"qk_rotation": True}),
    ("+ scale search", {"qk_scale_search": True}),
    ("all three", {"qk_balance": True, "qk_rotation": True, "qk_scale_search": True}),
    ("FP8 Q·Kᵀ + balance", {"qk_precision": "fp8", "qk_balance": True}),
    ("FP8 P·V", {"qk_precision": "fp4", "pv_precision": "fp8"}),
    ("FP8 Q·Kᵀ + P·V", {"qk_precision": "fp8", "pv_precision": "fp8"}),
    ("rot + FP8 Q·Kᵀ", {"qk_rotation": True, "qk_precision": "fp8", "qk_fp8_rotated": True}),
    ("rot + FP8 Q·Kᵀ + P·V", {"qk_rotation": True, "qk_precision": "fp8", "qk_fp8_rotated": True,
                              "pv_precision": "fp8"}),
)


LETTERS = "BRSQP"  # reference.TREATMENTS, in order
FLOORS_ALL_THREE = ref.BALANCE | ref.ROTATION | ref.SCALE_SEARCH


def set_label(s: int) -> str:
    return "".join(c for i, c in enumerate(LETTERS) if (s >> i) & 1) or "-"


def chosen_output(q, k, v, causal: bool, errors: torch.Tensor, floors: int):
    sets = ref.choose_treatments(errors, floors=floors)
    return ref.sageattn3_treated(q, k, v, sets, is_causal=causal), sets


def measure(cases, seq: int) -> list[dict]:
    rows = []
    for case in cases:
        for d in (64, 128):
            for causal in (False, True):
                q, k, v = ac.make(case, 1, 4, 2, seq, seq, d, seed=SEED)
                exact = ref.exact_attention(q, k, v, is_causal=causal)
                row = {"case": case, "d": d, "causal": causal, "dtype": str(q.dtype).removeprefix("torch."),
                       "fp8_heads": int(ref.preprocess(q, k, v, qk_precision="auto").qk_fp8.sum())}
                for name, kw in COLUMNS:
                    row[name] = ac.cos_sim(ref.sageattn3(q, k, v, is_causal=causal, **kw), exact)
                errors = ref.treatment_errors(q, k, v, ref.preprocess(q, k, v, qk_precision="fp4"), is_causal=causal)
                out, sets = chosen_output(q, k, v, causal, errors, 0)
                row["chooser"], row["sets"] = ac.cos_sim(out, exact), " ".join(map(set_label, sets.flatten().tolist()))
                out, sets = chosen_output(q, k, v, causal, errors, FLOORS_ALL_THREE)
                row["forced"], row["forced_sets"] = ac.cos_sim(out, exact), " ".join(
                    map(set_label, sets.flatten().tolist()))
                rows.append(row)
                print(f"  {case:12s} D={d:3d} causal={causal!s:5s} " + " ".join(
                    f"{row[n]:.4f}" for n, _ in COLUMNS) + f" chooser {row['chooser']:.4f} ({row['sets']}) forced "
                    f"{row['forced']:.4f} ({row['forced_sets']})", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = ["case", "dtype", "D", "causal", "FP8 heads (default)"] + [n for n, _ in COLUMNS] + [
        "chooser", "sets per head", "chooser, all three forced", "sets per head (forced)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["case"], r["dtype"], str(r["d"]), "yes" if r["causal"] else "no", f"{r['fp8_heads']}/4"]
        cells += [f"{r[n]:.4f}" for n, _ in COLUMNS]
        cells += [f"{r['chooser']:.4f}", r["sets"], f"{r['forced']:.4f}", r["forced_sets"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens (queries and keys)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=ac.CASES, metavar="CASE",
                    help="cases of tests/attention_cases.py (default: the hard ones)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t0 = time.perf_counter()
    print(table(measure(args.cases, args.seq)))
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
