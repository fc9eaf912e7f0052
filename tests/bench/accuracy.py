"""The accuracy table of docs/accuracy.md, and the README's summary of it: FP4 attention against exact attention on the
hard inputs of tests/attention_cases.py, the published SageAttention3 algorithm side by side
with this package's.

    python tests/bench/accuracy.py                  # print the table (CPU, the reference)
    python tests/bench/accuracy.py --write-docs     # ... into docs/accuracy.md, its summary into README.md
    python tests/bench/accuracy.py --gpu            # also the kernels (sm_120/121, or an H100
                                                    # with the MMA-model test flavour installed)

Columns (cos-sim and relative L1 = sum|out - exact| / sum|exact| against exact attention,
computed in float64 from the bf16 inputs):
- "paper": ``sageattn3.reference.sageattn3_paper``, the algorithm as published (no rotation,
  plain NVFP4 scales, delta_s = mean_q · K_sᵀ materialised);
- "auto (default)": ``sageattn3.reference.sageattn3`` with this package's defaults: the per-head
  Q·Kᵀ precision (qk_precision="auto": FP8 Q·Kᵀ for the heads the rule picks, FP4 elsewhere;
  docs/accuracy-auto.md) and P·V precision (pv_precision="auto": MXFP8 P·V for the heads whose
  P or V the rule finds too coarse, NVFP4 elsewhere), delta_s = delta_key + r · K̂ᵀ (K̂ the quantized K plus its quantization
  residual), no balance, no rotation of the FP4 heads (the FP8 heads multiply rotated rows:
  ``sageattn3.reference.fp8_rows``), plain scales;
- "auto, seeds 0-7": the defaults on the same case drawn with seeds 0-7 (the other columns are
  seed 2025): the lowest cos-sim of a whole call, and of a single q head, against exact attention;
- "FP8 heads": how many heads the rule gives FP8 Q·Kᵀ and FP8 P·V with the defaults ("raw": of the
  FP8 Q·Kᵀ heads, those that multiply the raw 16-bit rows at D 128, ``Preprocessed.qk16``);
- the accuracy options, each on top of the defaults ("auto"; the rule runs on the rows they
  make, options as floors): "auto + balance" (qk_balance=True, the Q/K channel balance), "auto +
  rotation" (qk_rotation=True, which brings the scale search with it unless told otherwise),
  "auto + scale search" (qk_scale_search=True), "auto + all three" (balanced, then rotated, and
  quantized with the scale search); "FP8 Q·Kᵀ": qk_precision="fp8" (every head FP8 Q·Kᵀ, P·V as
  the rule picks);
- the speed choice: "FP4 Q·Kᵀ (speed)": qk_precision="fp4" (every head FP4, the rule does not
  run, so P·V is NVFP4 too: the defaults before "auto"), and "FP4 + balance": that with
  qk_balance=True;
- with --gpu: "kernels": ``sageattn3_blackwell`` (the preprocessing and attention kernels, the
  defaults) and its cos-sim against "auto (default)" on the same inputs; "kernels, all three": the
  same with the balance, the rotation and the scale search, against "auto + all three".
The reference is bit-exact with the kernels' quantization; the FP4 MMA itself was only ever run
as the H100 software model of the instruction. Shapes: batch 1, 4 q heads over 2 kv heads
(GQA), SEQ tokens, each case's own dtype (bf16; fp16 for large_logits); every case with a fixed
seed.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import attention_cases as ac  # noqa: E402

SEQ = 1024
SEEDS = 8  # the defaults' column over other draws of each case: seeds 0 .. SEEDS - 1
MARK_START, MARK_END = "<!-- accuracy:start -->", "<!-- accuracy:end -->"
SUMMARY_START, SUMMARY_END = "<!-- accuracy-summary:start -->", "<!-- accuracy-summary:end -->"
# The README's few rows (case, D, causal) and columns (by header) of the full table.
SUMMARY_ROWS = [("randn", 128, False), ("q_outliers", 128, False), ("k_outliers", 128, False),
                ("qk_outliers", 128, False), ("qk_massive", 128, False), ("peaky", 128, False),
                ("rope_bias", 128, False), ("large_logits", 128, False)]
SUMMARY_COLUMNS = ["inputs", "auto (default): cos / rel-L1", "auto + rotation", "auto + all three",
                   "FP4 Q·Kᵀ (speed)"]
LABELS = {
    "randn": "zero-mean Q, K, V",
    "q_offset_x1": "Q channel offsets x1",
    "q_offset_x3": "Q channel offsets x3",
    "q_offset_x8": "Q channel offsets x8",
    "q_outliers": "Q outlier channels x8..x20",
    "k_outliers": "K outlier channels x8..x20",
    "qk_outliers": "Q and K outliers, same channels",
    "k_bias": "K per-channel bias x8",
    "peaky": "near-one-hot rows (Q x4)",
    "zero_mean_v": "zero-mean V (Q/K offsets x3)",
    "q_drift": "Q offset drifting -8..+8 along the sequence",
    "rope_bias": "RoPE'd Q/K with channel offsets (x3 / x5)",
    "k_sink": "one huge constant K channel + 4 sink keys",
    "mixed_heads": "mixed heads: zero-mean, near-one-hot, 2 x RoPE'd",
    "qk_massive": "Q and K massive outliers x20..x60, same channels",
    "large_logits": "large logits: 4 sink keys, V x30 (fp16)",
    "v_sink": "4 sink keys whose V is 1/30 of the others'",
}


def _reference():
    if "--gpu" not in sys.argv[1:]:
        sys.path.insert(0, str(ROOT / "sageattn3"))  # the source tree's reference (no build needed)
    from sageattn3 import reference

    return reference


def measure(ref, gpu: bool) -> list[dict]:
    rows = []
    for case in ac.CASES:
        for d in (64, 128):
            for causal in (False, True):
                q, k, v = ac.make(case, 1, 4, 2, SEQ, SEQ, d, seed=2025)
                exact = ref.exact_attention(q, k, v, is_causal=causal)
                outs = {
                    "paper": ref.sageattn3_paper(q, k, v, is_causal=causal),
                    "ours": ref.sageattn3(q, k, v, is_causal=causal),
                    "bal": ref.sageattn3(q, k, v, is_causal=causal, qk_balance=True),
                    "rot": ref.sageattn3(q, k, v, is_causal=causal, qk_rotation=True),
                    "search": ref.sageattn3(q, k, v, is_causal=causal, qk_scale_search=True),
                    "all": ref.sageattn3(q, k, v, is_causal=causal, qk_balance=True, qk_rotation=True,
                                         qk_scale_search=True),
                    "fp8": ref.sageattn3(q, k, v, is_causal=causal, qk_precision="fp8"),
                    "fp4": ref.sageattn3(q, k, v, is_causal=causal, qk_precision="fp4"),
                    "fp4bal": ref.sageattn3(q, k, v, is_causal=causal, qk_balance=True, qk_precision="fp4"),
                }
                row_seeds = _other_seeds(ref, case, d, causal)
                pre = ref.preprocess(q, k, v, qk_precision="auto", is_causal=causal)
                heads = pre.qk_fp8
                row = {"case": case, "d": d, "causal": causal, "fp8_heads": int(heads.sum()), "heads": heads.numel(),
                       "pv8_heads": int(pre.pv_fp8.sum()) if pre.pv_fp8 is not None else 0,
                       "raw_heads": int(pre.qk16.sum()) if pre.qk16 is not None else 0}
                for name, out in outs.items():
                    row[name] = (ac.cos_sim(out, exact), ac.rel_l1(out, exact))
                row["seeds"] = row_seeds
                if gpu:
                    import sageattn3

                    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
                    kern = sageattn3.sageattn3_blackwell(qc, kc, vc, is_causal=causal, qk_balance=False).float().cpu()
                    row["kernels"] = (ac.cos_sim(kern, exact), ac.rel_l1(kern, exact))
                    row["kernels_vs_ours"] = ac.cos_sim(kern, outs["ours"])
                    kern = sageattn3.sageattn3_blackwell(qc, kc, vc, is_causal=causal, qk_balance=True, qk_rotation=True,
                                                         qk_scale_search=True).float().cpu()
                    row["kernels_all"] = (ac.cos_sim(kern, exact), ac.rel_l1(kern, exact))
                    row["kernels_all_vs_all"] = ac.cos_sim(kern, outs["all"])
                rows.append(row)
                names = [n for n in ("paper", "ours", "bal", "rot", "search", "all", "fp8", "fp4", "fp4bal", "kernels",
                                      "kernels_all")
                         if n in row]
                print(f"  {case:12s} D={d:3d} causal={causal!s:5s} " + "  ".join(
                    f"{n} {row[n][0]:.4f}/{row[n][1]:.3f}" for n in names), file=sys.stderr, flush=True)
    return rows


def _other_seeds(ref, case: str, d: int, causal: bool) -> tuple[float, float]:
    """The defaults on the same case drawn with seeds 0 .. SEEDS - 1: the lowest cos-sim of a whole
    call and of a single q head against exact attention (one seed can hide what others show)."""
    call, head = 1.0, 1.0
    for seed in range(SEEDS):
        q, k, v = ac.make(case, 1, 4, 2, SEQ, SEQ, d, seed=seed)
        exact, out = ref.exact_attention(q, k, v, is_causal=causal), ref.sageattn3(q, k, v, is_causal=causal)
        call = min(call, ac.cos_sim(out, exact))
        head = min([head] + [ac.cos_sim(out[:, h], exact[:, h]) for h in range(q.shape[1])])
    return call, head


def table(rows: list[dict], gpu: bool) -> str:
    head = ["inputs", "D", "causal", "paper: cos / rel-L1", "auto (default): cos / rel-L1",
            f"auto, seeds 0-{SEEDS - 1}: lowest call / head cos", "FP8 heads: Q·Kᵀ, P·V",
            "auto + balance", "auto + rotation", "auto + scale search", "auto + all three", "FP8 Q·Kᵀ",
            "FP4 Q·Kᵀ (speed)", "FP4 + balance"]
    if gpu:
        head += ["kernels: cos / rel-L1", "kernels vs ours (cos)", "kernels, all three", "vs auto + all three (cos)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [LABELS[r["case"]], str(r["d"]), "yes" if r["causal"] else "no"]
        cells += [f"{r[n][0]:.4f} / {r[n][1]:.3f}" for n in ("paper", "ours")]
        cells += [f"{r['seeds'][0]:.4f} / {r['seeds'][1]:.4f}"]
        raw = f" ({r['raw_heads']} raw)" if r.get("raw_heads") else ""
        cells += [f"{r['fp8_heads']}/{r['heads']}{raw}, {r['pv8_heads']}/{r['heads']}"]
        cells += [f"{r[n][0]:.4f} / {r[n][1]:.3f}" for n in ("bal", "rot", "search", "all", "fp8", "fp4", "fp4bal")]
        if gpu:
            cells += [f"{r['kernels'][0]:.4f} / {r['kernels'][1]:.3f}", f"{r['kernels_vs_ours']:.6f}",
                      f"{r['kernels_all'][0]:.4f} / {r['kernels_all'][1]:.3f}", f"{r['kernels_all_vs_all']:.6f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + floors(rows)


OPTION_COLUMNS = {"bal": "auto + balance", "rot": "auto + rotation", "search": "auto + scale search",
                  "all": "auto + all three", "fp8": "FP8 Q·Kᵀ"}


def floors(rows: list[dict]) -> str:
    """One sentence under the table: each accuracy option's cos-sim against the defaults', cell by
    cell, unrounded (the table's four digits can hide or make a difference of 0.00005)."""
    worst = []
    for name, label in OPTION_COLUMNS.items():
        where = min(rows, key=lambda r: r[name][0] - r["ours"][0])
        gap = where[name][0] - where["ours"][0]
        worst.append(f"{label} {gap:+.5f} ({LABELS[where['case']]}, D {where['d']}, "
                     f"{'causal' if where['causal'] else 'non-causal'})")
    below = sum(r[n][0] < r["ours"][0] for r in rows for n in OPTION_COLUMNS)
    shown = sum(f"{r[n][0]:.4f}" < f"{r['ours'][0]:.4f}" for r in rows for n in OPTION_COLUMNS)
    return (f"The accuracy options against the defaults, cos-sim unrounded, the smallest difference in each "
            f"column: {'; '.join(worst)}. Cells below the defaults: {below} of {len(rows) * len(OPTION_COLUMNS)} "
            f"unrounded, {shown} at the four digits shown.")


def summary(text: str) -> str:
    """The README's rows of the full table ``text`` (SUMMARY_ROWS, D 128, SUMMARY_COLUMNS)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.strip().splitlines()
            if line.startswith("|")]
    head = rows[0]
    missing = [c for c in SUMMARY_COLUMNS if c not in head]
    if missing:
        raise SystemExit(f"the table has no column {missing[0]!r} (SUMMARY_COLUMNS); its columns: {head}")
    cols = [head.index(c) for c in SUMMARY_COLUMNS]
    by_key = {(r[0], r[1], r[2]): r for r in rows[2:]}
    out = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + " --- |" * len(cols)]
    for case, d, causal in SUMMARY_ROWS:
        key = (LABELS[case], str(d), "yes" if causal else "no")
        if key not in by_key:
            raise SystemExit(f"the table has no row {key} (SUMMARY_ROWS)")
        out.append("| " + " | ".join(by_key[key][i] for i in cols) + " |")
    return "\n".join(out)


def _fill(path: Path, start: str, end: str, text: str) -> None:
    page = path.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(page):
        raise SystemExit(f"{path.relative_to(ROOT)} has no {start} ... {end} section to fill")
    path.write_text(pattern.sub(lambda _: f"{start}\n{text}\n{end}", page))


# What the table was computed from: the reference, the cases and this generator (their syntax
# trees: comments do not count), with the table itself. Stored beside the table; a test
# recomputes it, so a table edited by hand, or left behind by a change of what computes it, fails.
DIGEST_SOURCES = (*sorted((ROOT / "sageattn3" / "sageattn3" / "reference").glob("*.py")),
                  ROOT / "tests" / "attention_cases.py", Path(__file__).resolve())
DIGEST = re.compile(r"<!-- accuracy-digest: ([0-9a-f]{64}) -->\n?")


def digest(text: str) -> str:
    h = hashlib.sha256()
    for src in DIGEST_SOURCES:
        h.update(ast.dump(ast.parse(src.read_text(encoding="utf-8"))).encode() + b"\0")
    h.update(text.strip().encode())
    return h.hexdigest()


def write_docs(text: str) -> None:
    """The full table into docs/accuracy.md (with its digest after it), its summary into README.md."""
    page = ROOT / "docs" / "accuracy.md"
    _fill(page, MARK_START, MARK_END, text)
    body = DIGEST.sub("", page.read_text())
    page.write_text(body.replace(MARK_END, f"{MARK_END}\n<!-- accuracy-digest: {digest(text)} -->", 1))
    _fill(ROOT / "README.md", SUMMARY_START, SUMMARY_END, summary(text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="also run the kernels (needs a GPU with the FP4 path)")
    ap.add_argument("--write-docs", action="store_true",
                    help="replace the table in docs/accuracy.md and its summary in README.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.gpu:
        os.environ.setdefault("SAGEATTN3_FORCE_FP4", "1")  # the MMA-model flavour on an H100
        import sageattn3

        path = sageattn3.backend()
        if not path.startswith("fp4"):
            raise SystemExit(f"--gpu: the FP4 path is not available here ({path})")
        print(f"kernels: {path}", file=sys.stderr)
    ref = _reference()
    t0 = time.perf_counter()
    rows = measure(ref, args.gpu)
    text = table(rows, args.gpu)
    print(text)
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
