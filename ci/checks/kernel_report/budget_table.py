"""The per-tile budget as a table (the model: :mod:`ci.checks.sass_budget`): one column per
kernel instantiation, the consumer warp's counts by pipe, the producer, the pre-passes, the bound
per SM per tile and the ceiling on each GPU."""

from __future__ import annotations

from ci.checks.sass_budget import GPUS, PIPES, REF, Budget, Gpu


def _num(x: float | None, unit: str = "") -> str:
    return "not counted" if x is None else f"{x:,.0f}{unit}"


def _bound_cell(b: Budget, g: Gpu) -> str:
    (k, clk), pre = b.bound_parts(g)
    if pre is None or pre[1] == 0:
        return f"{clk:,.0f} clk ({k})"
    return f"{clk + pre[1]:,.0f} clk = {clk:,.0f} ({k}) + {pre[1]:,.0f} (pre-passes, {pre[0]})"


def _producer_cell(b: Budget) -> str:
    """The producer's warp-instructions per key tile, all its warps, and where it runs."""
    if b.producer is None:
        return _num(None)
    if not b.producer_warps:
        return f"{b.producer:,.0f} (inline, warp 0)"
    if b.producer_warps == 1:
        return f"{b.producer:,.0f} (a warp of its own)"
    return f"{b.producer:,.0f} ({b.producer_warps} warps, the busiest {b.producer_own:,.0f})"


def _busiest_cell(b: Budget) -> str:
    """The busiest warp's warp-instructions per key tile, and which warp it is."""
    if not b.producer_warps:
        which = ("warp 0: consumer + producer" if (b.producer or 0.0) >= b.last_warp
                 else "the last warp: consumer + its own")
    elif b.producer_own > b.instructions + b.last_warp:
        which = "a producer warp"
    else:
        which = "a consumer warp" + (" + its own" if b.last_warp else "")
    return f"{b.busiest_warp:,.0f} ({which})"


def _prepass_cell(b: Budget, name: str) -> str:
    p = b.prepasses.get(name)
    if p is None:
        return "-"
    return f"{_num(p.instructions)} ({p.dram_bytes:,.0f} B)"


def table(budgets: list[Budget], gpus=GPUS, calibration: float | None = None) -> str:
    rows = [("per warp per key tile", *(b.label for b in budgets))]
    rows.append(("warp-instructions, a consumer warp", *(f"{b.instructions:,}" for b in budgets)))
    for p in PIPES:
        if any(b.counts[p] for b in budgets):
            rows.append((f"  {p}", *(f"{b.counts[p]:,}" for b in budgets)))
    rows.append(("producer per key tile, all its warps (where it runs)", *(_producer_cell(b) for b in budgets)))
    rows.append(("last warp's own per key tile (V's exponent factors, in a consumer warp)",
                 *(f"{b.last_warp:,.0f}" for b in budgets)))
    rows.append(("busiest warp (which)", *(_busiest_cell(b) for b in budgets)))
    rows.append(("per SM per tile: all consumer warps + producer + last warp's own",
                 *(f"{b.sm_instructions:,.0f}" for b in budgets)))
    rows.append(("shared memory bytes / warp", *(f"{b.smem_bytes:,}" for b in budgets)))
    rows.append(("L2 bytes / CTA (TMA + loads)", *(f"{b.l2_bytes:,}" for b in budgets)))
    rows.append((f"DRAM bytes / tile, compulsory at {REF.tokens // 1024}k tokens", *(f"{b.dram_bytes:,.0f}" for b in budgets)))
    names = list(dict.fromkeys(n for b in budgets for n in b.prepasses))
    for n in names:
        rows.append((f"pre-pass {n}: warp-instructions (DRAM bytes) / tile", *(_prepass_cell(b, n) for b in budgets)))
    rows.append(("issue per SM per tile: (all warps + pre-passes) / 4", *(f"{b.issue_all():,.0f} clk" for b in budgets)))
    for g in gpus:
        rows.append((f"bound per SM per tile, {g.name}", *(_bound_cell(b, g) for b in budgets)))
    for g in gpus:
        rows.append((f"ceiling, {g.name} ({g.sms} SMs, {g.clock_ghz} GHz, {g.dram_gb_s:,.0f} GB/s)",
                     *(f"{b.ceiling_tops(g):,.0f} TOPS" for b in budgets)))
    if calibration is not None:
        for g in gpus:
            rows.append((f"x {calibration:.3f} (calibrated), {g.name}",
                         *(f"{b.ceiling_tops(g) * calibration:,.0f} TOPS" for b in budgets)))
    return _markdown(rows)


def _markdown(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if k == 0:
            out.append("| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(out)


def notes(budgets: list[Budget]) -> list[str]:
    """What each figure of the table counts, in lines under it."""
    out = [
        f"reference shape of the amortized figures: {REF.tokens:,} tokens (queries = keys), non-causal, one query "
        f"head per kv head, batch 1: {REF.blocks} query blocks x {REF.blocks} key tiles per head",
        "producer: ours but the bounded mode, the producer warpgroup (4 warps of its own): its key loop's SASS "
        "(the shortest loop issuing two TMA loads or more) per stage + the rest of its tile loop / key tiles per "
        "query tile, each instruction counted in every warp that issues it (by source line: the first thread's "
        "TMA issue and a tile's Q in one warp, the delta_s vector in two, V's exponent factors in one, the rest in "
        "all four; static, as the consumer's count); the busiest warp is then a consumer warp or a producer warp, "
        "not their sum. The bounded mode, thread 0 of warp 0 inline: the Producer lines in the key loop's SASS, "
        "per stage as counted, its per-query-tile blocks (Q issue, the step to the next tile) / key tiles per "
        "query tile, on top of warp 0's consumer work; its last warp's own lines (V's exponent factors) once per "
        "SM. Upstream, its producer warp (a warp of its own): its key loop + the rest of its tile loop / key "
        "tiles (its epilogue warp's stores, once per query tile, not counted, as neither kernel's epilogue is)",
        "DRAM bytes: what the kernel must move at the reference shape with K and V read once per head (reused "
        "through L2 by the query blocks), Q and the output once per query block, delta_s rows per query block and "
        "key every tile; the L2 bytes per CTA over the DRAM bandwidth would bound upstream's D 128 at about 120 "
        "TOPS on a GB10, below FlashInfer's measured 215-225 TFLOP/s there, so the reuse is real",
        "pre-passes: separate kernels before the attention kernel on the same stream; per attention tile = their "
        "warp-instructions (all warps) / the attention tiles their work serves; bound = the attention kernel's "
        "largest term + the pre-passes' larger of issue and memory (their time adds; it does not hide under the "
        "tensor work). The rule runs with qk_precision 'auto' (the default) wherever FP8 can run, FP4 heads "
        "included (with 'fp4': subtract its row); MXFP8 only for the FP8 heads (for the FP4 heads of an 'auto' "
        "call its CTAs read one byte and exit: not counted). Not counted for either kernel: the FP4 quantization "
        "and means (ours: smooth_quant; upstream: its preprocessing), a few DRAM bytes per tile at 32k",
    ]
    seen = set()
    for b in budgets:
        for p in b.prepasses.values():
            key = (b.head_dim, p.note)
            if p.note and key not in seen:
                seen.add(key)
                out.append(f"  D{b.head_dim} {p.note}")
    return out


def print_budget(budgets: list[Budget], calibration, stored_upstream: str | None) -> None:
    """The table with its calibration line above and the notes and set-aside counts under it."""
    cal = calibration
    print(f"\n== per-tile budget, sm_120a SASS: consumer warps, producer, pre-passes (model: docs/performance.md)\n"
          f"calibration: x{cal.ratio:.3f} = upstream's {cal.measured_tops:.0f} TOPS measured on an {cal.gpu.name} / "
          f"the model's ceiling for it, {cal.predicted_tops:.0f} TOPS ({cal.source})"
          + (f"; upstream's counts as stored from {stored_upstream} (--upstream recounts)" if stored_upstream else ""))
    print(table(budgets, calibration=cal.ratio))
    for line in notes(budgets):
        print(line)
    for b in budgets:
        aside = ", ".join(f"{k} {v}" for k, v in sorted(b.set_aside.items()))
        if aside:
            print(f"  {b.label}: set aside from the consumer's count: {aside}")
