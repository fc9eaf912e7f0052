"""The diagnosis's environment sections (Python, torch and its CUDA and C++ ABI, driver, GPUs),
the installed wheel's build record and whether it fits, and the error record every section
falls back to (``_error``). Assembled by ``sageattn3._diagnose``."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import traceback

import torch


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
