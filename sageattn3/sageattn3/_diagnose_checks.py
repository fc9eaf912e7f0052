"""The diagnosis's per-GPU sections: the path ``sageattn3_blackwell`` takes, the known-answer
self-check, accuracy on fixed seeded shapes and speed at fixed shapes. Assembled by
``sageattn3._diagnose``."""

from __future__ import annotations

import statistics
import time

import torch

from sageattn3._diagnose_env import _error, clocks

MODEL_LABEL = "MMA model: not Blackwell timing"

# Accuracy: (label, batch, q heads, kv heads, q length, k length, head dim, causal), bf16 inputs
# with per-channel offsets (what the smoothing is for), seed = 1000 + position.
ACCURACY_CASES = (
    ("D128", 1, 8, 8, 1024, 1024, 128, False),
    ("D128 causal", 1, 8, 8, 1024, 1024, 128, True),
    ("D64", 1, 8, 8, 1024, 1024, 64, False),
    ("D64 causal", 1, 8, 8, 1024, 1024, 64, True),
    ("GQA 4:1 D128", 1, 16, 4, 1024, 1024, 128, False),
    ("GQA 2:1 D64 causal, ragged 1000 x 777", 2, 6, 3, 1000, 777, 64, True),
)
QUICK_ACCURACY_CASES = (
    ("D128", 1, 4, 4, 256, 256, 128, False),
    ("GQA 2:1 D64 causal, ragged 300 x 231", 1, 4, 2, 300, 231, 64, True),
)
# vs the same-quantization reference: kernel and reference differ only by float32 rounding
# (a rare FP4 code on a rounding boundary) and the bf16 output; vs exact attention: the FP4
# quantization itself (the paper's level: cos-sim > 0.99).
MIN_COS_REFERENCE = 0.999
MAX_REL_L1_REFERENCE = 0.02
MIN_COS_EXACT = 0.99

SPEED_SEQS = (4096, 16384, 32768)
QUICK_SPEED_SEQS = (4096,)
SPEED_BATCH, SPEED_HEADS, SPEED_HEAD_DIM = 1, 24, 128
MAX_CALL_S = 3.0  # a shape whose single kernel call would take longer (the MMA model) is skipped

def _inputs(case, seed: int, device):
    _, b, hq, hk, sq, sk, d, _ = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g) + torch.randn(d, generator=g)
    k = torch.randn(b, hk, sk, d, generator=g) + 3 * torch.randn(d, generator=g)
    v = torch.randn(b, hk, sk, d, generator=g) + 2 * torch.randn(d, generator=g)
    return tuple(t.to(torch.bfloat16).to(device) for t in (q, k, v))


def compare(out: torch.Tensor, want: torch.Tensor) -> dict:
    """cos-sim, relative L1 (sum|a-b| / sum|b|) and max abs error of ``out`` against ``want``."""
    a, b = out.double().flatten(), want.double().flatten()
    if not bool(torch.isfinite(a).all()):
        return {"cos": float("nan"), "rel_l1": float("inf"), "max_abs": float("inf"), "finite": False}
    cos = float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))
    return {"cos": cos, "rel_l1": float((a - b).abs().sum() / b.abs().sum().clamp_min(1e-300)),
            "max_abs": float((a - b).abs().max()), "finite": True}


def accuracy(device: torch.device, quick: bool) -> dict:
    from sageattn3 import api, reference

    cases = []
    ok = True
    for i, case in enumerate(QUICK_ACCURACY_CASES if quick else ACCURACY_CASES):
        label, b, hq, hk, sq, sk, d, causal = case
        row = {"case": label, "shape": {"batch": b, "q_heads": hq, "kv_heads": hk, "q_len": sq, "k_len": sk,
                                        "head_dim": d, "causal": causal, "dtype": "bfloat16"}}
        try:
            q, k, v = _inputs(case, 1000 + i, device)
            choice: list = []
            out = api._fp4_attention(q, k, v, causal, True, qk_precision=reference.QK_PRECISION_DEFAULT, choice=choice)
            row["qk_choice"] = choice[0].describe() if choice else None
            ref = reference.sageattn3(q, k, v, is_causal=causal)
            exact = reference.exact_attention(q, k, v, is_causal=causal)
            row["vs_reference"] = compare(out, ref)
            row["vs_exact"] = compare(out, exact)
            row["reference_vs_exact"] = compare(ref, exact)
            r, e = row["vs_reference"], row["vs_exact"]
            row["ok"] = bool(r["finite"] and r["cos"] >= MIN_COS_REFERENCE and r["rel_l1"] <= MAX_REL_L1_REFERENCE
                             and e["cos"] >= MIN_COS_EXACT)
            del q, k, v, out, ref, exact
        except Exception as e:  # noqa: BLE001  (a kernel error is a result here)
            row.update(_error(e), ok=False)
        ok = ok and row["ok"]
        cases.append(row)
    return {"ok": ok, "cases": cases, "qk_demo": qk_demo(device),
            "thresholds": {"vs_reference": f"cos >= {MIN_COS_REFERENCE}, rel_l1 <= {MAX_REL_L1_REFERENCE}",
                           "vs_exact": f"cos >= {MIN_COS_EXACT}"},
            "exact": "softmax attention in float64 (float32 result)",
            "reference": "sageattn3.reference.sageattn3: the same algorithm and quantization, float32, in PyTorch"}


def qk_demo(device: torch.device) -> dict:
    """The per-head Q·Kᵀ precision rule on one input whose heads differ: the accuracy inputs with
    V made zero-mean and Q's heads 2 and 3 scaled by 4 (near-one-hot rows, whose FP4 score error
    then shows in the output: the rule should pick FP8 for those two only)."""
    from sageattn3 import api

    try:
        q, k, v = _inputs(("demo", 1, 4, 2, 512, 512, 128, False), 999, device)
        q = torch.cat((q[:, :2], 4 * q[:, 2:]), dim=1)
        v = v - v.float().mean(dim=-2, keepdim=True).to(v.dtype)
        return {"input": "4 heads, 512 tokens, D 128, zero-mean V; heads 2 and 3 near-one-hot (Q x4)",
                "choice": api.qk_choice(q, k, v).describe()}
    except Exception as e:  # noqa: BLE001  (reported, not raised)
        return _error(e)


def event_time_ms(fn) -> float:
    """One call of ``fn`` timed with CUDA events on the current stream (ms)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _time_ms(fn, budget_s: float, first: float | None = None) -> float:
    """Median of CUDA-event-timed calls after one warm-up; as many as fit in ``budget_s``."""
    if first is None:
        fn()
        torch.cuda.synchronize()
    times = []
    deadline = time.perf_counter() + budget_s
    while True:
        times.append(event_time_ms(fn))
        if len(times) >= 10 or (len(times) >= 1 and time.perf_counter() > deadline):
            break
    return statistics.median(times)


def _speed_row(device: torch.device, b: int, h: int, s: int, d: int, budget: float) -> dict:
    import torch.nn.functional as F

    from sageattn3 import _attn, api

    flops = 4 * b * h * s * s * d
    g = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(b, h, s, d, generator=g, device=device, dtype=torch.bfloat16) for _ in range(3))
    pre = api.preprocess(q, k, v, pad=_attn.SEQ_PAD)
    kernel = _time_ms(lambda: _attn.attention_from_preprocessed(pre, out_dtype=q.dtype, trusted=True), budget)
    call = _time_ms(lambda: api.sageattn3_blackwell(q, k, v), budget)
    sdpa = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v), budget)
    return {"kernel_ms": round(kernel, 4), "kernel_tops": round(flops / kernel / 1e9, 1),
            "call_ms": round(call, 4), "call_tops": round(flops / call / 1e9, 1),
            "sdpa_ms": round(sdpa, 4), "sdpa_tops": round(flops / sdpa / 1e9, 1)}


def speed(device: torch.device, quick: bool, model: bool) -> dict:
    b, h, d = SPEED_BATCH, SPEED_HEADS, SPEED_HEAD_DIM
    budget = 0.2 if quick else 0.6
    rows = []
    kernel_4k = None
    out = {"label": MODEL_LABEL if model else "real FP4 kernel", "clocks_before": clocks(device.index)}
    with torch.cuda.device(device):
        for s in (QUICK_SPEED_SEQS if quick else SPEED_SEQS):
            row: dict = {"batch": b, "heads": h, "seq": s, "head_dim": d, "dtype": "bfloat16", "causal": False}
            if model:
                row["label"] = MODEL_LABEL
            if kernel_4k is not None:
                est = kernel_4k * (s / SPEED_SEQS[0]) ** 2 / 1e3
                if est > MAX_CALL_S:
                    row["skipped"] = f"one kernel call would take about {est:.0f} s here{' (MMA model)' if model else ''}"
                    rows.append(row)
                    continue
            try:
                row.update(_speed_row(device, b, h, s, d, budget))
                if s == SPEED_SEQS[0]:
                    kernel_4k = row["kernel_ms"]
            except Exception as e:  # noqa: BLE001
                row.update(_error(e))
            rows.append(row)
        torch.cuda.empty_cache()
    out["rows"] = rows
    out["clocks_after"] = clocks(device.index)
    out["notes"] = ("median of CUDA-event-timed calls; TOPS = 4*B*H*S*S*D / time; kernel = the attention "
                    "kernel on preprocessed inputs; call = sageattn3_blackwell (preprocessing included); "
                    "sdpa = torch scaled_dot_product_attention on the same bf16 inputs")
    return out


def device_report(index: int, quick: bool, run_accuracy: bool, run_speed: bool) -> dict:
    from sageattn3 import _kernels, _selfcheck, api

    dev = torch.device("cuda", index)
    p = torch.cuda.get_device_properties(index)
    rep: dict = {"index": index, "name": p.name, "cc": f"{p.major}.{p.minor}"}
    raw = api._attention_path(dev, None)
    rep["path"] = api.backend(dev, 128)
    rep["path_d64"] = api.backend(dev, 64)
    failed = _selfcheck.failure(dev)
    fp4 = raw.is_fp4 or failed is not None
    rep["fp4"] = fp4
    model = (raw.is_fp4 and raw.model) or (fp4 and _kernels.mma_model_build())
    if model:
        rep["flavour"] = (f"MMA-model test flavour: the FP4 MMA runs as a software model on this GPU "
                          f"({_kernels.FORCE_FP4_ENV}=1); accuracy is meaningful, speed is not ({MODEL_LABEL})")
    if not fp4:
        rep["why_not_fp4"] = raw.reason
        return rep
    try:
        r = _selfcheck.ensure(dev, api._fp4_attention)
        note = None
        if r is None:  # skipped by the environment: the diagnosis runs it anyway, uncached
            r = _selfcheck.run(dev, api._fp4_attention)
            note = f"run by the diagnosis although {_selfcheck.SKIP_ENV}=1 (not cached)"
        rep["selfcheck"] = {"ok": r.ok, "summary": r.summary(), "figures": r.figures, "error": r.error,
                            "gpu_ms": r.gpu_ms, "wall_ms": r.wall_ms, "note": note}
    except Exception as e:  # noqa: BLE001
        rep["selfcheck"] = {"ok": False, **_error(e)}
    rep["path"] = api.backend(dev, 128)  # now with the self-check's result
    if run_accuracy:
        try:
            rep["accuracy"] = accuracy(dev, quick)
        except Exception as e:  # noqa: BLE001
            rep["accuracy"] = {"ok": False, **_error(e)}
    if run_speed:
        try:
            rep["speed"] = speed(dev, quick, model)
        except Exception as e:  # noqa: BLE001
            rep["speed"] = _error(e)
    return rep
