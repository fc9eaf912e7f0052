"""What this installation is and does, as one report: ``python -m sageattn3`` prints it (and
writes it as JSON with ``--json FILE``), ``sageattn3.diagnose()`` returns it as a dict.

Sections: the environment (Python, torch and its CUDA and C++ ABI, driver, GPUs); the installed
wheel's build record and whether it fits this torch and these GPUs (with the pip command for the
wheel that does when it does not); per GPU, the path ``sageattn3_blackwell`` takes and why, the
known-answer self-check, accuracy on fixed seeded shapes against exact attention and against
the same-quantization reference (``sageattn3.reference``), and speed at fixed shapes (the
kernel alone, the whole call, torch SDPA) with the GPU clocks. With the MMA-model test flavour
(an H100 with ``SAGEATTN3_FORCE_FP4=1``) the FP4 MMA is a software model: its times are labelled
``MMA model: not Blackwell timing`` and judged by nobody.

The exit status (``EXIT_CODES``) says whether all is as expected.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback

import torch

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NO_FP4 = 3
EXIT_MISMATCH = 4
EXIT_WRONG = 5
EXIT_CODES = {
    EXIT_OK: "all as expected: the FP4 path runs on at least one GPU, its self-check and accuracy pass",
    EXIT_ERROR: "the diagnosis itself failed (a bug: please report it with the --json report, which holds the "
                "traceback)",
    EXIT_USAGE: "bad command-line arguments",
    EXIT_NO_FP4: "FP4 unavailable here (no CUDA GPU, no GPU with the FP4 MMA, kernels not built): "
                 "sageattn3_blackwell uses torch SDPA; the reason is in the report",
    EXIT_MISMATCH: "the installed wheel does not fit this torch or these GPUs: the report gives the pip command "
                   "for the wheel that does",
    EXIT_WRONG: "the FP4 kernel gives wrong results here (self-check or accuracy failed): please report it",
}

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


def _error(e: BaseException) -> dict:
    tb = traceback.extract_tb(e.__traceback__)
    where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else "?"
    # the frames as file name (no folders: they can name the user's paths), line, function
    frames = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in tb][-12:]
    return {"error": f"{type(e).__name__}: {e}", "where": where, "traceback": frames}


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------

_SMI_FIELDS = ("uuid", "index", "name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem",
               "clocks.max.mem", "temperature.gpu", "power.draw", "pstate")


def nvidia_smi() -> list[dict] | None:
    """One dict per GPU from nvidia-smi (None when it is not there or fails)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    rows = []
    for line in out.stdout.strip().splitlines():
        vals = [v.strip() for v in line.split(",")]
        if len(vals) == len(_SMI_FIELDS):
            rows.append(dict(zip(_SMI_FIELDS, vals)))
    return rows


def _smi_row(rows: list[dict] | None, props) -> dict | None:
    if not rows:
        return None
    uuid = str(getattr(props, "uuid", "") or "").lower().removeprefix("gpu-")
    for r in rows:
        if uuid and r["uuid"].lower().removeprefix("gpu-") == uuid:
            return r
    return None


def clocks(device_index: int) -> dict | None:
    """The GPU's current and maximum SM/memory clocks (MHz), temperature, power, P-state."""
    props = torch.cuda.get_device_properties(device_index)
    row = _smi_row(nvidia_smi(), props)
    if row is None:
        return None
    return {k.replace(".", "_"): row[k] for k in _SMI_FIELDS[4:]}


def _driver_api_version() -> str | None:
    """The CUDA version the installed driver supports (cuDriverGetVersion)."""
    names = ("nvcuda.dll",) if os.name == "nt" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            return f"{v.value // 1000}.{(v.value % 1000) // 10}"
    return None


def environment() -> dict:
    env = {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False)),
        "cuda_available": torch.cuda.is_available(),
        "driver": None,
        "driver_cuda": _driver_api_version(),
        "gpus": [],
    }
    if not env["cuda_available"]:
        return env
    rows = nvidia_smi()
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        row = _smi_row(rows, p)
        if row and not env["driver"]:
            env["driver"] = row["driver_version"]
        env["gpus"].append({
            "index": i,
            "name": p.name,
            "cc": f"{p.major}.{p.minor}",
            "sm_count": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1) or None,
        })
    return env


# ---------------------------------------------------------------------------------------------
# The wheel and whether it fits
# ---------------------------------------------------------------------------------------------


def build() -> dict:
    from sageattn3 import _guard, _kernels

    rec = _guard.build_record()
    info = {
        "installed_wheel": bool(rec),
        "record": rec or None,
        "extension_loaded": _kernels.loaded(),
        "extension_problem": _kernels.NOT_LOADED_REASON,
        "mma_model": _kernels.mma_model_build(),
    }
    if _kernels.loaded():
        info["ops"] = _kernels.library_ops()
        info["ops_without_fake"] = _kernels.register_fakes()
    return info


def fit(env: dict) -> dict:
    """Whether the installed wheel fits this torch and these GPUs; the pip command when not."""
    from sageattn3 import _guard, _kernels, _which

    rec = _guard.build_record()
    out: dict = {"torch_problems": [], "gpus": [], "ok": True}
    if not rec:
        out["note"] = "no build record: a source tree, not an installed wheel"
        return out
    out["torch_problems"] = _guard.torch_problems(torch.__version__, torch.version.cuda, rec)
    archs = tuple(rec.get("archs") or ())
    for g in env.get("gpus", []):
        cc = tuple(int(x) for x in g["cc"].split("."))
        runs = [a for a in archs if _kernels.arch_runs_on(a, cc)]
        fp4_mma = cc in _kernels.FP4_MMA_CCS
        out["gpus"].append({"index": g["index"], "arch": f"sm_{cc[0]}{cc[1]}", "fp4_mma": fp4_mma,
                            "code_for_it": runs})
        if fp4_mma and not runs:
            out["torch_problems"].append(f"GPU {g['index']} ({g['name']}, sm_{cc[0]}{cc[1]}) has the FP4 MMA but "
                                         f"this wheel has no code for it (built for {', '.join(archs) or 'nothing'})")
    out["ok"] = not out["torch_problems"]
    try:
        spec = _which.torch_spec(torch.__version__, torch.version.cuda)
    except _which.TorchVersionError as e:
        out["which"] = {"error": str(e)}
        return out
    ans = _which.answer(spec, rec, reinstall=not out["ok"])
    out["which"] = ans.as_dict()
    return out


# ---------------------------------------------------------------------------------------------
# Per GPU: path, self-check, accuracy, speed
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# The whole report
# ---------------------------------------------------------------------------------------------


def status(report: dict) -> dict:
    """The exit code and its reasons (the most serious finding wins)."""
    reasons: dict[int, list[str]] = {c: [] for c in EXIT_CODES}
    for name in ("environment", "build", "fit"):
        sec = report.get(name) or {}
        if "error" in sec:
            reasons[EXIT_ERROR].append(f"{name}: {sec['error']}")
    fit_ = report.get("fit") or {}
    build_ = report.get("build") or {}
    env = report.get("environment") or {}
    cpu_torch = "error" not in env and env.get("torch") and not env.get("torch_cuda")
    if fit_.get("torch_problems"):
        if cpu_torch:  # one line says it all: no wheel of this project loads into a CPU-only torch
            reasons[EXIT_MISMATCH].append(
                f"torch {env.get('torch')} is a CPU-only build: sageattn3's kernels need a CUDA build of torch "
                f"(this wheel: CUDA {((build_.get('record') or {}).get('cuda')) or '?'}); install one, then "
                f"`python -m sageattn3 which`")
        else:
            reasons[EXIT_MISMATCH].extend(fit_["torch_problems"])
    elif build_.get("installed_wheel") and not build_.get("extension_loaded"):
        # (when the wheel does not fit, the refusal restates the problems above)
        reasons[EXIT_MISMATCH].append(f"the compiled extension did not load: {build_.get('extension_problem')}")
    fp4_devices = [d for d in report.get("devices", []) if d.get("fp4")]
    for d in report.get("devices", []):
        if "error" in d:
            reasons[EXIT_ERROR].append(f"GPU {d.get('index')}: {d['error']}")
        sc = d.get("selfcheck")
        if sc is not None and not sc.get("ok"):
            reasons[EXIT_WRONG].append(f"GPU {d['index']} ({d['name']}): FP4 self-check failed: "
                                       f"{sc.get('summary') or sc.get('error')}")
        acc = d.get("accuracy")
        if acc is not None and not acc.get("ok"):
            bad = [c["case"] for c in acc.get("cases", []) if not c.get("ok")] or [acc.get("error", "?")]
            reasons[EXIT_WRONG].append(f"GPU {d['index']} ({d['name']}): accuracy out of bounds: {', '.join(bad)}")
    if not fp4_devices and "error" not in env and not reasons[EXIT_MISMATCH]:
        # (a failed environment section says nothing of CUDA; a wheel that does not fit says why
        # nothing runs, and `import sageattn3` refuses it: no SDPA path to speak of)
        if not env.get("cuda_available"):
            why = (f"torch {env.get('torch')} is a CPU-only build" if not env.get("torch_cuda")
                   else f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}) sees no CUDA GPU")
        else:
            why = "; ".join(f"GPU {d['index']} ({d['name']}): {d.get('why_not_fp4', '?')}" for d in report["devices"])
        reasons[EXIT_NO_FP4].append(f"FP4 unavailable: {why}; sageattn3_blackwell uses torch SDPA")
    for code in (EXIT_WRONG, EXIT_MISMATCH, EXIT_ERROR, EXIT_NO_FP4):
        if reasons[code]:
            return {"code": code, "meaning": EXIT_CODES[code], "reasons": reasons[code],
                    "also": [r for c in (EXIT_WRONG, EXIT_MISMATCH, EXIT_ERROR, EXIT_NO_FP4) if c != code
                             for r in reasons[c]]}
    return {"code": EXIT_OK, "meaning": EXIT_CODES[EXIT_OK], "reasons": []}


def diagnose(quick: bool = False, accuracy: bool = True, speed: bool = True) -> dict:
    """The diagnosis as a dict (what ``python -m sageattn3 --json FILE`` writes). ``quick``:
    smaller accuracy shapes and one speed shape (a few seconds); ``accuracy``/``speed``: run
    those sections (they need a GPU that takes the FP4 path)."""
    import sageattn3

    t0 = time.perf_counter()
    report: dict = {"report": "sageattn3 diagnosis", "schema": 1, "sageattn3": sageattn3.__version__,
                    "quick": quick, "sections": {"accuracy": accuracy, "speed": speed},
                    "exit_codes": {str(k): v for k, v in EXIT_CODES.items()}}
    for name, fn in (("environment", environment), ("build", build)):
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001
            report[name] = _error(e)
    try:
        report["fit"] = fit(report.get("environment") or {})
    except Exception as e:  # noqa: BLE001
        report["fit"] = _error(e)
    report["devices"] = []
    for g in (report.get("environment") or {}).get("gpus", []):
        try:
            report["devices"].append(device_report(g["index"], quick, accuracy, speed))
        except Exception as e:  # noqa: BLE001
            report["devices"].append({"index": g["index"], "name": g.get("name"), **_error(e)})
    report["status"] = status(report)
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return report


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def _fmt_cmp(c: dict) -> str:
    if not c.get("finite", True):
        return "non-finite output"
    return f"cos {c['cos']:.6f}  rel-L1 {c['rel_l1']:.4f}  max|err| {c['max_abs']:.4f}"


def _fmt_environment(env: dict) -> list[str]:
    out = ["\nEnvironment"]
    if "error" in env:
        out.append(f"  error: {env['error']} (at {env.get('where', '?')})")
        return out
    out.append(f"  Python {env['python']} ({env['implementation']}), {env['platform']}")
    out.append(f"  torch {env['torch']}, CUDA {env['torch_cuda'] or 'none (CPU build)'}, "
               f"C++11 ABI {env['torch_cxx11_abi']}")
    out.append(f"  driver {env['driver'] or 'unknown'} (supports CUDA {env['driver_cuda'] or 'unknown'})")
    if not env["gpus"]:
        out.append("  no CUDA GPU visible")
    for g in env["gpus"]:
        out.append(f"  GPU {g['index']}: {g['name']}, compute capability {g['cc']}, {g['sm_count']} SMs, "
                   f"{g['memory_gib']} GiB")
    return out


def _fmt_wheel(b: dict, f: dict, env: dict) -> list[str]:
    """The installed wheel's record, its compiled extension and whether it fits."""
    out = ["\nInstalled wheel"]
    if "error" in b:
        out.append(f"  error: {b['error']}")
    elif not b.get("installed_wheel"):
        out.append("  no build record: imported from a source tree")
    else:
        rec = b["record"]
        extra = rec.get("extra") if isinstance(rec.get("extra"), dict) else {}
        out.append(f"  version {rec.get('version')}  variant {rec.get('variant')}  {rec.get('requires_torch')}")
        out.append(f"  built with CUDA {rec.get('cuda')} for {', '.join(rec.get('archs') or [])}; torch "
                   f"{rec.get('torch_build')}; commit {rec.get('source_commit', '?')}")
        out.append(f"  patches: {', '.join(rec.get('patches') or []) or 'none'}")
        if b.get("mma_model") or extra.get("mma_model"):
            out.append("  MMA-model TEST FLAVOUR (the FP4 MMA is a software model)")
    if b.get("installed_wheel") or "extension_problem" in b:
        not_fit = b.get("installed_wheel") and f.get("torch_problems")
        out.append("  compiled extension: " + ("loaded" if b.get("extension_loaded") else
                                               "not loaded: the wheel does not fit this torch (below)" if not_fit
                                               else str(b.get("extension_problem"))))
    if "error" in f:
        out.append(f"  fit check error: {f['error']}")
    elif b.get("installed_wheel"):
        if f.get("ok"):
            out.append("  fits this torch and these GPUs")
        w = f.get("which") or {}
        if f.get("torch_problems") and "error" not in env and not env.get("torch_cuda") and w.get("reason"):
            # a CPU-only torch: one line (what `which` says: no wheel serves it, install a CUDA torch)
            out.append(f"  DOES NOT FIT: {w['reason']} ({w.get('url')})")
        elif not f.get("ok") and w:
            for p in f.get("torch_problems", []):
                out.append(f"  DOES NOT FIT: {p}")
            out.append(f"  the wheel for this torch: {w.get('command') or w.get('url')}\n    ({w.get('reason')})")
        else:
            for p in f.get("torch_problems", []):
                out.append(f"  DOES NOT FIT: {p}")
    return out


def _fmt_accuracy(acc: dict) -> list[str]:
    out = [f"  accuracy ({'ok' if acc['ok'] else 'OUT OF BOUNDS'}; {acc.get('thresholds')}):"]
    for c in acc.get("cases", []):
        if "error" in c:
            out.append(f"    {c['case']:40s} error: {c['error']}")
            continue
        out.append(f"    {c['case']:40s} vs exact: {_fmt_cmp(c['vs_exact'])}")
        out.append(f"    {'':40s} vs reference: {_fmt_cmp(c['vs_reference'])}{'' if c['ok'] else '  <-- FAIL'}")
        if c.get("qk_choice"):
            out.append(f"    {'':40s} {c['qk_choice']}")
    demo = acc.get("qk_demo")
    if demo:
        out.append(f"  Q·Kᵀ precision rule on {demo.get('input', 'a demo input')}: "
                   f"{demo.get('choice') or demo.get('error')}")
    return out


def _fmt_speed(sp: dict) -> list[str]:
    out = [f"  speed ({sp.get('label', '')}): batch {SPEED_BATCH}, {SPEED_HEADS} heads, D {SPEED_HEAD_DIM}, bf16"]
    cb = sp.get("clocks_before")
    if cb:
        out.append(f"    clocks: SM {cb['clocks_sm']}/{cb['clocks_max_sm']} MHz, memory "
                   f"{cb['clocks_mem']}/{cb['clocks_max_mem']} MHz, {cb['temperature_gpu']} C, {cb['pstate']}")
    for row in sp.get("rows", []):
        lab = f"    {row['seq']:6d} tokens: "
        if "skipped" in row:
            out.append(lab + f"skipped ({row['skipped']})")
        elif "error" in row:
            out.append(lab + f"error: {row['error']}")
        else:
            tag = f"  [{MODEL_LABEL}]" if row.get("label") == MODEL_LABEL else ""
            out.append(lab + f"kernel {row['kernel_ms']:.3f} ms ({row['kernel_tops']} TOPS), whole call "
                       f"{row['call_ms']:.3f} ms ({row['call_tops']} TOPS), torch SDPA {row['sdpa_ms']:.3f} ms "
                       f"({row['sdpa_tops']} TOPS){tag}")
    if "error" in sp:
        out.append(f"    error: {sp['error']}")
    return out


def _fmt_device(d: dict, sections: dict) -> list[str]:
    out = [f"\nGPU {d['index']}: {d.get('name')}"]
    if "error" in d:
        out.append(f"  error: {d['error']} (at {d.get('where', '?')})")
        return out
    out.append(f"  path: {d['path']}")
    if d.get("flavour"):
        out.append(f"  {d['flavour']}")
    if not d.get("fp4"):
        out.append("  FP4 checks: not run (self-check, accuracy, speed): this GPU takes the SDPA path")
    else:
        skipped = [n for n in ("accuracy", "speed") if not sections.get(n, True)]
        if skipped:
            out.append(f"  skipped on request: {', '.join(skipped)}")
    sc = d.get("selfcheck")
    if sc:
        out.append(f"  self-check: {'passed' if sc['ok'] else 'FAILED'}: {sc.get('summary') or sc.get('error')}")
    if d.get("accuracy"):
        out += _fmt_accuracy(d["accuracy"])
    if d.get("speed"):
        out += _fmt_speed(d["speed"])
    return out


def format_report(r: dict) -> str:
    out = [f"sageattn3 {r.get('sageattn3')} diagnosis{' (quick)' if r.get('quick') else ''}"]
    env = r.get("environment") or {}
    out += _fmt_environment(env)
    out += _fmt_wheel(r.get("build") or {}, r.get("fit") or {}, env)
    if not r.get("devices") and "error" not in env:
        out.append("\nFP4 checks: not run (self-check, accuracy, speed): no CUDA GPU visible")
    for d in r.get("devices", []):
        out += _fmt_device(d, r.get("sections") or {})
    st = r.get("status") or {}
    out.append(f"\nResult: exit {st.get('code')}: {st.get('meaning')}")
    for reason in st.get("reasons", []):
        out.append(f"  - {reason}")
    for reason in st.get("also", []):
        out.append(f"  - (also) {reason}")
    out.append(f"({r.get('elapsed_s')} s)")
    return "\n".join(out)


def finite_json(obj):
    """NaN/inf as strings: strict JSON for bug trackers and other tools."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj
