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

The sections are collected in ``_diagnose_env`` (environment, the wheel) and ``_diagnose_checks``
(per GPU) and written as text in ``_diagnose_text``; this module assembles them into the report
and its status, and their names stay importable from here.
"""

from __future__ import annotations
import time

from sageattn3._diagnose_checks import (  # noqa: F401  (the report's parts, importable from here)
    ACCURACY_CASES,
    MAX_CALL_S,
    MAX_REL_L1_REFERENCE,
    MIN_COS_EXACT,
    MIN_COS_REFERENCE,
    MODEL_LABEL,
    QUICK_ACCURACY_CASES,
    QUICK_SPEED_SEQS,
    SPEED_BATCH,
    SPEED_HEAD_DIM,
    SPEED_HEADS,
    SPEED_SEQS,
    _inputs,
    _speed_row,
    _time_ms,
    accuracy,
    compare,
    device_report,
    event_time_ms,
    qk_demo,
    speed,
)
from sageattn3._diagnose_env import (  # noqa: F401
    _SMI_FIELDS,
    _driver_api_version,
    _error,
    _smi_row,
    build,
    clocks,
    environment,
    fit,
    nvidia_smi,
)
from sageattn3._diagnose_text import (  # noqa: F401
    _fmt_accuracy,
    _fmt_cmp,
    _fmt_device,
    _fmt_environment,
    _fmt_speed,
    _fmt_wheel,
    finite_json,
    format_report,
)

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
