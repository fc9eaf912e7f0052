"""The diagnosis report as text (what ``python -m sageattn3`` prints) and as strict JSON."""

from __future__ import annotations

import math

from sageattn3._diagnose_checks import MODEL_LABEL, SPEED_BATCH, SPEED_HEAD_DIM, SPEED_HEADS


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
